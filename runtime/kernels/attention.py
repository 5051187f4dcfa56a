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
from numba.np.numpy_support import carray

from runtime.kernels._intrinsics import ALIGN, f32_at, zeros64
from runtime.kernels._simd import (
    vfma16,
    vhsum16,
    vhsum16x4,
    vload16,
    vsplat16,
    vstore16,
    vzero16,
)

__all__ = [
    "KERNELS",
    "latent_attention",
    "latent_attention_cached",
    "latent_attention_seqs",
    "write_rows_at",
]

F32Array = npt.NDArray[np.float32]
_KEY_BLOCK = 8  # keys whose weighted values are added per pass over the output (their rows: L1)


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


@njit(nogil=True, cache=True, inline="always")
def _dot4(a, a0, n, b, bi):  # type: ignore[no-untyped-def]
    """:func:`_dot` of ``b[bi : bi + n]`` with the four rows of ``a`` at ``a0, a0 + n,
    a0 + 2n, a0 + 3n`` (four heads' queries against one key), side by side: four independent
    chains share each load of ``b`` and keep the FMA unit busy where one chain waits on its
    latency. Each result takes :func:`_dot`'s operations in its order: the same bits."""
    n16 = n // 16 * 16
    a1, a2, a3 = a0 + n, a0 + 2 * n, a0 + 3 * n
    acc0 = vzero16()
    acc1 = vzero16()
    acc2 = vzero16()
    acc3 = vzero16()
    for c in range(0, n16, 16):
        y = vload16(b, bi + c)
        acc0 = vfma16(vload16(a, a0 + c), y, acc0)
        acc1 = vfma16(vload16(a, a1 + c), y, acc1)
        acc2 = vfma16(vload16(a, a2 + c), y, acc2)
        acc3 = vfma16(vload16(a, a3 + c), y, acc3)
    zero = np.float32(0.0)
    s0, s1, s2, s3 = vhsum16x4(acc0, acc1, acc2, acc3) if n16 > 0 else (zero, zero, zero, zero)
    for c in range(n16, n):
        y1 = b[bi + c]
        s0 += a[a0 + c] * y1
        s1 += a[a1 + c] * y1
        s2 += a[a2 + c] * y1
        s3 += a[a3 + c] * y1
    return s0, s1, s2, s3


@njit(nogil=True, cache=True, inline="always")
def _keep(scores, at, top, h, v):  # type: ignore[no-untyped-def]
    """Head ``h``'s score ``v`` into ``scores[at]``, its running max into ``top[h]``."""
    scores[at] = v
    if v > top[h]:
        top[h] = v


