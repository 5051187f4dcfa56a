"""KV slots: conversations whose KV cache the server keeps between requests (and restarts).

A request naming ``cache_slot`` i runs in slot i: the slot's cache keeps the previous turn's
tokens, the engine reuses its longest common token prefix with the new prompt and prefills only
the rest. One request at a time per slot (a lock). With a state directory, every finished turn
is written to ``<dir>/.coli_kv.<i>`` before the response ends (records appended, count last),
so a restarted server continues the conversation without prefilling it again, bit for bit as
if it had never stopped. Files are checked at start-up and loaded on first use; a damaged or
foreign file is reported, renamed aside and the slot starts empty.
"""

from __future__ import annotations

import fcntl
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from runtime.kv import KVCache
from storage.atomic import set_aside_and_warn
from storage.errors import KVFileError
from storage.kvfile import (
    async_sync_kv,
    header_for,
    load_kv,
    read_header,
    read_tokens,
    slot_path,
)

__all__ = ["REUSE_MIN_TOKENS", "Slot", "SlotPool"]

_log = structlog.get_logger(__name__)
# Automatic prefix matching takes a slot only for a prefix of at least this many tokens, or
# of half the slot's tokens when it holds fewer: the few tokens every chat template puts first
# are no reason to give a new conversation another one's slot.
REUSE_MIN_TOKENS = 64


@dataclass
class Slot:
    """One KV slot. ``persisted``: leading cache rows known to equal the file's records."""

    index: int
    path: Path | None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    cache: KVCache | None = None
    persisted: int = 0
    loaded: bool = False
    last_used: float = 0.0
    turns: int = 0
    tenant: str | None = None  # the API key of its last request (None: none, or from disk)
    # a request named it (cache_slot): a client's conversation, never lent to requests that
    # name no slot (they took it while the client's next turn waited behind them, and their
    # rows replaced its cache)
    named: bool = False
    # the token ids of its file, read at start-up, until the file is loaded on first use
    file_tokens: npt.NDArray[np.int32] | None = None

    def held(self) -> npt.NDArray[np.int32] | None:
        """The tokens the slot holds: its cache's, or (not loaded yet) its file's."""
        if self.cache is not None:
            return self.cache.tokens
        return self.file_tokens

    def describe(self) -> dict[str, Any]:
        held = self.held()
        return {
            "slot": self.index,
            "tokens": 0 if held is None else int(held.size),
            "persisted_tokens": (
                self.persisted
                if self.loaded or self.file_tokens is None
                else int(self.file_tokens.size)
            ),
            "busy": self.lock.locked(),
            "loaded": self.loaded,
            "named": self.named,
            "turns": self.turns,
            "last_used": self.last_used or None,
            "file": None if self.path is None else str(self.path),
        }


