"""``.coli_kv`` slot files: layout, round trip, crash safety, validation (storage/kvfile.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import structlog
from _demo import demo_model

from runtime.kv import KVCache
from storage.errors import KVFileError
from storage.kvfile import (
    KV_MAGIC,
    async_sync_kv,
    header_for,
    load_kv,
    model_identity,
    read_header,
    read_kv,
    slot_path,
    sync_kv,
    write_kv,
)

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1000
DIMS = dict(n_layers=3, kv_lora_rank=8, qk_rope_head_dim=4, index_head_dim=6, indexed_layers=[0, 2])


def new_cache() -> KVCache:
    return KVCache(**DIMS)  # type: ignore[arg-type]


def row_values(pos: np.ndarray, epoch: int, width: int, salt: int) -> np.ndarray:
    """Deterministic float rows [N, width] for positions ``pos`` (and an epoch)."""
    return (pos[:, None] * 1.25 + np.arange(width)[None, :] * 0.01 + epoch * 100 + salt).astype(
        np.float32
    )


def fill(cache: KVCache, start: int, end: int, epoch: int = 0) -> None:
    """Rows [start, end) with values that name their position and epoch, then commit."""
    pos = np.arange(start, end)
    cache.truncate(min(cache.length, start))
    cache.reserve(end)
    for layer in range(cache.n_layers):
        cache.write(
            layer,
            start,
            row_values(pos, epoch, cache.kv_lora_rank, layer),
            row_values(pos, epoch, cache.qk_rope_head_dim, 10 + layer),
        )
    for layer in cache.indexed_layers:
        cache.write_index(layer, start, row_values(pos, epoch, cache.index_head_dim, 20 + layer))
    cache.write_tokens(start, (pos * 7 + epoch) % VOCAB)
    cache.commit(end)


def same(a: KVCache, b: KVCache, n: int | None = None) -> bool:
    n = a.length if n is None else n
    if b.length < n:
        return False
    ok = np.array_equal(a.tokens[:n], b.tokens[:n])
    for layer in range(a.n_layers):
        ok &= np.array_equal(a.latent(layer, n), b.latent(layer, n))
        ok &= np.array_equal(a.k_rope(layer, n), b.k_rope(layer, n))
    for layer in a.indexed_layers:
        ok &= np.array_equal(a.index_keys(layer, n), b.index_keys(layer, n))
    return bool(ok)


def test_round_trip_and_header_layout(tmp_path: Path) -> None:
    c = new_cache()
    fill(c, 0, 11)
    p = slot_path(tmp_path, 3)
    assert p.name == ".coli_kv.3"
    assert sync_kv(p, c, valid=0, vocab=VOCAB, identity=1234) == 11
    raw = p.read_bytes()
    assert raw[:8] == KV_MAGIC == b"COLIKV1\0"
    words = struct.unpack("<8i", raw[8:40])
    assert words == (3, 8, 4, 6, 2, VOCAB, 11, 1234)
    per = 1 + 3 * (8 + 4) + 2 * 6
    assert len(raw) == 40 + 11 * per * 4
    # record 5: token, then per layer latent + rope, then index keys of layers 0 and 2
    rec = np.frombuffer(raw[40 + 5 * per * 4 : 40 + 6 * per * 4], dtype="<f4")
    assert rec[:1].view("<i4")[0] == c.tokens[5]
    assert np.array_equal(rec[1:9], c.latent(0)[5])
    assert np.array_equal(rec[9:13], c.k_rope(0)[5])
    assert np.array_equal(rec[13:21], c.latent(1)[5])
    assert np.array_equal(rec[37:43], c.index_keys(0)[5])
    assert np.array_equal(rec[43:49], c.index_keys(2)[5])
    back = read_kv(p, new_cache, VOCAB, 1234)
    assert back.length == 11 and same(c, back)
    assert read_header(p) == header_for(c, VOCAB, 1234, 11)


def test_append_and_drop_keep_the_file_equal_to_the_cache(tmp_path: Path) -> None:
    p = slot_path(tmp_path, 0)
    c = new_cache()
    fill(c, 0, 6)
    persisted = sync_kv(p, c, valid=0, vocab=VOCAB)
    fill(c, 6, 9)  # a turn appends
    persisted = sync_kv(p, c, valid=persisted, vocab=VOCAB)
    assert same(c, read_kv(p, new_cache, VOCAB))
    fill(c, 4, 7, epoch=1)  # a new prompt shares only 4 tokens: rows 4.. change, file shrinks
    persisted = sync_kv(p, c, valid=4, vocab=VOCAB)
    assert persisted == 7 and os.path.getsize(p) == read_header(p).file_nbytes()
    assert same(c, read_kv(p, new_cache, VOCAB))


@pytest.mark.parametrize("fail_at", range(1, 8))
def test_an_interrupted_update_never_loads_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """Crash (an exception) at each write/fsync of a drop-then-append update: what loads is the
    old state, the kept prefix, or the new state, each exactly."""
    p = slot_path(tmp_path, 0)
    old = new_cache()
    fill(old, 0, 10)
    sync_kv(p, old, valid=0, vocab=VOCAB)
    new = new_cache()
    fill(new, 0, 10)
    fill(new, 4, 13, epoch=1)
    calls = {"n": 0}
    real_pwrite, real_fsync = os.pwrite, os.fsync

    def tick() -> None:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(5, "injected failure")

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        tick()
        return real_pwrite(fd, data, offset)

    def fsync(fd: int) -> None:
        tick()
        real_fsync(fd)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fsync", fsync)
    try:
        sync_kv(p, new, valid=4, vocab=VOCAB)
    except KVFileError:
        pass
    monkeypatch.undo()
    got = read_kv(p, new_cache, VOCAB)
    assert got.length in (10, 4, 13)
    assert same(old if got.length == 10 else new, got, got.length)


def test_mismatched_or_damaged_files_are_reported_and_set_aside(tmp_path: Path) -> None:
    c = new_cache()
    fill(c, 0, 5)
    good = tmp_path / "good"
    write_kv(good, c, VOCAB, identity=7)
    cases: dict[str, bytes] = {}
    raw = good.read_bytes()
    cases["bad magic"] = b"NOTKV1\0\0" + raw[8:]
    cases["truncated"] = raw[:-9]
    cases["short header"] = raw[:20]
    other = KVCache(3, 16, 4, 6, [0, 2])
    fill(other, 0, 2)
    write_kv(tmp_path / "o", other, VOCAB, identity=7)
    cases["other dims"] = (tmp_path / "o").read_bytes()
    write_kv(tmp_path / "v", c, VOCAB + 1, identity=7)
    cases["other vocab"] = (tmp_path / "v").read_bytes()
    write_kv(tmp_path / "w", c, VOCAB, identity=8)
    cases["other weights"] = (tmp_path / "w").read_bytes()
    bad_tok = bytearray(raw)
    bad_tok[40:44] = struct.pack("<i", VOCAB + 5)
    cases["token outside vocab"] = bytes(bad_tok)
    # 0.5 with its top exponent bit flipped: 1.7e38, finite, and an overflow in every
    # attention that reuses it (the file used to load, and every later turn failed)
    flipped = bytearray(raw)
    flipped[48:52] = struct.pack("<I", 0x3F000000 ^ 0x40000000)
    cases["a flipped exponent bit"] = bytes(flipped)
    for name, data in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        p = d / ".coli_kv.0"
        p.write_bytes(data)
        with structlog.testing.capture_logs() as logs:
            assert load_kv(p, new_cache, VOCAB, identity=7) is None, name
        assert not p.exists(), name
        assert len(list(d.glob(".coli_kv.0.bad-*"))) == 1, name
        assert any(e["log_level"] == "warning" and e.get("problem") for e in logs), name
    # a file with no identity recorded (another engine's) is accepted on its dimensions
    write_kv(tmp_path / "anon", c, VOCAB, identity=0)
    loaded = load_kv(tmp_path / "anon", new_cache, VOCAB, identity=7)
    assert loaded is not None and same(c, loaded)
    assert load_kv(tmp_path / "missing", new_cache, VOCAB) is None


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from runtime.kv import KVCache
    from storage.kvfile import sync_kv
    path, batch = sys.argv[1], int(sys.argv[2])
    c = KVCache(8, 512, 64, 128, [0, 3, 5])
    n = persisted = 0
    while True:  # until killed: grow to 2000 records, drop back to 1000, grow again, ...
        if n >= 2000:
            n = 1000
            c.truncate(n)
        pos = np.arange(n, n + batch)
        c.reserve(n + batch)
        for layer in range(8):
            c.write(layer, n, np.repeat(pos[:, None] + layer, 512, 1).astype(np.float32),
                    np.repeat(pos[:, None] - layer, 64, 1).astype(np.float32))
        for layer in (0, 3, 5):
            c.write_index(layer, n, np.repeat(pos[:, None] * 2.0, 128, 1).astype(np.float32))
        c.write_tokens(n, pos % 1000)
        c.commit(n + batch)
        n += batch
        persisted = sync_kv(path, c, valid=min(persisted, n - batch), vocab=1000)
        print(persisted, flush=True)
    """
)