@njit(nogil=True, cache=True, error_model="numpy")
def _latent_attention(  # type: ignore[no-untyped-def]
    q_lat, q_rope, latent, k_rope, allowed, n_rows, n_heads, c, r, s_all, scale, rows_after, out
):
    """Flat arrays: q_lat [T*NH*C], q_rope [T*NH*R], latent [S*C], k_rope [S*R], allowed
    [T*S] (uint8; an empty array: every causal key), out [T*NH*C].

    Per row, keys are the outer loop and heads the inner one: a key's latent row is read from
    memory once for all heads (it then sits in L1), not once per head; scores take four heads
    at a time (:func:`_dot4`), weighted values ``_KEY_BLOCK`` keys per pass over the output
    (four 16-column sums side by side, loaded and stored once per block). Every (head, key)
    score, every exponential and every output column's sum over keys is still computed with
    the operations, and in the order, of the module docstring: only independent computations
    are interleaved."""
    masked = allowed.size > 0
    keys = np.empty(s_all, np.int64)  # the row's keys, increasing
    scores = np.empty(n_heads * s_all, np.float32)  # [NH, S] scores, then exp weights
    top = np.empty(n_heads, np.float32)  # [NH]
    total = np.empty(n_heads, np.float32)  # [NH]
    c16 = c // 16 * 16
    h4 = n_heads // 4 * 4
    for i in range(n_rows):
        end = s_all - rows_after - n_rows + i + 1  # keys [0, end) are causal for row i
        m = 0
        for s in range(end):
            if not masked or allowed[i * s_all + s]:
                keys[m] = s
                m += 1
        q0 = i * n_heads
        top[:] = np.float32(-np.inf)
        total[:] = np.float32(0.0)
        for j in range(m):
            s = keys[j]
            for h in range(0, h4, 4):
                d0, d1, d2, d3 = _dot4(q_lat, (q0 + h) * c, c, latent, s * c)
                e0, e1, e2, e3 = _dot4(q_rope, (q0 + h) * r, r, k_rope, s * r)
                _keep(scores, h * s_all + s, top, h, (d0 + e0) * scale)
                _keep(scores, (h + 1) * s_all + s, top, h + 1, (d1 + e1) * scale)
                _keep(scores, (h + 2) * s_all + s, top, h + 2, (d2 + e2) * scale)
                _keep(scores, (h + 3) * s_all + s, top, h + 3, (d3 + e3) * scale)
            for h in range(h4, n_heads):
                qh = q0 + h
                d = _dot(q_lat, qh * c, latent, s * c, c) + _dot(q_rope, qh * r, k_rope, s * r, r)
                _keep(scores, h * s_all + s, top, h, d * scale)
        for h in range(n_heads):
            hs = h * s_all
            for j in range(m):
                s = keys[j]
                e = np.exp(scores[hs + s] - top[h])
                scores[hs + s] = e
                total[h] += e
            for j in range(m):  # the weights, in place (p = e / total, as before)
                s = keys[j]
                scores[hs + s] = scores[hs + s] / total[h]
        for h in range(n_heads):
            qi = (q0 + h) * c
            for k in range(0, c16, 16):
                vstore16(out, qi + k, vzero16())
            for k in range(c16, c):
                out[qi + k] = np.float32(0.0)
        c64 = c16 // 64 * 64
        for j0 in range(0, m, _KEY_BLOCK):  # a block's latent rows stay in L1 for every head
            j1 = min(j0 + _KEY_BLOCK, m)
            for h in range(n_heads):
                qi = (q0 + h) * c
                hs = h * s_all
                for k in range(0, c64, 64):  # four independent 16-column sums side by side
                    o = qi + k
                    a0 = vload16(out, o)
                    a1 = vload16(out, o + 16)
                    a2 = vload16(out, o + 32)
                    a3 = vload16(out, o + 48)
                    for j in range(j0, j1):
                        s = keys[j]
                        pv = vsplat16(scores[hs + s])
                        li = s * c + k
                        a0 = vfma16(pv, vload16(latent, li), a0)
                        a1 = vfma16(pv, vload16(latent, li + 16), a1)
                        a2 = vfma16(pv, vload16(latent, li + 32), a2)
                        a3 = vfma16(pv, vload16(latent, li + 48), a3)
                    vstore16(out, o, a0)
                    vstore16(out, o + 16, a1)
                    vstore16(out, o + 32, a2)
                    vstore16(out, o + 48, a3)
                for k in range(c64, c16, 16):
                    o = qi + k
                    acc = vload16(out, o)
                    for j in range(j0, j1):
                        s = keys[j]
                        acc = vfma16(vsplat16(scores[hs + s]), vload16(latent, s * c + k), acc)
                    vstore16(out, o, acc)
                for k in range(c16, c):
                    a = out[qi + k]
                    for j in range(j0, j1):
                        s = keys[j]
                        a += scores[hs + s] * latent[s * c + k]
                    out[qi + k] = a


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
    if t == 0:
        return np.empty((t, nh, c), dtype=np.float32)
    if allowed is None:
        mask = _NO_MASK
    else:
        mask = np.ascontiguousarray(allowed).view(np.uint8).reshape(-1)  # [T * S]
    out: F32Array = _attend(
        _flat(q_lat), _flat(q_rope), _flat(latent), _flat(k_rope), mask,
        t, nh, c, r, s_all, np.float32(scale), rows_after,
    )  # fmt: skip
    return out.reshape(t, nh, c)


_NO_MASK = np.zeros(0, dtype=np.uint8)  # read-only by use: the kernel only reads a mask


def _flat(a: F32Array) -> F32Array:
    """``a`` as a flat C-contiguous float32 array (a view when it already is one)."""
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=np.float32)
    return a.reshape(-1)


@njit(nogil=True, cache=True, inline="always")
def _copy(dst, src):  # type: ignore[no-untyped-def]
    """``dst[:] = src`` for flat arrays of one size, element by element: numpy's slice
    assignment compiles numba's shape-mismatch error message with it (~2.4 s of a first run's
    compile), a check the callers' sizes make moot."""
    for i in range(src.size):
        dst[i] = src[i]


@njit(nogil=True, cache=True, inline="always")
def _on_a_line(a):  # type: ignore[no-untyped-def]
    """Flat ``a`` itself when it starts a 64-byte line, else an aligned copy: the 16-lane loads
    ran 1.33x faster aligned (2048 keys x 64 heads, an AVX-512 Intel guest); the same values,
    so the same result."""
    if a.ctypes.data % ALIGN == 0:
        return a
    b = zeros64(a.size, np.float32)
    _copy(b, a)
    return b


