"""Damaged weights never run silently: ``coli doctor --verify`` reads every byte, and NaN / inf
logits stop a generation with a clear error instead of emitting a token drawn from garbage."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from _demo import TINY
from helpers_storage import make_container

import colibri
from storage.container import Container
from storage.doctor import run_doctor
from storage.errors import ModelError

pytestmark = pytest.mark.reliability


def _status(path: Path, verify: bool) -> dict[str, tuple[str, str]]:
    r = run_doctor(path, verify=verify)
    return {c.name: (c.status, c.message) for c in r.checks}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


def test_verify_catches_one_flipped_bit_in_an_expert(tmp_path: Path) -> None:
    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    c = Container.open(d)
    x = c.expert(2, 5)
    _flip(x.path, x.start + 1000)  # one nibble of one int4 weight: no header sees it
    plain = _status(d, verify=False)
    assert all(s == "pass" for s, _ in plain.values()), plain  # headers are all fine
    status, msg = _status(d, verify=True)["verify"]
    assert status == "fail" and x.path.name in msg and "damaged" in msg
    seen: list[tuple[int, int, str]] = []
    r = run_doctor(d, verify=True, progress=lambda a, b, w: seen.append((a, b, w)))
    assert r.exit_code == 1
    assert seen and seen[-1][0] == seen[-1][1] > 0  # progress ends at the total


def test_verify_passes_an_intact_container_and_the_cli_exit_codes(tmp_path: Path) -> None:
    assert _status(TINY, verify=True)["verify"][0] == "pass"
    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    x = Container.open(d).expert(1, 0)
    _flip(x.path, x.start)
    for path, want in ((TINY, 0), (d, 1)):
        p = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "doctor", "--verify", "--model", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == want, p.stdout + p.stderr
        assert ("FAIL verify" in p.stdout) == bool(want)


def test_verify_without_a_manifest_scans_floats_for_nan(tmp_path: Path) -> None:
    path = make_container(tmp_path / "pub")[0]  # public layout: no manifest
    status, msg = _status(path, verify=True)["verify"]
    assert status == "warn" and "no colibri-manifest.json" in msg and "all finite" in msg
    c = Container.open(path)
    scales = c.entry("model.layers.1.self_attn.o_proj.weight").scales
    assert scales is not None
    with open(scales.path, "r+b") as fh:  # one scale becomes NaN (exponent bits all set)
        fh.seek(scales.start + 4 * 3)
        fh.write(np.array([np.nan], dtype=np.float32).tobytes())
    status, msg = _status(path, verify=True)["verify"]
    assert status == "fail" and "model.layers.1.self_attn.o_proj.weight.qs" in msg


def test_nan_logits_stop_the_generation(tmp_path: Path, private_home: None) -> None:
    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    norm = Container.open(d).entry("model.norm.weight").weight
    with open(norm.path, "r+b") as fh:  # the final norm: every logit becomes NaN
        fh.seek(norm.start)
        fh.write(np.full(4, np.nan, dtype=np.float32).tobytes())
    with colibri.open_model(d, draft="off") as m:
        with pytest.raises(ModelError, match=r"non-finite logits .* doctor --verify"):
            m.generate([5, 6, 7], max_new_tokens=4)
    with colibri.open_model(d, draft="mtp:2") as m:
        with pytest.raises(ModelError, match="non-finite logits"):
            m.generate([5, 6, 7], max_new_tokens=4)
        # sampled: a speculative round samples its row before the engine checks it
        with pytest.raises(ModelError, match=r"non-finite logits .* doctor --verify"):
            m.generate([5, 6, 7], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)


def test_activations_that_overflow_stop_the_generation(tmp_path: Path, private_home: None) -> None:
    """Scales blown up to 1e25 give finite activations whose squares overflow: the reference
    normalises them to zeros and the logits stay finite (a fluent-looking wrong answer, or
    end of text at once). The final norm's check stops the generation instead."""
    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    c = Container.open(d)
    last = c.arch.num_hidden_layers - 1
    scales = c.entry(f"model.layers.{last}.self_attn.o_proj.weight").scales
    assert scales is not None
    with open(scales.path, "r+b") as fh:
        fh.seek(scales.start)
        fh.write(np.full(scales.nbytes // 4, 1e25, dtype=np.float32).tobytes())
    with colibri.open_model(d, draft="off") as m, warnings.catch_warnings():
        warnings.simplefilter("error")  # the error says it all: no numpy warnings before it
        with pytest.raises(ModelError, match=r"overflowed or became NaN .* doctor --verify"):
            m.generate([5, 6, 7], max_new_tokens=4)


def test_verify_tells_an_unreadable_shard_from_a_damaged_one(tmp_path: Path) -> None:
    """A shard the manifest lists but that cannot be read (missing here; permissions or an
    I/O error alike) is reported as unreadable, not as damaged bytes to re-copy."""
    import json

    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    doc = json.loads((d / "colibri-manifest.json").read_text())
    doc["shards"].append({**doc["shards"][0], "file": "out-00042.safetensors"})
    (d / "colibri-manifest.json").write_text(json.dumps(doc))
    status, msg = _status(d, verify=True)["verify"]
    assert status == "fail" and "could not be read" in msg and "out-00042" in msg, msg
    assert "damaged" not in msg
