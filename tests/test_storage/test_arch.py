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