@njit(nogil=True, cache=True)
def _attend(  # type: ignore[no-untyped-def]
    q_lat, q_rope, latent, k_rope, allowed, n_rows, n_heads, c, r, s_all, scale, rows_after
):
    """:func:`_latent_attention` on 64-byte aligned inputs (copied where they are not; the KV
    cache's rows already are) into a new aligned ``out`` [T*NH*C]."""
    out = zeros64(n_rows * n_heads * c, np.float32)
    _latent_attention(
        _on_a_line(q_lat), _on_a_line(q_rope), _on_a_line(latent), _on_a_line(k_rope), allowed,
        n_rows, n_heads, c, r, s_all, scale, rows_after, out,
    )  # fmt: skip
    return out


@njit(nogil=True, cache=True)
def _attend_seqs(  # type: ignore[no-untyped-def]
    q_lat, q_rope, latents, k_ropes, lengths, bounds, masks, mask_at, n_heads, c, r, scale
):
    """:func:`_attend` for the rows of several sequences in one call: sequence ``j`` has rows
    ``bounds[j] .. bounds[j + 1]`` of the flat ``q_lat`` [N*NH*C] / ``q_rope`` [N*NH*R], its
    ``lengths[j]`` keys at the addresses ``latents[j]`` / ``k_ropes[j]`` (its KV cache's rows:
    64-byte aligned, alive for the call) and its mask at ``masks[mask_at[j] : mask_at[j + 1]]``
    (empty: every causal key). Each sequence's rows get exactly :func:`_latent_attention` over
    its own keys, so the same bits as one call per sequence."""
    out = zeros64(bounds[-1] * n_heads * c, np.float32)
    for j in range(lengths.size):
        lo, hi = bounds[j], bounds[j + 1]
        s_all = lengths[j]
        qa, qb = lo * n_heads * c, hi * n_heads * c
        latent = carray(f32_at(latents[j]), s_all * c)
        k_rope = carray(f32_at(k_ropes[j]), s_all * r)
        part = _on_a_line(out[qa:qb])
        _latent_attention(
            _on_a_line(q_lat[qa:qb]), _on_a_line(q_rope[lo * n_heads * r : hi * n_heads * r]),
            latent, k_rope, masks[mask_at[j] : mask_at[j + 1]],
            hi - lo, n_heads, c, r, s_all, scale, 0, part,
        )  # fmt: skip
        if part.ctypes.data != out[qa:qb].ctypes.data:
            _copy(out[qa:qb], part)
    return out


@njit(nogil=True, cache=True)
def _write_rows(rows, at, starts, bounds, width):  # type: ignore[no-untyped-def]
    """Rows ``bounds[j] .. bounds[j + 1]`` of ``rows`` (flat [N * W]) to the float32 buffer at
    address ``at[j]``, from its row ``starts[j]`` on, for every sequence ``j``."""
    for j in range(at.size):
        lo, hi = bounds[j], bounds[j + 1]
        dst = carray(f32_at(at[j] + starts[j] * width * 4), (hi - lo) * width)
        _copy(dst, rows[lo * width : hi * width])


def write_rows_at(
    rows: F32Array, at: npt.NDArray[np.int64], starts: npt.NDArray[np.int64],
    bounds: npt.NDArray[np.int64],
) -> None:  # fmt: skip
    """Copy the rows of several sequences (``rows`` [N, W], sequence ``j``'s at ``bounds[j] ..
    bounds[j + 1]``) into their own buffers in one call: sequence ``j``'s to the C-contiguous
    float32 rows of W values that begin at address ``at[j]``, from row ``starts[j]`` on (one KV
    cache per sequence: ``KVCache.write_seqs``, which checks that the rows are reserved; the
    caller keeps the buffers alive)."""
    n, w = rows.shape
    if rows.dtype != np.float32 or bounds.size != at.size + 1 or int(bounds[-1]) != n:
        raise ValueError(f"rows {rows.shape} {rows.dtype} against bounds {bounds.tolist()}")
    _write_rows(_flat(rows), at, starts, bounds, w)


