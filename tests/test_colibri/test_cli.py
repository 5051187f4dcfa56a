"""The `coli` command, run as a real subprocess (`python -m colibri.cli`) on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli import coli
from _demo import demo_model

DEMO = demo_model()


@pytest.fixture(scope="module", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`coli run` on the read-only demo model keeps `.coli_usage` under ~/.cache/colibri:
    give the subprocesses a home of their own."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        yield home


def assert_clean_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit non-zero with one `error:` line (plus an optional `hint:`), no traceback."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


# ----------------------------------------------------------------------------- basics


def test_help_lists_every_command() -> None:
    r = coli("--help")
    assert r.returncode == 0
    for cmd in ("run", "convert", "doctor", "info"):
        assert cmd in r.stdout


def test_run_on_the_bundled_model() -> None:
    r = coli("run", "Hello", "-n", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text printed"
    assert "Traceback" not in r.stderr


def test_run_missing_model_dir_is_one_clean_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    r = coli("run", "--model", str(missing), "Hello")
    assert_clean_error(r, str(missing))
    assert any(line.startswith("hint: ") for line in r.stderr.splitlines()), r.stderr
    assert r.stdout == ""


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    r = coli("--debug", "run", "--model", str(tmp_path / "nope"), "Hello")
    assert r.returncode != 0
    assert "Traceback" in r.stderr
    assert "ContainerError" in r.stderr


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--top-p", "2"), "--top-p"),
        (("-t", "nan"), "--temperature"),
        (("-t", "-1"), "--temperature"),
        (("-n", "-5"), "--max-tokens"),
        (("--top-k", "-3"), "--top-k"),
        (("--seed", "-1"), "--seed"),
    ],
)
@pytest.mark.parametrize("cmd", ["run", "chat"])
def test_bad_sampling_flags_are_usage_errors_before_loading(
    cmd: str, args: tuple[str, ...], flag: str
) -> None:
    """Checked by click before the model loads (no 'loaded' log line), naming the flag."""
    r = coli("-v", cmd, *args, *(("x",) if cmd == "run" else ()))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"Invalid value for '{flag}'" in r.stderr and "loaded" not in r.stderr, r.stderr


def test_doctor_on_a_broken_dir_fails_with_a_report(tmp_path: Path) -> None:
    r = coli("doctor", "--model", str(tmp_path), "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert doc["checks"][0]["status"] == "fail" and "config.json" in doc["checks"][0]["message"]


# ----------------------------------------------------------------------------- convert


def _convert(oracle_dir: Path, tmp: pytest.TempPathFactory, model_type: str) -> tuple[str, Path]:
    """`coli convert` of an oracle checkpoint (the conversion itself is checked here)."""
    dst = tmp.mktemp("converted") / model_type
    r = coli("convert", str(oracle_dir / model_type), str(dst))
    assert r.returncode == 0, r.stderr
    assert "converted" in r.stdout
    # the summary on stdout; notes (the int4 groups warning the oracle's 96-wide matrices
    # get, on stdout before) on stderr
    assert "note:" not in r.stdout and "groups per row" not in r.stdout
    names = sorted(p.name for p in dst.iterdir())
    for want in (
        "colibri-manifest.json",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "out-00000.safetensors",
        "out-mtp-00000.safetensors",
    ):
        assert want in names, names
    return model_type, dst


@pytest.fixture(scope="module")
def glm(oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return _convert(oracle_dir, tmp_path_factory, "glm_moe_dsa")


@pytest.fixture(scope="module")
def dsv3(oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return _convert(oracle_dir, tmp_path_factory, "deepseek_v3")


@pytest.mark.parametrize("which", ["glm", "dsv3"])
def test_convert_then_doctor_and_info(which: str, request: pytest.FixtureRequest) -> None:
    model_type, dst = request.getfixturevalue(which)
    r = coli("doctor", "--model", str(dst))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("PASS config") and model_type in lines[0]
    assert all(line.split()[0] in ("PASS", "WARN") for line in lines), r.stdout
    doc = json.loads(coli("doctor", "--json", "--model", str(dst)).stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0
    checks = {c["name"]: c for c in doc["checks"]}
    assert {"config", "tokenizer", "shards", "tensors", "experts", "mtp", "names"} <= set(checks)
    assert "64 of 64 start 4 KiB-aligned" in checks["experts"]["message"]
    r = coli("info", "--model", str(dst), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model_type"] == model_type and info["model"] == str(dst)
    assert info["layers"] == 4 and info["routed_experts_per_layer"] == 16
    assert info["expert_bytes"] > 0


def test_convert_rerun_is_a_noop_and_refuses_other_options(
    glm: tuple[str, Path], oracle_dir: Path
) -> None:
    model_type, dst = glm
    src = oracle_dir / model_type
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    r = coli("convert", str(src), str(dst))
    assert r.returncode == 0, r.stderr
    assert "already converted" in r.stdout
    assert "note:" not in r.stderr and "groups per row" not in r.stdout  # said once, not again
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    r = coli("convert", str(src), str(dst), "--experts", "int8")
    assert_clean_error(r, "--experts", "--force")
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before


def test_env_var_maps_to_the_model_flag(dsv3: tuple[str, Path]) -> None:
    _, dst = dsv3
    r = coli("info", "--json", env={"COLI_MODEL": str(dst)})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model"] == str(dst) and info["model_type"] == "deepseek_v3"
    # the flag wins over the variable
    r = coli("info", "--json", "--model", str(DEMO), env={"COLI_MODEL": str(dst)})
    assert json.loads(r.stdout)["model_type"] == "glm_moe_dsa"


def test_run_on_a_converted_deepseek_v3(dsv3: tuple[str, Path]) -> None:
    _, dst = dsv3
    r = coli("run", "--model", str(dst), "--raw", "-n", "4", "-t", "0.8", "--seed", "5",
             "--stats", "Hi")  # fmt: skip
    assert r.returncode == 0, r.stderr
    *text, last = r.stdout.splitlines()
    assert "".join(text).strip()
    stats = json.loads(last)  # --stats: counters as one JSON line at the end
    assert stats["tokens"] == stats["generated_tokens"] >= 1
    assert stats["experts"]["mode"] in ("resident", "streaming")


def test_convert_bad_format_fails_cleanly(oracle_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    r = coli("convert", str(oracle_dir / "glm_moe_dsa"), str(dst), "--experts", "int5")
    assert_clean_error(r, "int5")
    assert "int4-g64" in r.stderr  # says what would work
    assert not dst.exists() or not any(dst.iterdir())
    # an empty format was the default, silently; --help lists the formats
    r = coli("convert", str(oracle_dir / "glm_moe_dsa"), str(dst), "--io", "")
    assert r.returncode == 2 and "--io is empty; formats: f32, bf16" in r.stderr, r.stderr
    assert "int4-gN (N a power of two" in coli("convert", "--help").stdout


def test_convert_missing_source_fails_cleanly(tmp_path: Path) -> None:
    r = coli("convert", str(tmp_path / "no-src"), str(tmp_path / "dst"))
    assert_clean_error(r, "no-src")


def test_bundled_demo_streams_most_experts_with_the_same_text(tmp_path: Path) -> None:
    """`coli run --ram 16MiB` on the bundled trained model (cache slots for 7 of 32 experts per
    layer: most experts stream from disk) prints exactly what the fully resident run prints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    env["HOME"] = str(tmp_path)
    args = [sys.executable, "-m", "colibri.cli", "run", "What is a list in Python?", "-n", "24"]
    resident = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
    streamed = subprocess.run(
        [*args, "--ram", "16MiB", "--stats"], capture_output=True, text=True, env=env, check=True
    )
    text, stats_line = streamed.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.strip() and text.strip() == resident.stdout.strip()
    stats = json.loads(stats_line)
    assert stats["experts"]["mode"] == "streaming"
    assert stats["experts"]["lru_slots_per_layer"] < 32 // 2
    assert stats["experts"]["bytes_read"] > 0


def test_run_checks_tokenizer_and_budget_before_loading(tmp_path: Path) -> None:
    """A model without tokenizer.json, or a RAM budget that cannot hold the dense part, is one
    clean error before any weight is loaded."""
    import shutil

    src = demo_model()
    bare = tmp_path / "bare"
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("tokenizer.json", ".*"))
    r = coli("run", "--model", str(bare), "hello")
    assert_clean_error(r, "tokenizer.json")
    r = coli("run", "--model", str(src), "--ram", "1MiB", "hello")
    assert_clean_error(r, "RAM budget")
