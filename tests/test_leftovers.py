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
