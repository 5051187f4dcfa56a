"""storage.convert: HF checkpoint -> colibri container (layout, exact values, resume, errors)."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from convert_helpers import make_checkpoint, tiny_config
from safetensors.numpy import load_file

from storage.arch import ArchConfig, classify, expected_tensors
from storage.container import Container
from storage.convert import (
    ALIGN,
    DEFAULTS,
    STATE_NAME,
    ConvertOptions,
    ConvertResult,
    convert,
)
from storage.errors import ColibriError, ConfigError, ContainerError, ConversionError
from storage.manifest import MANIFEST_NAME, Manifest, read_manifest, sha256_file
from storage.quant import QTensor, QuantFormat, dequantize, infer_format, quantize
from storage.safetensors import PAD_PREFIX, ShardHeader, TensorInfo, read_header, read_tensor

ROOT = Path(__file__).resolve().parents[2]
SMALL = 64 << 10  # small target shard size: several main and MTP shards from a tiny model
Src = tuple[Path, dict[str, Any], dict[str, Any]]  # source dir, config, reference f32 weights


# ----------------------------------------------------------------------------- checks


def _headers(dst: Path) -> dict[str, ShardHeader]:
    return {p.name: read_header(p) for p in sorted(dst.glob("*.safetensors"))}


def _catalog(dst: Path) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for h in _headers(dst).values():
        for name, info in h.tensors.items():
            if not name.startswith(PAD_PREFIX):
                assert name not in out, f"{name} twice"
                out[name] = info
    return out


def _bits(a: np.ndarray[Any, Any]) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def check_values(dst: Path, ref: dict[str, Any], cfg: dict[str, Any], opts: ConvertOptions) -> None:
    """Every converted tensor is exactly quantize(reference f32, format) (bytes and scales)."""
    arch = ArchConfig.from_dict(cfg)
    cat = _catalog(dst)
    for name, w in ref.items():
        role = classify(name, arch)
        assert role is not None
        fmt = opts.format_for(role.role)
        info = cat[name]
        got = read_tensor(info)
        if fmt.kind == "f32":
            assert info.dtype == "F32" and info.shape == w.shape, name
            assert _bits(got) == _bits(w), name
            continue
        o, i = w.shape
        want = quantize(w, fmt)
        if fmt.kind in ("bf16", "f16"):
            assert info.dtype == fmt.kind.upper() and info.shape == (o, i), name
            assert _bits(got) == _bits(want.data), name
            continue
        qs = cat[name + ".qs"]
        assert info.dtype == "U8" and len(info.shape) == 1 and qs.dtype == "F32", name
        scales = read_tensor(qs).astype(np.float32)
        assert want.scales is not None
        assert _bits(got) == _bits(want.data) and _bits(scales) == _bits(want.scales), name
        # A reader infers the format from byte counts (the public rule); where that is ambiguous
        # (one group per row == per row) both readings dequantize identically.
        inferred = infer_format(info.nbytes, qs.numel, (o, i), dtype="U8", where=name)
        back = dequantize(QTensor(inferred, (o, i), got, scales))
        assert _bits(back) == _bits(dequantize(want)), name


def check_layout(dst: Path, cfg: dict[str, Any]) -> Manifest:
    """Shards load with the safetensors library, checksums match, experts are aligned blobs."""
    arch = ArchConfig.from_dict(cfg)
    manifest = read_manifest(dst)
    assert manifest is not None
    headers = _headers(dst)
    assert sorted(headers) == sorted(s.file for s in manifest.shards)
    for s in manifest.shards:
        p = dst / s.file
        assert p.stat().st_size == s.size and s.size % ALIGN == 0
        assert sha256_file(p) == s.sha256
        real = [n for n in headers[s.file].tensors if not n.startswith(PAD_PREFIX)]
        assert len(real) == s.tensors
        assert headers[s.file].data_start % ALIGN == 0
        assert s.kind == ("mtp" if s.file.startswith("out-mtp-") else "main")
        if not any(t.dtype == "BF16" for t in headers[s.file].tensors.values()):
            assert len(load_file(str(p))) == len(headers[s.file].tensors)

    moe_layers = [lay for lay in range(arch.total_layers) if arch.is_moe_layer(lay)]
    assert len(manifest.experts) == len(moe_layers) * arch.n_routed_experts
    for lay in moe_layers:
        for e in range(arch.n_routed_experts):
            ent = manifest.expert(lay, e)
            assert ent is not None
            h = headers[ent.shard]
            assert ent.shard.startswith("out-mtp-") == (lay >= arch.num_hidden_layers)
            parts = [
                h.tensors[f"model.layers.{lay}.mlp.experts.{e}.{p}.weight"]
                for p in ("down_proj", "gate_proj", "up_proj")
            ]
            assert parts[0].start == ent.start and ent.start % ALIGN == 0
            assert parts[0].end == parts[1].start and parts[1].end == parts[2].start
            assert parts[2].end == ent.end
            _only_padding_until_aligned(h, ent.end)
            if ent.qs_start is not None:
                qs = [h.tensors[t.name + ".qs"] for t in parts]
                assert qs[0].start == ent.qs_start and ent.qs_start % ALIGN == 0
                assert qs[0].end == qs[1].start and qs[1].end == qs[2].start == qs[2].start
                assert qs[2].end == ent.qs_end
                _only_padding_until_aligned(h, ent.qs_end)
    return manifest


def _only_padding_until_aligned(h: ShardHeader, end: int) -> None:
    """An aligned O_DIRECT read that covers ``end`` rounded up sees no foreign tensor bytes."""
    stop = -(-end // ALIGN) * ALIGN
    assert stop <= h.file_size
    for t in h.tensors.values():
        if t.start < stop and t.end > end:
            assert t.name.startswith(PAD_PREFIX), f"{t.name} shares the 4 KiB block after {end}"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory: pytest.TempPathFactory) -> Src:
    root = tmp_path_factory.mktemp("bf16") / "src"
    cfg = tiny_config()
    return root, cfg, make_checkpoint(root, cfg, dtype="BF16", n_shards=3)


@pytest.fixture(scope="module")
def bf16_converted(
    bf16_src: Src, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, ConvertResult]:
    dst = tmp_path_factory.mktemp("bf16out") / "dst"
    return dst, convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))


# ----------------------------------------------------------------------------- formats


def test_bf16_defaults_layout_and_values(
    bf16_src: Src, bf16_converted: tuple[Path, ConvertResult]
) -> None:
    src, cfg, ref = bf16_src
    dst, result = bf16_converted
    opts = ConvertOptions(shard_size=SMALL)
    m = check_layout(dst, cfg)
    check_values(dst, ref, cfg, opts)
    assert m == result.manifest and not result.already_complete
    names = [s.file for s in m.shards]
    assert names[0] == "out-00000.safetensors" and "out-mtp-00000.safetensors" in names
    assert sum(n.startswith("out-mtp-") for n in names) >= 2 and len(names) >= 5
    assert m.options == {**opts.recorded()} and m.options["experts"] == "int4-g64"
    assert m.model_type == "glm_moe_dsa" and m.num_mtp_layers == 1
    assert result.unknown_tensors == () and set(result.written) == set(names)
    for side in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (dst / side).read_bytes() == (src / side).read_bytes()
    assert not list(dst.glob("*.tmp")) and not (dst / STATE_NAME).exists()
    # MTP matrices are int8 (the policy), io too; the router stays F32 [E, H].
    cat = _catalog(dst)
    head = cat["model.layers.2.shared_head.head.weight"]
    assert head.path.name.startswith("out-mtp-") and head.nbytes == 256 * 64
    assert cat["model.layers.1.mlp.gate.weight"].dtype == "F32"
    assert cat["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    assert "converted" in str(result)


def test_container_reads_the_output(
    bf16_src: Src, bf16_converted: tuple[Path, ConvertResult]
) -> None:
    container = pytest.importorskip("storage.container")
    _src, _cfg, ref = bf16_src
    dst, result = bf16_converted
    c = container.Container.open(dst)
    for ent in result.manifest.experts:
        ext = c.expert(ent.layer, ent.expert)
        assert (ext.start, ext.end) == (ent.start, ent.end)
    w = ref["model.layers.1.mlp.experts.3.up_proj.weight"]
    got = c.load_qtensor("model.layers.1.mlp.experts.3.up_proj.weight")
    assert _bits(dequantize(got)) == _bits(dequantize(quantize(w, "int4-g64")))


@pytest.mark.parametrize("model", ["glm_moe_dsa", "deepseek_v3"])
def test_transformers_checkpoint_converts(oracle_dir: Path, tmp_path: Path, model: str) -> None:
    """A checkpoint saved by transformers itself (the oracle) converts, reads back, and f32
    output reproduces every source value exactly."""
    container = pytest.importorskip("storage.container")
    src = oracle_dir / model
    cfg = json.loads((src / "config.json").read_text())
    f32 = ConvertOptions(experts="f32", dense="f32", io="f32", mtp="f32")
    convert(src, tmp_path / "f32", f32)
    out = _catalog(tmp_path / "f32")
    for h in (read_header(p) for p in sorted(src.glob("*.safetensors"))):
        for name, info in h.tensors.items():
            raw = read_tensor(info)
            want = raw.astype(np.float32) if info.dtype == "F32" else None
            if info.dtype == "BF16":
                want = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            assert want is not None and out[name].dtype == "F32", name
            assert _bits(read_tensor(out[name])) == _bits(want), name
    result = convert(src, tmp_path / "q", DEFAULTS)
    check_layout(tmp_path / "q", cfg)
    c = container.Container.open(tmp_path / "q")
    assert not c.problems
    for ent in result.manifest.experts:
        ext = c.expert(ent.layer, ent.expert)
        assert (ext.start, ext.end) == (ent.start, ent.end)


def test_fp8_block_input_and_f32_experts(tmp_path: Path) -> None:
    cfg = tiny_config("deepseek_v3")
    ref = make_checkpoint(tmp_path / "src", cfg, dtype="FP8", n_shards=1, index=False)
    assert (tmp_path / "src" / "model.safetensors").exists()
    opts = ConvertOptions(experts="f32", dense="int4-g64", shard_size=SMALL)
    convert(tmp_path / "src", tmp_path / "dst", opts)
    check_layout(tmp_path / "dst", cfg)
    check_values(tmp_path / "dst", ref, cfg, opts)
    cat = _catalog(tmp_path / "dst")
    up = cat["model.layers.1.mlp.experts.0.up_proj.weight"]
    assert up.dtype == "F32" and up.shape == (96, 64)
    assert not any(n.endswith("_scale_inv") for n in cat)  # consumed, not copied
    # q_b_proj [192, 48] spans two 128-row blocks: the second block's scale must apply.
    qb = ref["model.layers.0.self_attn.q_b_proj.weight"]
    assert qb.shape == (192, 48)


def test_row_blocks_give_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Big matrices are converted in 128-row blocks; the bytes must not change (FP8 blocks too)."""
    cfg = tiny_config("deepseek_v3")
    ref = make_checkpoint(tmp_path / "src", cfg, dtype="FP8", n_shards=2)
    opts = ConvertOptions(experts="int4-g32", dense="int8", io="bf16", mtp="f16", shard_size=SMALL)
    convert(tmp_path / "src", tmp_path / "whole", opts)
    monkeypatch.setattr("storage.convert._ROW_CHUNK_BYTES", 4096)  # 128 rows per block
    convert(tmp_path / "src", tmp_path / "blocks", opts)
    assert _files(tmp_path / "blocks") == _files(tmp_path / "whole")
    check_values(tmp_path / "blocks", ref, cfg, opts)


