"""Multi-head latent attention (DeepSeek-V2/V3, GLM-5) over a compressed KV cache.

Per token the cache keeps only the normed KV latent ``c`` [C] and the roped shared rope key
``k_r`` [R]. Per head h, with ``kv_b_proj`` rows split into K part ``W_UK[h]`` [N, C] and
V part ``W_UV[h]`` [V, C]::

    score[t, s] = (q_nope[t] . W_UK[h] c[s] + q_rope[t] . k_r[s]) * scale
    out[t]      = W_UV[h] sum_s softmax(score)[t, s] c[s]

Two evaluation orders, equal up to rounding (tests hold them within 1e-4):

* reconstruct: expand ``kv_b_proj(c)`` for every key (k_nope, v per head) -- what the reference
  does; cheapest for a fresh prefill (S ~ T);
* absorbed: fold ``W_UK[h]`` into the query (``q_lat = W_UK[h]^T q_nope``) and apply ``W_UV[h]``
  after the weighted latent sum; cost no longer grows with S * kv_b -- the decode path.

``prefer_absorbed`` picks the cheaper by a multiply-add count (see there).

Shape legend: T new tokens, S keys (cache + new), D hidden, NH heads, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, C kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from runtime.kernels import attention as attention_kernel
from runtime.kernels.heads import HeadsMatmul
from runtime.layers.rms_norm import rms_norm
from runtime.layers.rope import apply_rope
from runtime.linear import Linear

__all__ = [
    "LORA_NORM_EPS",
    "MLADims",
    "MLAProjection",
    "MLAWeights",
    "attend",
    "causal_mask",
    "prefer_absorbed",
    "project",
    "softmax",
]

F32Array = npt.NDArray[np.float32]
MatMul = Callable[[Linear, F32Array], F32Array]  # applies a projection: lin(x) or a split
BoolArray = npt.NDArray[np.bool_]
#: several projections of the same input: [lin(x) for lin in lins] (or a split of them)
ManyMatMul = Callable[[Sequence[Linear], F32Array], list[F32Array]]
#: (q_a_proj, kv_a_proj_with_mqa, q_a_layernorm, its eps, q_b_proj, x) -> (q_resid, kv, q)
LoraFn = Callable[
    [Linear, Linear, F32Array, float, Linear, F32Array],
    tuple[F32Array, F32Array, F32Array] | None,
]
#: the compute's absorbed attention of a step's queries over their keys through W_UK, W_UV
#: and o_proj (its bias left out): (uk_heads, uv_heads, o_proj, q_nope, q_rope, latent,
#: k_rope, allowed, scale) -> [T, D] or None
HeadsFn = Callable[
    [HeadsMatmul, HeadsMatmul | None, Linear, F32Array, F32Array, F32Array, F32Array,
     BoolArray | None, float],
    F32Array | None,
]  # fmt: skip

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not
# config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MLADims:
    """MLA sizes (HF config keys)."""

    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """One layer's attention weights; ``uk_heads`` / ``w_uv`` are per-head for absorption."""

    kv_a_proj_with_mqa: Linear  # [C + R, D]
    kv_a_layernorm: F32Array  # [C]
    kv_b_proj: Linear  # [NH * (N + V), C]
    o_proj: Linear  # [D, NH * V]
    uk_heads: HeadsMatmul  # [T, NH, N] -> [T, NH, C] through W_UK[h] (int4 rows or a copy)
    w_uv: Sequence[Linear]  # NH x [V, C]: row slices of the stored kv_b_proj
    uv_heads: HeadsMatmul | None = None  # every head's w_uv in one call (same bits)
    q_a_proj: Linear | None = None  # [Q, D]
    q_a_layernorm: F32Array | None = None  # [Q]
    q_b_proj: Linear | None = None  # [NH * (N + R), Q]
    q_proj: Linear | None = None  # [NH * (N + R), D] when q_lora_rank is None
    q_a_bias: F32Array | None = None  # attention_bias models only
    kv_a_bias: F32Array | None = None
    o_bias: F32Array | None = None


class MLAProjection(NamedTuple):
    """Projections of the new tokens: queries, the query residual and the new cache rows."""

    q_nope: F32Array  # [T, NH, N]
    q_rope: F32Array  # [T, NH, R] roped
    q_resid: F32Array | None  # [T, Q] q_a_layernorm output (the DSA indexer's input)
    latent: F32Array  # [T, C] normed KV latent (cached)
    k_rope: F32Array  # [T, R] roped shared key (cached)


def _call(lin: Linear, x: F32Array) -> F32Array:
    return lin(x)


