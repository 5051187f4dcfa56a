"""storage.arch decides the DSA indexer rule once; the runtime's GLM-5 config agrees with it."""

from __future__ import annotations

from typing import Any

import pytest
from helpers_storage import tiny_config

from runtime.models.glm_moe_dsa import GlmMoeDsaConfig
from storage.arch import ArchConfig, default_indexer_types, expected_tensors, optional_tensors
from storage.errors import ConfigError


def _cfg(**over: Any) -> dict[str, Any]:
    layers = ["dense"] + ["sparse"] * 5
    cfg = tiny_config(num_hidden_layers=6, mlp_layer_types=layers, rope_theta=10000.0, **over)
    cfg.pop("indexer_types")
    return cfg


@pytest.mark.parametrize(
    ("over", "want"),
    [
        ({}, "FFFFFF"),  # neither key: every layer full
        ({"index_topk_pattern": "FSSFSF"}, "FSSFSF"),
        ({"index_topk_pattern": ["full", "shared", "full", "full", "shared", "full"]}, "FSFFSF"),
        ({"index_topk_freq": 2}, "FFSFSF"),  # offset 2: layers 0, 1 full, then every 2nd
        ({"index_topk_freq": 3, "index_skip_topk_offset": 1}, "FSSFSS"),
    ],
)
def test_storage_and_runtime_agree_on_the_indexer_layers(over: dict[str, Any], want: str) -> None:
    cfg = _cfg(**over)
    arch = ArchConfig.from_dict(cfg)
    rt = GlmMoeDsaConfig.from_dict(cfg)
    got = "".join("F" if arch.has_indexer(i) else "S" for i in range(6))
    assert got == want
    assert [rt.runs_indexer(i) for i in range(7)] == [arch.has_indexer(i) for i in range(7)]
    names = set(expected_tensors(arch))
    for i in range(6):
        assert (f"model.layers.{i}.self_attn.indexer.wk.weight" in names) == (want[i] == "F")
    # the MTP layer (index 6) has an indexer, and only it is optional
    assert optional_tensors(arch) == {
        n for n in names if n.startswith("model.layers.6.self_attn.indexer.")
    }
    assert len(optional_tensors(arch)) == 5


def test_bad_pattern_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        default_indexer_types({"index_topk_pattern": "FXS"}, 3)
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        default_indexer_types({"index_topk_pattern": 5}, 3)


def test_plain_mla_has_no_indexer_anywhere() -> None:
    cfg = tiny_config(model_type="deepseek_v3")
    arch = ArchConfig.from_dict(cfg)
    assert not any(arch.has_indexer(i) for i in range(arch.total_layers))
    assert optional_tensors(arch) == frozenset()


def test_tensors_a_layer_has_no_place_for_are_unknown() -> None:
    """An indexer tensor of a layer that runs no indexer (DeepSeek-V3; a GLM-5 "shared"
    layer), a router correction bias of a dense layer, a q_a_proj bias without q_lora_rank
    were classified known (and dropped without a word); the ones the model applies stay."""
    import json

    from _demo import TINY

    from storage.arch import classify

    glm = ArchConfig.from_dict(json.loads((TINY / "config.json").read_text()))
    assert glm.indexer_types[:2] == ("full", "shared") and not glm.is_moe_layer(0)
    dsv3 = ArchConfig.from_dict(tiny_config(model_type="deepseek_v3", q_lora_rank=None))
    unknown = [
        (glm, "model.layers.1.self_attn.indexer.k_norm.bias"),
        (glm, "model.layers.1.self_attn.indexer.wk.weight"),
        (glm, "model.layers.0.mlp.gate.e_score_correction_bias"),
        (dsv3, "model.layers.1.self_attn.indexer.k_norm.bias"),
        (dsv3, "model.layers.1.self_attn.indexer.k_norm.weight"),
        (dsv3, "model.layers.1.self_attn.q_a_proj.bias"),
    ]
    assert [n for a, n in unknown if classify(n, a) is not None] == []
    known = [
        (glm, "model.layers.0.self_attn.indexer.k_norm.bias"),
        (glm, "model.layers.2.self_attn.indexer.wk.weight"),
        (glm, "model.layers.1.mlp.gate.e_score_correction_bias"),
        (glm, f"model.layers.{glm.num_hidden_layers}.mlp.gate.e_score_correction_bias"),
    ]
    assert [n for a, n in known if classify(n, a) is None] == []


