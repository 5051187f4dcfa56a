"""Sizes for people: one way to write a byte count everywhere (CLI, doctor, plan, logs).

Binary units with one decimal (``812 B``, ``36.0 KiB``, ``18.0 MiB``, ``9.9 GiB``, ``1.5 TiB``);
the dashboard (``colibri/web/app.js``, ``fmtBytes``) writes them the same way. Machine-readable
output (``--json``) keeps plain byte counts.
"""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, one decimal (whole bytes below 1 KiB)."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