def project(
    w: MLAWeights,
    d: MLADims,
    x: F32Array,
    cos: F32Array,
    sin: F32Array,
    interleave: bool,
    mm: MatMul = _call,
    many: ManyMatMul | None = None,
    lora: LoraFn | None = None,
) -> MLAProjection:
    """``x`` [T, D] (input-normed hidden) -> queries and the new latent/rope-key rows.

    ``mm(lin, x)`` applies a projection (default ``lin(x)``; the compute's split over threads
    for one token, bit-identical); ``many(lins, x)`` several of the same input at once (the
    compute's :meth:`~runtime.compute.ExpertCompute.linears`: ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` in one split); ``lora`` the query path's two projections, its norm
    and the KV projection at once (the compute's
    :meth:`~runtime.compute.ExpertCompute.lora`), or None where it does not take them."""
    t = x.shape[0]
    q_resid = None
    kv = None
    chain = None
    if w.q_a_proj is not None and w.q_b_proj is not None and w.q_a_layernorm is not None:
        if lora is not None and w.q_a_bias is None:
            chain = lora(
                w.q_a_proj, w.kv_a_proj_with_mqa, w.q_a_layernorm, LORA_NORM_EPS, w.q_b_proj, x
            )
        if chain is not None:  # [T, Q], [T, C + R], [T, NH * (N + R)]
            q_resid, kv, q = chain
        else:
            if many is not None:
                qa, kv = many([w.q_a_proj, w.kv_a_proj_with_mqa], x)  # [T, Q], [T, C + R]
            else:
                qa = mm(w.q_a_proj, x)  # [T, Q]
            if w.q_a_bias is not None:
                qa = qa + w.q_a_bias
            q_resid = rms_norm(qa, w.q_a_layernorm, LORA_NORM_EPS)  # [T, Q]
            q = mm(w.q_b_proj, q_resid)  # [T, NH * (N + R)]
    elif w.q_proj is not None:
        q = mm(w.q_proj, x)  # [T, NH * (N + R)]
    else:
        raise ValueError("MLA weights need q_proj or q_a_proj + q_a_layernorm + q_b_proj")
    q = q.reshape(t, d.num_attention_heads, d.qk_head_dim)  # [T, NH, N + R]
    q_nope = q[:, :, : d.qk_nope_head_dim]  # [T, NH, N]
    q_rope = apply_rope(q[:, :, d.qk_nope_head_dim :], cos, sin, interleave)  # [T, NH, R]
    if kv is None:
        kv = mm(w.kv_a_proj_with_mqa, x)  # [T, C + R]
    if w.kv_a_bias is not None:
        kv = kv + w.kv_a_bias
    latent = rms_norm(kv[:, : d.kv_lora_rank], w.kv_a_layernorm, LORA_NORM_EPS)  # [T, C]
    k_rope = apply_rope(kv[:, d.kv_lora_rank :], cos, sin, interleave)  # [T, R]
    return MLAProjection(q_nope, q_rope, q_resid, latent, k_rope)


def causal_mask(t: int, s: int) -> BoolArray:
    """Allowed [T, S]: new token i (absolute position s - t + i) sees keys 0..s - t + i."""
    return np.arange(s)[None, :] <= (np.arange(t) + (s - t))[:, None]  # [T, S]


def softmax(scores: F32Array, allowed: BoolArray) -> F32Array:
    """Masked softmax over the last axis in float32 (masked entries get exactly 0)."""
    z = np.where(allowed, scores, np.float32(-np.inf))  # [..., S]
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)  # [..., S]
    probs: F32Array = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    return probs


def prefer_absorbed(d: MLADims, t: int, s: int) -> bool:
    """Whether absorption costs fewer multiply-adds than reconstruction for T queries, S keys.

    reconstruct: S*NH*C*(N+V) (expand every key) + T*S*NH*(N+R+V) (scores + values);
    absorbed:    T*NH*C*(N+V) (fold W_UK, apply W_UV) + T*S*NH*(2C+R).
    Decode (T = 1) always absorbs; a fresh prefill (S = T) reconstructs.
    """
    n, r, v, c = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
    recon = s * c * (n + v) + t * s * (n + r + v)
    absorbed = t * c * (n + v) + t * s * (2 * c + r)
    return absorbed < recon