@pytest.mark.parametrize(
    ("dtype", "opts"),
    [
        ("F16", ConvertOptions(experts="bf16", dense="int4-row", io="f32", mtp="int8")),
        ("F32", ConvertOptions(experts="int8", dense="f16", io="bf16", mtp="int4-g32")),
    ],
)
def test_f16_f32_inputs_honour_options(tmp_path: Path, dtype: str, opts: ConvertOptions) -> None:
    opts = ConvertOptions(**{**opts.__dict__, "shard_size": SMALL})
    cfg = tiny_config()
    ref = make_checkpoint(tmp_path / "src", cfg, dtype=dtype, n_shards=2, index=False)
    convert(tmp_path / "src", tmp_path / "dst", opts)
    check_layout(tmp_path / "dst", cfg)
    check_values(tmp_path / "dst", ref, cfg, opts)


def test_unknown_tensors_are_copied_verbatim(tmp_path: Path) -> None:
    cfg = tiny_config()
    extra: dict[str, np.ndarray[Any, Any]] = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.arange(8, dtype=np.float32),
        "model.extra_counts": np.array([[1, 2, 3]], dtype=np.int32),
        "model.layers.2.mystery": np.full((5,), 7, dtype=np.float16),
    }
    make_checkpoint(tmp_path / "src", cfg, extra=extra)
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(shard_size=SMALL))
    assert set(result.unknown_tensors) == set(extra)
    assert set(result.manifest.unknown_tensors) == set(extra)
    cat = _catalog(tmp_path / "dst")
    for name, arr in extra.items():
        got = read_tensor(cat[name])
        assert got.dtype == arr.dtype and got.shape == arr.shape and _bits(got) == _bits(arr)
    assert cat["model.layers.2.mystery"].path.name.startswith("out-mtp-")
    assert "copied 3 unrecognised tensors" in str(result)


