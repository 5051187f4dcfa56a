"""storage.doctor: one line per check, never raises for a broken model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers_storage import DEFAULT_POLICY, Arrays, make_container, rewrite, tiny_config

from storage.doctor import DoctorReport, run_doctor
from storage.safetensors import TensorSpec, write_safetensors


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_container(tmp_path_factory.mktemp("good") / "model")[0]


@pytest.fixture
def copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "model"))


def by_name(r: DoctorReport) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.message) for c in r.checks}


def test_good_container_passes(good: Path) -> None:
    r = run_doctor(good)
    checks = by_name(r)
    assert list(checks) == ["config", "tokenizer", "shards", "tensors", "experts", "mtp", "names"]
    assert all(s == "pass" for s, _ in checks.values()), checks
    assert r.ok and r.exit_code == 0
    assert "glm_moe_dsa, 2 layers (1 dense, 1 MoE) + 1 MTP" in checks["config"][1]
    assert "eos [1, 2, 3]" in checks["config"][1]
    assert "8 of 8 experts in 2 layers" in checks["experts"][1]
    assert "0 of 8 start 4 KiB-aligned" in checks["experts"][1]
    assert "all 82 expected tensors present" in checks["tensors"][1]
    assert "mtp=int8" in checks["tensors"][1]
    lines = r.render_lines()
    assert lines[0].startswith("PASS config ")
    assert all(line[:5] == "PASS " for line in lines)
    # names line up in one column
    assert len({line.index(c.message) for line, c in zip(lines, r.checks, strict=True)}) == 1


def test_json_form(good: Path) -> None:
    doc = run_doctor(good).to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["model"] == str(good)
    assert {c["name"] for c in doc["checks"]} >= {"config", "shards", "tensors", "experts"}
    assert all(set(c) == {"status", "name", "message"} for c in doc["checks"])


def test_truncated_shard(copy: Path) -> None:
    shard = copy / "out-mtp-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    r = run_doctor(copy)
    checks = by_name(r)
    assert r.exit_code == 1
    assert checks["shards"][0] == "fail" and str(shard) in checks["shards"][1]
    assert "truncated" in checks["shards"][1]
    assert checks["tensors"][0] == "fail"
    assert "model.layers.2." in checks["tensors"][1] and "see shards" in checks["tensors"][1]
    assert any(line.startswith("FAIL shards") for line in r.render_lines())


def test_missing_tensor(tmp_path: Path) -> None:
    path, _, _ = make_container(tmp_path / "m", drop=("model.norm.weight",))
    r = run_doctor(path)
    status, msg = by_name(r)["tensors"]
    assert status == "fail" and r.exit_code == 1
    assert "1 of 82 expected tensors missing: model.norm.weight" in msg


def test_int4_mtp_head_warns(tmp_path: Path) -> None:
    path, _, _ = make_container(tmp_path / "m", policy={**DEFAULT_POLICY, "mtp": "int4-g64"})
    r = run_doctor(path)
    status, msg = by_name(r)["mtp"]
    assert status == "warn"
    assert "int4 MTP head gives 0-4% draft acceptance; convert with --mtp int8" in msg
    assert r.exit_code == 0  # a warning is not a failure
    assert any(line.startswith("WARN mtp") for line in r.render_lines())


def test_per_row_int4_warns(tmp_path: Path) -> None:
    cfg = tiny_config(hidden_size=128)
    path, _, _ = make_container(
        tmp_path / "m", cfg, policy={**DEFAULT_POLICY, "expert": "int4-row"}
    )
    status, msg = by_name(run_doctor(path))["tensors"]
    assert status == "warn" and "per-row int4" in msg and "int4-g64" in msg


def test_missing_and_broken_tokenizer(copy: Path) -> None:
    (copy / "tokenizer.json").unlink()
    status, msg = by_name(run_doctor(copy))["tokenizer"]
    assert status == "warn" and "tokenizer.json not found" in msg
    (copy / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    r = run_doctor(copy)
    status, msg = by_name(r)["tokenizer"]
    assert status == "fail" and str(copy / "tokenizer.json") in msg and r.exit_code == 1


def test_broken_tokenizer_config(copy: Path) -> None:
    (copy / "tokenizer_config.json").write_text("{")
    status, msg = by_name(run_doctor(copy))["tokenizer"]
    assert status == "fail" and "tokenizer_config.json" in msg


def test_missing_directory_never_raises(tmp_path: Path) -> None:
    r = run_doctor(tmp_path / "nope")
    assert [c.name for c in r.checks] == ["config"]
    assert r.checks[0].status == "fail" and "does not exist" in r.checks[0].message
    assert r.exit_code == 1


def test_bad_config_still_checks_shards(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (copy / "config.json").write_text(json.dumps(cfg))
    checks = by_name(run_doctor(copy))
    assert checks["config"][0] == "fail" and "'kv_lora_rank'" in checks["config"][1]
    assert checks["tokenizer"][0] == "pass"
    assert checks["shards"][0] == "pass" and "2 shards" in checks["shards"][1]
    assert "tensors" not in checks
    shard = copy / "out-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    checks = by_name(run_doctor(copy))
    assert checks["shards"][0] == "fail" and str(shard) in checks["shards"][1]


def test_bad_generation_config_fails_config(copy: Path) -> None:
    (copy / "generation_config.json").write_text("[")
    status, msg = by_name(run_doctor(copy))["config"]
    assert status == "fail" and "generation_config.json" in msg


def test_expert_layout_fails(copy: Path) -> None:
    gate = "model.layers.1.mlp.experts.2.gate_proj.weight"
    rewrite(copy / "out-00000.safetensors", align={gate: 4096})
    status, msg = by_name(run_doctor(copy))["experts"]
    assert status == "fail" and "layer 1 expert 2" in msg and "not byte-adjacent" in msg


def test_unusable_tensor_and_duplicate(copy: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite(copy / "out-00000.safetensors", lambda t: t.update({name: ("U8", t[name][1][:-1])}))
    extra = copy / "extra.safetensors"
    write_safetensors(extra, [TensorSpec("model.norm.weight", "F32", (64,))], [np.ones(64, "f4")])
    checks = by_name(run_doctor(copy))
    assert checks["tensors"][0] == "fail"
    assert "1 unusable" in checks["tensors"][1] and name in checks["tensors"][1]
    assert "missing" not in checks["tensors"][1]
    assert checks["shards"][0] == "fail" and "extra.safetensors" in checks["shards"][1]


def test_unknown_names_warn(copy: Path) -> None:
    def add(t: Arrays) -> None:
        t["model.vision_tower.proj.weight"] = ("F32", np.ones((2, 2), np.float32))

    rewrite(copy / "out-00000.safetensors", add)
    r = run_doctor(copy)
    status, msg = by_name(r)["names"]
    assert status == "warn" and "model.vision_tower.proj.weight" in msg and r.exit_code == 0


def test_header_length_ten_bytes_short_fails(tmp_path: Path) -> None:
    """A padded header shortened by 10 bytes still parses but shifts every tensor: doctor must
    fail it (it passed before, and `run` printed a blank line)."""
    import struct

    path, _, _ = make_container(tmp_path / "m")
    shard = path / "out-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    js = bytes(raw[8 : 8 + n]) + b" " * 16  # pad the header with spaces, as converters do
    shard.write_bytes(struct.pack("<Q", len(js) - 10) + js + bytes(raw[8 + n :]))
    r = run_doctor(path)
    status, msg = by_name(r)["shards"]
    assert status == "fail" and r.exit_code == 1
    assert "data bytes" in msg and str(shard) in msg


def test_doctor_refuses_what_run_refuses(tmp_path: Path) -> None:
    """A chat template that does not compile and routing keys the runtime rejects fail the
    doctor too (it passed them before, and `run` then stopped)."""
    path, _, _ = make_container(tmp_path / "m")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    status, msg = by_name(run_doctor(path))["tokenizer"]
    assert status == "fail" and "does not compile" in msg and "chat_template.jinja" in msg
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert by_name(run_doctor(path))["tokenizer"][0] == "pass"  # transformers' extensions
    cfg = json.loads((path / "config.json").read_text())
    for bad, want in ((0, "outside 1..n_routed_experts"), (9, "outside 1..n_routed_experts")):
        (path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": bad}))
        r = run_doctor(path)
        status, msg = by_name(r)["config"]
        assert status == "fail" and want in msg and r.exit_code == 1
    del cfg["num_experts_per_tok"]
    (path / "config.json").write_text(json.dumps(cfg))
    status, msg = by_name(run_doctor(path))["config"]
    assert status == "fail" and "num_experts_per_tok" in msg


@pytest.mark.parametrize(
    ("key", "value", "want"),
    [
        ("rms_norm_eps", "abc", "rms_norm_eps must be a number"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite positive number"),
        ("routed_scaling_factor", float("inf"), "routed_scaling_factor must be a finite"),
        ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
        ("rope_theta", "x", "rope_theta must be a number"),
        ("n_routed_experts", 32.5, "n_routed_experts must be an integer, got 32.5"),
        ("hidden_size", "256", "hidden_size must be an integer, got '256'"),
        ("num_hidden_layers", -1, "num_hidden_layers must be >= 1, got -1"),
        ("vocab_size", True, "vocab_size must be an integer, got True"),
    ],
)
def test_doctor_fails_config_values_the_runtime_refuses(
    copy: Path, key: str, value: object, want: str
) -> None:
    """Each bad value fails the doctor's config line, naming the key, and the runtime refuses
    it with the same message (a config the doctor passes runs)."""
    from runtime.models import load_model
    from storage.container import Container
    from storage.errors import ConfigError

    cfg = json.loads((copy / "config.json").read_text())
    cfg[key] = value
    if key == "rope_theta":
        cfg.pop("rope_parameters", None)
    (copy / "config.json").write_text(json.dumps(cfg))
    r = run_doctor(copy)
    status, msg = by_name(r)["config"]
    assert status == "fail" and want in msg and r.exit_code == 1, msg
    with pytest.raises(ConfigError, match=want.replace("(", r"\(")):
        load_model(Container.open(copy))


def test_shard_sizes_are_checked_against_the_manifest(tmp_path: Path) -> None:
    """Without --verify the doctor still compares each shard's size with the manifest's (a
    stat, no data read): a manifest that disagrees fails the shards line, naming the file."""
    from _demo import TINY

    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    assert by_name(run_doctor(d))["shards"][0] == "pass"
    doc = json.loads((d / "colibri-manifest.json").read_text())
    real = doc["shards"][0]["size"]
    doc["shards"][0]["size"] = real + 4096
    (d / "colibri-manifest.json").write_text(json.dumps(doc))
    status, msg = by_name(run_doctor(d))["shards"]
    name = doc["shards"][0]["file"]
    assert status == "fail" and f"{d}/{name}: {real} bytes, manifest says {real + 4096}" in msg
    doc["shards"][0]["size"] = 123  # smaller than the experts it lists: the manifest is invalid
    (d / "colibri-manifest.json").write_text(json.dumps(doc))
    status, msg = by_name(run_doctor(d))["shards"]
    assert status == "fail" and "as this manifest records it" in msg, msg


def test_a_container_without_its_mtp_shard_warns_and_runs(
    copy: Path, tmp_path: Path, private_home: None
) -> None:
    """The MTP layer is optional (it drafts; the model runs without it): a container whose
    out-mtp-* shards were not copied failed the doctor (every MTP tensor "missing") though it
    generates. A warning now; a partial MTP layer still fails."""
    import colibri

    (copy / "out-mtp-00000.safetensors").unlink()
    r = run_doctor(copy)
    checks = by_name(r)
    assert r.exit_code == 0 and checks["tensors"][0] == "pass", checks
    assert checks["mtp"][0] == "warn" and "none of its tensors" in checks["mtp"][1]
    with colibri.open_model(copy) as model:
        assert len(model.generate([1, 2, 3], max_new_tokens=4)) == 4
    path, _, _ = make_container(tmp_path / "part", drop=("model.layers.2.eh_proj.weight",))
    status, msg = by_name(run_doctor(path))["tensors"]
    assert status == "fail" and "model.layers.2.eh_proj.weight" in msg
