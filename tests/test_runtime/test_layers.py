"""Each runtime block against the transformers module it reimplements (fp32, small random sizes).

Blocks are fed through the real loader (``runtime.weights.load_layer``) from a dict-backed
container holding the torch module's parameters under their HF names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from runtime.kernels import norm as norm_kernels
from runtime.kernels import rope as rope_kernels
from runtime.kv import KVCache
from runtime.layers import dsa_indexer as dsa
from runtime.layers import mla
from runtime.layers import moe as moe_ops
from runtime.layers.moe_router import RouterConfig, route
from runtime.layers.rms_norm import layer_norm, layer_norm_numpy, rms_norm, rms_norm_numpy
from runtime.layers.rope import (
    Rope,
    RopeParameters,
    apply_rope,
    apply_rope_numpy,
    mla_softmax_scale,
)
from runtime.layers.topk import torch_topk_indices
from runtime.weights import embed_rows, f32_linear, load_layer, qtensor_rows
from storage.errors import ModelError
from storage.quant import QTensor, QuantFormat, dequantize, quantize

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm  # noqa: E402

torch.set_num_threads(1)


class DictContainer:
    """The container surface the runtime reads, over a dict of HF-named float32 arrays."""

    def __init__(self, tensors: Mapping[str, np.ndarray], config: dict[str, Any]) -> None:
        self.tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
        self.config = config

    def has(self, name: str) -> bool:
        return name in self.tensors

    def load_qtensor(self, name: str) -> QTensor:
        w = self.tensors[name]
        return QTensor(QuantFormat("f32"), (w.shape[0], w.shape[1]), w)

    def load_f32(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def expert(self, layer: int, expert: int) -> Any:
        raise NotImplementedError

    def expert_layers(self) -> list[int]:
        return []


def _randomize(module: Any, seed: int) -> None:
    """Every parameter/buffer random (norm weights near 1) so no path hides behind defaults."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def _state(module: Any, prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for k, v in module.state_dict().items():
        out[prefix + k] = v.detach().float().numpy()
    return out


def _ds_config(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256,
    )
    base.update(kw)
    cfg = ds.DeepseekV3Config(**base)
    cfg._attn_implementation = "eager"
    return cfg


def _glm_config(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=6,
        index_head_dim=32,
        index_n_heads=2,
        indexer_types=["full", "full"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256,
    )
    base.update(kw)
    cfg = glm.GlmMoeDsaConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def _dims(cfg: Any) -> mla.MLADims:
    return mla.MLADims(
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )


def _router_cfg(cfg: Any) -> RouterConfig:
    return RouterConfig(
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.n_group,
        cfg.topk_group,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    )


def _causal(t: int) -> Any:
    m = torch.full((t, t), float("-inf")).triu(1)
    return m[None, None]


# ----------------------------------------------------------------------------- norms, rope


def test_rms_norm_and_layer_norm_match_torch() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 48)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(48)).astype(np.float32)
    b = (0.1 * rng.standard_normal(48)).astype(np.float32)
    ref = ds.DeepseekV3RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        want = ref(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), want, rtol=1e-6, atol=1e-6)
    want_ln = torch.nn.functional.layer_norm(
        torch.from_numpy(x), (48,), torch.from_numpy(w), torch.from_numpy(b), 1e-6
    ).numpy()
    np.testing.assert_allclose(layer_norm(x, w, b, 1e-6), want_ln, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [1, 7, 8, 9, 48, 127, 128, 129, 256, 300, 576, 2048, 6144, 7000])
