"""The ``--draft`` option.

Shape legend: see ``runtime.speculative``; no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from storage.errors import ModelError


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """The ``--draft`` option: ``auto`` (the cost model decides, up to ``k`` drafts), ``off``,
    ``N`` (always N drafts when a source has them), or a source pinned with ``mtp``/``lookup``
    (``mtp:3``, ``lookup``: that source only; with a number, fixed k)."""

    mode: Literal["auto", "off", "fixed"] = "auto"
    k: int = 4
    source: Literal["any", "mtp", "lookup"] = "any"

    @classmethod
    def parse(cls, value: str | int | DraftPolicy | None) -> DraftPolicy:
        if value is None:
            return cls()
        if isinstance(value, DraftPolicy):
            return value
        if isinstance(value, bool):
            raise ModelError(f"draft: expected auto, off, N, mtp[:N] or lookup[:N], got {value}")
        text = str(value).strip().lower()
        if text in ("auto", ""):
            return cls()
        if text in ("off", "0", "none", "false"):
            return cls("off", 0)
        src: Literal["any", "mtp", "lookup"] = "any"
        num = text
        for name in ("mtp", "lookup"):
            if text == name:
                return cls("auto", 4, name)
            if text.startswith(name + ":"):
                src, num = name, text[len(name) + 1 :]
        try:
            k = int(num)
        except ValueError:
            raise ModelError(
                f"draft: expected auto, off, N, mtp[:N] or lookup[:N], got {value!r}"
            ) from None
        if not 0 <= k <= 16:
            raise ModelError(f"draft: N must be in 0..16, got {k}")
        return cls("off", 0) if k == 0 else cls("fixed", k, src)

    def __str__(self) -> str:
        if self.mode == "off":
            return "off"
        base = "auto" if self.mode == "auto" else str(self.k)
        if self.source == "any":
            return base
        return self.source if self.mode == "auto" else f"{self.source}:{self.k}"