def latent_attention_seqs(
    q_lat: F32Array,
    q_rope: F32Array,
    keys: list[tuple[F32Array, F32Array]],
    rows: list[int],
    allowed: list[npt.NDArray[np.bool_] | None],
    scale: float,
) -> F32Array:
    """:func:`latent_attention` for several sequences in one kernel call: ``q_lat`` [N, NH, C]
    and ``q_rope`` [N, NH, R] hold their rows one sequence after another (``rows[j]`` of
    sequence ``j``), ``keys[j]`` its (``latent`` [S_j, C], ``k_rope`` [S_j, R]) and
    ``allowed[j]`` its [T_j, S_j] mask or None -> [N, NH, C], each sequence's rows the bits of
    its own :func:`latent_attention` call (``rows_after`` 0: the rows are its last)."""
    n, _, c = q_lat.shape
    r = q_rope.shape[2]
    if len(keys) != len(rows) or len(allowed) != len(rows) or sum(rows) != n:
        raise ValueError(f"{len(keys)} key sets, {len(rows)} row counts ({sum(rows)} rows), "
                         f"{len(allowed)} masks for {n} query rows")  # fmt: skip
    at = []
    for j, ((latent, k_rope), t) in enumerate(zip(keys, rows, strict=True)):
        s_all = latent.shape[0]
        where = (latent.ctypes.data, k_rope.ctypes.data)
        if (
            latent.dtype != np.float32 or k_rope.dtype != np.float32
            or latent.shape[1:] != (c,) or k_rope.shape != (s_all, r)
            or not (latent.flags.c_contiguous and k_rope.flags.c_contiguous)
            or where[0] % ALIGN or where[1] % ALIGN
        ):  # fmt: skip
            raise ValueError(f"sequence {j}: latent {latent.shape}, k_rope {k_rope.shape} "
                             f"(float32, C-contiguous, 64-byte aligned) for {t} rows")  # fmt: skip
        at.append(where)  # (rows against key counts: checked there)
    lengths = [latent.shape[0] for latent, _ in keys]
    return latent_attention_cached(q_lat, q_rope, at, lengths, rows, allowed, scale)


def latent_attention_cached(
    q_lat: F32Array,
    q_rope: F32Array,
    at: list[tuple[int, int]],
    lengths: list[int],
    rows: list[int],
    allowed: list[npt.NDArray[np.bool_] | None],
    scale: float,
) -> F32Array:
    """:func:`latent_attention_seqs` over key rows given by where they begin (``at[j]``, e.g.
    ``KVCache.addresses`` of the layer: 64-byte aligned, C-contiguous float32 rows of C and R
    values) and how many keys each sequence has (``lengths[j]``, at least its ``rows[j]``):
    no per-sequence checks of key arrays, which a KV cache's buffers meet by construction
    (they cost ~5 us a sequence a layer in a batched decode step). The key buffers must stay
    alive and unresized for the call."""
    n, nh, c = q_lat.shape
    r = q_rope.shape[2]
    if len(at) != len(rows) or len(lengths) != len(rows) or len(allowed) != len(rows):
        raise ValueError(f"{len(at)} caches, {len(lengths)} lengths, {len(allowed)} masks "
                         f"for {len(rows)} sequences")  # fmt: skip
    if sum(rows) != n or any(not 1 <= t <= s for t, s in zip(rows, lengths, strict=True)):
        raise ValueError(f"rows {rows} (for {n} query rows) against key counts {lengths}")
    parts = []
    mask_at = np.zeros(len(rows) + 1, np.int64)
    for j, (t, s_all, mask) in enumerate(zip(rows, lengths, allowed, strict=True)):
        if mask is not None:
            if mask.shape != (t, s_all):
                raise ValueError(f"sequence {j}: allowed {mask.shape} for T={t}, S={s_all}")
            parts.append(np.ascontiguousarray(mask).view(np.uint8).reshape(-1))
        mask_at[j + 1] = mask_at[j] + (0 if mask is None else t * s_all)
    masks = np.concatenate(parts) if parts else _NO_MASK
    bounds = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(rows, out=bounds[1:])
    out: F32Array = _attend_seqs(
        _flat(q_lat), _flat(q_rope), np.array([a for a, _ in at], np.int64),
        np.array([b for _, b in at], np.int64), np.array(lengths, np.int64), bounds, masks,
        mask_at, nh, c, r, np.float32(scale),
    )  # fmt: skip
    return out.reshape(n, nh, c)


#: Every compiled kernel (tests check they were built with ``nogil=True``).
KERNELS = (
    _latent_attention,
    _attend,
    _attend_seqs,
    _on_a_line,
    _copy,
    _dot,
    _dot4,
    _keep,
    _write_rows,
)
