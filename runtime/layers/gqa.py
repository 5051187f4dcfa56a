"""Grouped-query attention (OLMoE, Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2) as transformers has it.

``project``: ``q = q_proj(x)``, ``k = k_proj(x)``, ``v = v_proj(x)`` (+ biases), then the q/k
RMSNorm of the family: ``"full"`` over the whole projection (OLMoE, MiniMax-M2: weight
[NH * HD] / [NKV * HD]), ``"head"`` per head (Qwen3-MoE, GLM-4.5 with ``use_qk_norm``: weight
[HD]) or none; OLMoE's ``clip_qkv`` clamps all three. RoPE (half split, ``rotate_half``) turns
the first ``rotary_dim`` lanes of every q and k head; the rest pass through (partial rotary).

``attend``: each query head h reads KV head ``h // (NH / NKV)``; scores ``(q . k) * HD^-0.5``,
causal softmax in float32, then ``o_proj`` (+ bias). Every query row is computed on its own over
exactly its causal keys, with the products a one-token decode runs, so a token's output does
not depend on how many rows share the call (prefill chunk, verify block, batched step).

Shape legend: T new tokens, S keys (cache + new), D hidden, NH query heads, NKV KV heads,
G = NH / NKV heads per KV head, HD head_dim, R rotary_dim, R2 = R / 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from runtime.layers.rms_norm import rms_norm
from runtime.layers.rope import apply_rope
from runtime.linear import Linear

__all__ = ["GQADims", "GQAWeights", "attend", "project"]

F32Array = npt.NDArray[np.float32]
MatMul = Callable[[Linear, F32Array], F32Array]  # applies a projection: lin(x) or a split


@dataclass(frozen=True, slots=True)
class GQADims:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: Literal["none", "head", "full"]
    rms_norm_eps: float
    clip_qkv: float | None = None

    @property
    def kv_width(self) -> int:
        """KV: floats of one token's keys (or values) over every KV head."""
        return self.num_key_value_heads * self.head_dim

    @property
    def group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


@dataclass(frozen=True, slots=True)
class GQAWeights:
    q_proj: Linear  # [NH * HD, D]
    k_proj: Linear  # [NKV * HD, D]
    v_proj: Linear  # [NKV * HD, D]
    o_proj: Linear  # [D, NH * HD]
    q_bias: F32Array | None
    k_bias: F32Array | None
    v_bias: F32Array | None
    o_bias: F32Array | None
    q_norm: F32Array | None  # [NH * HD] ("full") or [HD] ("head")
    k_norm: F32Array | None  # [NKV * HD] or [HD]


def _call(lin: Linear, x: F32Array) -> F32Array:
    return lin(x)


def _lin(lin: Linear, bias: F32Array | None, x: F32Array, mm: MatMul) -> F32Array:
    y = mm(lin, x)
    return y if bias is None else (y + bias).astype(np.float32)


def _norm(x: F32Array, weight: F32Array | None, d: GQADims, heads: int) -> F32Array:
    """The family's q/k RMSNorm of ``x`` [T, heads * HD]."""
    if weight is None or d.qk_norm == "none":
        return x
    if d.qk_norm == "full":
        return rms_norm(x, weight, d.rms_norm_eps)
    t = x.shape[0]
    return rms_norm(x.reshape(t, heads, d.head_dim), weight, d.rms_norm_eps).reshape(t, -1)


def _rope(x: F32Array, d: GQADims, cos: F32Array, sin: F32Array) -> F32Array:
    """RoPE on the first ``rotary_dim`` lanes of each head of ``x`` [T, H, HD]."""
    r = d.rotary_dim
    if r == d.head_dim:
        return apply_rope(x, cos, sin, False)
    out = x.copy()
    out[..., :r] = apply_rope(np.ascontiguousarray(x[..., :r]), cos, sin, False)
    return out


def project(
    w: GQAWeights,
    d: GQADims,
    x: F32Array,
    cos: F32Array,
    sin: F32Array,
    mm: MatMul = _call,
) -> tuple[F32Array, F32Array, F32Array]:
    """``x`` [T, D] (input-normed) -> q [T, NH, HD] roped, keys [T, KV] roped, values [T, KV].
    ``mm(lin, x)`` applies a projection (default ``lin(x)``)."""
    t = x.shape[0]
    q = _norm(_lin(w.q_proj, w.q_bias, x, mm), w.q_norm, d, d.num_attention_heads)  # [T, NH*HD]
    k = _norm(_lin(w.k_proj, w.k_bias, x, mm), w.k_norm, d, d.num_key_value_heads)  # [T, KV]
    v = _lin(w.v_proj, w.v_bias, x, mm)  # [T, KV]
    if d.clip_qkv is not None:
        c = np.float32(d.clip_qkv)
        q, k, v = (np.clip(a, -c, c).astype(np.float32) for a in (q, k, v))
    q3 = _rope(q.reshape(t, d.num_attention_heads, d.head_dim), d, cos, sin)  # [T, NH, HD]
    k3 = _rope(k.reshape(t, d.num_key_value_heads, d.head_dim), d, cos, sin)  # [T, NKV, HD]
    return q3, k3.reshape(t, d.kv_width), np.ascontiguousarray(v, dtype=np.float32)


def attend(
    w: GQAWeights,
    d: GQADims,
    q: F32Array,
    keys: F32Array,
    values: F32Array,
    *,
    rows_after: int = 0,
    mm: MatMul = _call,
) -> F32Array:
    """Causal attention of the new queries ``q`` [T, NH, HD] over ``keys`` / ``values``
    [S, KV] (cache + new rows) -> o_proj output [T, D].

    ``rows_after``: how many new rows follow these T (a block of a step's rows computed on its
    own, with exactly the products the whole step runs for them)."""
    out = attend_heads(d, q, keys, values, rows_after=rows_after)  # [T, NH * HD]
    return out_proj(w, out, mm)


def attend_heads(
    d: GQADims, q: F32Array, keys: F32Array, values: F32Array, *, rows_after: int = 0
) -> F32Array:
    """The attention of :func:`attend` before ``o_proj``: [T, NH * HD], one row at a time."""
    t, nkv, g, hd = q.shape[0], d.num_key_value_heads, d.group, d.head_dim
    scale = np.float32(hd**-0.5)
    s_all = keys.shape[0]
    k_heads = keys.reshape(s_all, nkv, hd).transpose(1, 2, 0)  # [NKV, HD, S]
    v_heads = values.reshape(s_all, nkv, hd).transpose(1, 0, 2)  # [NKV, S, HD]
    out = np.empty((t, nkv, g, hd), dtype=np.float32)  # [T, NKV, G, HD]
    qg = q.reshape(t, nkv, g, hd)  # [T, NKV, G, HD]
    for i in range(t):
        end = s_all - rows_after - t + i + 1  # keys [0, end) are causal for row i
        scores = np.matmul(qg[i], k_heads[:, :, :end]) * scale  # [NKV, G, S_i]
        z = scores - scores.max(axis=-1, keepdims=True)
        e = np.exp(z)
        probs = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)  # [NKV, G, S_i]
        out[i] = np.matmul(probs, v_heads[:, :end])  # [NKV, G, HD]
    return out.reshape(t, -1)


def out_proj(w: GQAWeights, out: F32Array, mm: MatMul = _call) -> F32Array:
    """``o_proj`` (+ bias) of the heads' outputs [T, NH * HD] -> [T, D] (rows independent)."""
    y = mm(w.o_proj, np.ascontiguousarray(out))  # [T, D]
    return y if w.o_bias is None else (y + w.o_bias).astype(np.float32)
