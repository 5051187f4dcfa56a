"""The server's KV slot pool on its own (colibri/server/slots.py): which slot a request without
``cache_slot`` takes, what a restarted server knows of its saved slots before it loads them,
and one slot directory per server. Real files on disk, no model."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import numpy as np

from colibri.server.slots import REUSE_MIN_TOKENS, SlotPool
from runtime.kv import KVCache
from storage.kvfile import slot_path, write_kv

VOCAB = 500


def _cache() -> KVCache:
    return KVCache(2, 4, 2)


def _filled(tokens: list[int]) -> KVCache:
    """A cache holding ``tokens`` (rows derived from the ids: any finite values do)."""
    c = _cache()
    n = len(tokens)
    c.reserve(n)
    for layer in range(2):
        base = np.arange(n, dtype=np.float32)[:, None] + layer
        c.write(layer, 0, np.repeat(base, 4, axis=1), np.repeat(base, 2, axis=1))
    c.write_tokens(0, np.asarray(tokens, np.int64))
    c.commit(n)
    return c


def _pool(directory: Path | None, n: int = 3) -> SlotPool:
    return SlotPool(n, _cache, vocab=VOCAB, identity=0, directory=directory)


def test_a_template_prefix_alone_is_no_reason_to_share_a_slot() -> None:
    """Every chat prompt begins with the same few template tokens: they matched every slot, so
    unrelated conversations took turns in one slot (each evicting the other) while the other
    slots stayed empty. A new conversation now takes an empty slot; a continuation its own."""
    pool = _pool(None)
    template = [1, 2]
    a = template + list(range(10, 29))  # conversation A: 21 tokens
    pool.slots[0].cache = _filled(a)
    pool.slots[0].last_used = time.time()
    b = template + list(range(100, 119))
    assert pool.pick(b) == 1  # an empty slot, not A's
    assert pool.pick([*a, 7, 8, 9]) == 0  # A's continuation: its own slot
    # a long shared preamble (agents resend it every turn) is worth a slot's reuse
    long = list(range(200, 200 + 3 * REUSE_MIN_TOKENS))
    pool.slots[1].cache = _filled(long)
    pool.slots[1].last_used = time.time()
    other_turn = [*long[: REUSE_MIN_TOKENS + 5], 400, 401]
    assert pool.pick(other_turn) == 1


def test_a_restarted_pool_matches_and_shows_its_saved_slots_before_loading_them(
    tmp_path: Path,
) -> None:
    """After a restart the saved slots were unloaded: they matched nothing (a continuation
    prefilled from scratch), `coli ps` showed them empty, and as the least recently used they
    were the first a new conversation overwrote."""
    a = list(range(10, 40))
    b = list(range(50, 80))
    write_kv(slot_path(tmp_path, 0), _filled(a), VOCAB)
    write_kv(slot_path(tmp_path, 1), _filled(b), VOCAB)
    pool = _pool(tmp_path)

    async def main() -> None:
        await pool.check_files()

    anyio.run(main)
    try:
        assert pool.pick([*b, 5, 6]) == 1  # the saved conversation continues in its slot
        assert pool.pick([*a, 5]) == 0
        assert pool.pick(list(range(300, 330))) == 2  # a new one takes the empty slot
        described = pool.describe()
        assert [d["tokens"] for d in described] == [30, 30, 0]
        assert [d["persisted_tokens"] for d in described] == [30, 30, 0]
        assert not any(d["loaded"] for d in described)
    finally:
        pool.close()


def test_one_slot_directory_per_server(tmp_path: Path) -> None:
    """Two servers saving slots in one directory interleaved their records into files that
    loaded with rows of neither conversation: the second one now keeps its slots in memory,
    with a warning, and the directory is free again once the first one closes."""
    import structlog

    first, second = _pool(tmp_path), _pool(tmp_path)

    async def check(pool: SlotPool) -> None:
        await pool.check_files()

    anyio.run(check, first)
    assert first.directory == tmp_path
    with structlog.testing.capture_logs() as logs:
        anyio.run(check, second)
    assert second.directory is None and all(s.path is None for s in second.slots)
    assert any("another colibri server" in e["event"] for e in logs), logs
    first.close()
    third = _pool(tmp_path)
    anyio.run(check, third)
    assert third.directory == tmp_path and third.slots[0].path == slot_path(tmp_path, 0)
    third.close()


def test_each_slot_is_matched_by_its_own_threshold() -> None:
    """Only the slot with the most common tokens was checked: a slot meeting its own
    threshold was passed over for an empty one when a bigger slot shared more tokens but not
    enough of its own."""
    pool = _pool(None)
    prompt = list(range(1000, 1100))
    big = prompt[:60] + list(range(5000, 5140))  # 200 tokens, 60 common: needs 64
    small = prompt[:55] + list(range(6000, 6045))  # 100 tokens, 55 common: needs 50
    pool.slots[0].cache, pool.slots[1].cache = _filled(big), _filled(small)
    assert pool.pick(prompt) == 1


def test_closing_the_pool_closes_the_directory(tmp_path: Path) -> None:
    """close() only unlocked: the directory's descriptor stayed open until garbage collection."""
    import os

    def open_fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}  # fmt: skip

    pool = _pool(tmp_path)

    async def check() -> None:
        await pool.check_files()

    anyio.run(check)
    assert str(tmp_path) in open_fds()
    pool.close()
    assert str(tmp_path) not in open_fds()


def test_a_named_slot_is_never_lent_to_requests_naming_none(tmp_path: Path) -> None:
    """Requests without cache_slot took any free slot, a client's named one too: the client's
    next turn waited behind them (4.4 s in the audit, with compute places free) and their rows
    replaced its cache. A slot a request named is left alone now, and so are saved slots found
    at start-up when only named slots are saved."""
    pool = _pool(None, n=2)
    convo = list(range(10, 40))

    async def name_it() -> None:
        async with pool.use(0, named=True) as slot:
            assert slot.cache is not None
            pool.slots[0].cache = _filled(convo)

    anyio.run(name_it)
    assert pool.pick([*convo, 1, 2]) == 1  # not slot 0, even for its own prefix
    pool.slots[1].named = True
    assert pool.pick([*convo, 1, 2]) is None  # a fresh cache rather than a named slot
    write_kv(slot_path(tmp_path, 0), _filled(convo), VOCAB)
    restored = SlotPool(2, _cache, vocab=VOCAB, identity=0, directory=tmp_path, files_named=True)

    async def check() -> None:
        await restored.check_files()

    anyio.run(check)
    try:
        assert restored.pick([*convo, 1]) == 1
        assert restored.describe()[0]["named"] is True
    finally:
        restored.close()