def test_rms_norm_kernel_is_numpy_bit_for_bit(d: int) -> None:
    """The one-call numba rms norm gives numpy's float32 arithmetic bit for bit (numpy's
    pairwise row sum: widths around its blocks of 8 and 128 and well past them), on
    contiguous rows, strided row views (a latent's columns of a projection) and 3-D per-head
    input, at every scale; each row alone is the same bits as in the batch."""
    rng = np.random.default_rng(d)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    for scale in (1e-4, 1.0, 40.0):
        x = (rng.standard_normal((5, d + 3)) * scale).astype(np.float32)
        for arr in (np.ascontiguousarray(x[:, :d]), x[:, :d], x[:, 3:]):
            got = rms_norm(arr, w, 1e-6)
            assert got.dtype == np.float32 and got.shape == arr.shape
            assert np.array_equal(got, rms_norm_numpy(arr, w, 1e-6))
            assert np.array_equal(got[2:3], rms_norm(arr[2:3], w, 1e-6))
    heads = rng.standard_normal((3, 4, d)).astype(np.float32)
    assert np.array_equal(rms_norm(heads, w, 1e-5), rms_norm_numpy(heads, w, 1e-5))
    assert np.array_equal(rms_norm(heads[0, 0], w, 1e-5), rms_norm_numpy(heads[0, 0], w, 1e-5))


@pytest.mark.parametrize("d", [1, 7, 8, 9, 64, 127, 128, 129, 300, 2048, 7000])
def test_layer_norm_kernel_is_numpy_bit_for_bit(d: int) -> None:
    """The one-call numba LayerNorm (the DSA indexer's key norm) gives numpy's float32
    arithmetic bit for bit: both means as numpy's pairwise row sums and one division, the
    centred values, the variance, the reciprocal square root and ``xc * inv * w + b`` in
    numpy's order; on contiguous rows and strided row views, rows far from zero (the
    centring matters), at every scale; each row alone is the same bits as in the batch."""
    rng = np.random.default_rng(100 + d)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(d)).astype(np.float32)
    for scale, shift in ((1e-4, 0.0), (1.0, 0.0), (40.0, 0.0), (1.0, 300.0)):
        x = (rng.standard_normal((5, d + 3)) * scale + shift).astype(np.float32)
        for arr in (np.ascontiguousarray(x[:, :d]), x[:, :d], x[:, 3:]):
            got = layer_norm(arr, w, b, 1e-6)
            assert got.dtype == np.float32 and got.shape == arr.shape
            assert np.array_equal(got, layer_norm_numpy(arr, w, b, 1e-6))
            assert np.array_equal(got[2:3], layer_norm(arr[2:3], w, b, 1e-6))
    heads = rng.standard_normal((3, 4, d)).astype(np.float32)
    assert np.array_equal(layer_norm(heads, w, b, 1e-5), layer_norm_numpy(heads, w, b, 1e-5))


