"""Crash-safe file replacement: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write_bytes",
    "fsync_dir",
    "remove_leftovers",
    "set_aside",
    "set_aside_and_warn",
    "temp_target",
]

# A temp file this old is no writer's: a live one touches its mtime with every write.
LEFTOVER_AGE_S = 300.0


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make renames inside ``directory`` durable (best effort where the OS refuses)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: a unique temp file in the same directory, fsync, rename,
    fsync the directory. The temp file is removed if anything fails. OSError propagates: the
    caller maps it to its own ColibriError. ``mode``: the file's permissions (a temp file is
    created 0600; model files are for everyone to read, private ones pass 0o600)."""
    dst = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(dst.parent)


def temp_target(name: str) -> str | None:
    """The file name an :func:`atomic_write_bytes` leftover (``.<name>.<random>.tmp``, left by a
    killed process) was meant to replace, or None for any other name."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    stem = name[1:-4]
    base, sep, _rand = stem.rpartition(".")
    return base if sep and base else None


def remove_leftovers(
    directory: str | os.PathLike[str], *, min_age_s: float = LEFTOVER_AGE_S
) -> list[Path]:
    """Delete the temp files that killed saves left in ``directory`` (``.<name>.<random>.tmp``,
    see :func:`temp_target`) once they are ``min_age_s`` old; returns what was removed. A
    missing or unreadable directory removes nothing; a file that cannot be removed stays."""
    d = Path(directory)
    try:
        names = os.listdir(d)
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in names:
        if temp_target(name) is None:
            continue
        p = d / name
        try:
            st = p.lstat()
            if now - st.st_mtime < min_age_s or not p.is_file():
                continue
            p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed


def set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Rename ``path`` to ``<name>.bad-<timestamp>`` (never overwriting); None if it failed.

    For a damaged state file (`.coli_usage`, `.coli_kv`, a chat session): it is kept for a
    look, and the next start begins afresh instead of failing."""
    p = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for k in range(1000):
        dest = p.with_name(f"{p.name}.bad-{stamp}" + (f"-{k}" if k else ""))
        if not dest.exists():
            try:
                os.replace(p, dest)
            except OSError:
                return None
            return dest
    return None


def set_aside_and_warn(log: Any, path: str | os.PathLike[str], message: str, problem: str) -> None:
    """:func:`set_aside` ``path`` and log one warning: ``message`` (what happens instead), the
    problem, and where the file went."""
    aside = set_aside(path)
    log.warning(
        message,
        path=str(path),
        problem=problem,
        moved_to=str(aside) if aside else "(could not rename it)",
    )
