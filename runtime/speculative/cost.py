"""The cost model: does drafting pay this round, from which source, and how many tokens?

Shape legend: see ``runtime.speculative``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.speculative._common import SOURCES
from runtime.speculative.acceptance import expected_tokens

# Acceptance priors (probability that a draft matches) before any telemetry: MTP heads reach
# 2.2-2.8 tokens/forward at k=3 when they pay; lookup is a guess; a forced grammar span only
# misses where another tokenization of the same bytes is allowed.
_PRIORS: dict[str, float] = {"grammar": 0.95, "mtp": 0.6, "lookup": 0.4}
_PRIOR_WEIGHT = 2.0  # pseudo-proposals behind each prior
POSITIONS = 4  # acceptance is kept per draft position 1..4 (later positions share the 4th)


def base_source(key: str) -> str:
    """The source of a cost-model key: ``lookup-3`` (a 3-gram lookup match) -> ``lookup``."""
    return key.split("-", 1)[0]


def _ewma(old: float | None, new: float, w: float) -> float:
    return new if old is None else old + w * (new - old)


_WINDOW = 16  # a step shape's latest times the cost model keeps (their median stands for it)
_AGE = 1024  # observations after which a shape not measured since is forgotten
_TRUST = 8  # batched steps with draft rows measured before their cost is trusted to stop probes


class _Cell:
    """The latest times of one step shape (sequences, rows) and when it was last measured."""

    __slots__ = ("last", "values")

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=_WINDOW)
        self.last = 0

    def add(self, seconds: float, at: int) -> None:
        self.values.append(seconds)
        self.last = at

    def median(self) -> float:
        return statistics.median(self.values)


def _moments(pts: list[tuple[float, float, int]]) -> tuple[float, float, float, float]:
    """Weighted means of x and y and the centred sums Sxx, Sxy of ``pts`` (x, y, weight)."""
    n = sum(w for _, _, w in pts)
    mx = sum(x * w for x, _, w in pts) / n
    my = sum(y * w for _, y, w in pts) / n
    sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
    sxy = sum(w * (x - mx) * (y - my) for x, y, w in pts)
    return mx, my, sxx, sxy


def _line(pts: list[tuple[float, float, int]]) -> tuple[float, float] | None:
    """(intercept, slope >= 0) of the weighted least-squares line through ``pts`` (x, y,
    weight), None when every x is the same."""
    mx, my, sxx, sxy = _moments(pts)
    if sxx <= 0:
        return None
    slope = max(sxy / sxx, 0.0)
    return max(my - slope * mx, 1e-9), slope


def _draft_row_cost(
    wide: dict[int, list[tuple[float, float, int]]], old: float | None
) -> float | None:
    """The cost of a draft row in a batched step (>= 0) from each width's points (draft rows,
    median seconds, measurements): per shape with draft rows, its extra time over the
    width's plain step per draft row, and the weighted median of those (a shape measured
    once, slow on its first run, would otherwise steer a least-squares slope with its
    leverage). Widths without a plain step measured give a least-squares slope within each
    width when none has one; ``old`` when there is nothing to go on."""
    per_row: list[tuple[float, int]] = []
    for pts in wide.values():
        plain = [m for x, m, _ in pts if x == 0]
        if plain:
            per_row += [((m - plain[0]) / x, w) for x, m, w in pts if x > 0]
    if per_row:
        per_row.sort()
        half = sum(w for _, w in per_row) / 2
        run = 0
        for v, w in per_row:
            run += w
            if run >= half:
                return max(v, 0.0)
    sums = [_moments(pts)[2:] for pts in wide.values()]
    sxx = sum(a for a, _ in sums)
    return max(sum(b for _, b in sums) / sxx, 0.0) if sxx > 0 else old


@dataclass
class CostModel:
    """When does drafting pay? ``choose({key: max_k, ..})`` -> (key, k, probe) for this round.

    Keys are sources (``grammar``, ``mtp``) or finer contexts of one (``lookup-3``: a lookup
    draft from a 3-gram match). A round with k drafts emits ``E(k) = 1 + a1 + a1 a2 + .. +
    a1..ak`` tokens, where ``ai`` is the key's acceptance at draft position i (given the
    earlier drafts matched: an MTP head's first draft, from real hidden states, is right far
    more often than its chained ones). It costs ``step(k + 1) + draft(k)`` seconds against
    ``step(1)`` per plain token, where ``draft(k) = first + (k - 1) * chain`` (an MTP head runs
    the newly accepted positions for its first draft, then one row per further draft),
    ``step(r) = t1 + t_row * (r - 1) + misses(r) * t_miss`` and ``misses(r) = moe_layers *
    U(r) * (1 - hit_rate)`` with ``U(r) = min(E, K + (r - 1) * K * overlap)`` distinct experts
    per layer (``overlap`` 1 until routing of wider steps is seen). A batched step of ``s``
    generations' ``r`` rows costs ``base[s] + t_wide * (r - s)`` (+ misses), ``base[s]``
    measured at that width or else ``t1 + t_seq * (s - 1)``: a further generation brings its
    own attention, cache and routing, a further row of one already there (a draft) much
    less, so the two are learned apart (:meth:`_fit`, from each step shape's median time).
    The round's choice is the
    key and k of the highest tokens per second, when that beats plain decoding by ``margin``.
    Acceptance per position is A / (A + R) over exponentially decayed counts (window
    ~``window`` checks). When nothing pays, a key that is off gets a k=1 probe after
    ``probe_interval`` such rounds, the gap doubling (up to ``max_probe_interval``) while
    probes find it still off."""

    top_k: int = 8
    n_experts: int = 256
    moe_layers: int = 1
    max_k: int = 4
    window: int = 24
    probe_interval: int = 16
    max_probe_interval: int = 256
    margin: float = 0.03
    ewma: float = 0.2
    t1: float | None = None  # compute seconds of a one-row step
    t_row: float | None = None  # extra compute seconds per extra row (one generation)
    t_seq: float | None = None  # extra compute seconds per extra generation (batched step)
    t_wide: float | None = None  # extra compute seconds per draft row in a batched step
    t_miss: float | None = None  # stall seconds per missed expert
    base: dict[int, float] = field(default_factory=dict)  # seqs -> a plain step's seconds
    hit_rate: float = 1.0  # resident: every expert is a hit
    overlap: float = 1.0  # new distinct experts per extra row, as a fraction of K
    draft_cost: dict[str, float] = field(default_factory=dict)  # seconds of a first draft
    chain_cost: dict[str, float] = field(default_factory=dict)  # seconds per further draft
    _acc: dict[str, list[list[float]]] = field(default_factory=dict)  # key -> [A, R] per pos
    _since_probe: dict[str, int] = field(default_factory=dict)
    _gap: dict[str, int] = field(default_factory=dict)
    _cells: dict[tuple[int, int], _Cell] = field(default_factory=dict)  # (seqs, rows) -> times
    _n_obs: int = 0
    _wide_drafted: int = 0  # batched steps with draft rows among the kept times

    # ---- telemetry in
    def observe_proposal(self, source: str, proposed: int, accepted: int) -> None:
        """``proposed`` drafts of ``source`` (a key) were checked: the first ``accepted``
        matched, and when ``accepted < proposed`` draft ``accepted + 1`` did not."""
        if proposed <= 0:
            return
        counts = self._counts(source)
        d = 1.0 - 1.0 / self.window
        for i in range(min(proposed, accepted + 1)):
            c = counts[min(i, POSITIONS - 1)]
            ok = i < accepted
            c[0] = c[0] * d + (1.0 if ok else 0.0)
            c[1] = c[1] * d + (0.0 if ok else 1.0)

    def observe_step(
        self,
        rows: int,
        seconds: float,
        *,
        seqs: int = 1,
        stall: float = 0.0,
        misses: int = 0,
        lookups: int = 0,
    ) -> None:
        """A verify (or plain) step of ``rows`` rows of ``seqs`` generations took ``seconds``,
        ``stall`` of them waiting for ``misses`` expert reads, out of ``lookups`` expert
        look-ups (streaming)."""
        compute = max(seconds - stall, 1e-9)
        self._n_obs += 1
        key = (max(int(seqs), 1), max(int(rows), 1))
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell()
        cell.add(compute, self._n_obs)
        self._fit()
        w = self.ewma
        if misses > 0:
            self.t_miss = _ewma(self.t_miss, stall / misses, w)
        if lookups > 0:
            self.hit_rate = _ewma(self.hit_rate, 1.0 - misses / lookups, w)

    def _fit(self) -> None:
        """The step costs from each step shape's median time (a step's time has a long right
        tail: the GIL, the guest's scheduler; means of raw times, or of what earlier estimates
        left of them, came out at 2-5x the typical cost of a draft row in a batched step, so
        drafting went off where it paid). One sequence: ``t1`` and ``t_row`` by least squares
        over its row counts. Several: one ``t_wide`` per draft row that the widths share
        (:func:`_draft_row_cost`), a fixed part per width (``base``), then ``t_seq`` from
        the widths' fixed parts. A step of one sequence costs no more than a step of several,
        so ``t1`` is capped by their fixed parts: times from the first steps (kernels
        compiling) do not stay the estimate when no one-row step has come since. A shape not
        measured for ``_AGE`` observations is forgotten."""
        now = self._n_obs
        for key in [k for k, c in self._cells.items() if now - c.last > _AGE]:
            del self._cells[key]
        one: list[tuple[float, float, int]] = []  # (rows - 1, median, measurements)
        wide: dict[int, list[tuple[float, float, int]]] = {}  # seqs -> (rows - seqs, ...)
        self._wide_drafted = 0
        for (seqs, rows), c in self._cells.items():
            if seqs == 1:
                one.append((rows - 1.0, c.median(), len(c.values)))
            else:
                wide.setdefault(seqs, []).append((float(rows - seqs), c.median(), len(c.values)))
                self._wide_drafted += len(c.values) if rows > seqs else 0
        if one:
            fit = _line(one)
            if fit is not None:
                self.t1, self.t_row = fit
            else:  # one row count: a one-row step, or (drafts only) every row alike
                x, m, _ = one[0]
                per_row = self.t_row if self.t_row is not None else m / (x + 1.0)
                self.t1 = max(m - per_row * x, 1e-9)
        if not wide:
            return
        self.t_wide = _draft_row_cost(wide, self.t_wide)
        per_draft = self.t_wide if self.t_wide is not None else (self.t_row or 0.0)
        base: dict[int, float] = {}
        for seqs, pts in wide.items():
            mean_x, mean_m, _, _ = _moments(pts)
            base[seqs] = max(mean_m - per_draft * mean_x, 1e-9)
        self.base = base
        if self.t1 is None:  # no one-sequence step seen yet: every sequence alike
            self.t1 = min(b / s for s, b in base.items())
        t1 = self.t1 = min(self.t1, min(base.values()))
        num = sum((s - 1) * (b - t1) for s, b in base.items())
        den = sum((s - 1) ** 2 for s in base)
        self.t_seq = max(num / den, 0.0)

    def observe_union(self, rows: int, union_per_layer: float) -> None:
        """Mean distinct routed experts per MoE layer seen in a step of ``rows`` rows."""
        if rows <= 1 or self.top_k <= 0:
            return
        ov = (union_per_layer - self.top_k) / ((rows - 1) * self.top_k)
        self.overlap = _ewma(self.overlap, min(max(ov, 0.0), 1.0), self.ewma)

    def observe_draft(self, source: str, tokens: int, seconds: float) -> None:
        """Drafting ``tokens`` tokens from ``source`` took ``seconds`` (split evenly)."""
        if tokens > 0:
            self.observe_draft_parts(
                source, seconds / tokens, tokens - 1, seconds - seconds / tokens
            )

    def observe_draft_parts(
        self, source: str, first: float | None, chained: int, chain_seconds: float
    ) -> None:
        """A round's first draft from ``source`` took ``first`` seconds (None: unknown, e.g.
        it included a one-off catch-up over a backlog), ``chained`` further drafts
        ``chain_seconds``."""
        if first is not None:
            self.draft_cost[source] = _ewma(self.draft_cost.get(source), first, 0.3)
        if chained > 0:
            self.chain_cost[source] = _ewma(
                self.chain_cost.get(source), chain_seconds / chained, 0.3
            )

    # ---- estimates
    def acceptance(self, source: str, position: int = 1) -> float:
        """Acceptance of ``source``'s draft at ``position`` (1-based) given the earlier ones
        matched."""
        a, r = self._counts(source)[min(max(position, 1), POSITIONS) - 1]
        return a / (a + r) if a + r > 0 else 0.0

    def expected(self, source: str, k: int) -> float:
        """Expected tokens of a round with ``k`` drafts from ``source``."""
        return expected_tokens([self.acceptance(source, i + 1) for i in range(POSITIONS)], k)

    def draft_seconds(self, source: str, k: int) -> float:
        """Estimated seconds to draft ``k`` tokens from ``source``."""
        if k <= 0:
            return 0.0
        base = base_source(source)
        first = self.draft_cost.get(source, self.draft_cost.get(base, 0.0))
        chain = self.chain_cost.get(source, self.chain_cost.get(base, first))
        return first + (k - 1) * chain

    def union(self, rows: int) -> float:
        return min(float(self.n_experts), self.top_k * (1.0 + (rows - 1) * self.overlap))

    def step_cost(self, rows: int, seqs: int = 1) -> float:
        """Estimated seconds of a step with ``rows`` rows of ``seqs`` generations."""
        t1 = self.t1 if self.t1 is not None else 1.0
        t_row = self.t_row if self.t_row is not None else 0.1 * t1
        t_miss = self.t_miss if self.t_miss is not None else 0.0
        misses = self.moe_layers * self.union(rows) * (1.0 - self.hit_rate)
        if seqs <= 1:
            return t1 + t_row * (rows - 1) + misses * t_miss
        t_seq = self.t_seq if self.t_seq is not None else t_row
        t_wide = self.t_wide if self.t_wide is not None else min(t_row, t_seq)
        plain = self.base.get(seqs)
        if plain is None:
            plain = t1 + t_seq * (seqs - 1)
        return plain + t_wide * max(rows - seqs, 0) + misses * t_miss

    def speedup(self, source: str, k: int, others: int = 0, other_seqs: int | None = None) -> float:
        """Estimated tokens/s with k drafts from ``source`` over plain decoding. ``others``:
        rows of other generations in the same (batched) step, ``other_seqs`` of them (default:
        one row each); the step's tokens/s is what counts then: ``(others + E(k)) /
        (step(others + 1 + k) + draft(k))`` against ``(others + 1) / step(others + 1)`` (each
        other row taken as one token). Alone (``others`` 0) that is ``E(k) * step(1) /
        (step(k + 1) + draft(k))``; in a wide step a draft's rows and its drafting cost every
        generation time, for one more token of one of them, so drafting pays less the wider
        the step."""
        if k <= 0:
            return 1.0
        o = max(int(others), 0)
        s = 1 + (o if other_seqs is None else max(min(int(other_seqs), o), 0))
        cost = self.step_cost(o + 1 + k, s) + self.draft_seconds(source, k)
        return (o + self.expected(source, k)) * self.step_cost(o + 1, s) / ((o + 1) * cost)

    def best(
        self,
        source: str,
        max_k: int | None = None,
        others: int = 0,
        other_seqs: int | None = None,
    ) -> tuple[int, float]:
        """(k, speed-up) of the best k in 1..max_k (``others``: see :meth:`speedup`)."""
        top = self.max_k if max_k is None else max_k
        best_k, best_s = 0, 1.0
        for k in range(1, top + 1):
            s = self.speedup(source, k, others, other_seqs)
            if s > best_s:
                best_k, best_s = k, s
        return best_k, best_s

    def _could_pay(self, key: str, others: int, other_seqs: int | None, k: int = 1) -> bool:
        """Whether ``k`` drafts from ``key`` would pay in a step this wide even if they were
        always accepted (:meth:`speedup` with ``E(k) = k + 1``). A probe (k = 1) that could not
        is skipped: it would tell nothing this step can use, and an MTP probe first runs the
        head over every position since it last ran while the step's other generations wait
        (eight streams of the demo model lost ~4% to such probes); it stays due for a
        narrower step. (The speed-up is a ratio of two linear functions of k: monotone, so
        k = 1 and the largest k bound every k between.) While fewer than ``_TRUST`` batched
        steps with draft rows are measured, a batched step could always pay for a draft that
        costs little to make (a prompt lookup; not an MTP head's catch-up): the cost of a
        draft row there is a guess from a few steps (the first ones of a shape run slow), and
        skipping probes would keep it."""
        o = max(int(others), 0)
        s = 1 + (o if other_seqs is None else max(min(int(other_seqs), o), 0))
        cost = self.step_cost(o + 1 + k, s) + self.draft_seconds(key, k)
        if s > 1 and self._wide_drafted < _TRUST and self.draft_seconds(key, k) < 0.1 * cost:
            return True
        return (o + 1 + k) * self.step_cost(o + 1, s) / ((o + 1) * cost) >= 1.0 + self.margin

    def pays(self, source: str) -> bool:
        return self.best(source)[1] >= 1.0 + self.margin

    def choose(
        self, options: Mapping[str, int], others: int = 0, other_seqs: int | None = None
    ) -> tuple[str | None, int, bool]:
        """This round's drafts: ``options`` maps each key that has drafts now to how many it
        can give; returns (key, k, probe), (None, 0, False) for a plain step. The key and k
        of the best estimated tokens/s win when they beat plain decoding by ``margin``; when
        nothing pays, a due probe (k = 1) replaces the plain step. ``others``: rows of other
        generations in the same step (:meth:`speedup`)."""
        best_key: str | None = None
        best_k, best_s = 0, 1.0 + self.margin
        paying = []
        for key, top in options.items():
            if top <= 0 or not (
                self._could_pay(key, others, other_seqs)
                or self._could_pay(key, others, other_seqs, top)
            ):
                continue  # not even drafts that are always right would pay in this step
            k, s = self.best(key, top, others, other_seqs)
            if s >= 1.0 + self.margin:
                paying.append(key)
                if s >= best_s:
                    best_key, best_k, best_s = key, k, s
        if best_key is not None:
            for key in paying:
                self._since_probe[key] = 0
                self._gap[key] = self.probe_interval
            return best_key, best_k, False
        probe: str | None = None
        for key, top in options.items():
            if top <= 0:
                continue
            n = self._since_probe.get(key, 0) + 1
            gap = self._gap.get(key, self.probe_interval)
            if probe is None and n >= gap and self._could_pay(key, others, other_seqs):
                # probes cost too: each one that finds the key still off doubles the gap
                self._since_probe[key] = 0
                self._gap[key] = min(2 * gap, self.max_probe_interval)
                probe = key
            else:
                self._since_probe[key] = n
        return (probe, 1, True) if probe is not None else (None, 0, False)

    def plan(
        self,
        source: str,
        max_k: int | None = None,
        others: int = 0,
        other_seqs: int | None = None,
    ) -> int:
        """Drafts to propose from ``source`` alone this round (0: not now), probes included
        (``others``, ``other_seqs``: see :meth:`speedup`)."""
        top = self.max_k if max_k is None else max_k
        return self.choose({source: top}, others, other_seqs)[1] if top > 0 else 0

    def snapshot(self) -> dict[str, Any]:
        """The model's state for ``stats()``."""
        keys = list(SOURCES) + sorted(k for k in self._acc if k not in SOURCES)
        return {
            "t1_s": self.t1,
            "t_row_s": self.t_row,
            "t_seq_s": self.t_seq,
            "t_wide_s": self.t_wide,
            "base_s": {str(k): v for k, v in sorted(self.base.items())},
            "t_miss_s": self.t_miss,
            "hit_rate": self.hit_rate,
            "overlap": self.overlap,
            "draft_cost_s": dict(self.draft_cost),
            "chain_cost_s": dict(self.chain_cost),
            "sources": {
                s: {
                    "acceptance": self.acceptance(s),
                    "acceptance_by_position": [self.acceptance(s, i + 1) for i in range(POSITIONS)],
                    "best_k": self.best(s)[0],
                    "speedup": self.best(s)[1],
                    "on": self.pays(s),
                }
                for s in keys
            },
        }

    def _counts(self, source: str) -> list[list[float]]:
        if source not in self._acc:
            prior = _PRIORS.get(base_source(source), 0.5)
            self._acc[source] = [
                [prior * _PRIOR_WEIGHT, (1.0 - prior) * _PRIOR_WEIGHT] for _ in range(POSITIONS)
            ]
        return self._acc[source]
