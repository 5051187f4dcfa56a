"""Draft sources: prompt lookup (no model) and the model's MTP head.

Shape legend: see ``runtime.speculative``.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from numba import njit

from runtime.context import StepContext
from runtime.kv import KVCache
from runtime.speculative._common import F32Array

R = TypeVar("R")
MAX_PENDING = 128  # MTP rows kept while the head is off (older history is dropped)


def lookup_match(
    history: Sequence[int] | npt.NDArray[np.integer], k: int, *, max_ngram: int = 3
) -> tuple[list[int], int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix n-gram (n = ``max_ngram`` .. 1) of ``history``, and that n; ([], 0) when
    none matches. (The cost model keeps acceptance per n: a 3-gram match is far more often
    right than a 1-gram one.)"""
    t = np.ascontiguousarray(history, dtype=np.int64).reshape(-1)  # [N]
    if k <= 0 or t.size < 2:
        return [], 0
    start, n = _latest_match(t, max_ngram)
    if n == 0:
        return [], 0
    return [int(x) for x in t[start : start + k]], n


@njit(nogil=True, cache=True)
def _latest_match(t, max_ngram):  # type: ignore[no-untyped-def]
    """(where the continuation starts, n) of the latest occurrence of ``t``'s longest suffix
    n-gram that starts strictly before the suffix itself; (-1, 0) for none. A scan from the
    end: it runs once per speculative round of every generation, where numpy's window views
    cost more than the search."""
    n_tok = t.size
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        s = n_tok - n
        for i in range(s - 1, -1, -1):
            same = True
            for j in range(n):
                if t[i + j] != t[s + j]:
                    same = False
                    break
            if same:
                return i + n, n
    return -1, 0


def lookup_draft(
    history: Sequence[int] | npt.NDArray[np.integer], k: int, *, max_ngram: int = 3
) -> list[int]:
    """Prompt-lookup draft: the tokens of :func:`lookup_match`; [] when none matches."""
    return lookup_match(history, k, max_ngram=max_ngram)[0]


@dataclass(eq=False)
class HeadRows:
    """Rows one draft needs from the MTP head: ``h`` [T, D] main (or head) hidden states and
    ``t`` [T] their next tokens, after the rows already in ``head.cache``. ``planned``: the
    verify rows the draft expects to give (the scheduler counts them for the other rounds of
    its step)."""

    head: MtpDrafter
    h: F32Array
    t: npt.NDArray[np.int64]
    planned: int = 1


# What the head gives back for a HeadRows: the last row's logits [V] and normed output [D],
# and the seconds of the call charged to this draft (its share of a batched call).
HeadOut = tuple[F32Array, F32Array, float]
# A draft that runs the head: yields HeadRows, is sent HeadOut, returns its result.
HeadGen = Generator[HeadRows, HeadOut, R]


def run_heads(model: Any, ctx: StepContext | None, asks: Sequence[HeadRows]) -> list[HeadOut]:
    """One head call for the rows of every draft in ``asks`` (each over its own cache): one
    ``mtp_step_batch`` (rows of several drafts share the head's weights and experts; each
    draft's result is the bits of its call alone). The call's seconds are shared by rows."""
    t0 = time.perf_counter()
    outs = model.mtp_step_batch(
        [a.h for a in asks], [a.t for a in asks], [a.head.cache for a in asks], ctx=ctx
    )
    dt = time.perf_counter() - t0
    rows = sum(int(a.t.size) for a in asks)
    return [
        (logits[-1], normed[-1], dt * int(a.t.size) / rows)
        for a, (logits, normed) in zip(asks, outs, strict=True)
    ]


def run_alone(model: Any, ctx: StepContext | None, gen: HeadGen[R]) -> R:
    """Drive one draft generator to its result, each head call on its own."""
    try:
        ask = next(gen)
        while True:
            ask = gen.send(run_heads(model, ctx, [ask])[0])
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


class MtpDrafter:
    """The MTP head's cache and the main hidden states it has not seen yet.

    Invariant: ``cache`` holds rows (h_j, token j+1) for real main positions only, in order; the
    pending rows continue them; ``wait`` is the main hidden of the last fed position, whose next
    token is not known yet."""

    def __init__(self, model: Any) -> None:
        self.cache: KVCache = model.new_mtp_cache()
        self.pend_h: list[F32Array] = []  # P rows of [D]
        self.pend_t: list[int] = []  # P next tokens
        self.wait: F32Array | None = None  # [D]

    def observe(self, ids: npt.NDArray[np.integer], hidden: F32Array) -> None:
        """Main rows ``ids`` [T] were run, giving ``hidden`` [T, D]: queue their pairs."""
        toks = [int(x) for x in np.asarray(ids).reshape(-1)]
        if self.wait is not None:
            self.pend_h.append(self.wait)
            self.pend_t.append(toks[0])
        for j in range(len(toks) - 1):
            self.pend_h.append(hidden[j])
            self.pend_t.append(toks[j + 1])
        self.wait = np.array(hidden[len(toks) - 1], dtype=np.float32)  # [D]
        if len(self.pend_t) > MAX_PENDING:  # the head is off: keep recent history only
            del self.pend_h[:-MAX_PENDING]
            del self.pend_t[:-MAX_PENDING]

    def flush_rows(self, last: int | None, planned: int = 1) -> HeadRows | None:
        """The head call that catches it up: the pending rows (plus (wait, ``last``) when
        given); None when nothing is pending. :meth:`flushed` marks them run."""
        h, t = list(self.pend_h), list(self.pend_t)
        if last is not None and self.wait is not None:
            h.append(self.wait)
            t.append(int(last))
        if not t:
            return None
        return HeadRows(self, np.stack(h), np.array(t, np.int64), planned)

    def flushed(self, last: int | None) -> None:
        """The rows of :meth:`flush_rows` (with the same ``last``) ran through the head."""
        self.pend_h.clear()
        self.pend_t.clear()
        if last is not None:
            self.wait = None

    def forget(self) -> None:
        """A main step ran without giving hidden states (a batched plain step): the head's
        history continues after a gap."""
        self.pend_h.clear()
        self.pend_t.clear()
        self.wait = None

    def chain_rows(self, g: F32Array, token: int, planned: int = 1) -> HeadRows:
        """The head call of one chained draft row from its own output ``g`` [D] and
        ``token``."""
        return HeadRows(self, g[None, :], np.array([token], np.int64), planned)
