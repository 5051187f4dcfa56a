"""The public GLM-5 int4 container, as the C engine's converter lays it out.

Its converter runs three passes over the Hugging Face checkpoint: ``out-NNNNN`` (one per source
shard, empty ones included), ``out-mtp-NNNNN`` (the MTP layer, **without** its DSA indexer) and
``out-idx-NNNNN`` (the main layers' indexers, int8 per row by default). These tests rebuild that
layout from the tiny test model (every tensor dequantized, then requantized the way a converter
variant writes it) and check: ``coli doctor`` passes, the forward is bit-identical to the same
tensors in one-pass layout (so the layout changes nothing), drafted greedy output equals
``--draft off`` past ``index_topk`` (the MTP layer attends densely), and a main layer without its
indexer keeps the clear error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from _demo import TINY

import colibri
from runtime.models import load_model
from storage.arch import INDEXER_TENSORS, classify
from storage.container import Container
from storage.doctor import run_doctor
from storage.errors import ModelError
from storage.public_layout import write_converter_passes, write_public_container
from storage.quant import QTensor, QuantFormat, dequantize, quantize

Tensors = dict[str, QTensor | npt.NDArray[np.float32]]

# Converter settings -> the formats its passes write (main resident, routed experts, io =
# embed/lm_head, mtp, indexer matrices). 1-D tensors, the router and norms are always F32.
VARIANTS: dict[str, dict[str, str]] = {
    # the published GLM-5.2 container: --group-size 64, io 8 bits, --mtp int8, --indexer int8
    "gs64": {
        "dense": "int4-g64",
        "expert": "int4-g64",
        "io": "int8",
        "mtp": "int8",
        "idx": "int8",
    },
    # the converter's own defaults: --group-size 0 (per-row int4)
    "row": {
        "dense": "int4-row",
        "expert": "int4-row",
        "io": "int8",
        "mtp": "int8",
        "idx": "int8",
    },
    # --group-size 128, --io-bits 4, --mtp at 4 bits, --indexer --ebits 4
    "gs128-io4": {
        "dense": "int4-g128",
        "expert": "int4-g128",
        "io": "int4-g128",
        "mtp": "int4-g128",
        "idx": "int4-g128",
    },
    # --ebits 8 everywhere; indexer weights kept float (an f32 indexer shard)
    "int8-idxf32": {
        "dense": "int8",
        "expert": "int8",
        "io": "int8",
        "mtp": "int8",
        "idx": "f32",
    },
}

TOPK = 16  # tests/data/tiny-glm: index_topk


@pytest.fixture(scope="module")
def floats() -> dict[str, npt.NDArray[np.float32]]:
    """Every tensor of the tiny model as float32 (quantized ones dequantized)."""
    c = Container.open(TINY)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for n in c.names():
        e = c.entry(n)
        role = classify(n, c.arch)
        if e.fmt is None or role is None or role.shape is None:
            out[n] = c.load_f32(n)
        else:
            out[n] = dequantize(c.load_qtensor(n))
    return out


def _quantized(
    floats: Mapping[str, npt.NDArray[np.float32]], cfg: Mapping[str, Any], fmts: Mapping[str, str]
) -> Tensors:
    arch = Container.open(TINY).arch
    out: Tensors = {}
    for n, w in floats.items():
        role = classify(n, arch)
        assert role is not None, n
        if role.shape is None or role.role == "f32":
            out[n] = w
        elif ".indexer." in n:
            out[n] = w if fmts["idx"] == "f32" else quantize(w, fmts["idx"])
        else:
            out[n] = quantize(w, fmts[role.role])
    return out


def _side_files() -> dict[str, bytes]:
    return {f: (TINY / f).read_bytes() for f in ("tokenizer.json", "tokenizer_config.json")}


def _config() -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((TINY / "config.json").read_text())
    return cfg


def _public(dst: Path, tensors: Tensors) -> list[str]:
    """The three-pass layout; the MTP indexer is dropped as the public converter drops it."""
    return write_converter_passes(
        dst,
        _config(),
        tensors,
        source_shard_bytes=400_000,
        tokenizer_files=_side_files(),
        generation_config={"eos_token_id": [0, 2]},
    )


@pytest.fixture(scope="module")
def variants(
    floats: dict[str, npt.NDArray[np.float32]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Tensors]]:
    root = tmp_path_factory.mktemp("public")
    out = {}
    for name, fmts in VARIANTS.items():
        t = _quantized(floats, _config(), fmts)
        _public(root / name, t)
        out[name] = (root / name, t)
    return out


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 1000, size=n)]


# ----------------------------------------------------------------------------- layout


def test_shards_are_numbered_as_the_public_converter_numbers_them(
    variants: dict[str, tuple[Path, Tensors]],
) -> None:
    d, _ = variants["gs64"]
    names = sorted(p.name for p in d.glob("*.safetensors"))
    main = [n for n in names if n.startswith("out-0")]
    mtp = [n for n in names if n.startswith("out-mtp-")]
    idx = [n for n in names if n.startswith("out-idx-")]
    for group, prefix in ((main, "out-"), (mtp, "out-mtp-"), (idx, "out-idx-")):
        assert group == [f"{prefix}{i:05d}.safetensors" for i in range(len(group))]
    assert len(mtp) >= 2 and len(idx) >= 2  # the MTP layer and the indexers span source shards
    # one main output per source shard: the trailing MTP-only source shards leave empty ones
    empty = [n for n in main if (d / n).stat().st_size <= 64]
    assert empty and empty == main[-len(empty) :]
    c = Container.open(d)
    n = c.arch.num_hidden_layers
    assert not any(c.has(f"model.layers.{n}.{t}") for t in INDEXER_TENSORS)
    assert all(c.has(f"model.layers.0.{t}") for t in INDEXER_TENSORS)
    where = {c.entry(f"model.layers.{layer}.self_attn.indexer.wk.weight").weight.path.name
             for layer in (0, 2)}  # fmt: skip
    assert all(w.startswith("out-idx-") for w in where)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_doctor_passes_every_variant(
    variant: str, variants: dict[str, tuple[Path, Tensors]]
) -> None:
    d, _ = variants[variant]
    r = run_doctor(d)
    checks = {c.name: (c.status, c.message) for c in r.checks}
    assert r.exit_code == 0, checks
    assert (
        checks["tensors"][0] in ("pass", "warn")
        and "expected tensors present" in (checks["tensors"][1])
    )
    status, msg = checks["mtp"]
    assert "indexer absent: MTP attention dense" in msg
    assert status == ("warn" if VARIANTS[variant]["mtp"].startswith("int4") else "pass")
    assert "indexer, " in checks["shards"][1]
    fmts = VARIANTS[variant]
    c = Container.open(d)
    idx_fmt = c.entry("model.layers.0.self_attn.indexer.wq_b.weight").fmt
    # (one group per row reads as int4-row: the same bytes and math, docs/format.md)
    assert idx_fmt is not None and idx_fmt.kind == fmts["idx"].split("-")[0]
    bias = c.entry("model.layers.0.self_attn.indexer.k_norm.bias")
    assert bias.weight.dtype == "F32" and bias.weight.path.name.startswith("out-idx-")


def test_coli_doctor_exits_zero_on_the_public_layout(
    variants: dict[str, tuple[Path, Tensors]],
) -> None:
    d, _ = variants["gs64"]
    p = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "doctor", "--model", str(d)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS mtp" in p.stdout and "indexer absent: MTP attention dense" in p.stdout
    assert "FAIL" not in p.stdout


def test_doctor_fails_a_partial_mtp_indexer_and_a_missing_main_indexer(
    variants: dict[str, tuple[Path, Tensors]], tmp_path: Path
) -> None:
    _, t = variants["gs64"]
    n = Container.open(TINY).arch.num_hidden_layers
    # one piece of the MTP indexer left (the one-pass writer keeps whatever it is given)
    partial = {
        k: v for k, v in t.items() if not k.startswith(f"model.layers.{n}.self_attn.indexer.")
    }
    partial[f"model.layers.{n}.self_attn.indexer.wk.weight"] = t[
        f"model.layers.{n}.self_attn.indexer.wk.weight"
    ]
    write_public_container(tmp_path / "partial", _config(), partial, tokenizer_files=_side_files())
    r = run_doctor(tmp_path / "partial")
    status, msg = {c.name: (c.status, c.message) for c in r.checks}["tensors"]
    assert status == "fail" and r.exit_code == 1
    assert f"model.layers.{n}.self_attn.indexer.wq_b.weight" in msg

    shutil.copytree(variants["gs64"][0], tmp_path / "noidx")
    for p in (tmp_path / "noidx").glob("out-idx-*"):
        p.unlink()
    r = run_doctor(tmp_path / "noidx")
    status, msg = {c.name: (c.status, c.message) for c in r.checks}["tensors"]
    assert status == "fail" and "model.layers.0.self_attn.indexer.wq_b.weight" in msg


# ----------------------------------------------------------------------------- model


def _logits(path: Path, ids: list[int]) -> np.ndarray:
    c = Container.open(path)
    m = load_model(c)
    return m.forward(np.asarray(ids), m.new_cache()).logits


@pytest.mark.parametrize("variant", ["gs64", "int8-idxf32"])
def test_forward_past_index_topk_is_the_one_pass_layouts(
    variant: str, variants: dict[str, tuple[Path, Tensors]], tmp_path: Path
) -> None:
    """Same tensors, other shards: bit-identical logits, sparse attention included."""
    d, t = variants[variant]
    write_public_container(tmp_path / "one", _config(), t, tokenizer_files=_side_files())
    ids = _prompt(1, 3 * TOPK)
    a, b = _logits(d, ids), _logits(tmp_path / "one", ids)
    assert a.shape == (len(ids), 1000)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_a_group_size_that_divides_the_width_is_read_by_the_c_engine_rule(
    floats: dict[str, npt.NDArray[np.float32]], tmp_path: Path
) -> None:
    """The C engine's converter writes gs = I / groups: --group-size 48 on the experts'
    down_proj (I = 96) is 2 groups of 48, which colibri's own rule (a power of two first, what
    its converter writes) read as 2 groups of 64: other weights, no error. Without colibri's
    manifest or its writer's mark the C rule goes first."""
    t = _quantized(floats, _config(), VARIANTS["gs64"])
    down = [n for n in t if ".experts." in n and n.endswith("down_proj.weight")]
    assert down
    for n in down:
        t[n] = quantize(floats[n], "int4-g48")
    # as the C engine's converter writes its shards: no colibri manifest, no metadata
    write_converter_passes(tmp_path / "c", _config(), t, source_shard_bytes=400_000,
                           tokenizer_files=_side_files(), metadata=None)  # fmt: skip
    c = Container.open(tmp_path / "c")
    for n in down:
        assert c.entry(n).fmt == QuantFormat("int4", 48), n
        got = dequantize(c.load_qtensor(n))
        want = t[n]
        assert isinstance(want, QTensor)
        np.testing.assert_array_equal(got, dequantize(want))