def attend(
    w: MLAWeights,
    d: MLADims,
    p: MLAProjection,
    latent: F32Array,
    k_rope: F32Array,
    allowed: BoolArray | None,
    scale: float,
    absorbed: bool,
    *,
    rows_after: int = 0,
    mm: MatMul = _call,
    heads: HeadsFn | None = None,
) -> F32Array:
    """Attention of the new queries over all keys -> o_proj output [T, D].

    ``latent`` [S, C] and ``k_rope`` [S, R] include the new rows; ``allowed`` [T, S] is the
    causal mask, narrowed by the DSA selection where the model has one (None: every causal
    key, the same result as the causal mask). ``rows_after``: how many
    new rows follow these T (absorbed form only: a block of a step's rows computed on its own,
    with exactly the products the whole step would run for them). ``heads``: the absorbed
    form's ``W_UK``, latent attention, ``W_UV`` and ``o_proj`` in one call where it takes them
    (the compute's :meth:`~runtime.compute.ExpertCompute.mla_heads`: head ranges, then feature
    ranges, over threads), [T, D] before ``o_proj``'s bias, or None.
    """
    t, nh = p.q_nope.shape[0], d.num_attention_heads
    sc = np.float32(scale)
    if absorbed:
        # One query row at a time over its causal keys only, with the same products a one-token
        # decode runs: a row's result does not depend on T (or on masked future keys in a
        # softmax sum), so decode and a speculative verify agree bit for bit (given
        # batch-invariant Linear kernels).
        if heads is not None and not rows_after:
            got = heads(
                w.uk_heads, w.uv_heads, w.o_proj, p.q_nope, p.q_rope, latent, k_rope, allowed,
                scale,
            )  # fmt: skip
            if got is not None:  # the same kernels, head and feature ranges on several threads
                return got if w.o_bias is None else got + w.o_bias
        q_lat = absorb_queries(w, d, p.q_nope)  # [T, NH, C]
        o_lat = latent_attention(q_lat, p.q_rope, latent, k_rope, allowed, scale, rows_after)
        return out_proj(w, unabsorb_values(w, d, o_lat), mm)  # [T, D]
    if rows_after:
        raise ValueError("rows_after applies to the absorbed form only")
    # Head-major GEMMs: the fast order for a prefill chunk (rows may depend on T by rounding;
    # prefill and decode are held to a tolerance, not bit identity).
    s = latent.shape[0]
    if allowed is None:
        allowed = causal_mask(t, s)  # [T, S]
    kv = w.kv_b_proj(np.ascontiguousarray(latent))  # [S, NH * (N + V)]
    kv = kv.reshape(s, nh, d.qk_nope_head_dim + d.v_head_dim)  # [S, NH, N + V]
    k_nope = kv[:, :, : d.qk_nope_head_dim].transpose(1, 2, 0)  # [NH, N, S]
    values = kv[:, :, d.qk_nope_head_dim :].transpose(1, 0, 2)  # [NH, S, V]
    q_nope = p.q_nope.transpose(1, 0, 2)  # [NH, T, N]
    q_rope = p.q_rope.transpose(1, 0, 2)  # [NH, T, R]
    scores = (q_nope @ k_nope + q_rope @ k_rope.T) * sc  # [NH, T, S]
    probs = softmax(scores, allowed[None])  # [NH, T, S]
    out = (probs @ values).transpose(1, 0, 2)  # [T, NH, V]
    return out_proj(w, out.reshape(t, nh * d.v_head_dim), mm)  # [T, D]


def absorb_queries(w: MLAWeights, d: MLADims, q_nope: F32Array) -> F32Array:
    """``q_nope`` [T, NH, N] folded into the latent space through W_UK: [T, NH, C]. Rows are
    independent (batch-invariant kernels), so the rows of several sequences may share a call."""
    return w.uk_heads(q_nope)  # [T, NH, C]


def latent_attention(
    q_lat: F32Array,
    q_rope: F32Array,
    latent: F32Array,
    k_rope: F32Array,
    allowed: BoolArray | None,
    scale: float,
    rows_after: int = 0,
) -> F32Array:
    """Absorbed attention of one sequence's queries (``q_lat`` [T, NH, C], ``q_rope``
    [T, NH, R]) over its keys, each row over its causal keys (those ``allowed`` [T, S] marks,
    when given) -> [T, NH, C]: the numba kernel of
    :mod:`runtime.kernels.attention` (fixed summation order, batch-invariant)."""
    return attention_kernel.latent_attention(
        q_lat, q_rope, latent, k_rope, allowed, scale, rows_after
    )


def latent_attention_cached(
    q_lat: F32Array,
    q_rope: F32Array,
    at: list[tuple[int, int]],
    lengths: list[int],
    rows: list[int],
    allowed: list[BoolArray | None],
    scale: float,
) -> F32Array:
    """:func:`latent_attention` for the rows of several sequences in one kernel call:
    ``rows[j]`` rows of sequence ``j`` one after another in ``q_lat`` [N, NH, C] / ``q_rope``
    [N, NH, R], its KV cache's rows of the layer where ``KVCache.addresses`` says (``at[j]``),
    ``lengths[j]`` of them, its mask or None in ``allowed[j]``; each sequence's rows the bits
    of its own call."""
    return attention_kernel.latent_attention_cached(
        q_lat, q_rope, at, lengths, rows, allowed, scale
    )


def unabsorb_values(w: MLAWeights, d: MLADims, o_lat: F32Array) -> F32Array:
    """Latent attention outputs [T, NH, C] through W_UV -> [T, NH * V] (rows independent)."""
    t = o_lat.shape[0]
    if w.uv_heads is not None:
        return w.uv_heads(o_lat).reshape(t, d.num_attention_heads * d.v_head_dim)
    out = np.empty((t, d.num_attention_heads, d.v_head_dim), dtype=np.float32)  # [T, NH, V]
    for h in range(d.num_attention_heads):
        out[:, h, :] = w.w_uv[h](np.ascontiguousarray(o_lat[:, h, :]))  # [T, V]
    return out.reshape(t, d.num_attention_heads * d.v_head_dim)


def out_proj(w: MLAWeights, out: F32Array, mm: MatMul = _call) -> F32Array:
    """``o_proj`` (+ bias) of the attention outputs [T, NH * V] -> [T, D]."""
    y = mm(w.o_proj, np.ascontiguousarray(out, dtype=np.float32))
    if w.o_bias is not None:
        y = y + w.o_bias
    return y  # [T, D]
