"""What the CPU offers and which kernel variant runs: reported by ``coli info`` and ``stats()``.

The exact kernels use one variant on every machine today: 8-lane float32 vectors with a fixed
lane order (``runtime.kernels._simd``), one AVX2 register wide. That fixed order is what makes a
row's result the same on any x86-64 CPU. On an AVX-512 machine the same kernels run (LLVM may
use the wider registers for the loads, not for the summation order). This module reads the
CPU's flags so the report says which instruction sets are there and which one the kernels are
shaped for.

Shape legend: L lanes of float32 per kernel vector (8).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.kernels._simd import LANES

__all__ = ["KernelInfo", "kernel_info"]

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
    variant: str  # the exact kernels' shape, e.g. "f32x8"
    lanes: int
    isa: str  # the widest vector ISA the CPU reports: avx512f, avx2, ... or "unknown"
    cpu_flags: tuple[str, ...]  # the watched flags the CPU has

    def as_dict(self) -> dict[str, object]:
        return {
            "variant": self.variant,
            "lanes": self.lanes,
            "isa": self.isa,
            "cpu_flags": list(self.cpu_flags),
        }

    def describe(self) -> str:
        return f"{self.variant} ({self.lanes} float32 lanes, fixed order) on {self.isa}"


def kernel_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> KernelInfo:
    flags: set[str] = set()
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    have = tuple(f for f in _WATCHED if f in flags)
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), "unknown")
    return KernelInfo(f"f32x{LANES}", LANES, isa, have)