def test_reserved_and_colliding_names_are_refused(
    tmp_path: Path, bf16_converted: tuple[Path, ConvertResult]
) -> None:
    with pytest.raises(ConversionError, match="reserved for padding"):
        convert(bf16_converted[0], tmp_path / "dst")  # a container is not an HF checkpoint
    clash = {"model.layers.0.self_attn.o_proj.weight.qs": np.zeros(3, np.float32)}
    make_checkpoint(tmp_path / "src", tiny_config(), extra=clash)
    with pytest.raises(ConversionError, match=r"o_proj\.weight\.qs.*twice"):
        convert(tmp_path / "src", tmp_path / "dst2")


def test_output_is_deterministic(
    bf16_src: Src,
    bf16_converted: tuple[Path, ConvertResult],
    tmp_path: Path,
) -> None:
    convert(bf16_src[0], tmp_path / "again", ConvertOptions(shard_size=SMALL))
    assert _files(tmp_path / "again") == _files(bf16_converted[0])


# ----------------------------------------------------------------------------- resume


class _Stop(Exception):
    pass


def test_rerun_noop_mismatch_force(tmp_path: Path, bf16_src: Src) -> None:
    src = bf16_src[0]
    dst = tmp_path / "dst"
    opts = ConvertOptions(shard_size=SMALL)
    ticks: list[tuple[int, int]] = []
    first = convert(src, dst, opts, progress=lambda d, t, m: ticks.append((d, t)))
    assert ticks[-1] == (first.total_bytes, first.total_bytes)
    assert [d for d, _t in ticks] == sorted(d for d, _t in ticks) and len(ticks) > 50
    before = _files(dst)
    seen: list[str] = []
    again = convert(src, dst, opts, progress=lambda d, t, m: seen.append(m))
    assert again.already_complete and again.written == ()
    assert "already converted" in str(again) and seen == ["already converted"]
    assert _files(dst) == before

    with pytest.raises(ConversionError, match=r"--experts int4-g64 \(this run: --experts f32\)"):
        convert(src, dst, ConvertOptions(experts="f32", shard_size=SMALL))
    with pytest.raises(ConversionError, match="--force would delete that model"):
        convert(src, dst, ConvertOptions(shard_size=SMALL * 2))
    assert _files(dst) == before

    forced = convert(src, dst, ConvertOptions(experts="f32", shard_size=SMALL), force=True)
    assert not forced.already_complete and forced.manifest.options["experts"] == "f32"
    assert set(forced.written) == {s.file for s in forced.manifest.shards}
    assert read_tensor(_catalog(dst)["model.layers.1.mlp.experts.0.up_proj.weight"]).dtype == (
        np.float32
    )
    assert not list(dst.glob("*.tmp"))


def test_a_finished_model_of_another_source_is_refused_not_offered_to_force(
    tmp_path: Path, bf16_src: Src, bf16_converted: tuple[Path, ConvertResult]
) -> None:
    """A dst holding a complete container is a model, not an interrupted conversion: the
    message says so and that --force would delete it (it used to call it "started from a
    different source" and recommend --force); nothing in it changes."""
    dst = bf16_converted[0]
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in dst.iterdir())
    other = tmp_path / "other"
    make_checkpoint(other, tiny_config(), seed=1)
    with pytest.raises(ConversionError) as err:
        convert(other, dst, ConvertOptions(shard_size=SMALL))
    msg = str(err.value)
    assert "already holds a finished model" in msg and "another source checkpoint" in msg, msg
    assert "--force would delete that model" in msg, msg
    with pytest.raises(
        ConversionError, match=r"finished model, converted with --shard-size .* --shard-size"
    ):
        convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL * 2))
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in dst.iterdir()) == before


def test_interrupted_run_resumes_and_redoes_a_bad_shard(
    tmp_path: Path,
    bf16_src: Src,
    bf16_converted: tuple[Path, ConvertResult],
) -> None:
    src = bf16_src[0]
    dst = tmp_path / "dst"
    opts = ConvertOptions(shard_size=SMALL)

    def stop_at_fourth_shard(done: int, total: int, msg: str) -> None:
        if msg.startswith("out-00003"):
            raise _Stop

    with pytest.raises(_Stop):
        convert(src, dst, opts, progress=stop_at_fourth_shard)
    state = json.loads((dst / STATE_NAME).read_text())
    assert [d["file"] for d in state["done"]] == [f"out-0000{k}.safetensors" for k in range(3)]
    assert not (dst / MANIFEST_NAME).exists() and not list(dst.glob("*.tmp"))

    # A finished shard that no longer matches its checksum is redone, the others are reused.
    bad = dst / "out-00001.safetensors"
    raw = bytearray(bad.read_bytes())
    raw[-ALIGN - 1] ^= 0xFF
    bad.write_bytes(bytes(raw))
    (dst / "out-00007.safetensors.tmp").write_bytes(b"junk from a dead run")

    with pytest.raises(ConversionError, match="different source"):
        other = tmp_path / "other"
        make_checkpoint(other, tiny_config(), seed=1)
        convert(other, dst, opts)

    result = convert(src, dst, opts)
    assert "out-00001.safetensors" in result.written
    assert set(result.reused) == {"out-00000.safetensors", "out-00002.safetensors"}
    assert any("resumed" in n for n in result.notes)
    assert _files(dst) == _files(bf16_converted[0])