def test_rms_norm_check_and_kernels_release_the_gil() -> None:
    """The final norm's check refuses a row whose squares overflow or hold a NaN, in the
    kernel as in numpy; unchecked, both give the same (non-finite) bits."""
    w = np.ones(64, np.float32)
    for bad in (np.float32(3e20), np.float32("nan")):
        x = np.ones((3, 64), np.float32)
        x[1, 5] = bad
        for fn in (rms_norm, rms_norm_numpy):
            with pytest.raises(ModelError, match="overflowed"):
                fn(x, w, 1e-6, check=True)
        with np.errstate(over="ignore", invalid="ignore"):
            want = rms_norm_numpy(x, w, 1e-6)
        np.testing.assert_array_equal(rms_norm(x, w, 1e-6), want)
    for k in norm_kernels.KERNELS:
        assert k.targetoptions.get("nogil") is True, k


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_kernel_is_numpy_bit_for_bit(interleave: bool) -> None:
    """The one-call numba rope gives numpy's float32 products and sums bit for bit, on
    [T, R] and [T, H, R], contiguous and as the strided views the projections hand it (the
    rope part of each head's query, the rope key after the latent); cos / sin it does not take
    (one row broadcast to every token) go to numpy."""
    rng = np.random.default_rng(7)
    t, h, nope, r = 5, 4, 24, 16
    cos = rng.standard_normal((t, r // 2)).astype(np.float32)
    sin = rng.standard_normal((t, r // 2)).astype(np.float32)
    q = (rng.standard_normal((t, h, nope + r)) * 3).astype(np.float32)
    kv = (rng.standard_normal((t, 40 + r)) * 3).astype(np.float32)
    for x in (q[:, :, nope:], np.ascontiguousarray(q[:, :, nope:]), kv[:, 40:], kv[:, 40:].copy()):
        got = apply_rope(x, cos, sin, interleave)
        assert got.shape == x.shape and got.dtype == np.float32 and got.flags.c_contiguous
        assert np.array_equal(got, apply_rope_numpy(x, cos, sin, interleave))
    x = kv[:, 40:]
    assert np.array_equal(
        apply_rope(x, cos[:1], sin[:1], interleave),
        apply_rope_numpy(x, cos[:1], sin[:1], interleave),
    )
    for k in rope_kernels.KERNELS:
        assert k.targetoptions.get("nogil") is True, k


YARN_CASES = [
    {"factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},
    {"factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 8.0, "original_max_position_embeddings": 100, "mscale_all_dim": 0.0},
    {"factor": 2.0, "original_max_position_embeddings": 128, "truncate": False,
     "attention_factor": 1.3},
]  # fmt: skip


@pytest.mark.parametrize("extra", YARN_CASES)
def test_yarn_frequencies_scaling_and_softmax_scale(extra: dict[str, Any]) -> None:
    params = {"rope_type": "yarn", "rope_theta": 10000.0, **extra}
    cfg = _ds_config(rope_parameters=dict(params), max_position_embeddings=512)
    emb = ds.DeepseekV3RotaryEmbedding(cfg)
    rp = RopeParameters.from_config(cfg.to_dict())
    rope = Rope(rp, cfg.qk_rope_head_dim, cfg.max_position_embeddings, True)
    np.testing.assert_allclose(rope.inv_freq, emb.inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(emb.attention_scaling, rel=1e-12)
    pos = np.array([0, 1, 5, 77, 300, 511])
    cos, sin = rope.cos_sin(pos)
    tc, ts = emb(torch.zeros(1), torch.from_numpy(pos)[None])
    half = cfg.qk_rope_head_dim // 2
    np.testing.assert_allclose(cos, tc[0, :, :half].numpy(), atol=2e-6)
    np.testing.assert_allclose(sin, ts[0, :, :half].numpy(), atol=2e-6)
    attn = ds.DeepseekV3Attention(cfg, 0)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert mla_softmax_scale(qk, rp) == pytest.approx(attn.scaling, rel=1e-12)


def test_rope_from_old_style_rope_scaling() -> None:
    old = {
        "rope_theta": 5000.0,
        "max_position_embeddings": 1024,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    }
    rp = RopeParameters.from_config(old)
    assert (rp.rope_type, rp.rope_theta, rp.factor) == ("yarn", 5000.0, 4.0)
    assert rp.original_max_position_embeddings == 256


@pytest.mark.parametrize("interleave", [True, False])
def test_apply_rope_matches_both_pairings(interleave: bool) -> None:
    rng = np.random.default_rng(1)
    t, h, r = 5, 3, 8
    q = rng.standard_normal((t, h, r)).astype(np.float32)
    k = rng.standard_normal((t, r)).astype(np.float32)
    rope = Rope(RopeParameters("default", 10000.0), r, 128, interleave)
    cos, sin = rope.cos_sin(np.arange(3, 3 + t))
    full_cos = torch.from_numpy(np.concatenate([cos, cos], -1))[None]  # [1, T, R]
    full_sin = torch.from_numpy(np.concatenate([sin, sin], -1))[None]
    tq = torch.from_numpy(q.transpose(1, 0, 2))[None]  # [1, H, T, R]
    tk = torch.from_numpy(k)[None, None]  # [1, 1, T, R]
    fn = ds.apply_rotary_pos_emb_interleave if interleave else ds.apply_rotary_pos_emb
    wq, wk = fn(tq, tk, full_cos, full_sin)
    np.testing.assert_allclose(
        apply_rope(q, cos, sin, interleave), wq[0].numpy().transpose(1, 0, 2), atol=1e-6
    )
    np.testing.assert_allclose(apply_rope(k, cos, sin, interleave), wk[0, 0].numpy(), atol=1e-6)


def test_rms_norm_is_the_mean_formula_bit_for_bit() -> None:
    """``rms_norm`` sums and divides without ``np.mean``'s wrapper: the same float32 sum and a
    correctly rounded division, so the bits of the plain formula for every width and scale."""
    rng = np.random.default_rng(9)
    for d in (7, 64, 100, 512, 2048, 7168):
        for scale in (1e-5, 1.0, 1e5):
            x = (rng.standard_normal((3, d)) * scale).astype(np.float32)
            w = rng.standard_normal(d).astype(np.float32)
            var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
            want = (w * (x * (np.float32(1.0) / np.sqrt(var + np.float32(1e-6))))).astype(
                np.float32
            )
            got = rms_norm(x, w, 1e-6)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ----------------------------------------------------------------------------- top-k, router


def test_topk_sets_equal_torch_including_ties() -> None:
    """Both ways of finding an untied set (the selection kernel for k <= 32, argpartition
    beyond) and the tie port give torch's set: integer runs, zeros, -inf masks, NaNs and
    signed zeros; without ``exact_masked_ties`` only a k-th value of -inf may differ."""
    rng = np.random.default_rng(2)
    for trial in range(480):
        n = int(rng.integers(2, 300))
        k = int(rng.integers(1, n + 1)) if trial % 2 else int(rng.integers(1, max(2, n // 64 + 1)))
        if trial % 3 == 0:
            k = min(k, int(rng.integers(1, 33)))  # the router's sizes: the kernel's range
        kind = trial % 6
        if kind == 0:
            x = rng.integers(0, 4, (3, n)).astype(np.float32)
        elif kind == 1:
            x = np.where(rng.random((3, n)) < 0.5, 0, rng.standard_normal((3, n)))
        elif kind == 2:
            x = rng.standard_normal((3, n))
            x[rng.random((3, n)) < 0.3] = -np.inf
        elif kind == 3:
            x = np.zeros((3, n))
            x[rng.random((3, n)) < 0.5] = -np.inf
        elif kind == 4:
            x = rng.standard_normal((3, n))
            x[rng.random((3, n)) < 0.05] = np.nan
        else:
            x = np.where(rng.random((3, n)) < 0.5, -0.0, rng.integers(-1, 2, (3, n)))
        x = x.astype(np.float32)
        want = torch.from_numpy(x).topk(k, dim=-1).indices.numpy()
        got = torch_topk_indices(x, k, exact_masked_ties=True)
        loose = torch_topk_indices(x, k)
        for row in range(3):
            assert set(got[row].tolist()) == set(want[row].tolist()), (trial, row)
            kth = np.sort(x[row][want[row]])[0]
            if not np.isneginf(kth):
                assert set(loose[row].tolist()) == set(want[row].tolist()), (trial, row)


def test_topk_with_lengths_is_torch_on_each_prefix() -> None:
    """``lengths``: each row's set is ``torch.topk`` of its first ``lengths[r]`` values, ties
    included, whatever the -inf tail (the DSA indexer's causal rows), on the selection
    kernel's sizes (k <= 64) and beyond."""
    rng = np.random.default_rng(5)
    for trial in range(240):
        k = int(rng.integers(1, 65)) if trial % 3 else int(rng.integers(65, 130))
        n = k + int(rng.integers(0, 200))
        lengths = rng.integers(k, n + 1, size=4)
        x = (rng.integers(0, 3, (4, n)) if trial % 2 else rng.standard_normal((4, n))).astype(
            np.float32
        )
        x[np.arange(n)[None, :] >= lengths[:, None]] = -np.inf  # the masked tail
        got = torch_topk_indices(x, k, lengths=lengths)
        for row in range(4):
            prefix = torch.from_numpy(x[row, : lengths[row]].copy())
            want = prefix.topk(k).indices.numpy()
            assert set(got[row].tolist()) == set(want.tolist()), (trial, row)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3)])
def test_router_matches_transformers(groups: tuple[int, int]) -> None:
    n_group, topk_group = groups
    cfg = _ds_config(n_routed_experts=32, num_experts_per_tok=6, n_group=n_group,
                     topk_group=topk_group)  # fmt: skip
    ref = ds.DeepseekV3TopkRouter(cfg)
    _randomize(ref, 3)
    with torch.no_grad():
        ref.weight.mul_(3.0)
        ref.e_score_correction_bias.copy_(0.05 * torch.randn(32))
    x = np.random.default_rng(4).standard_normal((40, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        _, w_ref, i_ref = ref(torch.from_numpy(x))
    w = moe_ops.MoEWeights(
        router=f32_linear(ref.weight.detach().numpy()),
        correction_bias=ref.e_score_correction_bias.numpy().copy(),
        shared=None,
        config=_router_cfg(cfg),
    )
    ids, weights = moe_ops.route(w, x)
    order = np.argsort(i_ref.numpy(), axis=1)
    np.testing.assert_array_equal(ids, np.take_along_axis(i_ref.numpy(), order, 1))
    np.testing.assert_allclose(
        weights, np.take_along_axis(w_ref.numpy(), order, 1), rtol=1e-5, atol=1e-6
    )


def test_router_exact_ties_follow_torch() -> None:
    """Equal router logits (duplicated router rows) tie exactly; torch's pick is reproduced."""
    cfg = _ds_config(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2)
    ref = ds.DeepseekV3TopkRouter(cfg)
    _randomize(ref, 5)
    with torch.no_grad():
        ref.weight[8:] = ref.weight[:8].clone()  # experts e and e+8 score the same
        ref.e_score_correction_bias.zero_()
    x = np.random.default_rng(6).standard_normal((30, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        _, _, i_ref = ref(torch.from_numpy(x))
    logits = x @ ref.weight.detach().numpy().T
    ids, _ = route(logits.astype(np.float32), np.zeros(16, np.float32), _router_cfg(cfg))
    np.testing.assert_array_equal(ids, np.sort(i_ref.numpy(), axis=1))


@pytest.mark.parametrize(
    ("n_e", "k", "groups", "norm"),
    [(64, 6, (1, 1), True), (256, 8, (8, 4), True), (32, 8, (4, 2), False), (16, 9, (1, 1), True)],
)
def test_the_router_kernel_is_the_numpy_router_bit_for_bit(
    n_e: int, k: int, groups: tuple[int, int], norm: bool
) -> None:
    """The sigmoid router's numba rows against its numpy form: the same ids and the same
    weight bits (a weight sum of 8 or more values in numpy's pairwise order), rows with exact
    ties at the boundary and a NaN handed to the numpy form, a whole step decided by it."""
    from runtime.layers.moe_router import KERNELS, _ascending, route_numpy

    assert all(kern.targetoptions.get("nogil") is True for kern in KERNELS)
    for ids in (np.array([5], np.int64), np.array([9, 2, 7, 0, 3, 8, 1, 4], np.int64)):
        assert np.array_equal(_ascending(ids), np.sort(ids)) and ids[0] in (5, 9)  # a copy
    cfg = RouterConfig(n_e, k, groups[0], groups[1], norm, 2.5)
    rng = np.random.default_rng(n_e + k)
    bias = (0.05 * rng.standard_normal(n_e)).astype(np.float32)
    logits = (3 * rng.standard_normal((300, n_e))).astype(np.float32)
    for t in range(0, 300, 7):
        got = route(logits[t : t + 7], bias, cfg)
        want = route_numpy(logits[t : t + 7], bias, cfg)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), t
    tied = logits[:5].copy()
    tied[:, 1::2] = tied[:, 0::2]  # experts 2j and 2j + 1 tie everywhere
    zero = np.zeros(n_e, np.float32)
    got, want = route(tied, zero, cfg), route_numpy(tied, zero, cfg)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    nan = logits[:3].copy()
    nan[1, 3] = np.nan
    got, want = route(nan, bias, cfg), route_numpy(nan, bias, cfg)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1], equal_nan=True)


# ----------------------------------------------------------------------------- MLA


def _mla_layer(cfg: Any, module_cls: Any, seed: int) -> tuple[Any, Any]:
    layer = module_cls(cfg, 0)
    _randomize(layer, seed)
    layer.eval()
    tensors = _state(layer, "model.layers.0.")
    c = DictContainer(tensors, {})
    lw = load_layer(c, 0, _dims(cfg), _router_cfg(cfg), moe=False, indexer=False)
    return layer, lw


@pytest.mark.parametrize("q_lora", [48, None])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_prefill_and_decode_match_transformers(q_lora: int | None, interleave: bool) -> None:
    cfg = _ds_config(
        q_lora_rank=q_lora,
        rope_interleave=interleave,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    )  # fmt: skip
    layer, lw = _mla_layer(cfg, ds.DeepseekV3DecoderLayer, 7)
    t = 11
    x = np.random.default_rng(8).standard_normal((t, cfg.hidden_size)).astype(np.float32)
    emb = ds.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        want = layer.self_attn(torch.from_numpy(x)[None], emb(torch.zeros(1), pos), _causal(t))[0][
            0
        ].numpy()
    d = _dims(cfg)
    rp = RopeParameters.from_config(cfg.to_dict())
    rope = Rope(rp, cfg.qk_rope_head_dim, cfg.max_position_embeddings, interleave)
    scale = mla_softmax_scale(d.qk_head_dim, rp)
    cos, sin = rope.cos_sin(np.arange(t))
    p = mla.project(lw.attn, d, x, cos, sin, interleave)
    allowed = mla.causal_mask(t, t)
    for absorbed in (False, True):
        got = mla.attend(lw.attn, d, p, p.latent, p.k_rope, allowed, scale, absorbed)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    # Decode token by token over a growing cache == the full (reconstructed) pass.
    full = mla.attend(lw.attn, d, p, p.latent, p.k_rope, allowed, scale, False)
    cache = KVCache(1, d.kv_lora_rank, d.qk_rope_head_dim)
    for i in range(t):
        c1, s1 = rope.cos_sin(np.array([i]))
        pi = mla.project(lw.attn, d, x[i : i + 1], c1, s1, interleave)
        cache.write(0, i, pi.latent, pi.k_rope)
        step = mla.attend(
            lw.attn, d, pi, cache.latent(0, i + 1), cache.k_rope(0, i + 1),
            mla.causal_mask(1, i + 1), scale, mla.prefer_absorbed(d, 1, i + 1),
        )  # fmt: skip
        cache.commit(i + 1)
        np.testing.assert_allclose(step[0], full[i], atol=1e-5, rtol=1e-4)


def test_prefer_absorbed_rule() -> None:
    d = mla.MLADims(64, 2048, 512, 192, 64, 256)
    assert mla.prefer_absorbed(d, 1, 10)
    assert mla.prefer_absorbed(d, 1, 100_000)
    assert not mla.prefer_absorbed(d, 512, 512)


# ----------------------------------------------------------------------------- DSA indexer


def test_indexer_selection_matches_transformers() -> None:
    cfg = _glm_config()
    layer = glm.GlmMoeDsaDecoderLayer(cfg, 0)
    _randomize(layer, 9)
    layer.eval()
    c = DictContainer(_state(layer, "model.layers.0."), {})
    lw = load_layer(c, 0, _dims(cfg), _router_cfg(cfg), moe=False, indexer=True)
    assert lw.indexer is not None
    t = 24
    x = np.random.default_rng(10).standard_normal((t, cfg.hidden_size)).astype(np.float32)
    emb = glm.GlmMoeDsaRotaryEmbedding(cfg)
    pos = torch.arange(t)[None]
    pe = emb(torch.zeros(1), pos)
    xt = torch.from_numpy(x)[None]
    attn = layer.self_attn
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(xt))
        # What transformers selects for query `row` when it is the newest token (a KV-cached
        # decode step: its row holds exactly row + 1 scores). colibri selects that for every
        # query of every call (batch-invariant); a full forward of T rows pads each row with -inf
        # to T, which can move torch's pick among exactly tied keys.
        want = [
            attn.indexer(
                xt[:, : row + 1],
                q_resid[:, : row + 1],
                tuple(e[:, : row + 1] for e in pe),
                _causal(row + 1)[:, 0],
                pos[:, : row + 1],
            )[0][row].numpy()
            for row in range(t)
        ]  # T x [k]
    d = _dims(cfg)
    idims = dsa.IndexerDims(cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk,
                            cfg.qk_rope_head_dim)  # fmt: skip
    rope = Rope(RopeParameters("default", 10000.0), cfg.qk_rope_head_dim, 256, True)
    cos, sin = rope.cos_sin(np.arange(t))
    p = mla.project(lw.attn, d, x, cos, sin, True)
    np.testing.assert_allclose(p.q_resid, q_resid[0].numpy(), atol=1e-5)
    keys = dsa.index_keys(lw.indexer, idims, x, cos, sin)
    scores = dsa.index_scores(lw.indexer, idims, x, p.q_resid, keys, cos, sin)
    sel = dsa.select(scores, cfg.index_topk)
    assert sel is not None
    n_ties = 0
    for row in range(t):
        causal = set(range(row + 1))
        want_set = {int(i) for i in want[row]} & causal
        assert set(np.flatnonzero(sel[row]).tolist()) & causal == want_set, row
        fin = np.sort(scores[row, : row + 1])[::-1]
        n_ties += int(fin.size > cfg.index_topk and fin[cfg.index_topk - 1] == fin[cfg.index_topk])
    assert n_ties > 0, "the test should exercise exact ties (relu zeros)"
    assert dsa.select(scores[:, :6], 6) is None  # index_topk >= S: no-op
    # a decode row (T = 1, its own path) selects what the same query did in the T-row call
    for row in range(cfg.index_topk, t):
        one = dsa.select(scores[row : row + 1, : row + 1], cfg.index_topk)
        assert one is not None and one.shape == (1, row + 1)
        assert np.array_equal(one[0], sel[row, : row + 1]), row


# ----------------------------------------------------------------------------- MoE, MLP


def test_moe_block_matches_transformers() -> None:
    cfg = _ds_config()
    moe_ref = ds.DeepseekV3MoE(cfg)
    _randomize(moe_ref, 11)
    x = np.random.default_rng(12).standard_normal((9, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = moe_ref(torch.from_numpy(x)[None])[0].numpy()
    router = f32_linear(moe_ref.gate.weight.detach().numpy())
    gu = moe_ref.experts.gate_up_proj.detach().numpy()
    dn = moe_ref.experts.down_proj.detach().numpy()
    i = cfg.moe_intermediate_size
    experts = {
        e: moe_ops.MLPWeights(f32_linear(gu[e, :i]), f32_linear(gu[e, i:]), f32_linear(dn[e]))
        for e in range(cfg.n_routed_experts)
    }
    sh = moe_ref.shared_experts
    w = moe_ops.MoEWeights(
        router=router,
        correction_bias=moe_ref.gate.e_score_correction_bias.numpy().copy(),
        shared=moe_ops.MLPWeights(
            f32_linear(sh.gate_proj.weight.detach().numpy()),
            f32_linear(sh.up_proj.weight.detach().numpy()),
            f32_linear(sh.down_proj.weight.detach().numpy()),
        ),
        config=_router_cfg(cfg),
    )
    ids, gates = moe_ops.route(w, x)
    union = moe_ops.union(ids)
    assert union == sorted(set(ids.ravel().tolist()))
    got = moe_ops.apply_experts(x, ids, gates, {e: experts[e] for e in union})
    got = got + moe_ops.shared(w, x)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ModelError):
        moe_ops.apply_experts(x, ids, gates, {})


# ----------------------------------------------------------------------------- helpers


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4-g64", "int4-row"])
def test_embed_rows_and_row_slices_dequantize_exactly(fmt: str) -> None:
    rng = np.random.default_rng(13)
    w = rng.standard_normal((50, 72)).astype(np.float32)
    q = quantize(w, fmt)
    full = dequantize(q)
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(embed_rows(q, ids), full[ids])
    np.testing.assert_array_equal(dequantize(qtensor_rows(q, 10, 17)), full[10:17])
    with pytest.raises(ModelError):
        embed_rows(q, np.array([50]))


def test_kv_cache_grows_commits_and_truncates() -> None:
    kv = KVCache(2, 4, 2, index_head_dim=3, indexed_layers=[1], capacity=2)
    rng = np.random.default_rng(14)
    lat = rng.standard_normal((5, 4)).astype(np.float32)
    kr = rng.standard_normal((5, 2)).astype(np.float32)
    for layer in range(2):
        kv.write(layer, 0, lat, kr)
    kv.write_index(1, 0, np.ones((5, 3), np.float32))
    kv.write_tokens(0, np.arange(5))
    assert kv.length == 0
    kv.commit(5)
    np.testing.assert_array_equal(kv.latent(0), lat)
    np.testing.assert_array_equal(kv.k_rope(1, 3), kr[:3])
    assert kv.index_keys(1).shape == (5, 3)
    assert kv.tokens.tolist() == [0, 1, 2, 3, 4]
    kv.truncate(2)
    assert kv.length == 2 and kv.latent(1).shape == (2, 4)
    with pytest.raises(ModelError):
        kv.index_keys(0)
    with pytest.raises(ModelError):
        kv.truncate(3)


def test_kv_cache_grows_one_layer_at_a_time() -> None:
    """Growing a KV cache copies its arrays one at a time, each old one let go once copied:
    while it doubles, memory grows by what the new arrays add over the old ones and one old
    layer (1.01x the old arrays here; 1.75x when each list's new arrays were all made before
    its old ones were let go), and every row written before is still there."""
    import tracemalloc

    n_layers, c, r, di = 8, 512, 64, 32
    rng = np.random.default_rng(3)
    tracemalloc.start()
    try:
        kv = KVCache(n_layers, c, r, di, indexed_layers=(1, 5), capacity=256)
        rows = rng.standard_normal((256, c)).astype(np.float32)
        for layer in range(n_layers):
            kv.write(layer, 0, rows + layer, rows[:, :r] - layer)
        kv.write_index(5, 0, rows[:, :di])
        kv.commit(256)
        old = 256 * 4 * (n_layers * (c + r) + 2 * di)
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        kv.reserve(257)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kv._cap == 512
    assert peak - before < 1.25 * old  # the new arrays (2x) less the old (1x), plus one layer
    for layer in range(n_layers):
        assert np.array_equal(kv.latent(layer), rows + layer)
        assert np.array_equal(kv.k_rope(layer), rows[:, :r] - layer)
        assert kv.addresses(layer)[0] == kv.latent(layer).ctypes.data
    assert np.array_equal(kv.index_keys(5), rows[:, :di])
