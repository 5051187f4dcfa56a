"""Temp files that killed saves leave behind (``.<name>.<random>.tmp``) are removed at start."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from _demo import TINY

import colibri
from storage.atomic import atomic_write_bytes, remove_leftovers

pytestmark = pytest.mark.reliability


def _leftover(d: Path, name: str, age_s: float, size: int = 1024) -> Path:
    p = d / name
    p.write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_only_old_leftovers_of_atomic_writes_go(tmp_path: Path) -> None:
    old = _leftover(tmp_path, ".coli_kv.3.abc123.tmp", 3600)
    fresh = _leftover(tmp_path, ".coli_usage.x9y8.tmp", 5)  # a save may be running right now
    other = _leftover(tmp_path, "notes.tmp", 3600)  # not ours
    keep = _leftover(tmp_path, ".coli_usage", 3600)
    assert remove_leftovers(tmp_path) == [old]
    assert not old.exists() and fresh.exists() and other.exists() and keep.exists()
    assert remove_leftovers(tmp_path / "missing") == []
    atomic_write_bytes(tmp_path / "f", b"ok")  # a completed write leaves nothing behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == [
        ".coli_usage.x9y8.tmp",
        "notes.tmp",
    ]


def test_engine_start_removes_old_leftovers_in_the_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    big = _leftover(state, ".coli_kv.1.k2j3h4.tmp", 3600, size=19 << 20)
    with colibri.open_model(TINY, state_dir=state) as m:
        m.generate([5, 6], max_new_tokens=1)
    assert not big.exists()


def test_atomic_writes_get_normal_permissions(tmp_path: Path) -> None:
    """Converted config and tokenizer files are readable by others (mkstemp alone gives 0600);
    private files (a chat session) ask for 0600."""
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "config.json", b"{}")
        atomic_write_bytes(tmp_path / "secret.json", b"{}", mode=0o600)
        os.umask(0o077)  # a user who wants everything private gets it
        atomic_write_bytes(tmp_path / "private.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "secret.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "private.json").stat().st_mode & 0o777 == 0o600