def test_damaged_finished_container_is_repaired(
    tmp_path: Path, bf16_src: Src, bf16_converted: tuple[Path, ConvertResult]
) -> None:
    dst = tmp_path / "dst"
    convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))
    (dst / "out-mtp-00001.safetensors").unlink()
    result = convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))
    assert result.written == ("out-mtp-00001.safetensors",)
    assert _files(dst) == _files(bf16_converted[0])


def test_concurrent_run_into_same_dst_is_refused(tmp_path: Path, bf16_src: Src) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    fd = os.open(dst, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ConversionError, match="another `coli convert`"):
            convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))
    finally:
        os.close(fd)
    assert list(dst.iterdir()) == []


def test_foreign_container_in_dst_needs_force(tmp_path: Path, bf16_src: Src) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "out-00000.safetensors").write_bytes(b"not ours")
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="pass --force"):
        convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))
    convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL), force=True)
    assert (dst / "notes.txt").read_text() == "keep me"  # force only touches colibri's files
    check_layout(dst, bf16_src[1])


def _kill_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("killsrc") / "src"
    cfg = tiny_config(
        hidden_size=256,
        moe_intermediate_size=256,
        n_routed_experts=48,
        num_hidden_layers=3,
        vocab_size=512,
    )
    make_checkpoint(src, cfg, dtype="BF16", n_shards=2)
    return src


def _inode(p: Path) -> int | None:
    try:
        return p.stat().st_ino
    except FileNotFoundError:
        return None


@pytest.mark.reliability
@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_is_byte_identical(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    src = _kill_model(tmp_path_factory)
    opts = ConvertOptions(shard_size=256 << 10)
    t0 = time.perf_counter()
    reference = convert(src, tmp_path / "ref", opts)
    t_ref = time.perf_counter() - t0
    assert len(reference.manifest.shards) > 50

    dst = tmp_path / "dst"
    state = dst / STATE_NAME
    cmd = [sys.executable, "-m", "storage.convert", str(src), str(dst)]
    cmd += ["--shard-size", str(opts.shard_size)]
    rng = random.Random(20240607)
    done_after: list[int] = []
    n_shards = len(reference.manifest.shards)

    def n_done() -> int:
        try:
            return len(json.loads(state.read_text())["done"])
        except (OSError, ValueError, KeyError):
            return -1

    # Rounds 0-3 kill at a random point after the run got going: a random number of shards
    # further on (progress, not time: a machine busy with other work converts slower or
    # faster than the reference run did), then a random moment inside the next shard;
    # round 4 kills during start-up / verification of the finished shards.
    for round_ in range(5):
        before = _inode(state)
        target = max(0, n_done()) + rng.randint(1, max(1, n_shards // 8))
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while (
            round_ < 4
            and proc.poll() is None
            and (_inode(state) in (None, before) or n_done() < target)
        ):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, t_ref / n_shards if round_ < 4 else 0.3))
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
        if (dst / MANIFEST_NAME).exists():
            break  # killed after it had finished: nothing left to interrupt
        done_after.append(len(json.loads(state.read_text())["done"]) if state.exists() else 0)
    assert len(done_after) >= 3 and 0 < done_after[-1] < len(reference.manifest.shards)
    assert done_after == sorted(done_after)

    final = convert(src, dst, opts)
    assert final.reused
    assert _files(dst) == _files(tmp_path / "ref")
    assert convert(src, dst, opts).already_complete


# ----------------------------------------------------------------------------- refusals


def test_refuses_without_free_disk(
    tmp_path: Path, bf16_src: Src, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda p: usage(10**9, 10**9 - 12345, 12345))
    dst = tmp_path / "dst"
    with pytest.raises(ConversionError, match=r"needs \d+ bytes .* but 12345 bytes") as ei:
        convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))
    assert str(dst) in str(ei.value)
    assert not list(dst.glob("out-*")) and not (dst / STATE_NAME).exists()


def test_truncated_source_shard_names_the_file(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", tiny_config(), n_shards=2)
    victim = tmp_path / "src" / "model-00002-of-00002.safetensors"
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(ColibriError, match=r"model-00002-of-00002\.safetensors"):
        convert(tmp_path / "src", tmp_path / "dst")


def test_source_errors_are_clear(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(ConversionError, match=r"config\.json"):
        convert(src, tmp_path / "dst")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConversionError, match="'llama' is not supported"):
        convert(src, tmp_path / "dst")
    with pytest.raises(ConversionError, match="must differ"):
        make_checkpoint(src, tiny_config())
        convert(src, src)
    with pytest.raises(ConversionError, match="unknown format"):
        ConvertOptions(experts="int5")


def test_shape_disagreeing_with_config(tmp_path: Path) -> None:
    cfg = tiny_config()
    make_checkpoint(tmp_path / "src", cfg)
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 80}))
    with pytest.raises(
        ConversionError, match=r"experts\.0\.down_proj\.weight.*\[64, 96\].*\[64, 80\]"
    ):
        convert(tmp_path / "src", tmp_path / "dst")


def test_fp8_without_scale_inv(tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    make_checkpoint(
        tmp_path / "src", tiny_config("deepseek_v3"), dtype="FP8", skip=(name + "_scale_inv",)
    )
    with pytest.raises(ConversionError, match=rf"{name}.*{name}_scale_inv"):
        convert(tmp_path / "src", tmp_path / "dst")


def test_missing_tensor_and_missing_mtp_layer(tmp_path: Path) -> None:
    cfg = tiny_config()
    arch = ArchConfig.from_dict(cfg)
    make_checkpoint(tmp_path / "a", cfg, skip=("model.layers.0.self_attn.o_proj.weight",))
    with pytest.raises(ConversionError, match=r"o_proj\.weight"):
        convert(tmp_path / "a", tmp_path / "dst")

    mtp = tuple(n for n in expected_tensors(arch) if n.startswith("model.layers.2."))
    make_checkpoint(tmp_path / "b", cfg, skip=mtp)
    result = convert(tmp_path / "b", tmp_path / "dst2", ConvertOptions(shard_size=SMALL))
    assert any("no MTP layer" in n for n in result.notes)
    assert not any(s.kind == "mtp" for s in result.manifest.shards)


def test_source_without_an_mtp_indexer_converts(tmp_path: Path) -> None:
    """The MTP layer's DSA indexer is optional (the public converter never writes one)."""
    cfg = tiny_config()
    arch = ArchConfig.from_dict(cfg)
    from storage.arch import optional_tensors

    skip = tuple(sorted(optional_tensors(arch)))
    assert skip and all(n.startswith("model.layers.2.self_attn.indexer.") for n in skip)
    make_checkpoint(tmp_path / "src", cfg, skip=skip)
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(shard_size=SMALL))
    assert any("no DSA indexer for the MTP layer" in n for n in result.notes)
    assert any(s.kind == "mtp" for s in result.manifest.shards)
    # one piece of it missing is an incomplete download, not an optional absence
    make_checkpoint(tmp_path / "src2", cfg, skip=skip[1:])
    with pytest.raises(ConversionError, match="in no shard"):
        convert(tmp_path / "src2", tmp_path / "dst2")


