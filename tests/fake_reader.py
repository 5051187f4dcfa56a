"""A Reader for store tests: real bytes from the files, with scripted delays, errors and stalls.

``FakeReader`` implements :class:`storage.reader.Reader`. Each ``read_many`` (one expert: blob
plus scales) looks up the first scripted rule matching its blob's (path, offset) and:
  * advances the shared :class:`FakeClock` by its delay (one loop turn, no real sleep), so time
    accounting can be checked exactly;
  * raises :class:`ReadError` (a damaged sector), or
  * blocks until its ``release`` event is set (a slow device, for cancellation tests).
It records how many reads (and bytes) were in flight at once and every extent it read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np
import numpy.typing as npt

from storage.errors import ReadError
from storage.reader import ReaderStats, ReadRequest

U8Array = npt.NDArray[np.uint8]


@dataclass
class FakeClock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Rule:
    offset: int | None = None  # the blob offset it applies to (None: every read)
    delay: float = 0.0
    error: bool = False
    release: anyio.Event | None = None
    times: int | None = None  # applies this many times, then retires (None: always)


@dataclass
class FakeReader:
    clock: FakeClock = field(default_factory=FakeClock)
    rules: list[Rule] = field(default_factory=list)
    name: str = "fake"
    reason: str = "test double"
    direct: bool = False
    stats: ReaderStats = field(default_factory=ReaderStats)
    in_flight: int = 0
    peak: int = 0
    bytes_in_flight: int = 0
    peak_bytes: int = 0
    extents: list[tuple[Path, int]] = field(default_factory=list)
    closed: bool = False

    def _rule(self, req: ReadRequest) -> Rule | None:
        for r in self.rules:
            if r.offset is None or r.offset == req.offset:
                if r.times is not None:
                    r.times -= 1
                    if r.times == 0:
                        self.rules.remove(r)
                return r
        return None

    async def read_into(self, req: ReadRequest, buf: U8Array) -> U8Array:
        return (await self.read_many([req], [buf]))[0]

    async def read_many(
        self, reqs: Sequence[ReadRequest], bufs: Sequence[U8Array]
    ) -> list[U8Array]:
        if self.closed:
            raise ReadError("fake reader is closed")
        rule = self._rule(reqs[0])
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        nbytes = sum(r.length for r in reqs)
        self.bytes_in_flight += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)
        try:
            if rule is not None and rule.release is not None:
                await rule.release.wait()
            await anyio.sleep(0)
            if rule is not None:
                self.clock.t += rule.delay
                if rule.error:
                    self.stats.errors += 1
                    raise ReadError(f"{reqs[0].path.name} @ {reqs[0].offset}: injected error")
            out = []
            for req, buf in zip(reqs, bufs, strict=True):
                fd = os.open(req.path, os.O_RDONLY)
                try:
                    data = os.pread(fd, req.length, req.offset)
                finally:
                    os.close(fd)
                view = buf[: req.length]
                view[:] = np.frombuffer(data, dtype=np.uint8)
                out.append(view)
                self.stats.reads += 1
                self.stats.bytes += req.length
            self.extents.append((reqs[0].path, reqs[0].offset))
            return out
        finally:
            self.in_flight -= 1
            self.bytes_in_flight -= nbytes

    def register_buffers(self, bufs: Sequence[U8Array]) -> bool:
        return False

    def reopen(self, paths: object) -> None:  # (it opens every file per read)
        pass

    async def aclose(self) -> None:
        self.closed = True