# ----------------------------------------------------------------------------- GQA families


def _gqa(model_type: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(
        model_type=model_type, hidden_size=64, vocab_size=100, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        moe_intermediate_size=32, num_experts_per_tok=2, rope_parameters={"rope_theta": 1e4},
    )  # fmt: skip
    cfg.update(over)
    return cfg


def test_mixtral_names_map_to_canonical_projections() -> None:
    from storage.arch import classify

    arch = ArchConfig.from_dict(_gqa("mixtral", num_local_experts=4))
    assert arch.n_routed_experts == 4 and arch.moe_intermediate_size == 48  # intermediate_size
    role = classify("model.layers.1.block_sparse_moe.experts.3.w3.weight", arch)
    assert role is not None and (role.role, role.proj, role.expert) == ("expert", "up_proj", 3)
    assert role.shape == (48, 64)
    down = classify("model.layers.1.block_sparse_moe.experts.3.w2.weight", arch)
    assert down is not None and (down.proj, down.shape) == ("down_proj", (64, 48))
    assert classify("model.layers.1.block_sparse_moe.experts.4.w1.weight", arch) is None
    gate = classify("model.layers.0.block_sparse_moe.gate.weight", arch)
    assert gate is not None and (gate.role, gate.shape) == ("f32", (4, 64))
    k = classify("model.layers.0.self_attn.k_proj.weight", arch)
    assert k is not None and k.shape == (2 * 16, 64)  # 2 KV heads x head_dim 16
    names = set(expected_tensors(arch))
    assert "model.layers.2.block_sparse_moe.experts.0.w1.weight" in names
    assert not any("q_norm" in n or "e_score" in n for n in names)
    assert arch.kv_floats_per_token == 3 * 2 * 2 * 16


def test_qwen3_dense_layers_and_norms() -> None:
    arch = ArchConfig.from_dict(_gqa("qwen3_moe", num_experts=8, mlp_only_layers=[1], head_dim=24))
    assert [arch.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert arch.head_dim == 24 and arch.qk_norm == "head"
    names = set(expected_tensors(arch))
    assert "model.layers.1.mlp.gate_proj.weight" in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    step = ArchConfig.from_dict(_gqa("qwen3_moe", num_experts=8, decoder_sparse_step=2))
    assert [step.is_moe_layer(i) for i in range(3)] == [False, True, False]


def test_gqa_rope_and_router_choices() -> None:
    from runtime.models.glm4_moe import Glm4MoeConfig
    from runtime.models.minimax_m2 import MiniMaxM2Config
    from runtime.models.mixtral import MixtralConfig
    from runtime.models.olmoe import OlmoeConfig

    glm = Glm4MoeConfig.from_dict(_gqa("glm4_moe", n_routed_experts=8, routed_scaling_factor=2.0))
    assert glm.rotary_dim == 8  # head_dim 16 x the 0.5 GLM-4.5 assumes when config.json omits it
    assert glm.router.scoring == "sigmoid" and glm.router.routed_scaling_factor == 2.0
    assert (
        glm.qk_norm == "none"
        and ArchConfig.from_dict(_gqa("glm4_moe", n_routed_experts=8, use_qk_norm=True)).qk_norm
        == "head"
    )
    mm = MiniMaxM2Config.from_dict(_gqa("minimax_m2", num_local_experts=8, rotary_dim=4,
                                        routed_scaling_factor=2.0))  # fmt: skip
    assert mm.rotary_dim == 4 and mm.qk_norm == "full"
    assert mm.router.norm_topk_prob and mm.router.routed_scaling_factor == 1.0  # not applied
    assert mm.router.norm_eps == 0.0
    mix = MixtralConfig.from_dict(_gqa("mixtral", num_local_experts=4, norm_topk_prob=False))
    assert mix.router.scoring == "softmax" and mix.router.norm_topk_prob  # always renormalised
    assert not OlmoeConfig.from_dict(_gqa("olmoe", num_experts=4)).router.norm_topk_prob
    with pytest.raises(ConfigError, match="sliding-window"):
        MixtralConfig.from_dict(_gqa("mixtral", num_local_experts=4, sliding_window=4096))
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        ArchConfig.from_dict(_gqa("olmoe", num_experts=4, num_key_value_heads=3))


def test_kv_file_header_versions() -> None:
    from storage.kvfile import KVHeader

    v2 = KVHeader(3, 32, 32, 0, 0, 100, 5, 9, layout="gqa")
    raw = v2.pack()
    assert raw[:8] == b"COLIKV2\0" and KVHeader.unpack(raw) == v2
    v1 = KVHeader(3, 64, 16, 0, 0, 100, 5, 9)
    assert v1.pack()[:8] == b"COLIKV1\0" and KVHeader.unpack(v1.pack()).layout == "mla"


_DEFAULTED = ("rms_norm_eps", "routed_scaling_factor", "n_group", "topk_group",
              "n_shared_experts", "first_k_dense_replace", "max_position_embeddings",
              "norm_topk_prob", "q_lora_rank", "use_qk_norm", "decoder_sparse_step")  # fmt: skip


@pytest.mark.parametrize(
    "model_type",
    ["glm_moe_dsa", "deepseek_v3", "deepseek_v32", "olmoe", "qwen3_moe", "mixtral", "glm4_moe",
     "minimax_m2"],
)  # fmt: skip
def test_keys_left_out_of_config_json_mean_what_transformers_takes(model_type: str) -> None:
    """A config.json without routed_scaling_factor / n_group / rms_norm_eps / ... runs with the
    values transformers' config class fills in for its family (DeepSeek-V3: 2.5, 8 groups of
    which 4, ...), not one default for all (1.0, 1, 1e-6: wrong routing, silently)."""
    transformers = pytest.importorskip("transformers")
    from runtime.models import ARCHITECTURES

    hf = transformers.CONFIG_MAPPING[model_type]()
    cfg = {k: v for k, v in hf.to_dict().items() if k not in _DEFAULTED}
    cfg["model_type"] = model_type
    if model_type == "qwen3_moe":
        cfg["mlp_only_layers"] = []
    if model_type == "glm4_moe":  # the class's own default (4096 / 96 heads) has odd rotary dims
        cfg["head_dim"] = 128
    rt = ARCHITECTURES[model_type].config_class.from_dict(cfg)
    arch = ArchConfig.from_dict(cfg)
    hf_moe = getattr(hf, "n_shared_experts", None)
    got = {
        "rms_norm_eps": rt.rms_norm_eps,
        "max_position_embeddings": rt.max_position_embeddings,
        "norm_topk_prob": rt.norm_topk_prob,
        "n_group": arch.n_group,
        "topk_group": arch.topk_group,
        "n_shared_experts": arch.n_shared_experts,
    }
    want = {
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        # Mixtral and MiniMax-M2 always renormalise their top-k (no key)
        "norm_topk_prob": getattr(hf, "norm_topk_prob", True),
        "n_group": getattr(hf, "n_group", None) or 1,
        "topk_group": getattr(hf, "topk_group", None) or 1,
        "n_shared_experts": hf_moe or 0,
    }
    if hasattr(hf, "routed_scaling_factor"):
        got["routed_scaling_factor"] = rt.routed_scaling_factor
        want["routed_scaling_factor"] = hf.routed_scaling_factor
    if hasattr(hf, "first_k_dense_replace"):
        got["first_dense"] = arch.mlp_layer_types.index("sparse")
        want["first_dense"] = hf.first_k_dense_replace
    if hasattr(hf, "q_lora_rank"):
        got["q_lora_rank"] = arch.q_lora_rank
        want["q_lora_rank"] = hf.q_lora_rank
    if model_type == "glm4_moe":
        got["qk_norm"], want["qk_norm"] = arch.qk_norm, "head" if hf.use_qk_norm else "none"
    assert got == want


def test_a_missing_expert_count_names_every_key_it_may_come_from() -> None:
    """A Mixtral config without num_local_experts was told it lacked 'n_routed_experts', a
    key Mixtral does not use."""
    from storage.arch import ArchConfig
    from storage.errors import ConfigError

    cfg = {
        "model_type": "mixtral", "hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "num_experts_per_tok": 2,
    }  # fmt: skip
    with pytest.raises(ConfigError, match="num_local_experts"):
        ArchConfig.from_dict(cfg)