@pytest.mark.reliability
def test_kill_9_during_append_leaves_old_or_new_count(tmp_path: Path) -> None:
    """The writer appends ~1.9 MB batches (and now and then drops records) until SIGKILL: the
    file always loads with the last printed count, the next one, or the kept prefix, and every
    record loaded is exactly what was written."""
    batch = 96
    for attempt in range(3):
        p = tmp_path / f".coli_kv.{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(p), str(batch)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the file exists with one batch
        assert first.strip() == str(batch)
        time.sleep(0.1 + 0.17 * attempt)
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
        assert proc.wait() == -signal.SIGKILL
        committed = [int(x) for x in (first + rest).split()][-1]
        nxt = committed + batch if committed < 2000 else 1000 + batch
        cache = read_kv(p, lambda: KVCache(8, 512, 64, 128, [0, 3, 5]), 1000)
        n = cache.length
        assert n in (committed, nxt, 1000), (committed, n)
        pos = np.arange(n)
        assert np.array_equal(cache.tokens, pos % 1000)
        for layer in range(8):
            assert np.array_equal(cache.latent(layer)[:, 0], (pos + layer).astype(np.float32))
            assert np.array_equal(cache.k_rope(layer)[:, -1], (pos - layer).astype(np.float32))
        for layer in (0, 3, 5):
            assert np.array_equal(cache.index_keys(layer)[:, 3], (pos * 2.0).astype(np.float32))


def test_model_identity_tells_weights_apart(tmp_path: Path) -> None:
    demo = demo_model()
    a = model_identity(demo)
    assert a == model_identity(demo) and 0 < a < 2**31
    copy = tmp_path / "m"
    shutil.copytree(demo, copy)
    assert model_identity(copy) == a  # same files, same identity, wherever they live
    shard = next(copy.glob("out-0*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one weight byte differs
    shard.write_bytes(bytes(data))
    assert model_identity(copy) != a
    # converted again from other weights whose shards end alike (an attention-only fine-tune:
    # the last 64 KiB and every header the same): the manifest's checksums tell them apart
    again = tmp_path / "again"
    shutil.copytree(demo, again)
    manifest = json.loads((again / "colibri-manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "0" * 64
    (again / "colibri-manifest.json").write_text(json.dumps(manifest))
    assert model_identity(again) != a


@pytest.mark.anyio
async def test_async_sync_runs_off_the_loop(tmp_path: Path, anyio_backend: str) -> None:
    c = new_cache()
    fill(c, 0, 4)
    p = slot_path(tmp_path, 1)
    assert await async_sync_kv(p, c, valid=0, vocab=VOCAB) == 4
    assert same(c, read_kv(p, new_cache, VOCAB))
