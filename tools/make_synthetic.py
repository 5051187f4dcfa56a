"""Make a synthetic container with real GLM-5 expert geometry for streaming benchmarks.

Hidden 6144, routed expert FFN 2048, int4 grouped gs64 (~18.9 MB of packed weights + 2.4 MB of
scales per expert), 256 experts per MoE layer, a few MoE layers and a deliberately small dense
part (few attention heads, small vocab). Weights are random bytes (uniform nibbles) with scales
chosen so activations stay O(1); the model computes noise, which is all a storage benchmark needs.
The layout is the converter's: every expert's three matrices adjacent and 4 KiB-aligned.

    python tools/make_synthetic.py --out /var/tmp/glm5-synth [--moe-layers 3] [--experts 256]
        [--predictable]

``--predictable`` scales every projection that writes into the residual stream (attention
``o_proj``, every ``down_proj``) by ``PREDICTABLE_SCALE``: the stream then stays close to the
token's embedding from layer to layer, so layer L+1's router applied to layer L's state
predicts L+1's experts almost exactly, while sampled tokens still route to varied experts.
That is the disk-bound model with predictable routing a lookahead benchmark needs.

Generated in about a minute per MoE layer on a 2-core machine (mostly disk writes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from storage.arch import ArchConfig, classify, expected_tensors  # noqa: E402
from storage.quant import QuantFormat  # noqa: E402
from storage.safetensors import TensorSpec, write_safetensors  # noqa: E402

GS = 64
# --predictable: the scale of the projections that write into the residual stream
PREDICTABLE_SCALE = 0.001


def synthetic_config(moe_layers: int, experts: int, top_k: int = 8) -> dict[str, object]:
    n_layers = moe_layers + 1
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "intermediate_size": 2048,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": n_layers,
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * moe_layers,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": top_k,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 512,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "head_dim": 64,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 2048,
        "indexer_types": ["full"] * n_layers,
        "vocab_size": 2048,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": [1],
        "num_nextn_predict_layers": 0,
        "scoring_func": "sigmoid",
    }


Maker = Callable[[np.random.Generator], np.ndarray]


def _tensors_for_layer(
    arch: ArchConfig, names: list[str], predictable: bool = False
) -> list[tuple[str, str, tuple[int, ...], int, Maker]]:
    """(name, dtype, shape, align, maker) in the converter's order: small tensors, then experts.

    Makers draw from the generator lazily, so one layer's experts never sit in memory at once."""
    small: list[tuple[str, str, tuple[int, ...], int, Maker]] = []
    experts: list[tuple[str, str, tuple[int, ...], int, Maker]] = []
    h, n_e = arch.hidden_size, arch.n_routed_experts
    for name in names:
        role = classify(name, arch)
        if role is None:
            raise SystemExit(f"internal: unknown tensor {name}")
        if role.role == "f32":
            if name.endswith("mlp.gate.weight"):
                small.append((name, "F32", (n_e, h), 1, _router(n_e, h)))
            elif name.endswith("e_score_correction_bias"):
                small.append((name, "F32", (n_e,), 1, _const(n_e, 0.0)))
            elif name.endswith(".bias"):
                small.append(
                    (name, "F32", (arch.index_head_dim,), 1, _const(arch.index_head_dim, 0.0))
                )
            else:
                size = _norm_size(name, arch)
                small.append((name, "F32", (size,), 1, _const(size, 1.0)))
            continue
        assert role.shape is not None
        o, i = role.shape
        fmt = QuantFormat("int8") if role.role == "io" else QuantFormat("int4", GS)
        nq, ns = fmt.weight_nbytes(o, i), fmt.n_scales(o, i)
        writes_residual = name.endswith(("o_proj.weight", "down_proj.weight"))
        gain = PREDICTABLE_SCALE if predictable and writes_residual else 1.0
        small.append((name + ".qs", "F32", (ns,), 1, _scales(ns, fmt, i, gain)))
        maker = _int8_bytes(nq) if fmt.kind == "int8" else _nibbles(nq)
        packed = (name, "U8", (nq,), 1, maker)
        if role.role == "expert":
            align = 4096 if role.proj == "down_proj" else 1
            experts.append((name, "U8", (nq,), align, maker))
        else:
            small.append(packed)
    # down, gate, up per expert (alphabetical): the first one aligned, the three adjacent
    experts.sort(key=lambda t: _expert_sort_key(t[0]))
    return small + experts


