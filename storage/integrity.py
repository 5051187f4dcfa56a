"""``--verify-reads``: every expert read checked against the CRC-32 the converter recorded.

A flipped bit on an SSD then becomes an error naming the expert and the file, never a wrong
token; with several copies (``--mirror``) the damaged copy is demoted and the read is served
from another (:meth:`storage.multidisk.placement.Placement.read_many` takes the checks per request).

Shape legend: B bytes of one read.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from storage.errors import ConfigError, ReadError
from storage.manifest import MANIFEST_NAME, read_manifest

__all__ = [
    "Check",
    "ExpertChecksums",
    "crc32_of",
    "crc_check",
    "load_checksums",
    "verify_views",
]

U8Array = npt.NDArray[np.uint8]
# A check of one read's bytes [B]: None when they are right, else what is wrong.
Check = Callable[[U8Array], str | None]


@dataclass(frozen=True, slots=True)
class ExpertChecksums:
    """CRC-32 of each expert's blob and of its scales (None: float experts, no scales)."""

    by_key: Mapping[tuple[int, int], tuple[int, int | None]]

    def get(self, layer: int, expert: int) -> tuple[int, int | None] | None:
        return self.by_key.get((layer, expert))


def load_checksums(model_dir: str | Path) -> ExpertChecksums:
    """The per-expert checksums of a converted container; ConfigError when it has none."""
    m = read_manifest(model_dir)
    if m is None:
        raise ConfigError(
            f"{model_dir}: --verify-reads needs {MANIFEST_NAME} with per-expert checksums, and "
            "this container has no manifest (the public C-engine containers have none; convert "
            "with `coli convert` to get one)"
        )
    missing = [e for e in m.experts if e.crc32 is None]
    if missing:
        raise ConfigError(
            f"{model_dir}: {MANIFEST_NAME} records no per-expert checksums (converted before "
            "they existed); add them with `python -m storage.manifest add-checksums DIR`"
        )
    return ExpertChecksums({(e.layer, e.expert): (e.crc32 or 0, e.qs_crc32) for e in m.experts})


def crc32_of(parts: Iterable[npt.NDArray[Any]]) -> int:
    """zlib CRC-32 of the bytes of ``parts`` one after the other (any dtype, as stored)."""
    crc = 0
    for a in parts:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)
    return crc


def crc_check(want: int, what: str) -> Check:
    """A check that the bytes have CRC-32 ``want``; ``what`` names them in the message."""

    def check(data: U8Array) -> str | None:
        got = crc32_of([data])
        if got == want:
            return None
        return (
            f"{what}: checksum mismatch (CRC-32 {got:08x}, the manifest says {want:08x}): "
            "this copy on disk is damaged; run `coli doctor --verify` (a mirror's copy: "
            "`coli mirror verify`)"
        )

    return check


async def verify_views(views: Sequence[U8Array | None], checks: Sequence[Check | None]) -> None:
    """Run each read's check (off the event loop); the first failure raises ReadError.
    A None view or check is skipped."""
    for v, check in zip(views, checks, strict=True):
        if v is None or check is None:
            continue
        problem = await anyio.to_thread.run_sync(check, v)
        if problem is not None:
            raise ReadError(problem)
