"""Damaged weights never run silently: 100 seeded mutations of a converted container.

Each mutation damages one copy of the tiny test model: a flipped byte in tensor data or in a
shard header, a header length off by a few bytes, a truncated or extended shard, a tensor
missing, a broken config.json value, a damaged tokenizer. Then, as a user would, ``coli doctor
--verify`` checks it and, if it passes, the model runs a forward (every mutation but a data
flip must also fail the plain ``coli doctor``, which reads no data). Outcomes:

* caught: the doctor fails it, or loading / running it stops with a ColibriError;
* harmless: the doctor passes and the logits are bit-identical to the intact model's;
* silent: the doctor passes and the logits differ (or are not finite). **Must never happen.**
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _demo import TINY

from runtime.models import load_model
from storage.container import Container
from storage.doctor import run_doctor
from storage.errors import ColibriError
from storage.safetensors import read_header

pytestmark = pytest.mark.reliability

PROMPT = np.array([5, 17, 250, 3, 999, 42, 8, 8, 600, 12, 77, 31, 400, 2, 90, 91, 92, 5, 6, 7])
SHARDS = ("out-00000.safetensors", "out-mtp-00000.safetensors")
Mutation = Callable[[Path, random.Random], str]


def _logits(path: Path) -> np.ndarray:
    m = load_model(Container.open(path))
    out = m.forward(PROMPT, m.new_cache())
    logits: np.ndarray = out.logits
    if m.has_mtp:  # the MTP head's weights count too
        mtp = m.mtp_forward(out.hidden, np.append(PROMPT[1:], 7), m.new_mtp_cache())
        logits = np.concatenate([logits, mtp])
    return logits


def _flip_data(d: Path, rng: random.Random) -> str:
    name = rng.choice(SHARDS)
    h = read_header(d / name)
    off = rng.randrange(h.data_start, h.file_size)
    bit = 1 << rng.randrange(8)
    with open(d / name, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ bit]))
    return f"data flip {name}@{off}"


def _flip_header(d: Path, rng: random.Random) -> str:
    name = rng.choice(SHARDS)
    h = read_header(d / name)
    raw = bytearray((d / name).read_bytes())
    js = raw[8 : h.data_start]
    digits = [i for i, c in enumerate(js) if chr(c).isdigit()]
    i = rng.choice(digits) + 8
    raw[i] = ord(str((int(chr(raw[i])) + rng.randrange(1, 10)) % 10))
    (d / name).write_bytes(bytes(raw))
    return f"header digit {name}@{i}"


def _header_length(d: Path, rng: random.Random) -> str:
    name = rng.choice(SHARDS)
    raw = bytearray((d / name).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    delta = rng.choice([-16, -10, -3, -1, 1, 5, 8])
    raw[:8] = struct.pack("<Q", n + delta)
    (d / name).write_bytes(bytes(raw))
    return f"header length {delta:+d} {name}"


def _truncate(d: Path, rng: random.Random) -> str:
    name = rng.choice(SHARDS)
    size = (d / name).stat().st_size
    cut = rng.randrange(1, size)
    with open(d / name, "r+b") as fh:
        fh.truncate(cut)
    return f"truncate {name} to {cut}"


def _extend(d: Path, rng: random.Random) -> str:
    name = rng.choice(SHARDS)
    with open(d / name, "ab") as fh:
        fh.write(bytes(rng.randrange(1, 9000)))
    return f"extend {name}"


def _drop_tensor(d: Path, rng: random.Random) -> str:
    """Remove one tensor from a header (its bytes stay: the rest of the file still tiles)."""
    name = rng.choice(SHARDS)
    h = read_header(d / name)
    victim = rng.choice(sorted(h.tensors))
    raw = (d / name).read_bytes()
    doc = json.loads(raw[8 : h.data_start])
    del doc[victim]
    js = json.dumps(doc).encode()
    js += b" " * ((-(8 + len(js))) % 8)
    data = raw[h.data_start :]
    (d / name).write_bytes(struct.pack("<Q", len(js)) + js + data)
    return f"drop {victim}"


def _config(d: Path, rng: random.Random) -> str:
    cfg = json.loads((d / "config.json").read_text())
    choices: list[tuple[str, object]] = [
        ("hidden_size", cfg["hidden_size"] + 8),
        ("hidden_size", "wide"),
        ("num_experts_per_tok", 0),
        ("num_experts_per_tok", cfg["n_routed_experts"] + 1),
        ("n_routed_experts", cfg["n_routed_experts"] * 2),
        ("vocab_size", cfg["vocab_size"] - 1),
        ("num_hidden_layers", cfg["num_hidden_layers"] + 1),
        ("kv_lora_rank", cfg["kv_lora_rank"] * 2),
        ("q_lora_rank", cfg["q_lora_rank"] + 16),
        ("moe_intermediate_size", cfg["moe_intermediate_size"] + 32),
        ("n_group", 3),
        ("topk_group", 5),
        ("model_type", "llama_moe"),
        ("indexer_types", ["full", "bogus", "full", "shared"]),
        ("mlp_layer_types", ["dense"]),
        ("rope_parameters", "fast"),
        ("qk_rope_head_dim", 7),
        ("index_head_dim", 8),
    ]
    key, value = rng.choice(choices)
    if rng.random() < 0.15:
        (d / "config.json").write_text(json.dumps(cfg)[:-7])  # cut: not JSON
        return "config cut"
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return f"config {key}={value!r}"


def _drop_config_key(d: Path, rng: random.Random) -> str:
    cfg = json.loads((d / "config.json").read_text())
    key = rng.choice(["hidden_size", "num_hidden_layers", "n_routed_experts", "kv_lora_rank",
                      "vocab_size", "num_experts_per_tok", "qk_nope_head_dim"])  # fmt: skip
    del cfg[key]
    (d / "config.json").write_text(json.dumps(cfg))
    return f"config without {key}"


MUTATIONS: list[tuple[Mutation, int]] = [
    (_flip_data, 40),
    (_flip_header, 12),
    (_header_length, 8),
    (_truncate, 10),
    (_extend, 4),
    (_drop_tensor, 8),
    (_config, 12),
    (_drop_config_key, 6),
]


def test_no_mutation_runs_silently(tmp_path: Path) -> None:
    reference = _logits(TINY)
    rng = random.Random(2026)
    outcomes: Counter[str] = Counter()
    silent: list[str] = []
    n = 0
    for mutate, count in MUTATIONS:
        for _ in range(count):
            d = tmp_path / f"m{n}"
            n += 1
            shutil.copytree(TINY, d)
            what = mutate(d, rng)
            if mutate is not _flip_data:
                # Everything but a flipped data byte is caught without reading the data: the
                # checks at open (header offsets tile the file, config values) are always on.
                cheap = run_doctor(d)
                assert not cheap.ok, f"{what}: passed the doctor without --verify"
            report = run_doctor(d, verify=True)
            if not report.ok:
                outcomes["caught by doctor"] += 1
                shutil.rmtree(d)
                continue
            try:
                got = _logits(d)
            except ColibriError:
                outcomes["caught at load/run"] += 1
                shutil.rmtree(d)
                continue
            if got.shape == reference.shape and np.array_equal(got, reference):
                outcomes["harmless"] += 1
            else:
                silent.append(what)
            shutil.rmtree(d)
    print(f"{n} mutations: {dict(outcomes)}, silent wrong runs: {len(silent)}")
    assert n >= 80
    assert not silent, f"ran with changed logits although doctor --verify passed: {silent}"
    assert outcomes["caught by doctor"] >= 0.8 * n  # the doctor, not luck, catches them
