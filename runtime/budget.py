"""RAM budget accounting: how one ``--ram`` number splits into dense, KV and expert tiers.

The budget covers what the engine allocates for the model: resident dense weights (and arrays
derived from them), the KV cache reserve, and every expert slot (pinned, LRU, transient read
buffers). The Python interpreter and libraries (a fixed ~0.2-0.4 GB) are outside it.

Shape legend: no arrays (byte counts of objects and configs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

try:  # numpy >= 2
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy 1.26
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]

__all__ = ["kv_bytes_per_token", "mem_available", "resident_nbytes"]


def resident_nbytes(obj: Any) -> int:
    """Bytes of every numpy array reachable from ``obj`` (dataclasses, lists, dicts, objects
    with ``__dict__``/``__slots__``): the union of the memory ranges they span, so views of one
    array count once, and weights carved out of a shared mapping (``storage.aligned.HugeArena``)
    count their own bytes, not the mapping's."""
    spans: list[tuple[int, int]] = []
    stack = [obj]
    visited: set[int] = set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, np.ndarray):
            if o.size:
                lo, hi = _byte_bounds(o)
                spans.append((int(lo), int(hi)))
            continue
        if isinstance(o, (str, bytes, int, float, bool, type(None))):
            continue
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif dataclasses.is_dataclass(o):
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
        else:
            d = getattr(o, "__dict__", None)
            if d:
                stack.extend(d.values())
            for name in getattr(type(o), "__slots__", ()):
                if hasattr(o, name):
                    stack.append(getattr(o, name))
    total, end = 0, -1
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def kv_bytes_per_token(cfg: Any) -> int:
    """KV cache bytes per token (all layers incl. MTP; float32): the compressed MLA latent or
    the K and V heads of a grouped-query model (``ArchConfig.kv_floats_per_token``)."""
    return int(4 * cfg.kv_floats_per_token)


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
