"""``.coli_usage``: cumulative routing counts per (layer, expert), kept beside the model.

Text layout (the C engine's, so files move between the two)::

    -1 <n_layers> <n_experts>
    -2 <version=1> <engine id>
    <layer> <expert> <count>        # one line per expert with a non-zero count

Saves are atomic (temporary file in the same directory, fsync, rename, fsync of the directory),
so a crash leaves the old file or the new one, never a mix. A file that does not parse, has other
dimensions, another version or another engine id is never trusted: it is renamed aside to
``<name>.bad-<timestamp>`` with a warning, and counting starts afresh.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np
import numpy.typing as npt
import structlog

from storage.atomic import atomic_write_bytes, set_aside_and_warn
from storage.errors import UsageFileError

__all__ = [
    "USAGE_FILE",
    "USAGE_VERSION",
    "UsageCounts",
    "asave_usage",
    "format_usage",
    "load_usage",
    "merge_save_usage",
    "parse_usage",
    "save_usage",
]

USAGE_FILE = ".coli_usage"
USAGE_VERSION = 1

_log = structlog.get_logger(__name__)
_MAX_COUNT = int(np.iinfo(np.int64).max)  # the counts are int64


class UsageCounts:
    """Selection counts ``counts[layer, expert]`` (int64), cumulative across sessions."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        if n_layers <= 0 or n_experts <= 0:
            raise ValueError(f"need n_layers > 0 and n_experts > 0, got {n_layers}, {n_experts}")
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.counts: npt.NDArray[np.int64] = np.zeros((n_layers, n_experts), dtype=np.int64)
        # the compute thread counts (add) while the event loop merges a save back (shift):
        # both read-modify-write the array, which numpy does without the GIL
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"UsageCounts({self.n_layers}x{self.n_experts}, total={self.total})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UsageCounts):
            return NotImplemented
        return self.counts.shape == other.counts.shape and bool(
            np.array_equal(self.counts, other.counts)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __getstate__(self) -> dict[str, Any]:  # (a lock does not pickle: a new one)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, layer: int, expert_ids: npt.ArrayLike) -> None:
        """Count one selection per id (repeats count repeatedly: one per routed token)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} outside [0, {self.n_layers})")
        ids = np.asarray(expert_ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_experts):
            raise ValueError(f"expert ids outside [0, {self.n_experts}) for layer {layer}")
        add = np.bincount(ids, minlength=self.n_experts)
        with self._lock:
            self.counts[layer] += add

    def shift(self, delta: npt.NDArray[np.int64]) -> None:
        """Add ``delta`` [layers, experts] (what a merged save brought from the file)."""
        if delta.any():
            with self._lock:
                self.counts += delta

    @property
    def total(self) -> int:
        """All selections counted."""
        return int(self.counts.sum())

    def top(self, n: int) -> list[tuple[int, int, int]]:
        """The ``n`` most selected ``(layer, expert, count)``; ties by (layer, expert)."""
        flat = self.counts.ravel()
        n = max(0, min(n, flat.size))
        # lexsort's last key is primary: count descending, then flat index ascending
        order = np.lexsort((np.arange(flat.size), -flat))[:n]
        return [(int(i // self.n_experts), int(i % self.n_experts), int(flat[i])) for i in order]

    def decay(self, factor: float) -> None:
        """Multiply every count by ``factor`` in [0, 1] (rounding down) so old habits fade."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"decay factor must be in [0, 1], got {factor}")
        with self._lock:
            self.counts = np.floor(self.counts * factor).astype(np.int64)

    def copy(self) -> UsageCounts:
        """An independent copy (e.g. a snapshot to save while counting goes on)."""
        c = UsageCounts(self.n_layers, self.n_experts)
        with self._lock:
            c.counts = self.counts.copy()
        return c


def _check_engine_id(engine_id: str) -> None:
    if not engine_id or any(ch.isspace() for ch in engine_id):
        raise ValueError(f"engine id must be non-empty without whitespace, got {engine_id!r}")


def format_usage(counts: UsageCounts, engine_id: str) -> str:
    """The file text for ``counts`` (non-zero entries only, in (layer, expert) order)."""
    _check_engine_id(engine_id)
    head = f"-1 {counts.n_layers} {counts.n_experts}\n-2 {USAGE_VERSION} {engine_id}\n"
    layers, experts = np.nonzero(counts.counts)
    vals = counts.counts[layers, experts]
    # every line by one C-level format of all the numbers: an f-string per line took 14 ms
    # for GLM-5's 78 x 256 experts, with the GIL held, at every turn's end
    numbers = np.stack([layers, experts, vals], axis=1).ravel().tolist()
    return head + ("%d %d %d\n" * int(layers.size)) % tuple(numbers)


#: The most digits a count may have for :func:`_fast_body` (any 18-digit number fits int64).
_FAST_DIGITS = 18


def _fast_body(body: str, n_layers: int, n_experts: int) -> npt.NDArray[np.int64] | None:
    """The ``(layer, expert, count)`` rows [N, 3] of a file body (the lines after the two
    header lines) when every line is exactly ``<digits> <digits> <digits>`` with single spaces
    (what :func:`format_usage` and the C engine write), in range and without a repeat; None
    for anything else, which the line-by-line parser then judges (and says what is wrong).
    The same counts as that parser, by numpy instead of a Python loop over the lines (22 ms
    for GLM-5's 78 x 256 experts, at every save, which merges the file's counts)."""
    if not body:
        return np.zeros((0, 3), np.int64)
    try:
        b = np.frombuffer(body.encode("ascii"), np.uint8)
    except UnicodeEncodeError:
        return None
    seps = np.flatnonzero((b < 48) | (b > 57))  # everything but the digits
    n = seps.size // 3
    if n == 0 or seps.size != 3 * n or seps[-1] != b.size - 1:
        return None
    kinds = b[seps].reshape(n, 3)
    if not ((kinds[:, :2] == 32).all() and (kinds[:, 2] == 10).all()):
        return None
    widths = np.diff(seps, prepend=-1) - 1  # digits before each separator
    if widths.min() < 1 or widths.max() > _FAST_DIGITS:
        return None
    try:
        vals = np.fromstring(body, dtype=np.int64, sep=" ")
    except ValueError:
        return None
    if vals.size != 3 * n:
        return None
    rows = vals.reshape(n, 3)
    if (rows[:, 0] >= n_layers).any() or (rows[:, 1] >= n_experts).any():
        return None
    if np.bincount(rows[:, 0] * n_experts + rows[:, 1]).max() > 1:  # a repeated pair
        return None
    return rows


def parse_usage(text: str, n_layers: int, n_experts: int, engine_id: str) -> UsageCounts:
    """Parse and validate file text; raises :class:`UsageFileError` saying what is wrong."""
    if not text.endswith("\n"):
        raise UsageFileError("the last line is incomplete (file truncated)")
    lines = text.split("\n", 2)  # the two header lines, then the body (split only if needed)
    if len(lines) < 3:
        raise UsageFileError("missing header lines")
    head = lines[0].split()
    if len(head) != 3 or head[0] != "-1":
        raise UsageFileError(f"line 1 should be '-1 <n_layers> <n_experts>', got {lines[0]!r}")
    try:
        dims = (int(head[1]), int(head[2]))
    except ValueError:
        raise UsageFileError(f"line 1 has non-integer dimensions: {lines[0]!r}") from None
    if dims != (n_layers, n_experts):
        raise UsageFileError(
            f"dimensions {dims[0]}x{dims[1]} do not match this model's {n_layers}x{n_experts}"
        )
    ver = lines[1].split()
    if len(ver) != 3 or ver[0] != "-2":
        raise UsageFileError(f"line 2 should be '-2 <version> <engine id>', got {lines[1]!r}")
    if ver[1] != str(USAGE_VERSION):
        raise UsageFileError(f"version {ver[1]!r} is not {USAGE_VERSION}")
    if ver[2] != engine_id:
        raise UsageFileError(f"engine id {ver[2]!r} is not this model's {engine_id!r}")
    rows = _fast_body(lines[2], n_layers, n_experts)
    if rows is None:
        return _parse_lines(lines[2].split("\n")[:-1], n_layers, n_experts)
    counts = UsageCounts(n_layers, n_experts)
    counts.counts[rows[:, 0], rows[:, 1]] = rows[:, 2]
    return counts


def _parse_lines(lines: list[str], n_layers: int, n_experts: int) -> UsageCounts:
    """The body's lines (the file's third line on) one by one: any whitespace between the
    fields; raises :class:`UsageFileError` at the first line that is wrong, saying why."""
    counts = UsageCounts(n_layers, n_experts)
    seen = np.zeros((n_layers, n_experts), dtype=bool)
    for no, line in enumerate(lines, start=3):
        parts = line.split()
        try:
            if len(parts) != 3:
                raise ValueError
            layer, expert, count = (int(x) for x in parts)
        except ValueError:
            raise UsageFileError(f"line {no} is not '<layer> <expert> <count>': {line!r}") from None
        if not (0 <= layer < n_layers and 0 <= expert < n_experts and 0 <= count <= _MAX_COUNT):
            raise UsageFileError(f"line {no} is out of range: {line!r}")
        if seen[layer, expert]:
            raise UsageFileError(f"line {no} repeats layer {layer} expert {expert}")
        seen[layer, expert] = True
        counts.counts[layer, expert] = count
    return counts


def load_usage(
    path: str | os.PathLike[str], n_layers: int, n_experts: int, engine_id: str
) -> UsageCounts | None:
    """Counts from ``path``, or None (with a warning) when missing, unreadable or damaged.

    A damaged or mismatched file is renamed aside to ``<name>.bad-<timestamp>`` so it is never
    trusted and never silently overwritten.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii")
    except FileNotFoundError:
        _log.info("no usage history yet; counting starts now", path=str(p))
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"unreadable: {exc}"
    else:
        try:
            return parse_usage(text, n_layers, n_experts, engine_id)
        except UsageFileError as exc:
            problem = str(exc)
    set_aside_and_warn(_log, p, "usage file ignored; counting starts afresh", problem)
    return None


def save_usage(path: str | os.PathLike[str], counts: UsageCounts, engine_id: str) -> None:
    """Write atomically: temp file in the same directory, fsync, rename, fsync the directory.

    Raises :class:`UsageFileError` when the disk refuses (full, read-only, permissions).
    """
    p = Path(path)
    try:
        atomic_write_bytes(p, format_usage(counts, engine_id).encode("ascii"))
    except OSError as exc:
        raise UsageFileError(f"cannot save usage counts to {p}: {exc}") from exc


def merge_save_usage(
    path: str | os.PathLike[str], counts: UsageCounts, since: UsageCounts, engine_id: str
) -> UsageCounts:
    """Save what ``counts`` gained over ``since`` (this process's counts when it last loaded
    or saved) added to the file's counts now, and return that sum: another process on the
    same state directory may have saved its own meanwhile (a chat and a server, two chats),
    and writing ``counts`` alone lost them (last writer won). The read and the write hold an
    exclusive ``flock`` on ``<path>.lock``. A file that is missing, or damaged since it was
    loaded, is replaced by ``counts``. Raises :class:`UsageFileError` as :func:`save_usage`."""
    p = Path(path)
    try:
        fd = os.open(p.with_name(p.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UsageFileError(f"cannot save usage counts to {p}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        disk: UsageCounts | None = None
        try:
            disk = parse_usage(
                p.read_text(encoding="ascii"), counts.n_layers, counts.n_experts, engine_id
            )
        except (OSError, UnicodeDecodeError, UsageFileError):
            disk = None
        total = counts.copy()
        if disk is not None:
            total.counts = disk.counts + np.maximum(counts.counts - since.counts, 0)
        save_usage(p, total, engine_id)
        return total
    finally:
        os.close(fd)


async def asave_usage(path: str | os.PathLike[str], counts: UsageCounts, engine_id: str) -> None:
    """:func:`save_usage` in a worker thread so the event loop never waits on fsync.

    The counts are snapshotted first, so counting may continue while the save runs. (anyio's
    threads rather than aiofiles: aiofiles runs on asyncio only, the engine also runs on trio.)
    """
    snap = counts.copy()
    await anyio.to_thread.run_sync(save_usage, path, snap, engine_id)
