"""Tiny random Hugging Face-style checkpoints for converter tests (numpy + the safetensors lib).

The checkpoint holds every name :func:`storage.arch.expected_tensors` lists, with the shapes
:func:`storage.arch.classify` implies, written by the official ``safetensors`` library (not by
colibri's own writer) so the converter is tested against the files real tools produce.
``make_checkpoint`` returns the float32 value each tensor stands for, computed independently of
``storage.quant`` (bf16 by bit truncation, fp8 e4m3 decoded by formula).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import TensorSpec, serialize_file

from storage.arch import ArchConfig, classify, expected_tensors

F32 = npt.NDArray[np.float32]
FP8_NAN = (0x7F, 0xFF)


def tiny_config(model_type: str = "glm_moe_dsa", **over: Any) -> dict[str, Any]:
    """2 layers (1 dense + 1 MoE), 4 experts, moe_intermediate 96, hidden 64, one MTP layer."""
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [
            "GlmMoeDsaForCausalLM" if model_type == "glm_moe_dsa" else "DeepseekV3ForCausalLM"
        ],
        "hidden_size": 64,
        "vocab_size": 256,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "intermediate_size": 160,
        "moe_intermediate_size": 96,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        # stated: left out, each family takes transformers' default (DeepSeek-V3: 8 groups)
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": 4096,
    }
    if model_type == "glm_moe_dsa":
        cfg.update({"index_n_heads": 2, "index_head_dim": 32, "index_topk": 8})
    cfg.update(over)
    return cfg


def vector_len(name: str, arch: ArchConfig) -> int:
    """Length of a 1-D tensor (classify gives no shape for those)."""
    if name.endswith("e_score_correction_bias"):
        return arch.n_routed_experts
    if "q_a_layernorm" in name:
        return arch.q_lora_rank or arch.hidden_size
    if "kv_a_layernorm" in name:
        return arch.kv_lora_rank
    if "indexer.k_norm" in name:
        return arch.index_head_dim
    return arch.hidden_size


def bf16_bits(x: F32) -> npt.NDArray[np.uint16]:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits: npt.NDArray[np.uint16]) -> F32:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fp8_value(raw: npt.NDArray[np.uint8]) -> F32:
    """e4m3fn decode by formula (independent of storage.quant's table)."""
    r = raw.astype(np.int32)
    sign = np.where(r & 0x80, -1.0, 1.0)
    exp = (r >> 3) & 0xF
    man = (r & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * 2.0**-6
    return (sign * np.where(exp == 0, sub, normal)).astype(np.float32)


def fp8_reference(raw: npt.NDArray[np.uint8], scale: F32) -> F32:
    o, i = raw.shape
    full = np.kron(scale, np.ones((128, 128), dtype=np.float32))[:o, :i].astype(np.float32)
    return (fp8_value(raw) * full).astype(np.float32)


def make_checkpoint(
    root: Path,
    cfg: dict[str, Any],
    *,
    dtype: str = "BF16",
    n_shards: int = 3,
    index: bool = True,
    seed: int = 0,
    extra: dict[str, npt.NDArray[Any]] | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, F32]:
    """Write config.json, tokenizer files and ``n_shards`` safetensors shards under ``root``.

    ``dtype``: F32, F16, BF16 (everything) or FP8 (matrices of role dense/expert/mtp as F8_E4M3 +
    ``weight_scale_inv``; the rest BF16). ``extra`` tensors are added verbatim (numpy dtypes);
    ``skip`` names (scale_inv ones included) are left out of the shards.
    Returns name -> the float32 value the converter must start from."""
    root.mkdir(parents=True, exist_ok=True)
    arch = ArchConfig.from_dict(cfg)
    rng = np.random.default_rng(seed)
    stored: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    ref: dict[str, F32] = {}
    for name in expected_tensors(arch):
        role = classify(name, arch)
        assert role is not None, name
        if role.shape is None:
            shape: tuple[int, ...] = (vector_len(name, arch),)
            w = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            shape = role.shape
            w = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        if dtype == "FP8" and role.role in ("dense", "expert", "mtp") and role.shape is not None:
            raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
            raw[np.isin(raw, FP8_NAN)] = 0x38  # 1.0: keep NaN codes out of the weights
            sshape = (-(-shape[0] // 128), -(-shape[1] // 128))
            scale = rng.uniform(0.001, 0.01, size=sshape).astype(np.float32)
            stored[name] = ("float8_e4m3fn", shape, raw.tobytes())
            stored[name + "_scale_inv"] = ("float32", sshape, scale.tobytes())
            ref[name] = fp8_reference(raw, scale)
        elif dtype in ("BF16", "FP8"):
            bits = bf16_bits(w)
            stored[name] = ("bfloat16", shape, bits.tobytes())
            ref[name] = bf16_value(bits)
        elif dtype == "F16":
            h = w.astype(np.float16)
            stored[name] = ("float16", shape, h.tobytes())
            ref[name] = h.astype(np.float32)
        elif dtype == "F32":
            stored[name] = ("float32", shape, w.tobytes())
            ref[name] = w
        else:
            raise ValueError(dtype)
    for name, arr in (extra or {}).items():
        a = np.ascontiguousarray(arr)
        stored[name] = (a.dtype.name, a.shape, a.tobytes())

    for name in skip:  # drop after generating, so the other tensors keep their values
        stored.pop(name, None)
    names = sorted(stored)
    single = n_shards == 1 and not index
    files: dict[str, list[str]] = {}
    for k, name in enumerate(names):
        # Keep a weight next to its scale_inv as real checkpoints do; otherwise round-robin.
        base = name.removesuffix("_scale_inv")
        slot = names.index(base) % n_shards if base in stored else k % n_shards
        fname = (
            "model.safetensors" if single else f"model-{slot + 1:05d}-of-{n_shards:05d}.safetensors"
        )
        files.setdefault(fname, []).append(name)
    for fname, members in sorted(files.items()):
        bufs = {n: np.frombuffer(stored[n][2], dtype=np.uint8).copy() for n in members}
        specs = {
            n: TensorSpec(
                dtype=stored[n][0],
                shape=list(stored[n][1]),
                data_ptr=bufs[n].ctypes.data,
                data_len=bufs[n].nbytes,
            )
            for n in members
        }
        serialize_file(specs, str(root / fname), metadata={"format": "pt"})
        del bufs
    if index and not single:
        wmap = {n: f for f, ms in files.items() for n in ms}
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": wmap}, indent=1)
        )
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (root / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}})
    )
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return ref
