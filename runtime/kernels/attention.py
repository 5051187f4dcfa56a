"""Absorbed MLA attention of one sequence's query rows over its cached latent keys (numba).

Why a kernel: the numpy form (one ``[NH, C] @ [C, S]`` BLAS product per query row and a
softmax) spent most of a decode step's attention time in BLAS dispatch and thread wake-ups for
products of a few million multiply-adds, and its summation order was BLAS's. Here every dot
product and every sum has a fixed order written below (16-lane vectors, then a fixed lane sum,
then a scalar tail), the kernel is serial and ``nogil``, and a row's result depends only on that
row's query and the keys it may see: batch-invariant by construction, like the matmul kernels.

Per row ``i`` (keys ``[0, end_i)``, ``end_i = S - rows_after - T + i + 1``) and head ``h``:
``score[s] = (q_lat[i, h] . latent[s] + q_rope[i, h] . k_rope[s]) * scale`` for allowed ``s``;
``p = exp(score - max) / sum(exp(score - max))`` (masked keys get exactly 0, the sum runs in
increasing ``s``); ``out[i, h] = sum_s p[s] * latent[s]`` in increasing ``s``.

Shape legend: T query rows, NH heads, C kv_lora_rank (latent width), R rope width, S keys.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from runtime.kernels._simd import vfma16, vhsum16, vload16, vsplat16, vstore16, vzero16

__all__ = ["KERNELS", "latent_attention"]

F32Array = npt.NDArray[np.float32]


@njit(nogil=True, cache=True, inline="always")
def _dot(a, ai, b, bi, n):  # type: ignore[no-untyped-def]
    """``a[ai : ai + n] . b[bi : bi + n]``: 16-lane chunks, the fixed lane sum, then the tail."""
    n16 = n // 16 * 16
    acc = vzero16()
    for c in range(0, n16, 16):
        acc = vfma16(vload16(a, ai + c), vload16(b, bi + c), acc)
    s = vhsum16(acc) if n16 > 0 else np.float32(0.0)
    for c in range(n16, n):
        s += a[ai + c] * b[bi + c]
    return s


@njit(nogil=True, cache=True, error_model="numpy")
def _latent_attention(  # type: ignore[no-untyped-def]
    q_lat, q_rope, latent, k_rope, allowed, n_rows, n_heads, c, r, s_all, scale, rows_after, out
):
    """Flat arrays: q_lat [T*NH*C], q_rope [T*NH*R], latent [S*C], k_rope [S*R], allowed
    [T*S] (uint8; an empty array: every causal key), out [T*NH*C]."""
    masked = allowed.size > 0
    scores = np.empty(s_all, np.float32)  # [S] one head's scores, then its weights
    c16 = c // 16 * 16
    neg_inf = np.float32(-np.inf)
    for i in range(n_rows):
        end = s_all - rows_after - n_rows + i + 1  # keys [0, end) are causal for row i
        arow = i * s_all
        for h in range(n_heads):
            qi = (i * n_heads + h) * c
            qr = (i * n_heads + h) * r
            top = neg_inf
            for s in range(end):
                if not masked or allowed[arow + s]:
                    v = (
                        _dot(q_lat, qi, latent, s * c, c) + _dot(q_rope, qr, k_rope, s * r, r)
                    ) * scale
                    scores[s] = v
                    if v > top:
                        top = v
            total = np.float32(0.0)
            for s in range(end):
                if not masked or allowed[arow + s]:
                    e = np.exp(scores[s] - top)
                    scores[s] = e
                    total += e
            for k in range(0, c16, 16):
                vstore16(out, qi + k, vzero16())
            for k in range(c16, c):
                out[qi + k] = np.float32(0.0)
            for s in range(end):
                if not masked or allowed[arow + s]:
                    p = scores[s] / total
                    pv = vsplat16(p)
                    for k in range(0, c16, 16):
                        o = qi + k
                        vstore16(out, o, vfma16(pv, vload16(latent, s * c + k), vload16(out, o)))
                    for k in range(c16, c):
                        out[qi + k] += p * latent[s * c + k]


def latent_attention(
    q_lat: F32Array,
    q_rope: F32Array,
    latent: F32Array,
    k_rope: F32Array,
    allowed: npt.NDArray[np.bool_] | None,
    scale: float,
    rows_after: int = 0,
) -> F32Array:
    """``q_lat`` [T, NH, C], ``q_rope`` [T, NH, R], ``latent`` [S, C], ``k_rope`` [S, R],
    ``allowed`` [T, S] or None (every causal key: the kernel bounds each row's keys itself, so
    a mask is only needed for a sparse selection) -> [T, NH, C] (see the module docstring)."""
    t, nh, c = q_lat.shape
    s_all, r = latent.shape[0], k_rope.shape[1]
    if latent.shape[1] != c or k_rope.shape[0] != s_all or q_rope.shape[:2] != (t, nh):
        raise ValueError(
            f"shapes do not agree: q_lat {q_lat.shape}, q_rope {q_rope.shape}, "
            f"latent {latent.shape}, k_rope {k_rope.shape}"
        )
    if (allowed is not None and allowed.shape != (t, s_all)) or not 0 <= rows_after <= s_all - t:
        shape = None if allowed is None else allowed.shape
        raise ValueError(f"allowed {shape} / rows_after {rows_after} for T={t}, S={s_all}")
    out = np.empty((t, nh, c), dtype=np.float32)  # [T, NH, C]
    if t == 0:
        return out
    if allowed is None:
        mask = _NO_MASK
    else:
        mask = np.ascontiguousarray(allowed).view(np.uint8).reshape(-1)  # [T * S]
    _latent_attention(
        _flat(q_lat), _flat(q_rope), _flat(latent), _flat(k_rope), mask,
        t, nh, c, r, s_all, np.float32(scale), rows_after, out.reshape(-1),
    )  # fmt: skip
    return out


_NO_MASK = np.zeros(0, dtype=np.uint8)  # read-only by use: the kernel only reads a mask


def _flat(a: F32Array) -> F32Array:
    """``a`` as a flat C-contiguous float32 array (a view when it already is one)."""
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=np.float32)
    return a.reshape(-1)


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (_latent_attention, _dot)
