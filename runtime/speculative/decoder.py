"""The round-by-round speculative decoder: draft, verify in one forward, accept, roll back.

Shape legend: see ``runtime.speculative``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from runtime.context import StepContext
from runtime.kv import KVCache
from runtime.policies.tiers import TierStats
from runtime.sampling import Sampler
from runtime.speculative._common import (
    SOURCES,
    Emitted,
    F32Array,
    F64Array,
    Source,
    TokenConstraint,
)
from runtime.speculative.acceptance import accept_or_resample, sample_from
from runtime.speculative.cost import CostModel
from runtime.speculative.drafts import HeadGen, HeadRows, MtpDrafter, lookup_match, run_alone
from runtime.speculative.policy import DraftPolicy
from runtime.speculative.stats import SpecStats

IdArray = npt.NDArray[np.int64]
_MAX_FORCED = 16  # a forced grammar span is drafted whole, up to this many tokens per step


@dataclass
class _Draft:
    tokens: list[int] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    q: list[F64Array | None] = field(default_factory=list)  # [V] each, None = one-hot
    keys: dict[str, str] = field(default_factory=dict)  # source -> its cost-model key
    probe: bool = False

    def add(self, tokens: Sequence[int], source: Source, key: str) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            self.sources.append(source)
            self.q.append(None)
        self.keys[source] = key


class _Clock:
    """Seconds a draft spent: its own compute, plus its share of each head call it waited on
    (a batched head call's time is shared by the drafts in it, not charged whole to each)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._since = time.perf_counter()

    def pause(self) -> None:
        self.spent += time.perf_counter() - self._since

    def resume(self, share: float) -> None:
        self.spent += share
        self._since = time.perf_counter()

    def now(self) -> float:
        return self.spent + time.perf_counter() - self._since


@dataclass
class _Round:
    """A drafted round waiting for its verify forward."""

    draft: _Draft
    ids: npt.NDArray[np.int64]  # [k + 1]: last, then the drafts
    start: int  # cache length before the verify rows
    budget: int  # tokens the generation may still emit: the round's emitted rows are cut there
    t0: float
    t_draft: float
    before: tuple[float, int, int] | None  # store counters before the forward


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
        store_stats: Callable[[], TierStats] | None = None,
        reproducible: bool = False,
        ctx: StepContext | None = None,
    ) -> None:
        """``ctx``: how the rounds compute (the engine's decode context)."""
        self.model = model
        self.ctx = ctx if ctx is not None else StepContext()
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
        # the prompt and every committed token, for prompt lookup ([: _n_hist]; grows by doubling)
        h = np.asarray(prompt, dtype=np.int64).reshape(-1)
        self._hist = np.zeros(max(64, 2 * h.size), np.int64)
        self._hist[: h.size] = h
        self._n_hist = int(h.size)
        self._n_main = int(model.config.num_hidden_layers)
        # reproducible (seeded sampling under "auto"): no choice may follow timings, so model
        # drafts stay off and forced grammar spans are always drafted
        self._fixed = policy.mode == "fixed" or reproducible
        drafts_on = policy.mode != "off" and not reproducible
        self._mtp: MtpDrafter | None = None
        if drafts_on and policy.source in ("any", "mtp") and model.has_mtp:
            self._mtp = MtpDrafter(model)
        # prompt lookup: pinned, or where there is no head, or (auto) next to the head
        self._lookup = drafts_on and (
            policy.source == "lookup"
            or (policy.source == "any" and (self._mtp is None or not self._fixed))
        )
        self._grammar_drafts = policy.mode != "off" and grammar is not None
        self._round: _Round | None = None

    # ---- entry points
    def prefill_hook(self, ids: npt.NDArray[np.integer], hidden: F32Array) -> None:
        """After each prefill chunk (compute thread): queue the chunk's rows for the MTP head.
        The head runs over them only when it first drafts (prefill itself reads and computes
        nothing more), over the latest ``MAX_PENDING`` prompt positions."""
        if self._mtp is not None:
            self._mtp.observe(ids, hidden)

    def first(self, logits: F32Array) -> int:
        """Sample the first generated token from the prefill's last logits [V]."""
        tok = self.sampler.sample(self._masked(logits))
        self._commit(tok)
        return tok

    def step(self, last: int, remaining: int) -> list[Emitted]:
        """One round after ``last`` (emitted, not yet in the cache); at most ``remaining``
        tokens come back, cut after the first stop token: :meth:`draft`, the verify forward
        alone, :meth:`accept`."""
        if remaining <= 0:
            return []
        ids = self.draft(last, remaining)
        t1 = time.perf_counter()
        logits, hidden, unions = self._forward(ids)  # [k + 1, V], [k + 1, D]
        return self.accept(logits, hidden, t_fwd=time.perf_counter() - t1, unions=unions)

    def draft(
        self, last: int, remaining: int, others: int = 0, other_seqs: int | None = None
    ) -> npt.NDArray[np.int64]:
        """Plan a round after ``last`` (emitted, not yet in the cache) that emits at most
        ``remaining`` (>= 1) tokens: returns its verify rows ``[last, *drafts]`` [k + 1]. Their
        forward runs next over ``cache`` (alone, or in the engine's batched step with other
        generations' rows: ``others`` rows of ``other_seqs`` generations, default one row
        each), then :meth:`accept` takes its logits and hidden rows. Compute thread (MTP
        drafting runs the head)."""
        gen = self.draft_steps(last, remaining, others, other_seqs)
        return run_alone(self.model, self.ctx, gen)

    def draft_steps(
        self, last: int, remaining: int, others: int = 0, other_seqs: int | None = None
    ) -> HeadGen[IdArray]:
        """:meth:`draft` as a generator that yields each MTP head call it needs
        (:class:`HeadRows`) and is sent its result, so that the scheduler can run the head
        calls of several generations' drafts as one batched call (:func:`run_heads`).

        How many tokens are drafted does not depend on ``remaining`` (only on the context left
        for the verify rows): the rounds, and so the random draws of a seeded generation, are
        the same whatever the token limit, and a smaller limit cuts the same text shorter
        (:meth:`accept` cuts the emitted rows at ``remaining``)."""
        t0 = time.perf_counter()
        clock = _Clock()
        start = self.cache.length
        room = int(self.model.config.max_position_embeddings) - start  # verify rows that fit
        d = yield from self._propose(clock, last, max(0, room - 1), others, other_seqs)
        t_draft = clock.now()
        ids = np.array([last, *d.tokens], dtype=np.int64)  # [k + 1]
        self._round = _Round(d, ids, start, remaining, t0, t_draft, self._store_snapshot())
        return ids

    def accept(
        self,
        logits: F32Array,
        hidden: F32Array,
        *,
        t_fwd: float | None = None,
        unions: Sequence[int] = (),
        shared: bool = False,
        step: tuple[int, float, int] | None = None,
    ) -> list[Emitted]:
        """Finish the round :meth:`draft` planned from its verify rows' ``logits`` [k + 1, V]
        and ``hidden`` [k + 1, D] (already in the cache): accept or resample the drafts, cut
        the cache to what was emitted (all but the final token), feed the MTP head. ``t_fwd``:
        the forward's seconds when it ran alone (the cost model learns from it; None for a
        batched step, whose time the other rows share); ``shared``: other generations' rows
        were in the same forward; ``step``: (rows, seconds, sequences) of that batched forward,
        given to
        one generation per step (the cost model learns what a wide step costs)."""
        r = self._round
        if r is None:
            raise RuntimeError("accept() without a drafted round")
        self._round = None
        emitted, acc = self._accept(r.draft, logits)
        if len(emitted) > r.budget:  # the generation's last round: cut at its token limit
            emitted = emitted[: r.budget]
            acc = min(acc, len(emitted))
        m = len(emitted)
        self.cache.truncate(r.start + m)  # keep last, e1..e(m-1): the rejected rows are gone
        if self._mtp is not None:
            self._mtp.observe(r.ids[:m], hidden[:m])
        self._telemetry(r, m, acc, t_fwd, list(unions), shared, step)
        return emitted

    def abandon(self) -> None:
        """Drop a drafted round whose forward will not be accepted (a cancelled generation)."""
        self._round = None

    # ---- drafting
    def _propose(
        self, clock: _Clock, last: int, room: int, others: int, other_seqs: int | None
    ) -> HeadGen[_Draft]:
        d = _Draft()
        if room <= 0:
            return d
        fixed = self._fixed
        cap = min(room, self.policy.k)
        if self._grammar_drafts and self.grammar is not None:
            forced = self.grammar.forced()[:_MAX_FORCED]
            if forced:
                kg = (
                    len(forced)
                    if fixed
                    else self.cost.plan("grammar", len(forced), others, other_seqs)
                )
                kg = min(kg, room)
                d.add(forced[:kg], "grammar", "grammar")
                cap = min(room, max(cap, kg))
        left = cap - len(d.tokens)
        if left <= 0 or (d.tokens and d.tokens[-1] in self.stops):
            return d
        if self._mtp is None and not self._lookup:
            return d
        # prompt lookup costs next to nothing: its draft (if any) is known before choosing
        look: list[int] = []
        look_key = "lookup"
        if self._lookup:
            t0 = time.perf_counter()
            hist = self._hist[: self._n_hist]
            if d.tokens:
                hist = np.concatenate([hist, np.asarray(d.tokens, dtype=np.int64)])
            toks, n = lookup_match(hist, left)
            look = self._legal(d.tokens, toks)
            look_key = f"lookup-{n}"
            self.cost.observe_draft("lookup", 1, time.perf_counter() - t0)
        if fixed:
            # a pinned source, or "N": the MTP head when the model has one, else lookup
            if self._mtp is not None:
                yield from self._draft_mtp(clock, d, last, left)
            else:
                d.add(look, "lookup", look_key)
            return d
        # auto: the key and k of the best estimated tokens/s (lookup from this match, or the
        # head), plain when neither pays, or a due probe
        options: dict[str, int] = {}
        if self._mtp is not None:
            options["mtp"] = left
        if look:
            options[look_key] = len(look)
        key, want, d.probe = self.cost.choose(options, others, other_seqs)
        if key == "mtp":
            yield from self._draft_mtp(clock, d, last, want)
        elif key is not None:
            d.add(look[:want], "lookup", key)
        return d

    def _draft_mtp(self, clock: _Clock, d: _Draft, last: int, want: int) -> HeadGen[None]:
        """Chain ``want`` MTP drafts after ``d``'s tokens and tell the cost model what the
        first draft (the head over the positions accepted since it last ran) and the chained
        ones cost; a first draft that caught the head up on a backlog (the prompt, rows from
        rounds it sat out) is a one-off the estimate leaves out. Each head call is yielded
        (:meth:`draft_steps`); ``clock`` counts this draft's own time and its share of them."""
        assert self._mtp is not None
        head = self._mtp
        d.keys["mtp"] = "mtp"
        t0 = clock.now()
        backlog = len(head.pend_t) > self.cost.max_k + 1
        planned = 1 + len(d.tokens) + want  # the verify rows this round expects to give
        ask = head.flush_rows(last, planned)
        if ask is None:
            return
        z, g = yield from self._head(clock, ask)  # [V], [D]
        head.flushed(last)
        real_len = head.cache.length
        pushed = 0
        t_first: float | None = None
        chained = 0
        try:
            # chain through the forced tokens already drafted, then draft `want` new ones
            for t in d.tokens:
                if self.grammar is not None:
                    self.grammar.push([t])
                    pushed += 1
                z, g = yield from self._head(clock, head.chain_rows(g, t, planned))
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
                if t_first is None:
                    t_first = clock.now() - t0
                if tok in self.stops or i + 1 == want:
                    break
                if self.grammar is not None:
                    self.grammar.push([tok])
                    pushed += 1
                z, g = yield from self._head(clock, head.chain_rows(g, tok, planned))
                chained += 1
        finally:
            if self.grammar is not None:
                self.grammar.rollback(pushed)
            head.cache.truncate(real_len)  # chained rows are drafts, never history
        if t_first is not None:
            rest = clock.now() - t0 - t_first
            self.cost.observe_draft_parts("mtp", None if backlog else t_first, chained, rest)

    @staticmethod
    def _head(clock: _Clock, ask: HeadRows) -> HeadGen[tuple[F32Array, F32Array]]:
        """One head call of a draft: yielded to whoever drives the draft; its share of the
        call's time goes on ``clock``."""
        clock.pause()
        z, g, share = yield ask
        clock.resume(share)
        return z, g

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
            out = model.forward(ids, self.cache, ctx=self.ctx)
            return out.logits, out.hidden, unions
        n_main = self._n_main

        def observe(event: str, layer: int, arr: Any) -> None:
            if event == "route" and layer < n_main:
                unions.append(int(np.unique(arr).size))

        out = model.forward(ids, self.cache, ctx=self.ctx.observing(observe))
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
        if self._n_hist == self._hist.size:
            self._hist = np.concatenate([self._hist, np.zeros_like(self._hist)])
        self._hist[self._n_hist] = tok
        self._n_hist += 1

    def _store_snapshot(self) -> tuple[float, int, int] | None:
        if self._store_stats is None:
            return None
        st = self._store_stats()
        looked = st.hits_pinned + st.hits_lru + st.misses
        return st.compute_stall_s, st.misses, looked

    def _telemetry(
        self,
        r: _Round,
        m: int,
        acc: int,
        t_fwd: float | None,
        unions: list[int],
        shared: bool,
        step: tuple[int, float, int] | None = None,
    ) -> None:
        st, cost, d = self.stats, self.cost, r.draft
        k = len(d.tokens)
        rows, seqs = k + 1, 1
        if t_fwd is None and step is not None:  # a batched step: its rows, seconds, sequences
            rows, t_fwd, seqs = step
            unions = []
        # row `acc` rejected its draft when it emitted a token (not cut by a stop or the budget)
        missed = acc if acc < k and acc < m else -1
        for src in SOURCES:
            idx = [i for i, s in enumerate(d.sources) if s == src]
            if not idx:
                continue
            st.proposed[src] += len(idx)
            took = sum(1 for i in idx if i < acc)
            st.accepted[src] += took
            # acceptance per position: drafts before the first miss, and the miss, were checked
            cost.observe_proposal(d.keys.get(src, src), took + int(missed in idx), took)
        if t_fwd is not None:
            stall_s, misses, looked = 0.0, 0, 0
            after = self._store_snapshot()
            if r.before is not None and after is not None:
                stall_s = after[0] - r.before[0]
                misses, looked = after[1] - r.before[1], after[2] - r.before[2]
            cost.observe_step(rows, t_fwd, seqs=seqs, stall=stall_s, misses=misses, lookups=looked)
            if unions:
                cost.observe_union(rows, sum(unions) / len(unions))
        st.rounds += 1
        st.tokens += m
        if k:
            st.verify_steps += 1
            st.probes += int(d.probe)
        if shared:
            st.batched_rounds += 1
            st.batched_tokens += m
            if k:
                st.batched_verify_rounds += 1
                st.batched_proposed += k
                st.batched_accepted += acc
        dt = time.perf_counter() - r.t0
        if not k:
            st.plain_steps += 1
            st.plain_seconds += dt
        st.seconds += dt
        st.draft_seconds += r.t_draft
        st.model_seconds += m * cost.step_cost(1)
