"""Types and constants shared by the speculative-decoding modules.

Shape legend: see ``runtime.speculative``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]
Source = Literal["grammar", "mtp", "lookup"]
SOURCES: tuple[Source, ...] = ("grammar", "mtp", "lookup")
Emitted = tuple[int, F32Array]  # (token id, the raw target logits [V] it was chosen from)


class TokenConstraint(Protocol):
    """What the decoder needs from a grammar (see ``runtime.grammar.GrammarMatcher``)."""

    def mask(self, logits: F32Array) -> F32Array: ...
    def consume(self, token: int) -> None: ...
    def push(self, tokens: Sequence[int]) -> None: ...
    def rollback(self, n: int) -> None: ...
    def forced(self) -> list[int]: ...
    def validate(self, tokens: Sequence[int]) -> int: ...
