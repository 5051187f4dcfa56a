"""Speculative decoding: cheap drafts, one batched verify forward, exact rollback.

One *round* (:meth:`SpeculativeDecoder.step`) after the last emitted token ``x`` at position L:

1. **Draft** up to k tokens ``d1..dk`` from one source:

   * ``grammar``: the span a structured-output grammar forces (free, almost always right);
   * ``mtp``: the model's multi-token-prediction head, run autoregressively (the first draft from
     real main hidden states, the next ones chained through the head's own output);
   * ``lookup``: prompt lookup, the continuation of the latest earlier match of the last 3, 2
     or 1 tokens in prompt + output (no model at all; pays on repetitive text and code).

2. **Verify**: ``model.forward([x, d1..dk], cache)`` through the same kernels as one-token decode
   (batch-invariant: every row is bit-identical to a one-row step, DESIGN.md section 3), so row i
   gives exactly the logits plain decoding would see after ``x, d1..di``.
3. **Accept** the longest prefix the target agrees with, then one more token from the first
   disagreeing row (or the bonus row after k accepts): greedy compares argmaxes, so output is
   byte-identical to plain greedy decoding; sampling uses speculative rejection sampling
   (Leviathan et al. 2023, Chen et al. 2023: accept d with probability min(1, p(d)/q(d)), else
   sample norm(max(0, p - q))), which draws from exactly the target distribution p. Deterministic
   drafts (lookup, grammar, greedy MTP) have a one-hot q.
4. **Roll back**: ``cache.truncate`` drops the rejected rows; the MTP head's cache keeps only rows
   built from real main hidden states (its chained draft rows are truncated and the accepted
   positions re-run from the verify forward's hidden states on the next round).

A :class:`CostModel` fed by live telemetry (acceptance per source, step time per row count, expert
misses and stall time of a streaming store, the expert union a wider step routes to) decides per
round whether drafting pays and how many tokens to draft; below break-even a source is switched
off and probed again every ``probe_interval`` rounds.

Shape legend: V vocab, D hidden, T rows of a step, k drafts (a verify step has k + 1 rows),
P pending MTP rows, K experts per token, E routed experts per layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from runtime.kv import KVCache
from runtime.sampling import Sampler
from storage.errors import ModelError

__all__ = [
    "SOURCES",
    "CostModel",
    "DraftPolicy",
    "SpecStats",
    "SpeculativeDecoder",
    "TokenConstraint",
    "accept_or_resample",
    "expected_tokens",
    "lookup_draft",
    "mtp_step",
    "sample_from",
]

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]
Source = Literal["grammar", "mtp", "lookup"]
SOURCES: tuple[Source, ...] = ("grammar", "mtp", "lookup")
Emitted = tuple[int, F32Array]  # (token id, the raw target logits [V] it was chosen from)

# Acceptance priors (per-token probability that a draft matches) before any telemetry: MTP
# heads reach 2.2-2.8 tokens/forward at k=3 when they pay; lookup is a guess; a forced grammar
# span only misses where another tokenization of the same bytes is allowed.
_PRIORS: dict[str, float] = {"grammar": 0.95, "mtp": 0.6, "lookup": 0.4}
_PRIOR_WEIGHT = 2.0  # pseudo-proposals behind each prior
_MAX_PENDING = 128  # MTP rows kept while the head is off (older history is dropped)
_MAX_FORCED = 16  # a forced grammar span is drafted whole, up to this many tokens per step


# ----------------------------------------------------------------------------------- policy


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


# ----------------------------------------------------------------------------------- drafts


def lookup_draft(
    history: Sequence[int] | npt.NDArray[np.integer], k: int, *, max_ngram: int = 3
) -> list[int]:
    """Prompt-lookup draft: up to ``k`` tokens that followed the latest earlier occurrence of
    the longest suffix n-gram (n = ``max_ngram`` .. 1) of ``history``; [] when none matches."""
    t = np.asarray(history, dtype=np.int64).reshape(-1)  # [N]
    n_tok = t.size
    if k <= 0 or n_tok < 2:
        return []
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        pat = t[n_tok - n :]  # [n]
        # windows starting at i < N - n (strictly earlier than the suffix itself)
        win = np.lib.stride_tricks.sliding_window_view(t[: n_tok - 1], n)  # [N - n, n]
        hit = np.flatnonzero((win == pat).all(axis=1))
        if hit.size:
            i = int(hit[-1])
            return [int(x) for x in t[i + n : i + n + k]]
    return []


def sample_from(probs: F64Array, rng: np.random.Generator) -> int:
    """Inverse-CDF sample from ``probs`` [V] (one uniform draw; never a zero-mass token)."""
    cum = np.cumsum(probs)  # [V]
    u = rng.random() * cum[-1]
    idx = int(np.searchsorted(cum, u, side="right"))
    if idx >= probs.size or probs[idx] <= 0:
        nz = np.flatnonzero(probs)
        idx = int(nz[min(int(np.searchsorted(nz, idx)), nz.size - 1)])
    return idx


def accept_or_resample(
    p: F64Array, q: F64Array | None, draft: int, rng: np.random.Generator
) -> tuple[bool, int]:
    """One step of speculative rejection sampling.

    ``p`` [V] target distribution, ``q`` [V] the distribution ``draft`` was drawn from (None: a
    deterministic draft, q one-hot). Accept with probability min(1, p(d)/q(d)); else return a
    sample from norm(max(0, p - q)). Either way the returned token is distributed exactly as p."""
    qd = 1.0 if q is None else float(q[draft])
    pd = float(p[draft])
    if qd > 0 and rng.random() * qd < pd:
        return True, int(draft)
    if q is None:
        resid = p.copy()  # [V]
        resid[draft] = 0.0
    else:
        resid = np.maximum(p - q, 0.0)  # [V]
    if not resid.sum() > 0:  # p == q up to rounding: rejection had probability ~0
        resid = p
    return False, sample_from(resid, rng)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verify step with k drafts when each is accepted with probability ``alpha``
    (independently, until the first miss): 1 + a + ... + a^k."""
    a = min(max(alpha, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class TokenConstraint(Protocol):
    """What the decoder needs from a grammar (see ``runtime.grammar.GrammarMatcher``)."""

    def mask(self, logits: F32Array) -> F32Array: ...
    def consume(self, token: int) -> None: ...
    def push(self, tokens: Sequence[int]) -> None: ...
    def rollback(self, n: int) -> None: ...
    def forced(self) -> list[int]: ...
    def validate(self, tokens: Sequence[int]) -> int: ...


# ----------------------------------------------------------------------------------- cost model


def _ewma(old: float | None, new: float, w: float) -> float:
    return new if old is None else old + w * (new - old)


@dataclass
class CostModel:
    """When does drafting pay? ``plan(source, max_k)`` -> k (0 = draft nothing this round).

    Expected tokens per round with k drafts at per-token acceptance a is ``1 + a + .. + a^k``;
    the round costs ``step(k + 1) + k * draft_cost[source]`` seconds against ``step(1)`` for a
    plain token, where ``step(r) = t1 + t_row * (r - 1) + misses(r) * t_miss`` and
    ``misses(r) = moe_layers * U(r) * (1 - hit_rate)`` with ``U(r) = min(E, K + (r - 1) * K *
    overlap)`` distinct experts per layer (``overlap`` 1 until routing of wider steps is seen).
    Acceptance per source is A / (A + R) over exponentially decayed counts (window ~``window``
    proposals) of accepted drafts A and first rejections R. A source whose best speed-up is
    below ``1 + margin`` is off and gets a k=1 probe after ``probe_interval`` rounds, the gap
    doubling (up to ``max_probe_interval``) while probes find it still off."""

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
    t_row: float | None = None  # extra compute seconds per extra row
    t_miss: float | None = None  # stall seconds per missed expert
    hit_rate: float = 1.0  # resident: every expert is a hit
    overlap: float = 1.0  # new distinct experts per extra row, as a fraction of K
    draft_cost: dict[str, float] = field(default_factory=dict)
    _acc: dict[str, list[float]] = field(default_factory=dict)
    _since_probe: dict[str, int] = field(default_factory=dict)
    _gap: dict[str, int] = field(default_factory=dict)
    _rounds: int = 0

    # ---- telemetry in
    def observe_proposal(self, source: str, proposed: int, accepted: int) -> None:
        """``proposed`` drafts of ``source`` were checked, the first ``accepted`` matched."""
        if proposed <= 0:
            return
        a, r = self._counts(source)
        d = 1.0 - 1.0 / self.window
        self._acc[source] = [a * d + accepted, r * d + (1.0 if accepted < proposed else 0.0)]

    def observe_step(
        self, rows: int, seconds: float, *, stall: float = 0.0, misses: int = 0, lookups: int = 0
    ) -> None:
        """A verify (or plain) step of ``rows`` rows took ``seconds``, ``stall`` of them waiting
        for ``misses`` expert reads, out of ``lookups`` expert look-ups (streaming)."""
        w = self.ewma
        compute = max(seconds - stall, 1e-9)
        if rows == 1:
            self.t1 = _ewma(self.t1, compute, w)
        elif self.t1 is not None:
            self.t_row = _ewma(self.t_row, max(compute - self.t1, 0.0) / (rows - 1), w)
        if misses > 0:
            self.t_miss = _ewma(self.t_miss, stall / misses, w)
        if lookups > 0:
            self.hit_rate = _ewma(self.hit_rate, 1.0 - misses / lookups, w)

    def observe_union(self, rows: int, union_per_layer: float) -> None:
        """Mean distinct routed experts per MoE layer seen in a step of ``rows`` rows."""
        if rows <= 1 or self.top_k <= 0:
            return
        ov = (union_per_layer - self.top_k) / ((rows - 1) * self.top_k)
        self.overlap = _ewma(self.overlap, min(max(ov, 0.0), 1.0), self.ewma)

    def observe_draft(self, source: str, tokens: int, seconds: float) -> None:
        """Drafting ``tokens`` tokens from ``source`` took ``seconds``."""
        if tokens > 0:
            self.draft_cost[source] = _ewma(self.draft_cost.get(source), seconds / tokens, 0.3)

    # ---- estimates
    def acceptance(self, source: str) -> float:
        a, r = self._counts(source)
        return a / (a + r) if a + r > 0 else 0.0

    def union(self, rows: int) -> float:
        return min(float(self.n_experts), self.top_k * (1.0 + (rows - 1) * self.overlap))

    def step_cost(self, rows: int) -> float:
        """Estimated seconds of a step with ``rows`` rows."""
        t1 = self.t1 if self.t1 is not None else 1.0
        t_row = self.t_row if self.t_row is not None else 0.1 * t1
        t_miss = self.t_miss if self.t_miss is not None else 0.0
        misses = self.moe_layers * self.union(rows) * (1.0 - self.hit_rate)
        return t1 + t_row * (rows - 1) + misses * t_miss

    def speedup(self, source: str, k: int) -> float:
        """Estimated tokens/s with k drafts from ``source`` over plain decoding."""
        if k <= 0:
            return 1.0
        cost = self.step_cost(k + 1) + k * self.draft_cost.get(source, 0.0)
        return expected_tokens(self.acceptance(source), k) * self.step_cost(1) / cost

    def best(self, source: str, max_k: int | None = None) -> tuple[int, float]:
        """(k, speed-up) of the best k in 1..max_k."""
        top = self.max_k if max_k is None else max_k
        best_k, best_s = 0, 1.0
        for k in range(1, top + 1):
            s = self.speedup(source, k)
            if s > best_s:
                best_k, best_s = k, s
        return best_k, best_s

    def pays(self, source: str) -> bool:
        return self.best(source)[1] >= 1.0 + self.margin

    def plan(self, source: str, max_k: int | None = None) -> int:
        """Drafts to propose from ``source`` this round (0: not now), probes included."""
        top = self.max_k if max_k is None else max_k
        if top <= 0:
            return 0
        k, s = self.best(source, top)
        if s >= 1.0 + self.margin:
            self._since_probe[source] = 0
            self._gap[source] = self.probe_interval
            return k
        n = self._since_probe.get(source, 0) + 1
        gap = self._gap.get(source, self.probe_interval)
        if n >= gap:
            # probes cost too: each one that finds the source still off doubles the gap
            self._since_probe[source] = 0
            self._gap[source] = min(2 * gap, self.max_probe_interval)
            return 1
        self._since_probe[source] = n
        return 0

    def snapshot(self) -> dict[str, Any]:
        """The model's state for ``stats()``."""
        return {
            "t1_s": self.t1,
            "t_row_s": self.t_row,
            "t_miss_s": self.t_miss,
            "hit_rate": self.hit_rate,
            "overlap": self.overlap,
            "draft_cost_s": dict(self.draft_cost),
            "sources": {
                s: {
                    "acceptance": self.acceptance(s),
                    "best_k": self.best(s)[0],
                    "speedup": self.best(s)[1],
                    "on": self.pays(s),
                }
                for s in SOURCES
            },
        }

    def _counts(self, source: str) -> list[float]:
        if source not in self._acc:
            prior = _PRIORS.get(source, 0.5)
            self._acc[source] = [prior * _PRIOR_WEIGHT, (1.0 - prior) * _PRIOR_WEIGHT]
        return self._acc[source]


# ----------------------------------------------------------------------------------- telemetry


@dataclass
class SpecStats:
    """Counters across generations (``engine.stats()["speculative"]``)."""

    rounds: int = 0
    verify_steps: int = 0  # forwards with drafts
    plain_steps: int = 0  # forwards without
    tokens: int = 0  # tokens emitted by rounds
    probes: int = 0
    seconds: float = 0.0  # wall time of rounds (drafting + verify + acceptance)
    draft_seconds: float = 0.0
    plain_seconds: float = 0.0  # wall time of the rounds without drafts
    model_seconds: float = 0.0  # the cost model's estimate of all tokens decoded plainly
    proposed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))

    def as_dict(self) -> dict[str, Any]:
        steps = self.verify_steps + self.plain_steps
        return {
            "rounds": self.rounds,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "tokens": self.tokens,
            "probes": self.probes,
            "seconds": self.seconds,
            "draft_seconds": self.draft_seconds,
            "proposed": dict(self.proposed),
            "accepted": dict(self.accepted),
            "acceptance": {
                s: self.accepted[s] / self.proposed[s] if self.proposed[s] else None
                for s in SOURCES
            },
            "tokens_per_forward": self.tokens / steps if steps else None,
            "estimated_speedup": self.estimated_speedup(),
        }

    def estimated_speedup(self) -> float | None:
        """Tokens/s of the rounds over plain decoding: the measured mean time of a plain round
        (once there are some) or else the cost model's estimate, times the tokens emitted,
        over the time the rounds took."""
        if self.seconds <= 0:
            return None
        if self.plain_steps >= 8:
            return self.tokens * (self.plain_seconds / self.plain_steps) / self.seconds
        return self.model_seconds / self.seconds