def _router(n_e: int, h: int) -> Maker:
    return lambda rng: rng.standard_normal((n_e, h), dtype=np.float32) * 0.02


def _const(n: int, v: float) -> Maker:
    return lambda rng: np.full(n, v, dtype=np.float32)


def _nibbles(n: int) -> Maker:
    """Packed int4 bytes whose values are uniform over -7..7 (nibbles 1..15): zero-mean, so no
    common-mode component makes every token route to the same experts."""

    def make(rng: np.random.Generator) -> np.ndarray:
        lo = rng.integers(1, 16, size=n, dtype=np.uint8)
        hi = rng.integers(1, 16, size=n, dtype=np.uint8)
        return lo | (hi << 4)

    return make


def _int8_bytes(n: int) -> Maker:
    """int8 values uniform over -127..127 (zero-mean), as raw bytes."""
    return lambda rng: rng.integers(-127, 128, size=n, dtype=np.int8).view(np.uint8)


def _scales(n: int, fmt: QuantFormat, i: int, gain: float = 1.0) -> Maker:
    # uniform -7..7 has std 4.3 and uniform -127..127 std 73: weights ~ N(0, gain^2 / i)
    spread = 4.3 if fmt.kind == "int4" else 73.0
    return lambda rng: np.full(n, gain / (spread * np.sqrt(i)), dtype=np.float32)


def _expert_sort_key(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]), parts[-2]


def _norm_size(name: str, arch: ArchConfig) -> int:
    if "q_a_layernorm" in name:
        assert arch.q_lora_rank is not None
        return arch.q_lora_rank
    if "kv_a_layernorm" in name:
        return arch.kv_lora_rank
    if "k_norm" in name:
        return arch.index_head_dim
    return arch.hidden_size


def build(
    out: Path,
    moe_layers: int,
    experts: int,
    seed: int = 0,
    top_k: int = 8,
    predictable: bool = False,
) -> None:
    cfg = synthetic_config(moe_layers, experts, top_k)
    arch = ArchConfig.from_dict(cfg)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    names = expected_tensors(arch)
    by_layer: dict[int, list[str]] = {}
    for n in names:
        role = classify(n, arch)
        layer = role.layer if role and role.layer is not None else -1
        by_layer.setdefault(layer, []).append(n)
    t0 = time.perf_counter()
    total = 0
    for k, layer in enumerate(sorted(by_layer)):
        items = _tensors_for_layer(arch, sorted(by_layer[layer]), predictable)
        specs = [TensorSpec(n, dt, shape, align) for n, dt, shape, align, _ in items]
        path = out / f"out-{k:05d}.safetensors"
        chunks = (make(rng) for *_, make in items)
        write_safetensors(path, specs, chunks, header_align=4096)
        total += path.stat().st_size
        print(f"  shard {path.name}: {path.stat().st_size / 2**30:.2f} GiB", flush=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}) + "\n")
    dt = time.perf_counter() - t0
    fmt = QuantFormat.parse("int4-g64")
    per_expert = 3 * fmt.weight_nbytes(2048, 6144)
    print(
        f"synthetic GLM-5 geometry: {moe_layers} MoE layers x {experts} experts, "
        f"{per_expert / 1e6:.1f} MB packed per expert, {total / 2**30:.2f} GiB in {dt:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--moe-layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--predictable",
        action="store_true",
        help="routing that layer L's state predicts for L+1 (for lookahead benchmarks)",
    )
    a = ap.parse_args(argv)
    build(a.out, a.moe_layers, a.experts, a.seed, a.top_k, a.predictable)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
