"""Every grouped-query family end to end through the real `coli` command: convert the oracle's
HF checkpoint, `coli doctor` passes, `coli run` generates (greedy tokens equal to the model
opened in-process); an unsupported model_type fails at convert and doctor with the list."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import colibri

pytest.importorskip("torch", reason="the oracle checkpoints need torch (test dependency)")

FAMILIES = ("olmoe", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2")
SUPPORTED = "glm_moe_dsa, deepseek_v3, olmoe, qwen3_moe, mixtral, glm4_moe, minimax_m2"


def coli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", *args],
        capture_output=True,
        text=True,
        env={**env, "HOME": str(home)},
        timeout=300,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_convert_doctor_run(name: str, oracle_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    r = coli("convert", str(oracle_dir / name), str(out), home=tmp_path)
    assert r.returncode == 0, r.stderr
    r = coli("doctor", "--model", str(out), home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and f"PASS config     {name}" in r.stdout
    r = coli("run", "--model", str(out), "--raw", "-n", "8", "The quick brown fox", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "8 tokens" in r.stderr
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    with colibri.open_model(out, learn=False) as m:
        want = m.generate(tok.encode("The quick brown fox").ids, max_new_tokens=8)
    assert r.stdout.rstrip("\n") == tok.decode(want)


def test_unsupported_model_type_names_the_supported_list(oracle_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(oracle_dir / "mixtral", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    r = coli("convert", str(src), str(tmp_path / "out"), home=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"model_type 'llama' is not supported (supported: {SUPPORTED})" in r.stderr
    good = tmp_path / "good"
    assert coli("convert", str(oracle_dir / "mixtral"), str(good), home=tmp_path).returncode == 0
    (good / "config.json").write_text(json.dumps(cfg))
    r = coli("doctor", "--model", str(good), home=tmp_path)
    assert r.returncode != 0
    assert "FAIL config" in r.stdout and f"(supported: {SUPPORTED})" in r.stdout
