"""``coli run --ray local``: the same text as one process, and the flags in ``--help``."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli import coli

pytest.importorskip("ray", reason="the ray extra is not installed")


def test_run_on_two_expert_workers_prints_the_same_text(tmp_path: Path) -> None:
    args = ("run", "--raw", "-n", "16", "--draft", "off", "Once upon a time")
    alone = coli(*args, home=tmp_path)
    assert alone.returncode == 0, alone.stderr
    spread = coli(*args, "--ray", "local", "--expert-workers", "2", home=tmp_path)
    assert spread.returncode == 0, spread.stderr
    assert spread.stdout == alone.stdout and alone.stdout.strip()


def test_cluster_flags_are_documented_in_help() -> None:
    for cmd in ("run", "chat", "serve"):
        out = coli(cmd, "--help").stdout
        for flag in ("--ray", "--expert-workers", "--worker-ram", "--expert-timeout"):
            assert flag in out, (cmd, flag)


def test_a_bad_worker_count_is_one_clear_line(tmp_path: Path) -> None:
    r = coli("run", "--ray", "local", "--expert-workers", "0", "hi", home=tmp_path)
    assert r.returncode == 2 and "--expert-workers" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_worker_that_cannot_open_the_model_is_one_clear_error(tmp_path: Path) -> None:
    r = coli("run", "--ray", "local", "--worker-model", str(tmp_path / "nowhere"), "hi",
             home=tmp_path)  # fmt: skip
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not start" in errors[0] and "does not exist" in errors[0]
    assert "Traceback" not in r.stderr and "^^^" not in r.stderr, r.stderr
