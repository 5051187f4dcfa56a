"""The ``--draft`` option.

Shape legend: see ``runtime.speculative``; no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from storage.errors import ModelError

#: Drafts a round for ``mtp`` / ``lookup`` under seeded sampling (see DraftPolicy.for_sampling).
SEEDED_K = 2


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """The ``--draft`` option: ``auto`` (the cost model decides, up to ``k`` drafts), ``off``,
    ``N`` (always N drafts when a source has them), or a source pinned with ``mtp``/``lookup``
    (``mtp:3``, ``lookup``: that source only; with a number, fixed k)."""

    mode: Literal["auto", "off", "fixed"] = "auto"
    k: int = 4
    source: Literal["any", "mtp", "lookup"] = "any"

    def for_sampling(self, *, seeded: bool) -> DraftPolicy:
        """The policy a generation runs: a pinned source without a number (``mtp``,
        ``lookup``) under *seeded* sampling drafts :data:`SEEDED_K` tokens a round, fixed. Its
        own schedule follows timings, which a seed's output must not depend on: it drafted
        nothing at all there, as if ``off`` (``auto``, which picks no source, still does)."""
        if seeded and self.mode == "auto" and self.source != "any":
            return DraftPolicy("fixed", SEEDED_K, self.source)
        return self

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