class SlotPool:
    """``n`` slots over one engine; ``directory`` None keeps them in memory only."""

    def __init__(
        self,
        n: int,
        new_cache: Callable[[], KVCache],
        *,
        vocab: int,
        identity: int,
        directory: Path | None,
        files_named: bool = False,
    ) -> None:
        """``files_named``: a slot file found at start-up holds a conversation a request
        named (only those are saved: no ``--kv-persist-auto``)."""
        self._new_cache = new_cache
        self._files_named = files_named
        self.vocab = vocab
        self.identity = identity
        self.directory = directory
        self.slots = [
            Slot(i, None if directory is None else slot_path(directory, i)) for i in range(n)
        ]
        self._unlock: weakref.finalize[[int], SlotPool] | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def _lock_directory(self) -> str | None:
        """Hold an exclusive ``flock`` on the slot directory while this pool lives: two
        servers writing the same slot files interleaved each other's records into files that
        loaded silently with rows of neither conversation. Returns why it could not (None:
        locked)."""
        assert self.directory is not None
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError as exc:
            return f"cannot open the directory to lock it: {exc.strerror or exc}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                return (
                    "another colibri server saves its slots in this directory (give this one "
                    "its own with --kv-dir DIR)"
                )
            return f"cannot lock the directory: {exc.strerror or exc}"  # ENOLCK (NFS), ...
        self._unlock = weakref.finalize(self, os.close, fd)
        return None

    def close(self) -> None:
        """Release the slot directory and its file descriptor (also done when the pool is
        garbage-collected)."""
        if self._unlock is not None:
            self._unlock()  # closing the descriptor drops the lock

    async def check_files(self) -> None:
        """Take the slot directory, then validate each slot file's header now (cheap) and read
        its token ids (what automatic prefix matching compares before the file is loaded); a
        bad file is reported and set aside."""
        if self.directory is None:
            return
        why = await anyio.to_thread.run_sync(self._lock_directory)
        if why is not None:
            _log.warning(f"KV slots kept in memory only: {why}", directory=str(self.directory))
            self.directory = None
            for s in self.slots:
                s.path = None
            return
        expect = self._new_cache()

        def check(slot: Slot, path: Path) -> None:
            if not path.exists():
                return
            want = header_for(expect, self.vocab, self.identity)
            try:
                h = read_header(path)
                if h.dims() != want.dims() or (
                    h.identity and self.identity and h.identity != self.identity
                ):
                    raise KVFileError(f"written for another model (header {h}, expected {want})")
                slot.file_tokens = read_tokens(path, h)
                slot.last_used = path.stat().st_mtime
                slot.named = self._files_named
            except (KVFileError, OSError) as exc:
                slot.file_tokens = None
                set_aside_and_warn(
                    _log, path, "KV slot file ignored; the slot starts empty", str(exc)
                )

        for s in self.slots:
            if s.path is not None:
                await anyio.to_thread.run_sync(check, s, s.path)

    async def _load(self, slot: Slot) -> None:
        if slot.loaded:
            return
        cache: KVCache | None = None
        if slot.path is not None:
            path = slot.path
            cache = await anyio.to_thread.run_sync(
                lambda: load_kv(path, self._new_cache, self.vocab, self.identity)
            )
        if cache is not None:
            slot.persisted = cache.length
            _log.info("KV slot restored", slot=slot.index, tokens=cache.length)
        slot.cache = cache if cache is not None else self._new_cache()
        slot.file_tokens = None
        slot.loaded = True

    @asynccontextmanager
    async def use(self, index: int, *, named: bool = False) -> AsyncIterator[Slot]:
        """Hold slot ``index`` (waits for the request using it), loaded and ready; ``named``:
        the request named it (from then on automatic matching leaves it alone)."""
        slot = self.slots[index]
        if named:
            slot.named = True
        async with slot.lock:
            await self._load(slot)
            slot.last_used = time.time()
            yield slot

    async def persist(self, slot: Slot) -> None:
        """Write the slot's new rows to its file (off the loop); errors are logged, not raised:
        the conversation goes on in memory."""
        if slot.path is None or slot.cache is None:
            return
        if slot.persisted == slot.cache.length and slot.path.exists():
            return
        try:
            slot.persisted = await async_sync_kv(
                slot.path,
                slot.cache,
                valid=slot.persisted,
                vocab=self.vocab,
                identity=self.identity,
            )
        except KVFileError as exc:
            slot.persisted = 0
            _log.warning("KV slot not saved", slot=slot.index, error=str(exc))

    def pick(
        self, prompt_ids: Sequence[int], *, tenant: str | None = None, scoped: bool = False
    ) -> int | None:
        """Automatic prefix matching for a request that names no ``cache_slot``: the free slot
        whose tokens share the longest prefix with the prompt (agents resend the same long
        preamble every turn), else the least recently used free slot; None when every slot is
        busy (the request then runs on a fresh cache). Reuse never changes output.

        ``scoped``: only slots whose last request came with ``tenant``'s API key count as a
        match (another key's slot may still be taken over, emptied first: see generation).
        Slots a request named (``cache_slot``), and saved ones restored when only named slots
        are saved (``files_named``), are never taken.

        A match needs :data:`REUSE_MIN_TOKENS` common tokens, or half the slot's tokens when
        it holds fewer (the tokens a chat template always puts first matched every slot, and
        unrelated conversations took turns in one). A slot not loaded yet matches on its
        file's tokens; without a match an empty slot goes first, then the least recently used
        (a file's age counts as its use)."""
        free = [s for s in self.slots if not s.lock.locked() and not s.named]
        if not free:
            return None
        ids = np.asarray(prompt_ids, dtype=np.int64)

        def size(s: Slot) -> int:
            held = s.held()
            return 0 if held is None else int(held.size)

        def common(s: Slot) -> int:
            held = s.held()
            if held is None or (scoped and s.tenant != tenant):
                return 0
            n = min(held.size, ids.size)
            diff = np.flatnonzero(held[:n] != ids[:n])
            return int(diff[0]) if diff.size else int(n)

        def enough(s: Slot) -> bool:  # each slot by its own threshold
            return common(s) >= min(REUSE_MIN_TOKENS, max(1, (size(s) + 1) // 2))

        matches = [s for s in free if enough(s)]
        if matches:
            return max(matches, key=lambda s: (common(s), -s.last_used)).index
        return min(free, key=lambda s: (size(s) > 0, s.last_used)).index

    def describe(self) -> list[dict[str, Any]]:
        return [s.describe() for s in self.slots]