# ----------------------------------------------------------------------------------- MTP


def mtp_step(
    model: Any,
    hidden: F32Array,
    next_ids: npt.NDArray[np.integer],
    mtp_cache: KVCache,
    *,
    last_only: bool = True,
) -> tuple[F32Array, F32Array]:
    """The model's MTP step: logits ([1, V] with ``last_only``) and the head's normed output
    [T, D], the input of the next chained draft."""
    logits, normed = model.mtp_step(hidden, next_ids, mtp_cache, last_only=last_only)
    return logits, normed


class _MtpDrafter:
    """The MTP head's cache and the main hidden states it has not seen yet.

    Invariant: ``cache`` holds rows (h_j, token j+1) for real main positions only, in order; the
    pending rows continue them; ``wait`` is the main hidden of the last fed position, whose next
    token is not known yet."""

    def __init__(self, model: Any) -> None:
        self.model = model
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
        if len(self.pend_t) > _MAX_PENDING:  # the head is off: keep recent history only
            del self.pend_h[:-_MAX_PENDING]
            del self.pend_t[:-_MAX_PENDING]

    def flush(self, last: int | None) -> tuple[F32Array, F32Array] | None:
        """Run the pending rows (plus (wait, ``last``) when given) through the head; returns
        the last row's (logits [V], normed output [D]), or None when nothing was pending."""
        h, t = list(self.pend_h), list(self.pend_t)
        if last is not None and self.wait is not None:
            h.append(self.wait)
            t.append(int(last))
        if not t:
            return None
        logits, normed = mtp_step(self.model, np.stack(h), np.array(t, np.int64), self.cache)
        self.pend_h.clear()
        self.pend_t.clear()
        if last is not None:
            self.wait = None
        return logits[-1], normed[-1]

    def forget(self) -> None:
        """A main step ran without giving hidden states (a batched plain step): the head's
        history continues after a gap."""
        self.pend_h.clear()
        self.pend_t.clear()
        self.wait = None

    def chain(self, g: F32Array, token: int) -> tuple[F32Array, F32Array]:
        """One chained draft row from the head's own output ``g`` [D] and ``token``."""
        logits, normed = mtp_step(self.model, g[None, :], np.array([token], np.int64), self.cache)
        return logits[-1], normed[-1]


