"""Tiny glm_moe_dsa-style configs and seeded random weights for storage tests (numpy only).

``tiny_config()`` has hidden 64, 2 main layers (the first dense), 4 routed experts with
moe_intermediate 96 (so a down_proj row of 96 is *not* a multiple of the 64-wide int4 group), one
MTP layer and a DSA indexer. ``random_weights`` draws every tensor of ``expected_tensors`` with
norm weights near 1 and small biases so every path matters; ``quantize_policy`` applies the
colibri precision policy (experts/dense int4-g64, io int8, mtp int8, 1-D and router f32).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from storage.arch import ArchConfig, classify, expected_tensors
from storage.public_layout import dtype_sort_key, write_public_container
from storage.quant import QTensor, quantize
from storage.safetensors import PAD_PREFIX, TensorSpec, read_header, read_tensor, write_safetensors

Arrays = dict[str, tuple[str, npt.NDArray[np.generic]]]  # name -> (safetensors dtype, data)

DEFAULT_POLICY: dict[str, str] = {
    "expert": "int4-g64",
    "dense": "int4-g64",
    "io": "int8",
    "mtp": "int8",
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small but complete glm_moe_dsa config.json dict (HF keys)."""
    cfg: dict[str, Any] = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense", "sparse"],
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
        "indexer_types": ["full", "shared"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "eos_token_id": [1, 2],
        "bos_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def vector_len(name: str, a: ArchConfig) -> int:
    """Length of a 1-D tensor of the architecture (the arch table knows only matrices)."""
    if name.endswith("q_a_layernorm.weight"):
        return a.q_lora_rank or a.hidden_size
    if name.endswith("kv_a_layernorm.weight"):
        return a.kv_lora_rank
    if ".indexer.k_norm." in name:
        return a.index_head_dim
    if name.endswith("e_score_correction_bias"):
        return a.n_routed_experts
    return a.hidden_size


def random_weights(cfg: Mapping[str, Any], seed: int = 0) -> dict[str, npt.NDArray[np.float32]]:
    """float32 weights for every expected tensor: matrices N(0, 1/fan_in), norm weights
    1 + 0.1 N, biases 0.1 N, correction bias 0.05 N."""
    a = ArchConfig.from_dict(cfg)
    rng = np.random.default_rng(seed)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name in expected_tensors(a):
        role = classify(name, a)
        if role is None:
            raise AssertionError(f"expected tensor {name} does not classify")
        if role.shape is not None:
            o, i = role.shape
            w = rng.standard_normal((o, i)) / np.sqrt(i)
        else:
            n = vector_len(name, a)
            if name.endswith("e_score_correction_bias"):
                w = 0.05 * rng.standard_normal(n)
            elif name.endswith("bias"):
                w = 0.1 * rng.standard_normal(n)
            else:
                w = 1.0 + 0.1 * rng.standard_normal(n)
        out[name] = w.astype(np.float32)
    return out


def quantize_policy(
    weights: Mapping[str, npt.NDArray[np.float32]],
    cfg: Mapping[str, Any],
    policy: Mapping[str, str] = DEFAULT_POLICY,
) -> dict[str, QTensor | npt.NDArray[np.float32]]:
    """Matrices of roles in ``policy`` quantized to that format; everything else (1-D tensors,
    the router) stays a float32 array."""
    a = ArchConfig.from_dict(cfg)
    out: dict[str, QTensor | npt.NDArray[np.float32]] = {}
    for name, w in weights.items():
        role = classify(name, a)
        if role is not None and role.shape is not None and role.role in policy:
            out[name] = quantize(w, policy[role.role])
        else:
            out[name] = w
    return out


def tokenizer_json(vocab_size: int = 128) -> bytes:
    """A tiny valid tokenizer.json (word-level) built with the `tokenizers` library."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, "<eot>": 2}
    for k in range(3, vocab_size):
        vocab[f"w{k}"] = k
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def make_container(
    dst: Path,
    cfg: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    policy: Mapping[str, str] = DEFAULT_POLICY,
    shard_bytes: int = 2**30,
    with_tokenizer: bool = True,
    drop: tuple[str, ...] = (),
) -> tuple[Path, dict[str, npt.NDArray[np.float32]], dict[str, QTensor | npt.NDArray[np.float32]]]:
    """Write a public-layout container of ``cfg`` (default :func:`tiny_config`) into ``dst``.

    Returns (dst, float32 weights, the stored tensors); ``drop`` omits tensors by name."""
    c = dict(cfg) if cfg is not None else tiny_config()
    w = random_weights(c, seed)
    stored = quantize_policy(w, c, policy)
    for name in drop:
        del stored[name]
    files: dict[str, bytes] = {}
    if with_tokenizer:
        files["tokenizer.json"] = tokenizer_json(int(c["vocab_size"]))
        files["tokenizer_config.json"] = b'{"eos_token": "<eos>", "model_max_length": 4096}'
    write_public_container(
        dst,
        c,
        stored,
        tokenizer_files=files,
        generation_config={"eos_token_id": [2, 3], "temperature": 1.0},
        shard_bytes=shard_bytes,
    )
    return dst, w, stored


def rewrite(
    path: Path,
    edit: Callable[[Arrays], None] = lambda t: None,
    *,
    order: Callable[[str, str], Any] = dtype_sort_key,
    align: dict[str, int] | None = None,
) -> None:
    """Rewrite one shard after ``edit`` changed its {name: (dtype, array)} map, in the order
    ``order(dtype, name)`` (default: the public layout's)."""
    sh = read_header(path)
    tensors: Arrays = {
        n: (i.dtype, read_tensor(i)) for n, i in sh.tensors.items() if not n.startswith(PAD_PREFIX)
    }
    edit(tensors)
    names = sorted(tensors, key=lambda n: order(tensors[n][0], n))
    specs = [
        TensorSpec(n, tensors[n][0], tuple(tensors[n][1].shape), (align or {}).get(n, 1))
        for n in names
    ]
    path.unlink()
    write_safetensors(path, specs, [tensors[n][1] for n in names])
