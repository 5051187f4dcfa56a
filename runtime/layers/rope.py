"""Rotary position embedding as transformers computes it: ``default`` and ``yarn`` (+ ``linear``).

Facts mirrored from ``transformers.modeling_rope_utils`` (5.24) and the MLA models:

* RoPE covers only the ``qk_rope_head_dim`` slice (the configs point ``head_dim`` at it).
* ``cos``/``sin`` are ``cos(pos * inv_freq) * attention_factor`` in float32; the pair layout is
  either *interleaved* -- pairs ``(x0, x1), (x2, x3), ...`` -- or *half split* -- pairs
  ``(x_i, x_{i+R/2})`` (``rotate_half``). GLM-5 (main attention and DSA indexer) and DeepSeek-V3
  with ``rope_interleave`` use interleaved pairs; DeepSeek-V3.2's indexer uses half split.
  The interleaved variant returns the rotated pairs *de-interleaved*
  (``cat([x_even', x_odd'])``); q and k get the same permutation, so dot products are unchanged
  and the cached rope key is stored in that layout.
* YaRN: ``inv_freq`` blends interpolation ``1/(factor * base^(2i/d))`` and extrapolation
  ``1/base^(2i/d)`` with a linear ramp between the correction dims for ``beta_fast``/``beta_slow``
  (floored/ceiled unless ``truncate`` is false). ``attention_factor`` (applied to cos/sin)
  defaults to ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set,
  else ``mscale(factor)``, with ``mscale(s, m) = 0.1 m ln(s) + 1`` (1 when s <= 1).
* The MLA softmax scale is ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` for
  any non-default rope type whose ``mscale_all_dim`` is set (``yarn_apply_mscale``).

Shape legend: T tokens, H heads, R rope dims, R2 = R / 2 frequencies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from runtime.kernels.rope import rope_rows
from storage.arch import rope_keys
from storage.errors import ConfigError

__all__ = [
    "Rope",
    "RopeParameters",
    "apply_rope",
    "apply_rope_numpy",
    "mla_softmax_scale",
    "yarn_get_mscale",
]

F32Array = npt.NDArray[np.float32]


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class RopeParameters:
    """The ``rope_parameters`` dict of an HF config, normalised (old ``rope_scaling`` accepted)."""

    rope_type: str
    rope_theta: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # share of head_dim that is rotated (GQA families); None: config.json does not say
    partial_rotary_factor: float | None = None

    @staticmethod
    def from_config(cfg: Mapping[str, Any]) -> RopeParameters:
        """Read ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``,
        checked by :func:`storage.arch.rope_keys` (the rule ``coli doctor`` checks too)."""
        return RopeParameters(**rope_keys(cfg))


def mla_softmax_scale(qk_head_dim: int, rope: RopeParameters) -> float:
    """Attention softmax scale of the MLA models (``yarn_apply_mscale``)."""
    scale = float(qk_head_dim**-0.5)
    if rope.rope_type != "default" and rope.mscale_all_dim:
        if rope.factor is None:
            raise ConfigError("config.json: rope_parameters.mscale_all_dim needs a factor")
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def _inv_freq_default(base: float, dim: int) -> F32Array:
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # [R2]
    inv: F32Array = (np.float32(1.0) / np.power(np.float32(base), exps)).astype(np.float32)
    return inv  # [R2]


def _inv_freq_yarn(p: RopeParameters, dim: int, max_pos: int) -> tuple[F32Array, float]:
    base = p.rope_theta
    orig = p.original_max_position_embeddings or max_pos
    factor = p.factor if p.factor is not None else max_pos / orig
    attention_factor = p.attention_factor
    if attention_factor is None:
        if p.mscale and p.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, p.mscale) / yarn_get_mscale(
                factor, p.mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = p.beta_fast or 32.0
    beta_slow = p.beta_slow or 1.0

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    ramp = np.clip(ramp, 0, 1).astype(np.float32)  # [R2]
    pos_freqs = np.power(
        np.float32(base), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    ).astype(np.float32)  # [R2]
    extrapolation = np.float32(1.0) / pos_freqs  # [R2]
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)  # [R2]
    extra_factor = np.float32(1.0) - ramp  # [R2]
    inv = interpolation * (np.float32(1.0) - extra_factor) + extrapolation * extra_factor
    return inv.astype(np.float32), float(attention_factor)


class Rope:
    """Frequencies of one rope configuration; ``cos_sin(positions)`` then ``apply_rope``."""

    def __init__(
        self, params: RopeParameters, dim: int, max_position_embeddings: int, interleave: bool
    ) -> None:
        if dim % 2:
            raise ConfigError(f"config.json: qk_rope_head_dim must be even, got {dim}")
        self.params = params
        self.dim = dim
        self.interleave = interleave
        if params.rope_type == "yarn":
            self.inv_freq, self.attention_scaling = _inv_freq_yarn(
                params, dim, max_position_embeddings
            )
        else:
            self.inv_freq = _inv_freq_default(params.rope_theta, dim)
            self.attention_scaling = 1.0
            if params.rope_type == "linear":
                self.inv_freq = (self.inv_freq / np.float32(params.factor or 1.0)).astype(
                    np.float32
                )

    def cos_sin(self, positions: npt.NDArray[np.integer]) -> tuple[F32Array, F32Array]:
        """Per-pair ``(cos, sin)`` [T, R2] for integer ``positions`` [T]."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, R2]
        a = np.float32(self.attention_scaling)
        return (np.cos(freqs) * a).astype(np.float32), (np.sin(freqs) * a).astype(np.float32)


def apply_rope(x: F32Array, cos: F32Array, sin: F32Array, interleave: bool) -> F32Array:
    """Rotate the last axis (R) of ``x`` [T, R] or [T, H, R] by per-token ``cos``/``sin`` [T, R2].

    Output layout is ``cat([x1 cos - x2 sin, x2 cos + x1 sin])`` for both pairings (x1, x2 are
    the even/odd lanes when ``interleave`` else the two halves), as the reference returns it.
    float32 input of an even width runs as one numba call (:func:`runtime.kernels.rope.
    rope_rows`, the same bits); anything else as :func:`apply_rope_numpy`.
    """
    r = x.shape[-1]
    if (
        x.dtype == np.float32
        and cos.dtype == np.float32
        and sin.dtype == np.float32
        and x.ndim in (2, 3)
        and r % 2 == 0
        and cos.shape == sin.shape == (x.shape[0], r // 2)
    ):
        x3 = x if x.ndim == 3 else x[:, None, :]  # [T, H, R] (a view)
        out = np.empty(x3.shape, dtype=np.float32)
        rope_rows(x3, cos, sin, interleave, out)
        return out.reshape(x.shape)
    return apply_rope_numpy(x, cos, sin, interleave)


def apply_rope_numpy(x: F32Array, cos: F32Array, sin: F32Array, interleave: bool) -> F32Array:
    """:func:`apply_rope` by numpy array operations."""
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    out = np.empty(x.shape, dtype=np.float32)  # [T, (H,) R]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out