def test_main_layer_without_indexer_keeps_the_clear_error(
    variants: dict[str, tuple[Path, Tensors]], tmp_path: Path
) -> None:
    shutil.copytree(variants["gs64"][0], tmp_path / "noidx")
    for p in (tmp_path / "noidx").glob("out-idx-*"):
        p.unlink()
    c = Container.open(tmp_path / "noidx")
    m = load_model(c)
    m.forward(np.asarray(_prompt(2, TOPK)), m.new_cache())  # up to index_topk: DSA is a no-op
    with pytest.raises(ModelError, match=r"layer 0: .* more than index_topk=16.*indexer"):
        m.forward(np.asarray(_prompt(2, TOPK + 1)), m.new_cache())


def test_mtp_layer_attends_densely_without_its_indexer(
    variants: dict[str, tuple[Path, Tensors]],
) -> None:
    d, _ = variants["gs64"]
    m = load_model(Container.open(d))
    assert m.weights.mtp and m.weights.mtp[0].layer.indexer is None
    cache, mtp_cache = m.new_cache(), m.new_mtp_cache()
    assert mtp_cache.indexed_layers == ()
    ids = np.asarray(_prompt(3, 2 * TOPK + 5))
    out = m.forward(ids, cache)
    logits = m.mtp_forward(out.hidden, np.append(ids[1:], 7), mtp_cache)
    assert logits.shape == (ids.size, 1000) and np.isfinite(logits).all()


@pytest.mark.parametrize("draft", ["mtp:3", "auto", "lookup:3"])
def test_drafted_greedy_equals_undrafted_past_index_topk(
    draft: str, variants: dict[str, tuple[Path, Tensors]], private_home: None
) -> None:
    d, _ = variants["gs64"]
    prompts = [_prompt(10 + k, 2 * TOPK + 3 * k) for k in range(4)]
    outs: dict[str, list[list[int]]] = {}
    for mode in ("off", draft):
        with colibri.open_model(d, draft=mode) as model:
            outs[mode] = [model.generate(p, max_new_tokens=24) for p in prompts]
            if mode != "off":
                spec = model.stats()["speculative"]
                assert spec["verify_steps"] > 0, spec  # it really drafted
    assert outs[draft] == outs["off"]
    assert all(len(o) == 24 for o in outs["off"])