# ----------------------------------------------------------------------------------- decoder


@dataclass
class _Draft:
    tokens: list[int] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    q: list[F64Array | None] = field(default_factory=list)  # [V] each, None = one-hot
    probe: bool = False


class SpeculativeDecoder:
    """Decodes one generation round by round (runs in the engine's compute thread).

    ``first(logits)`` samples the first token after prefill; ``step(last, remaining)`` emits
    1..k+1 tokens and leaves ``cache`` holding everything emitted except the final token (as
    plain decoding does). ``prefill_hook`` feeds prefill chunks to the MTP head."""

    def __init__(
        self,
        model: Any,
        cache: KVCache,
        sampler: Sampler,
        *,
        prompt: Sequence[int] | npt.NDArray[np.integer],
        policy: DraftPolicy,
        cost: CostModel,
        stats: SpecStats,
        grammar: TokenConstraint | None = None,
        stop_ids: Sequence[int] = (),
        store_stats: Callable[[], Any] | None = None,
        reproducible: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.policy = policy
        self.cost = cost
        self.stats = stats
        self.grammar = grammar
        self.stops = frozenset(int(t) for t in stop_ids)
        self._store_stats = store_stats
        seed = sampler.params.seed
        # The acceptance draws have their own stream: the sampler's stays as plain decoding.
        self._rng = np.random.Generator(np.random.PCG64(None if seed is None else [seed, 7]))
        self._history: list[int] = [int(x) for x in np.asarray(prompt).reshape(-1)]
        self._n_main = int(model.config.num_hidden_layers)
        # reproducible (seeded sampling under "auto"): no choice may follow timings, so model
        # drafts stay off and forced grammar spans are always drafted
        self._fixed = policy.mode == "fixed" or reproducible
        drafts_on = policy.mode != "off" and not reproducible
        self._mtp: _MtpDrafter | None = None
        if drafts_on and policy.source in ("any", "mtp") and getattr(model, "has_mtp", False):
            self._mtp = _MtpDrafter(model)
        # prompt lookup: pinned, or where there is no head, or (auto) when the head does not pay
        self._lookup = drafts_on and (
            policy.source == "lookup"
            or (policy.source == "any" and (self._mtp is None or not self._fixed))
        )
        self._grammar_drafts = policy.mode != "off" and grammar is not None

    # ---- entry points
    def prefill_hook(self, ids: npt.NDArray[np.integer], hidden: F32Array) -> None:
        """After each prefill chunk (compute thread): queue the chunk's rows for the MTP head.
        The head runs over them only when it first drafts (prefill itself reads and computes
        nothing more), over the latest ``_MAX_PENDING`` prompt positions."""
        if self._mtp is not None:
            self._mtp.observe(ids, hidden)

    def first(self, logits: F32Array) -> int:
        """Sample the first generated token from the prefill's last logits [V]."""
        tok = self.sampler.sample(self._masked(logits))
        self._commit(tok)
        return tok

    def step(self, last: int, remaining: int) -> list[Emitted]:
        """One round after ``last`` (emitted, not yet in the cache); at most ``remaining``
        tokens come back, cut after the first stop token."""
        if remaining <= 0:
            return []
        t0 = time.perf_counter()
        start = self.cache.length
        draft = self._propose(last, remaining - 1)
        t_draft = time.perf_counter() - t0
        ids = np.array([last, *draft.tokens], dtype=np.int64)  # [k + 1]
        before = self._store_snapshot()
        t1 = time.perf_counter()
        logits, hidden, unions = self._forward(ids)  # [k + 1, V], [k + 1, D]
        t_fwd = time.perf_counter() - t1
        emitted, acc = self._accept(draft, logits)
        m = len(emitted)
        self.cache.truncate(start + m)  # keep last, e1..e(m-1): the rejected rows are gone
        if self._mtp is not None:
            self._mtp.observe(ids[:m], hidden[:m])
        self._telemetry(draft, ids.size, m, acc, t0, t_draft, t_fwd, before, unions)
        return emitted

    def plain(self, last: int, logits: F32Array) -> list[Emitted]:
        """A round without drafts whose one-row forward of ``last`` ran elsewhere (the engine's
        batched decode step, shared with other generations): sample from ``logits`` [V]."""
        t0 = time.perf_counter()
        if self._mtp is not None:
            self._mtp.forget()
        tok = self.sampler.sample(self._masked(logits))
        self._commit(tok)
        st = self.stats
        st.rounds += 1
        st.tokens += 1
        st.plain_steps += 1
        dt = time.perf_counter() - t0
        st.plain_seconds += dt
        st.seconds += dt
        st.model_seconds += self.cost.step_cost(1)
        return [(tok, logits)]

    # ---- drafting
    def _propose(self, last: int, room: int) -> _Draft:
        d = _Draft()
        if room <= 0:
            return d
        fixed = self._fixed
        cap = min(room, self.policy.k)
        if self._grammar_drafts and self.grammar is not None:
            forced = self.grammar.forced()[:_MAX_FORCED]
            if forced:
                kg = len(forced) if fixed else self.cost.plan("grammar", len(forced))
                kg = min(kg, room)
                for t in forced[:kg]:
                    d.tokens.append(t)
                    d.sources.append("grammar")
                    d.q.append(None)
                cap = min(room, max(cap, kg))
        sources: list[Source] = []
        if self._mtp is not None:
            sources.append("mtp")
        if self._lookup:
            sources.append("lookup")
        left = cap - len(d.tokens)
        if not sources or left <= 0 or (d.tokens and d.tokens[-1] in self.stops):
            return d
        src, want = sources[0], left
        if not fixed:
            # the source with the best estimated speed-up that pays, else a due probe
            sources.sort(key=lambda s: -self.cost.best(s, left)[1])
            want = 0
            for s in sources:
                src, want = s, self.cost.plan(s, left)
                if want > 0:
                    break
            d.probe = want > 0 and not self.cost.pays(src)
        t0 = time.perf_counter()
        catch_up = 0.0
        # an idle MTP head runs nothing: its rows wait (observe keeps a bounded history)
        if want > 0 and src == "mtp":
            catch_up = self._draft_mtp(d, last, want)
        elif want > 0:
            self._draft_lookup(d, last, want)
        n_model = sum(1 for s in d.sources if s == src)
        if n_model:
            self.cost.observe_draft(src, n_model, time.perf_counter() - t0 - catch_up)
        return d

    def _draft_lookup(self, d: _Draft, last: int, want: int) -> None:
        # `last` is already in the history (committed when it was emitted)
        toks = self._legal(d.tokens, lookup_draft([*self._history, *d.tokens], want))
        for t in toks:
            d.tokens.append(t)
            d.sources.append("lookup")
            d.q.append(None)

    def _draft_mtp(self, d: _Draft, last: int, want: int) -> float:
        """Chain ``want`` MTP drafts after ``d``'s tokens; returns the seconds spent catching
        the head up on a backlog (the prompt, rows from rounds it sat out): a one-off cost the
        per-draft estimate leaves out."""
        assert self._mtp is not None
        head = self._mtp
        t0 = time.perf_counter()
        backlog = len(head.pend_t) > want + 1
        real = head.flush(last)
        catch_up = time.perf_counter() - t0 if backlog else 0.0
        if real is None:
            return catch_up
        z, g = real  # [V], [D]
        real_len = head.cache.length
        pushed = 0
        try:
            # chain through the forced tokens already drafted, then draft `want` new ones
            for t in d.tokens:
                if self.grammar is not None:
                    self.grammar.push([t])
                    pushed += 1
                z, g = head.chain(g, t)
            for i in range(want):
                zm = self._masked(z)
                if not np.isfinite(zm).any():
                    break
                q: F64Array | None = None
                if self.sampler.params.greedy:
                    tok = int(np.argmax(zm))
                else:
                    q = self.sampler.probs(zm)
                    tok = sample_from(q, self._rng)
                d.tokens.append(tok)
                d.sources.append("mtp")
                d.q.append(q)
                if tok in self.stops or i + 1 == want:
                    break
                if self.grammar is not None:
                    self.grammar.push([tok])
                    pushed += 1
                z, g = head.chain(g, tok)
        finally:
            if self.grammar is not None:
                self.grammar.rollback(pushed)
            head.cache.truncate(real_len)  # chained rows are drafts, never history
        return catch_up

    def _legal(self, before: list[int], toks: list[int]) -> list[int]:
        """``toks`` (drafted after ``before``) cut at the first token the grammar rejects and
        after the first stop token."""
        if self.grammar is not None and toks:
            self.grammar.push(before)
            try:
                toks = toks[: self.grammar.validate(toks)]
            finally:
                self.grammar.rollback(len(before))
        for i, t in enumerate(toks):
            if t in self.stops:
                return toks[: i + 1]
        return toks

    # ---- verify and accept
    def _forward(self, ids: npt.NDArray[np.int64]) -> tuple[F32Array, F32Array, list[int]]:
        unions: list[int] = []
        model = self.model
        if ids.size == 1 or self._store_stats is None:
            out = model.forward(ids, self.cache)
            return out.logits, out.hidden, unions
        prev = model.observer
        n_main = self._n_main

        def observe(event: str, layer: int, arr: Any) -> None:
            if event == "route" and layer < n_main:
                unions.append(int(np.unique(arr).size))
            if prev is not None:
                prev(event, layer, arr)

        model.observer = observe
        try:
            out = model.forward(ids, self.cache)
        finally:
            model.observer = prev
        return out.logits, out.hidden, unions

    def _accept(self, d: _Draft, logits: F32Array) -> tuple[list[Emitted], int]:
        """Walk the verify rows; returns the emitted (token, raw logits row) pairs and how many
        drafts were accepted."""
        out: list[Emitted] = []
        acc = 0
        greedy = self.sampler.params.greedy
        k = len(d.tokens)
        for i in range(k + 1):
            z = logits[i]  # [V]
            zm = self._masked(z)
            if i == k:
                tok = self.sampler.sample(zm)  # the bonus row (or a plain step)
                ok = False
            elif greedy:
                tok = int(np.argmax(zm))
                ok = tok == d.tokens[i]
            else:
                ok, tok = accept_or_resample(self.sampler.probs(zm), d.q[i], d.tokens[i], self._rng)
            out.append((tok, z))
            acc += int(ok)
            self._commit(tok)
            if tok in self.stops or not ok:
                break
        return out, acc

    # ---- helpers
    def _masked(self, logits: F32Array) -> F32Array:
        return logits if self.grammar is None else self.grammar.mask(logits)

    def _commit(self, tok: int) -> None:
        if self.grammar is not None and tok not in self.stops:
            self.grammar.consume(tok)
        self._history.append(int(tok))

    def _store_snapshot(self) -> tuple[float, int, int] | None:
        if self._store_stats is None:
            return None
        st = self._store_stats()
        stall = float(getattr(st, "compute_stall_s", getattr(st, "read_wait_s", 0.0)))
        looked = int(st.hits_pinned + st.hits_lru + st.misses)
        return stall, int(st.misses), looked

    def _telemetry(
        self,
        d: _Draft,
        rows: int,
        m: int,
        acc: int,
        t0: float,
        t_draft: float,
        t_fwd: float,
        before: tuple[float, int, int] | None,
        unions: list[int],
    ) -> None:
        st, cost = self.stats, self.cost
        k = len(d.tokens)
        # row `acc` rejected its draft when it emitted a token (not cut by a stop or the budget)
        missed = acc if acc < k and acc < m else -1
        for src in SOURCES:
            idx = [i for i, s in enumerate(d.sources) if s == src]
            if not idx:
                continue
            st.proposed[src] += len(idx)
            took = sum(1 for i in idx if i < acc)
            st.accepted[src] += took
            # geometric acceptance: drafts before the first miss, and the miss, were checked
            cost.observe_proposal(src, took + int(missed in idx), took)
        stall_s, misses, looked = 0.0, 0, 0
        after = self._store_snapshot()
        if before is not None and after is not None:
            stall_s = after[0] - before[0]
            misses, looked = after[1] - before[1], after[2] - before[2]
        cost.observe_step(rows, t_fwd, stall=stall_s, misses=misses, lookups=looked)
        if unions:
            cost.observe_union(rows, sum(unions) / len(unions))
        st.rounds += 1
        st.tokens += m
        if k:
            st.verify_steps += 1
            st.probes += int(d.probe)
        dt = time.perf_counter() - t0
        if not k:
            st.plain_steps += 1
            st.plain_seconds += dt
        st.seconds += dt
        st.draft_seconds += t_draft
        st.model_seconds += m * cost.step_cost(1)
