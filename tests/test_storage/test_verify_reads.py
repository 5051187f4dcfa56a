"""``--verify-reads``: a flipped bit in an expert on disk is an error naming the expert and the
file, never a wrong token; with a mirror, the damaged copy is demoted and the read served from
the other, the output unchanged. Real files, real readers (threads and io_uring backends)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from _demo import TINY
from test_devices import budget_for_lru, run_model

from storage.container import Container
from storage.errors import ConfigError, ReadError

pytestmark = pytest.mark.reliability

LAYER = 2


def _damage_layer(d: Path, layer: int) -> list[str]:
    """Flip one byte in every expert blob of ``layer`` (so any routing meets one)."""
    c = Container.open(d)
    names = []
    for e in range(c.arch.n_routed_experts):
        x = c.expert(layer, e)
        with open(x.path, "r+b") as fh:
            fh.seek(x.start + (x.end - x.start) // 3)
            b = fh.read(1)[0]
            fh.seek(x.start + (x.end - x.start) // 3)
            fh.write(bytes([b ^ 0x40]))
        names.append(x.path.name)
    return names


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], np.ndarray]:
    toks, logits, _ = run_model(TINY, ram_budget=budget_for_lru(TINY, 0))
    return toks, logits


@pytest.mark.parametrize("reader", ["threads", "uring"])
def test_intact_container_verifies_and_runs_unchanged(
    reference: tuple[list[int], np.ndarray], reader: str, private_home: None
) -> None:
    toks, logits, st = run_model(
        TINY, ram_budget=budget_for_lru(TINY, 0), verify_reads=True, reader=reader
    )
    assert toks == reference[0] and np.array_equal(logits, reference[1])
    assert st["read_errors"] == 0 and st["experts_read"] > 0


def test_damaged_expert_is_an_error_not_a_wrong_token(
    reference: tuple[list[int], np.ndarray], tmp_path: Path, private_home: None
) -> None:
    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    (shard,) = set(_damage_layer(d, LAYER))
    budget = budget_for_lru(d, 0)
    # Unchecked, the damage runs silently: other logits, no error (what --verify-reads is for).
    _, logits, _ = run_model(d, ram_budget=budget)
    assert not np.array_equal(logits, reference[1])
    with pytest.raises(ReadError, match=rf"layer {LAYER} expert \d+ in {shard}.*checksum"):
        run_model(d, ram_budget=budget, verify_reads=True)
    # Everything resident: the experts are checked once, as they load.
    with pytest.raises(ReadError, match=rf"layer {LAYER} expert \d+ in {shard}.*checksum"):
        run_model(d, verify_reads=True)


@pytest.mark.parametrize("prefetch", ["auto", "on"])
def test_damaged_mirror_copy_is_demoted_and_the_output_unchanged(
    reference: tuple[list[int], np.ndarray],
    tmp_path: Path,
    private_home: None,
    prefetch: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if prefetch == "on":  # lookahead reads in many pieces, each through the copy placement
        monkeypatch.setattr("runtime.experts.LOOKAHEAD_PIECE", 8192)
    mirror = Path(shutil.copytree(TINY, tmp_path / "mirror"))
    _damage_layer(mirror, LAYER)  # the primary stays intact
    toks, logits, st = run_model(
        TINY,
        ram_budget=budget_for_lru(TINY, 0),
        mirror=[mirror],
        disk_weights="0,1",  # the mirror serves first
        disk_adapt=False,
        verify_reads=True,
        prefetch=prefetch,
    )
    if prefetch == "on":
        assert st["prefetch_issued"] > 0
    assert toks == reference[0] and np.array_equal(logits, reference[1])
    prim, mir = st["devices"]
    assert mir["demoted"] and "checksum" in (mir["demoted_reason"] or "")
    assert mir["failovers"] >= 1 and prim["served_failovers"] >= 1


def test_verify_reads_needs_checksums(tmp_path: Path, private_home: None) -> None:
    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    (d / "colibri-manifest.json").unlink()  # as a public C-engine container
    with pytest.raises(ConfigError, match=r"needs colibri-manifest\.json"):
        run_model(d, verify_reads=True)


def test_a_failed_checksum_counts_as_its_copys_error(tmp_path: Path, private_home: None) -> None:
    """With one copy, bytes that failed their checksum were the engine's read error but not
    the copy's: /metrics said 33 read errors and expert_device_errors_total 0."""
    import colibri

    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    _damage_layer(d, LAYER)
    with colibri.open_model(d, ram_budget=budget_for_lru(d, 0), verify_reads=True) as m:
        with pytest.raises(ReadError, match="checksum"):
            m.generate([1, 2, 3, 4], max_new_tokens=4)
        experts = m.stats()["experts"]
    (device,) = experts["devices"]
    assert experts["read_errors"] >= 1
    assert device["errors"] >= 1