def test_defaults_are_the_precision_policy() -> None:
    assert DEFAULTS.recorded() == {
        "experts": "int4-g64",
        "dense": "int4-g64",
        "io": "int8",
        "mtp": "int8",
        "shard_size": 2 << 30,
    }
    assert DEFAULTS.format_for("f32") == QuantFormat("f32")
    # The CLI builds options this way; it must keep working.
    assert ConvertOptions(**{**DEFAULTS.__dict__, "experts": "int4-row"}).experts == "int4-row"


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"experts": "int4-g48"}, r"--experts 'int4-g48': the group size must be a power of two"),
        ({"dense": "int4-g96"}, r"--dense 'int4-g96': the group size must be a power of two"),
        ({"experts": "int4-q"}, r"--experts 'int4-q'"),
        ({"shard_size": 1}, r"--shard-size 1 is below 4096 bytes"),
    ],
)
def test_options_a_reader_could_not_recover_are_refused(kw: dict[str, Any], want: str) -> None:
    """A group size is not recorded in the container: readers infer it from the scales per
    row, and only powers of two always come back (int4-g48 on a 160-wide row reads as g40,
    a silently different model)."""
    with pytest.raises(ConversionError, match=want):
        ConvertOptions(**kw)
    # what infer_format does with it, for the record: g48 on 160 columns is not g48
    assert infer_format(64 * 80, 64 * 4, (64, 160)).group_size != 48
    for gs in (16, 32, 64, 128, 256):
        ConvertOptions(experts=f"int4-g{gs}", dense=f"int4-g{gs}")


@pytest.mark.parametrize("which", ["expert", "norm"])
def test_non_finite_source_weights_are_refused(tmp_path: Path, which: str) -> None:
    """A NaN or inf in the source (a quantized matrix, or a norm copied as it is) stops the
    conversion naming the tensor: the container would otherwise carry the damage with
    checksums that vouch for it."""
    from storage.arch import ArchConfig, classify

    cfg = tiny_config()
    arch = ArchConfig.from_dict(cfg)
    names = expected_tensors(arch)
    if which == "expert":
        name = next(n for n in names if ".experts." in n and n.endswith("up_proj.weight"))
    else:
        name = next(n for n in names if n.endswith("post_attention_layernorm.weight"))
    role = classify(name, arch)
    assert role is not None
    shape = role.shape or (cfg["hidden_size"],)
    bad = np.full(shape, 0.05, dtype=np.float32)
    bad.reshape(-1)[7] = np.nan if which == "expert" else np.inf
    src = tmp_path / "src"
    make_checkpoint(src, cfg, dtype="F32", n_shards=1, extra={name: bad})
    with pytest.raises(ConversionError, match=rf"{re.escape(name)}' holds NaN or infinite"):
        convert(src, tmp_path / "dst", ConvertOptions(shard_size=SMALL))


def test_a_dst_holding_another_model_is_refused(bf16_src: Src, tmp_path: Path) -> None:
    """Converting into a directory that holds a Hugging Face checkpoint would overwrite its
    config.json and put shards beside its tensors (a model no reader opens): refused, with
    --force too (force removes colibri's files only), and nothing of it is touched."""
    dst = Path(shutil.copytree(bf16_src[0], tmp_path / "hf"))
    before = {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()}
    for force in (False, True):
        with pytest.raises(ConversionError, match="another model's weights"):
            convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL), force=force)
    assert {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()} == before


@contextlib.contextmanager
def _tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mnt`` for the block (the test is skipped where mounting
    is refused), unmounted after it."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_a_failed_conversion_leaves_no_empty_dst_behind(bf16_src: Src, tmp_path: Path) -> None:
    """A conversion refused before it wrote anything (here: no disk space, on a 512 KiB
    tmpfs) removes the DST it created instead of leaving it empty."""
    with _tmpfs(tmp_path / "small", "512k") as mnt:
        dst = mnt / "new" / "dst"
        with pytest.raises(ConversionError, match="not enough free disk space"):
            convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL))
        assert not dst.exists()
        (mnt / "kept").mkdir()  # a DST that was there before stays
        with pytest.raises(ConversionError, match="not enough free disk space"):
            convert(bf16_src[0], mnt / "kept", ConvertOptions(shard_size=SMALL))
        assert (mnt / "kept").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_a_disk_that_fills_mid_shard_says_a_rerun_resumes(
    bf16_src: Src, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The up-front space check passed (here: told so) but the disk filled while a shard was
    written: the error was a bare "write failed: No space left on device", with no word that
    the shards written are kept and a rerun resumes."""
    usage = collections.namedtuple("usage", "total used free")
    with _tmpfs(tmp_path / "small", "256k") as mnt:
        monkeypatch.setattr("shutil.disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
        with pytest.raises(ConversionError, match=r"No space left.*rerun the same command") as ei:
            convert(bf16_src[0], mnt / "dst", ConvertOptions(shard_size=SMALL))
        assert "(it resumes)" in str(ei.value)
        assert not list((mnt / "dst").glob("*.tmp"))


def test_a_source_fine_tuned_mid_file_is_another_source(tmp_path: Path) -> None:
    """Weights changed in the middle of a shard (a fine-tune of some layers: names, sizes,
    header, first MiB and last 64 KiB all alike) are another source: a finished DST is not
    "already converted", it is refused (it kept the old weights: wrong output)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_checkpoint(src, tiny_config(vocab_size=16384), dtype="F32", n_shards=1, index=False)
    convert(src, dst, ConvertOptions(shard_size=SMALL))
    assert convert(src, dst, ConvertOptions(shard_size=SMALL)).already_complete
    (shard,) = src.glob("*.safetensors")
    size = shard.stat().st_size
    inside = [
        t
        for t in read_header(shard).tensors.values()
        if t.start >= 1 << 20 and t.end <= size - (64 << 10) and "layers.1.self_attn" in t.name
    ]
    assert inside, "no tensor lies between the first MiB and the last 64 KiB"
    raw = bytearray(shard.read_bytes())
    t = inside[0]
    for i in range(t.start + 3, t.end, 4):
        raw[i] ^= 0x80  # every float32 of one attention tensor negated
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConversionError, match="another source checkpoint"):
        convert(src, dst, ConvertOptions(shard_size=SMALL))


