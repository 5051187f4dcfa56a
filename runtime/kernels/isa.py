"""What the CPU offers and which kernel variant runs: reported by ``coli info`` and ``stats()``.

The exact kernels come in two widths (``runtime.kernels._simd``): 8 float32 lanes (one AVX2
register) for every format, and 16 lanes (one AVX-512 register) for int4 weights whose groups are
whole 64-column chunks (int4-g64, g128, ... and per-row int4: every container colibri writes by
default). The width is chosen once per process from the CPU: 16 where ``avx512f`` is present,
else 8. Each width has its own fixed lane order, so a row's result is deterministic and
batch-invariant on every machine, and identical on every machine that runs the same width (the
16-lane kernel gives the same bits on an AVX2 CPU, only slower). Two machines with different
widths agree to float rounding, not bit for bit: :class:`runtime.linear.Linear` takes ``lanes=``
to pin one.

The opt-in lossy mode ``fast-int8`` (``--kernels fast-int8``, :mod:`._q8`) rounds activations to
int8 for int4 weights and does the products in integers: ``vpdpbusd`` where the CPU has
AVX-512 VNNI, ``vpmaddwd`` on 16-bit activation words on AVX2, plain vector integer ops
elsewhere (the same integers either way, so the same bits on every x86-64 CPU).

Shape legend: L lanes of float32 per kernel vector (8 or 16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KernelInfo", "cpu_flags", "exact_lanes", "kernel_info"]

_WATCHED = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "amx_int8",
)


@dataclass(frozen=True, slots=True)
class KernelInfo:
    variant: str  # the exact int4 kernels' shape, "f32x16" or "f32x8"
    lanes: int
    isa: str  # the widest vector ISA the CPU reports: avx512f, avx2, ... or "unknown"
    cpu_flags: tuple[str, ...]  # the watched flags the CPU has
    mode: str = "exact"  # "exact" or the opt-in lossy "fast-int8"
    #: fast-int8's integer dot: "vnni", "avx2" or "portable", what numba's code may use here
    int8_kind: str = "portable"

    @property
    def lossy(self) -> bool:
        return self.mode != "exact"

    @property
    def int8_dot(self) -> str:
        """How fast-int8 multiplies int4 weights by int8 activations in this process."""
        return _INT8_DOT[self.int8_kind]

    def as_dict(self) -> dict[str, object]:
        return {
            "variant": self.variant,
            "lanes": self.lanes,
            "isa": self.isa,
            "cpu_flags": list(self.cpu_flags),
            "mode": self.mode,
            "lossy": self.lossy,
            "int8_dot": self.int8_dot,
        }

    def describe(self) -> str:
        exact = f"{self.variant} ({self.lanes} float32 lanes, fixed order) on {self.isa}"
        if not self.lossy:
            return exact
        return (
            f"fast-int8 (LOSSY: activations rounded to int8, {self.int8_dot}) for int4 "
            f"weights; {exact} for the rest"
        )


_INT8_DOT = {
    "vnni": "vpdpbusd (avx512_vnni)",
    "avx2": "vpmaddwd on 16-bit activation words (avx2)",
    "portable": "portable vector integer ops (no avx2 in numba's target)",
}


def _int8_kind_of(flags: frozenset[str]) -> str:
    """The integer dot a CPU with ``/proc/cpuinfo`` flags ``flags`` would run."""
    if {"avx512_vnni", "avx512bw"} <= flags:
        return "vnni"
    return "avx2" if "avx2" in flags else "portable"


def _int8_kind_here() -> str:
    """The integer dot this process's kernels use: numba's code-generation target decides, not
    the CPU alone (``NUMBA_CPU_NAME=generic`` on a VNNI machine runs the portable form)."""
    from runtime.kernels._q8 import q8dot_kind  # numba and llvmlite: only here

    return q8dot_kind()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU flags of the first processor in ``cpuinfo`` (empty when unreadable)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _lanes_for(flags: frozenset[str]) -> int:
    return 16 if "avx512f" in flags else 8


@functools.cache
def exact_lanes() -> int:
    """The int4 kernel width this process uses by default: 16 with AVX-512F, else 8 (the CPU
    does not change while a process runs, so this is read once)."""
    return _lanes_for(cpu_flags())


_CPUINFO = Path("/proc/cpuinfo")


def kernel_info(cpuinfo: Path = _CPUINFO, *, mode: str = "exact") -> KernelInfo:
    """What runs here; ``mode`` is the engine's ``kernels`` option ("exact" or "fast-int8").
    ``int8_kind`` follows numba's target in this process; for another ``cpuinfo`` file, what
    that CPU's flags would give."""
    flags = cpu_flags(cpuinfo)
    have = tuple(f for f in _WATCHED if f in flags)
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), "unknown")
    lanes = _lanes_for(flags)
    kind = _int8_kind_here() if cpuinfo == _CPUINFO else _int8_kind_of(flags)
    return KernelInfo(f"f32x{lanes}", lanes, isa, have, mode, kind)