def test_a_config_declaring_fewer_layers_than_the_checkpoint_holds_is_refused(
    tmp_path: Path,
) -> None:
    """A config.json whose num_hidden_layers is short of the checkpoint's layers converted the
    extra layer as "unrecognised tensors" and ran a shallower model (wrong output, silently):
    it is refused, naming the layer and what to check."""
    src = tmp_path / "src"
    cfg = tiny_config("deepseek_v3", num_hidden_layers=3, num_nextn_predict_layers=0)
    make_checkpoint(src, cfg, n_shards=1, index=False)
    doc = json.loads((src / "config.json").read_text())
    doc["num_hidden_layers"] = 2
    (src / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ConversionError, match=r"declares 2 layers .* model\.layers\.2\."):
        convert(src, tmp_path / "dst", ConvertOptions(shard_size=SMALL))


def test_a_repair_killed_while_re_verifying_resumes(tmp_path: Path, bf16_src: Src) -> None:
    """Repairing a finished model with a truncated shard first drops its manifest, then
    re-hashes every shard: a kill -9 in that window left shards that neither a manifest nor
    a state file claimed, and the rerun refused them ("a conversion this one did not start",
    --force: convert everything again). The state file is written first now: the rerun
    resumes and the result is the clean conversion's, byte for byte."""
    src = bf16_src[0]
    clean = tmp_path / "clean"
    convert(src, clean, ConvertOptions(shard_size=SMALL))
    dst = tmp_path / "dst"
    shutil.copytree(clean, dst)
    victim = sorted(dst.glob("out-0*.safetensors"))[1]
    with open(victim, "r+b") as fh:
        fh.truncate(4096)
    script = textwrap.dedent(
        f"""
        import os, signal
        from storage.convert import ConvertOptions, convert
        def progress(done, total, what):
            if what.startswith("verifying"):
                os.kill(os.getpid(), signal.SIGKILL)
        convert({str(src)!r}, {str(dst)!r}, ConvertOptions(shard_size={SMALL}),
                progress=progress)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (dst / "colibri-manifest.json").exists()
    result = convert(src, dst, ConvertOptions(shard_size=SMALL))
    assert result.written == (victim.name,)
    assert _files(dst) == _files(clean)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a read-only tmpfs (needs root)")
def test_a_read_only_dst_is_named_with_what_to_do(bf16_src: Src, tmp_path: Path) -> None:
    """A DST on a read-only filesystem failed with the name of a random temp file and the OS
    message alone; the error names the file colibri writes and says what to do."""
    with _tmpfs(tmp_path / "ro", "80m") as mnt:
        (mnt / "dst").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(ConversionError) as err:
            convert(bf16_src[0], mnt / "dst", ConvertOptions(shard_size=SMALL))
        msg = str(err.value)
        assert ".colibri-convert.json: cannot write" in msg and "read-only" in msg, msg
        assert ".tmp" not in msg, msg


def test_a_tied_checkpoint_without_lm_head_converts_with_the_embedding(tmp_path: Path) -> None:
    """save_pretrained leaves a tied lm_head out: such a checkpoint was refused as an
    incomplete download ("lm_head.weight ... is the download complete?"). The container's
    lm_head is the input embedding, stored alike (the same bytes)."""
    src = tmp_path / "src"
    make_checkpoint(src, tiny_config(tie_word_embeddings=True), skip=("lm_head.weight",))
    result = convert(src, tmp_path / "dst", ConvertOptions(shard_size=SMALL))
    assert any("tie_word_embeddings" in n for n in result.notes)
    cat = _catalog(tmp_path / "dst")
    head, embed = cat["lm_head.weight"], cat["model.embed_tokens.weight"]
    assert head.dtype == embed.dtype and head.shape == embed.shape
    assert np.array_equal(read_tensor(head), read_tensor(embed))


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_key_value_heads": 2,
          "use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
        ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                              "partial_rotary_factor": 0.5}}, "partial_rotary_factor != 1"),
        ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "dynamic"}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)  # fmt: skip
def test_a_config_the_runtime_refuses_is_refused_before_converting(
    tmp_path: Path, over: dict[str, Any], match: str
) -> None:
    """A config the runtime cannot run (a sliding window, partial rotary on MLA, an unknown
    rope type or activation) converted a whole checkpoint (hours for a large one) before the
    first `coli run` refused it; the converter refuses it up front, writing nothing."""
    src = tmp_path / "src"
    make_checkpoint(src, tiny_config("deepseek_v3"), n_shards=1, index=False)
    (src / "config.json").write_text(json.dumps({**tiny_config("deepseek_v3"), **over}))
    with pytest.raises(ConversionError, match=match):
        convert(src, tmp_path / "dst", ConvertOptions(shard_size=SMALL))
    assert not (tmp_path / "dst").exists()


def test_an_interrupted_conversion_is_named_as_one(tmp_path: Path, bf16_src: Src) -> None:
    """A DST a conversion stopped in (shards and its state file, no config.json yet) was
    "not a colibri model directory ... convert a Hugging Face checkpoint" to coli run and
    coli doctor; it is named an interrupted conversion, with the way to finish it."""
    from storage.container import Container
    from storage.doctor import run_doctor

    dst = tmp_path / "dst"

    def stop(done: int, total: int, what: str) -> None:
        if what.startswith("out-00001"):  # the first shard is done: stop in the second
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL), progress=stop)
    assert (dst / ".colibri-convert.json").is_file() and not (dst / "config.json").exists()
    with pytest.raises(ContainerError, match=r"interrupted `coli convert`.*rerun"):
        Container.open(dst)
    report = run_doctor(dst)
    assert any("interrupted `coli convert`" in c.message for c in report.checks), report.checks


def test_an_index_naming_files_outside_src_and_a_dst_that_is_a_file_are_refused(
    tmp_path: Path, bf16_src: Src
) -> None:
    """A model.safetensors.index.json entry "../other/model.safetensors" opened and read a
    file outside SRC; a DST that is a file said "cannot create: File exists"."""
    src = tmp_path / "src"
    shutil.copytree(bf16_src[0], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere/model.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="outside"):
        convert(src, tmp_path / "dst", ConvertOptions(shard_size=SMALL))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConversionError, match="is a file, not a directory"):
        convert(bf16_src[0], tmp_path / "afile", ConvertOptions(shard_size=SMALL))


def test_a_source_without_mtp_weights_makes_a_container_that_declares_none(
    tmp_path: Path,
) -> None:
    """Converting a checkpoint whose config declares an MTP layer it has no weights for is
    allowed (docs/format.md); the container's config said one MTP layer all the same, so
    `coli doctor` failed it (67 tensors missing) and `coli info` counted one. Its config.json
    now declares none, and the doctor passes it."""
    from storage.container import Container
    from storage.doctor import run_doctor

    cfg = tiny_config()
    arch = ArchConfig.from_dict(cfg)
    mtp = tuple(
        n
        for n in expected_tensors(arch)
        if n.startswith(tuple(f"model.layers.{i}." for i in range(arch.num_hidden_layers, 64)))
    )
    assert mtp
    make_checkpoint(tmp_path / "src", cfg, n_shards=1, skip=mtp)
    res = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(shard_size=SMALL))
    assert any("no MTP layer weights" in n for n in res.notes), res.notes
    written = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 0
    assert {k: v for k, v in written.items() if k != "num_nextn_predict_layers"} == {
        k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"
    }
    assert Container.open(tmp_path / "dst").arch.num_mtp_layers == 0
    report = run_doctor(tmp_path / "dst")
    assert report.ok and not [c for c in report.checks if c.status != "pass"], report.checks
    # the same as a script (format.md's `python -m storage.convert`): a helper defined after
    # the __main__ block was a NameError there, after every shard had been written
    r = subprocess.run(
        [sys.executable, "-m", "storage.convert", str(tmp_path / "src"), str(tmp_path / "dst2")],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (
        json.loads((tmp_path / "dst2" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    )


def test_a_norm_of_another_length_than_the_config_implies_is_refused(tmp_path: Path) -> None:
    """A 1-D tensor was checked for being 1-D only: a norm of the wrong length converted and
    then ran broadcast (wrong output)."""
    cfg = tiny_config()
    name = "model.layers.1.post_attention_layernorm.weight"
    bad = {name: np.ones(cfg["hidden_size"] // 2, dtype=np.float32)}
    make_checkpoint(tmp_path / "src", cfg, n_shards=1, extra=bad)  # in place of the real one
    with pytest.raises(ConversionError, match=rf"{name}'.*\[32\].*implies \[64\]"):
        convert(tmp_path / "src", tmp_path / "dst", ConvertOptions())


def test_a_width_that_is_not_whole_groups_is_noted(tmp_path: Path) -> None:
    """int4-g64 on a 160-wide matrix (the tiny config's dense MLP) reads right in colibri,
    whose last group of a row is shorter, but the C engine derives the group size from the
    scale count (160 / 3 = 53) and misreads it: the conversion says so, naming a matrix."""
    cfg = tiny_config()
    make_checkpoint(tmp_path / "src", cfg, n_shards=1)
    res = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions())
    (note,) = [n for n in res.notes if "groups per row" in n]
    assert "160 wide" in note and "int4-g64" in note, note
    even = ConvertOptions(dense="int4-g16", experts="int4-g16")
    ok = convert(tmp_path / "src", tmp_path / "dst16", even)
    assert not [n for n in ok.notes if "groups per row" in n], ok.notes
    # g128: the 64-wide matrices are one (short) group, which the C engine reads as such;
    # only the wider ones that are no whole number of groups are counted (all were)
    g128 = ConvertOptions(dense="int4-g128", experts="int4-g128")
    wide = convert(tmp_path / "src", tmp_path / "dst128", g128)
    (note,) = [n for n in wide.notes if "groups per row" in n]
    c = Container.open(tmp_path / "dst128")  # (a one-group matrix reads back as int4-row)
    entries = [c.entry(n) for n in c.names()]
    widths = [e.shape[1] for e in entries if e.fmt is not None and e.fmt.kind == "int4"]
    assert min(widths) < 128
    n = sum(1 for w in widths if w > 128 and w % 128)
    assert note.startswith(f"{n} {'matrix' if n == 1 else 'matrices'} (e.g."), note


def test_a_sliding_window_as_long_as_the_context_is_full_attention(tmp_path: Path) -> None:
    """A window that never cuts a key (sliding_window >= max_position_embeddings, as some
    Mistral-derived MoE configs carry) was refused as sliding-window attention."""
    from storage.arch import rotary_keys

    cfg = {**tiny_config("deepseek_v3"), "model_type": "qwen3_moe", "num_experts": 4,
           "num_key_value_heads": 2, "use_sliding_window": True}  # fmt: skip
    ctx = int(cfg.get("max_position_embeddings") or 512)
    cfg["max_position_embeddings"] = ctx
    rotary_keys({**cfg, "sliding_window": ctx})  # accepted
    with pytest.raises(ConfigError, match="shorter than the"):
        rotary_keys({**cfg, "sliding_window": ctx - 1})


def test_the_mtp_layer_of_a_family_without_an_mtp_head_is_left_out(tmp_path: Path) -> None:
    """GLM-4.5 declares an MTP layer colibri never runs: its tensors were copied verbatim as
    unrecognised ones (GBs of bf16 experts on a real checkpoint); they are left out, said."""
    cfg = {
        "model_type": "glm4_moe", "hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    mtp = {
        f"model.layers.2.{n}": np.ones(shape, dtype=np.float32)
        for n, shape in (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)),
                         ("mlp.experts.0.down_proj.weight", (64, 32)))
    }  # fmt: skip
    make_checkpoint(tmp_path / "src", cfg, n_shards=1, extra=mtp)
    res = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions())
    (note,) = [n for n in res.notes if "left out the MTP layer" in n]
    assert "3 tensors" in note and "glm4_moe" in note, note
    names = {n for p in (tmp_path / "dst").glob("*.safetensors") for n in read_header(p).tensors}
    assert names and not [n for n in names if n.startswith("model.layers.2.")], sorted(names)
    # and the container's config declares none (it copied the source's 1: another reader was
    # told of a layer the shards do not hold)
    out_cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert out_cfg["num_nextn_predict_layers"] == 0


def test_f16_output_that_would_overflow_is_refused(tmp_path: Path) -> None:
    """A value beyond float16's range was cast to inf with only a numpy warning: the
    conversion succeeded, doctor --verify passed (the checksums vouch for the inf) and the
    model stopped at its first token saying its weights were damaged."""
    from storage.arch import ArchConfig

    cfg = tiny_config()
    name = next(n for n in expected_tensors(ArchConfig.from_dict(cfg)) if "o_proj" in n)
    src = tmp_path / "src"
    ws = make_checkpoint(src, cfg, dtype="F32", n_shards=1)
    big = np.array(ws[name], dtype=np.float32)
    big.reshape(-1)[3] = 1e5
    make_checkpoint(src, cfg, dtype="F32", n_shards=1, extra={name: big})
    with pytest.raises(ConversionError, match=rf"{re.escape(name)}' holds values up to 100000"):
        convert(src, tmp_path / "dst", ConvertOptions(dense="f16"))
    convert(src, tmp_path / "ok", ConvertOptions(dense="bf16"))  # bf16 holds it


def test_a_dst_holding_another_models_files_is_refused(bf16_src: Src, tmp_path: Path) -> None:
    """A folder with another model's config.json / tokenizer.json and non-safetensors weights
    (pytorch_model.bin) was converted into: its config and tokenizer were replaced."""
    dst = tmp_path / "other"
    dst.mkdir()
    (dst / "config.json").write_text('{"model_type": "mine"}')
    (dst / "tokenizer.json").write_text("{}")
    (dst / "pytorch_model.bin").write_bytes(b"weights")
    before = _files(dst)
    for force in (False, True):
        with pytest.raises(ConversionError, match="another model's weights or files"):
            convert(bf16_src[0], dst, ConvertOptions(shard_size=SMALL), force=force)
    assert _files(dst) == before


def test_a_rerun_restores_side_files_and_takes_the_sources_fixes(
    bf16_src: Src, tmp_path: Path
) -> None:
    """A finished container that lost its tokenizer.json said 'already converted; nothing to
    do' and stayed unusable ('config.json not found ... coli convert' sent the user in a
    circle); a fixed generation_config.json in the source was never taken either."""
    src = Path(shutil.copytree(bf16_src[0], tmp_path / "src"))
    dst = tmp_path / "dst"
    convert(src, dst, ConvertOptions(shard_size=SMALL))
    side = [n for n in ("config.json", "tokenizer.json") if (dst / n).exists()]
    assert "config.json" in side
    for n in side:
        (dst / n).unlink()
    (src / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    res = convert(src, dst, ConvertOptions(shard_size=SMALL))
    assert res.already_complete and res.written == ()
    for n in [*side, "generation_config.json"]:
        assert (dst / n).read_bytes() == (src / n).read_bytes(), n
    assert any("rewrote" in n and "config.json" in n for n in res.notes), res.notes
    again = convert(src, dst, ConvertOptions(shard_size=SMALL))  # nothing left to rewrite
    assert not [n for n in again.notes if "rewrote" in n]


def test_a_failed_start_then_a_fixed_source_converts(tmp_path: Path) -> None:
    """A conversion that stopped at a NaN before finishing any shard left a state file that then
    refused the repaired source as 'a different source checkpoint ... pass --force' (doctor
    had just said to rerun the same command)."""
    from storage.arch import ArchConfig

    cfg = tiny_config()
    name = next(n for n in expected_tensors(ArchConfig.from_dict(cfg)) if "o_proj" in n)
    src = tmp_path / "src"
    ws = make_checkpoint(src, cfg, dtype="F32", n_shards=1)
    bad = np.array(ws[name], dtype=np.float32)
    bad.reshape(-1)[0] = np.nan
    make_checkpoint(src, cfg, dtype="F32", n_shards=1, extra={name: bad})
    with pytest.raises(ConversionError, match="holds NaN"):  # in its first shard
        convert(src, tmp_path / "dst", ConvertOptions())
    make_checkpoint(src, cfg, dtype="F32", n_shards=1)  # the repaired download
    convert(src, tmp_path / "dst", ConvertOptions())
    check_layout(tmp_path / "dst", cfg)


def test_an_attention_bias_the_config_does_not_give_is_unknown_and_never_applied(
    tmp_path: Path,
) -> None:
    """A q_a_proj.bias in a checkpoint whose config says attention_bias false was classified
    as a known F32 tensor and applied (logits off by 7.6 on Mixtral), where transformers
    ignores it: it is an unknown tensor now (listed, kept, never applied); with
    attention_bias true it is the model's bias and applies."""
    from runtime.models import load_model
    from storage.container import Container

    name = "model.layers.0.self_attn.q_a_proj.bias"
    extra = {name: np.full((48,), 3.0, dtype=np.float32)}
    ids = np.array([1, 5, 9, 13], dtype=np.int64)

    def logits(cfg: dict[str, Any], bias: bool, tag: str) -> tuple[Any, Any]:
        src = tmp_path / f"src-{tag}"
        make_checkpoint(src, cfg, dtype="F32", n_shards=1, extra=extra if bias else None)
        res = convert(src, tmp_path / f"dst-{tag}", ConvertOptions(experts="f32", dense="f32"))
        model = load_model(Container.open(tmp_path / f"dst-{tag}"))
        return model.forward(ids, model.new_cache()).logits, res

    plain, _ = logits(tiny_config(), False, "plain")
    ignored, res = logits(tiny_config(), True, "ignored")
    assert name in res.unknown_tensors
    assert np.array_equal(plain, ignored)
    applied, res = logits(tiny_config(attention_bias=True), True, "applied")
    assert name not in res.unknown_tensors and not np.allclose(plain, applied)
