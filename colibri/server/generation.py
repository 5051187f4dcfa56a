"""One generation request, API-neutral: the OpenAI and Anthropic routes both drive this.

It iterates ``engine.generate`` (one call per request: whatever batching the engine does, the
server needs nothing else), turns token ids into text incrementally, applies stop strings, the
``<think>`` split and tool-call parsing, measures TTFT / inter-token latency / queue wait, runs
in a KV slot when asked (prefix reuse, then the slot is saved before the response ends), and
records the turn for ``/profile`` and ``/metrics``.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import anyio

from colibri._engine import DoneEvent, GenerationEvent, TokenEvent
from colibri.server.errors import ApiError
from colibri.server.state import AppState, Lease, Ticket, Turn
from colibri.server.textproc import (
    ParsedToolCall,
    StopMatcher,
    ThinkSplitter,
    ToolCallSplitter,
)
from runtime.grammar import GrammarError
from runtime.sampling import log_softmax, top_ids
from storage.errors import ColibriError, ModelError

__all__ = ["Delta", "GenParams", "Generation", "Result", "TokenLogprob", "check_prompt", "new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class GenParams:
    """What to generate (already validated and tokenized by a route)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None: the model's end-of-sequence ids
    logprobs: bool = False
    top_logprobs: int = 0
    slot: int | None = None
    slot_explicit: bool = False  # named by the request (cache_slot), not matched automatically
    tenant: str | None = None  # the API key it came with (security.tenant_of)
    think: bool = False  # split <think>...</think> into reasoning
    think_open: bool = False  # the prompt ends inside a think section
    tools: list[dict[str, Any]] | None = None  # parse tool-call blocks against these
    one_call: bool = False  # parallel_tool_calls false: only the first call is a call
    grammar: Any = None  # runtime.grammar.GrammarSpec: structured output (response_format)
    draft: str | int | None = None  # the request's drafting (None: the engine's --draft)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token, its logprob and the most likely alternatives (id, text, logprob);
    ``raw`` / ``top_raw``: their bytes (a token's text may be U+FFFD: part of a character)."""

    token_id: int
    token: str
    raw: bytes
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    top_raw: tuple[bytes, ...] = ()  # one per entry of ``top``


@dataclass
class Delta:
    """New text of one kind, with the logprobs of the tokens released since the last delta."""

    kind: Literal["content", "reasoning"]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Result:
    """The finished generation."""

    finish_reason: str  # stop | length | tool_calls | cancelled
    stop_sequence: str | None
    content: str
    reasoning: str
    tool_calls: list[ParsedToolCall]
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    turn: Turn

    @property
    def prompt_tokens(self) -> int:
        return self.turn.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.turn.completion_tokens

    def stats(self) -> dict[str, Any]:
        """colibri's own counters for this request (the ``colibri`` field of responses)."""
        t = self.turn.as_dict()
        keys = (
            "slot",
            "prompt_tokens_computed",
            "prompt_tokens_reused",
            "queue_wait_ms",
            "ttft_ms",
            "prefill_ms",
            "decode_tokens_per_s",
            "total_ms",
            "score_ms",
        )
        return {k: t[k] for k in keys}


def check_prompt(
    state: AppState,
    ids: list[int],
    max_tokens: int | None,
    *,
    param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> int:
    """Validate prompt ids against the vocabulary and context; returns max_tokens to use.
    ``param``: the request field that holds the prompt; ``max_tokens_param``: the one that
    held ``max_tokens`` (both named in the errors)."""
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param, code="empty_prompt")
    ctx = state.context_length
    if len(ids) >= ctx:
        raise ApiError(
            400,
            f"this model's context is {ctx} tokens, but the prompt has {len(ids)} tokens; "
            "shorten it",
            param=param,
            code="context_length_exceeded",
        )
    # after the context check: an over-long prompt is refused without a scan of its ids
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"token id {bad[0]} is outside the vocabulary (0..{state.vocab_size - 1})",
            param="prompt",
            code="invalid_token",
        )
    if max_tokens is None:
        return ctx - len(ids)
    if len(ids) + max_tokens > ctx:
        raise ApiError(
            400,
            f"this model's context is {ctx} tokens: {len(ids)} prompt tokens + "
            f"{max_tokens_param} {max_tokens} exceed it; lower {max_tokens_param} to at most "
            f"{ctx - len(ids)}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens


class Generation:
    """Run one request: ``gen.run(lease)`` streams deltas, ``gen.complete(lease)`` waits for the
    :class:`Result` (also in ``gen.result`` afterwards)."""

    def __init__(self, state: AppState, params: GenParams, route: str, request_id: str) -> None:
        self.state = state
        self.p = params
        self.route = route
        self.id = request_id
        self.result: Result | None = None
        self._tok = state.tokenizer
        self._text_cache: dict[int, str] = {}
        self._reused: int | None = None  # prompt tokens the KV slot already holds (admit)
        self._score_s: float | None = None  # prompt_logprobs' seconds (the turn's score_s)

    def _token_text(self, tid: int) -> str:
        t = self._text_cache.get(tid)
        if t is None:
            t = self._text_cache[tid] = self._tok.decode([tid])
        return t

    def _logprob(self, ev: TokenEvent, *, spelled: bool = False) -> TokenLogprob:
        """``spelled``: the token stands in text that holds special tokens as written (an
        echoed prompt: "<|user|>hello" is its own text), not in decoded output (which leaves
        them out): their text and bytes are then their spelling, so offsets stay right."""
        top = tuple((t, self._token_text(t), lp) for t, lp in ev.top)
        tok = self._tok
        raw = tok.token_bytes(ev.token_id, spelled=spelled)
        text = self._token_text(ev.token_id)
        if spelled and tok.is_special(ev.token_id):
            text = raw.decode("utf-8", "replace")
        return TokenLogprob(
            ev.token_id, text, raw, ev.logprob, top, tuple(tok.token_bytes(t) for t, _ in ev.top)
        )

    async def prompt_logprobs(self, n_top: int, text: str | None = None) -> list[TokenLogprob]:
        """Each prompt token's logprob given the tokens before it, with the ``n_top`` most
        likely alternatives (legacy completions' ``echo`` with ``logprobs``: scoring a
        prompt). One forward over the prompt; the first token has no context, so its entry
        holds 0.0 (:func:`completion_logprobs` reports it as null)."""
        ids = self.p.prompt_ids
        t0 = time.perf_counter()
        try:
            logits = await self.state.engine.forward(ids)  # [T, V]
        finally:
            self._score_s = (self._score_s or 0.0) + time.perf_counter() - t0

        # ``text``: the prompt as sent, which the echo returns: a special token spelled in it
        # ("<|user|>") stands for its spelling there; one the tokenizer added (a BOS) for none.
        # Which is which, the tokenizer's own spans say (a token's bytes need not rebuild the
        # text: a sentencepiece "▁Hi" at the start, an NFC-normalized run).
        spelled_at: set[int] = set()
        if text is not None:
            same, spans = self._tok.spans(text)
            if same == [int(i) for i in ids]:
                spelled_at = {
                    k for k, (a, b) in enumerate(spans) if b > a and self._tok.is_special(same[k])
                }

        def entry(ev: TokenEvent) -> TokenLogprob:
            return self._logprob(ev, spelled=ev.index in spelled_at)

        def entries() -> list[TokenLogprob]:
            out = [entry(TokenEvent(ids[0], 0, 0.0))]
            for i in range(1, len(ids)):
                row = log_softmax(logits[i - 1])  # [V]
                top = tuple((int(t), float(row[t])) for t in top_ids(row, n_top)) if n_top else ()
                out.append(entry(TokenEvent(ids[i], i, float(row[ids[i]]), top)))
            return out

        return await self.state.off_loop(entries)

    async def complete(self, lease: Lease) -> Result:
        """Run to the end (non-streaming responses)."""
        async with aclosing(self.run(lease)) as deltas:
            async for _ in deltas:
                pass
        return self.final()

    def final(self) -> Result:
        """The result once :meth:`run` has finished."""
        if self.result is None:  # pragma: no cover - run() sets it or raises
            raise ApiError(500, "generation ended without a result")
        return self.result

    @asynccontextmanager
    async def admitted(self, ticket: Ticket) -> AsyncIterator[Lease]:
        """The request's place (its KV slot, then a compute place: ``Admission.enter``). A
        request that ends while still queued (its client gave up, the server stops) is
        recorded as a cancelled turn, in ``/profile`` and the metrics, as one that ends while
        generating is; once admitted, :meth:`run` records it."""
        st = self.state
        entered = False
        try:
            async with st.admission.enter(
                ticket, st.slots, self.p.slot, named=self.p.slot_explicit
            ) as lease:
                entered = True
                yield lease
        except BaseException as exc:
            if not entered:
                cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
                self._record_queued(ticket, "cancelled" if cancelled else "error")
            raise

    def _record_queued(self, ticket: Ticket, reason: str) -> None:
        p, metrics = self.p, self.state.metrics
        turn = Turn(
            id=self.id,
            route=self.route,
            started=time.time() - ticket.wait_s,
            slot=p.slot,
            prompt_tokens=len(p.prompt_ids),
            prompt_tokens_computed=0,
            prompt_tokens_reused=0,
            max_tokens=p.max_tokens,
            finish_reason=reason,
            queue_wait_s=ticket.wait_s,
            total_s=time.perf_counter() - ticket.arrived,
        )
        metrics.request_success.labels(turn.finish_reason).inc()
        metrics.e2e.observe(turn.total_s)
        # counted as an admitted request's are (its prompt and its wait were left out)
        metrics.prompt_tokens.inc(turn.prompt_tokens)
        metrics.queue_time.observe(ticket.wait_s)
        self.state.record(turn)

    def admit(self, lease: Lease) -> int:
        """Ready the lease's KV slot for this request (a slot another key used is emptied
        first) and return how many prompt tokens its cache already holds (reused, not
        computed). Once per generation: :meth:`run` calls it, and a route that reports that
        split before the run starts (Anthropic's ``message_start``) calls it first."""
        if self._reused is not None:
            return self._reused
        st, p = self.state, self.p
        slot = lease.slot
        cache = None if slot is None else slot.cache
        if slot is not None and cache is not None:
            # Another key's conversation is emptied before use, so nothing of it is reused. A
            # slot restored from disk has no known key (the file does not record one): with
            # several keys it is nobody's, so its rows are dropped rather than handed to
            # whichever key names it first.
            foreign = slot.tenant != p.tenant
            if st.config.reuse_scope == "key" and foreign:
                cache.truncate(0)
            slot.tenant = p.tenant
        reused = (
            0
            if cache is None
            else st.engine.prompt_reuse(
                cache, p.prompt_ids, temperature=p.temperature, seed=p.seed, draft=p.draft
            )
        )
        if slot is not None:
            slot.persisted = min(slot.persisted, reused)  # rows past it are about to change
        self._reused = reused
        return reused

    async def run(self, lease: Lease) -> AsyncGenerator[Delta, None]:
        """Yield text deltas as they are final; ``self.result`` is set when it returns.

        Consume it inside ``aclosing``: a consumer cancelled while this generator waits at a
        ``yield`` must close it at once, which closes the engine's generator (its lock)."""
        st, p = self.state, self.p
        engine = st.engine
        slot = lease.slot
        cache = None if slot is None else slot.cache
        reused = self.admit(lease)
        turn = Turn(
            id=self.id,
            route=self.route,
            started=time.time() - lease.ticket.wait_s,
            slot=p.slot,
            prompt_tokens=len(p.prompt_ids),
            prompt_tokens_computed=len(p.prompt_ids) - reused,
            prompt_tokens_reused=reused,
            max_tokens=p.max_tokens,
            queue_wait_s=lease.ticket.wait_s,
            score_s=self._score_s,
        )
        stream = self._tok.stream()
        stopper = StopMatcher(p.stop)
        think = ThinkSplitter(enabled=p.think, inside=p.think_open)
        tools = ToolCallSplitter(enabled=p.tools is not None)
        content: list[str] = []
        reasoning: list[str] = []
        pending_lp: list[TokenLogprob] = []
        all_lp: list[TokenLogprob] = []
        # where each logprob's token text starts in the text fed to the stop matcher (one per
        # all_lp entry): a token whose text starts at or after the stop string it completed is
        # not part of the output, and neither is its logprob
        lp_at: list[int] = []
        fed = 0

        def drop_past_stop() -> None:
            """Drop the logprobs of the tokens whose text starts at or after the stop string
            just matched; they are still pending (never attached to a delta: their text was
            held back)."""
            keep = sum(1 for at in lp_at if at < stopper.released)
            cut = len(all_lp) - keep
            assert 0 <= cut <= len(pending_lp)
            del all_lp[keep:], lp_at[keep:]
            del pending_lp[len(pending_lp) - cut :]

        ids: list[int] = []
        reason = "cancelled"
        t_admit = lease.ticket.admitted or time.perf_counter()
        t_first: float | None = None
        t_last: float | None = None
        stops = p.stop_token_ids
        stop_set = set(engine.container.eos_token_ids if stops is None else stops)
        if p.grammar is not None:  # the engine ends a constrained generation there too
            stop_set |= set(engine.container.eos_token_ids)
        metrics = st.metrics

        def route(text: str, final: bool = False) -> list[Delta]:
            parts = think.feed(text) + (think.flush() if final else [])
            out: list[Delta] = []
            for kind, t in parts:
                if kind == "content":
                    t = tools.feed(t)
                if t:
                    out.append(Delta("reasoning" if kind == "reasoning" else "content", t))
            return out

        def emit(deltas: list[Delta]) -> list[Delta]:
            for d in deltas:
                (content if d.kind == "content" else reasoning).append(d.text)
            if deltas and pending_lp:
                # the tokens whose text has begun to be released (the rest wait: their text is
                # held back or empty so far)
                starts = lp_at[len(lp_at) - len(pending_lp) :]
                n = sum(1 for at in starts if at < stopper.released)
                if n:
                    deltas[0].logprobs = pending_lp[:n]
                    del pending_lp[:n]
            return deltas

        try:
            # generate is declared an AsyncIterator; it is an async generator (aclose)
            agen = cast(
                AsyncGenerator[GenerationEvent, None],
                engine.generate(
                    p.prompt_ids,
                    max_new_tokens=p.max_tokens,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    seed=p.seed,
                    stop_token_ids=stops,
                    cache=cache,
                    top_logprobs=p.top_logprobs if p.logprobs else 0,
                    grammar=p.grammar,
                    draft=p.draft,
                ),
            )
            hit = False
            async with aclosing(agen):
                async for ev in agen:
                    if isinstance(ev, DoneEvent):
                        reason = "stop" if ev.reason == "stop" else ev.reason
                        turn.time = ev.stats.get("time")
                        continue
                    now = time.perf_counter()
                    if t_first is None:
                        t_first = now
                        turn.ttft_s = now - lease.ticket.arrived
                        turn.prefill_s = now - t_admit
                        metrics.ttft.observe(turn.ttft_s)
                    elif t_last is not None:
                        metrics.itl.observe(now - t_last)
                    t_last = now
                    turn.decode_s = now - t_first
                    ids.append(ev.token_id)
                    turn.completion_tokens = len(ids)
                    metrics.generation_tokens.inc()  # as generated, not when the request ends
                    if ev.token_id in stop_set:
                        # the token that ends the generation (end-of-sequence, or one of the
                        # request's stop_token_ids) is not part of the output: neither its
                        # text nor its logprob (its id stays in token_ids)
                        continue
                    piece = stream.push(ev.token_id)
                    start = stream.last_start  # (its own text, after what it released)
                    if not piece and stopper.stops and stopper.would_hit(stream.pending()):
                        # a stop string in text held back (a byte token's run): the
                        # generation ends here, so that text is final; it was found only
                        # once the run ended, a step or many later
                        piece, start = stream.flush(), 0
                    if p.logprobs:
                        lp = self._logprob(ev)
                        pending_lp.append(lp)
                        all_lp.append(lp)
                        lp_at.append(fed + start)
                    fed += len(piece)
                    released, hit = stopper.feed(piece)
                    if hit:  # the tokens from the stop string on are not in the output
                        drop_past_stop()
                    for d in emit(route(released)):
                        yield d
                    if hit:
                        reason = "stop"
                        break
            if not hit:
                tail, hit = stopper.feed(stream.flush())
                if hit:  # in the text held back to the end: a stop all the same
                    drop_past_stop()
                    reason = "stop"
                tail += stopper.flush()
            else:
                tail = ""
            final = emit(route(tail, final=True))
            # cut at max_tokens, a stop string or a stop token id the request added: an
            # unclosed last block is no finished call (it became one with its arguments lost)
            asked = ids and ids[-1] in stop_set and ids[-1] not in engine.container.eos_token_ids
            cut = reason == "length" or stopper.hit is not None or bool(asked)
            rest, calls = tools.finish(p.tools, cut=cut)
            if p.one_call:
                calls = calls[:1]
            if rest:
                final += emit([Delta("content", rest)])
            if pending_lp:
                final.append(Delta("content", "", pending_lp.copy()))
                pending_lp.clear()
            for d in final:
                yield d
            if calls and reason != "length":
                # the model stopped to call tools; a call cut off by max_tokens is no finished
                # call (OpenAI reports "length" then too)
                reason = "tool_calls"
            lease.release_compute()
            if slot is not None:
                slot.turns += 1
                if p.slot_explicit or st.config.kv_persist_auto:
                    with anyio.CancelScope(shield=True):
                        await st.slots.persist(slot)
            self.result = Result(
                finish_reason=reason,
                stop_sequence=stopper.hit,
                content="".join(content),
                reasoning="".join(reasoning),
                tool_calls=calls,
                token_ids=ids,
                logprobs=all_lp,
                turn=turn,
            )
        except GrammarError as exc:  # (a parser limit a grammar reached mid-generation)
            reason = "error"
            raise ApiError(
                400, f"response_format: {exc}", param="response_format", code="invalid_request"
            ) from exc
        except ModelError as exc:
            reason = "error"
            raise ApiError(400, str(exc), code="invalid_request") from exc
        except ColibriError as exc:
            reason = "error"
            raise ApiError(503, f"the engine failed: {exc}", code="engine_error") from exc
        except Exception:
            reason = "error"
            raise
        finally:
            turn.finish_reason = reason if self.result is not None else _aborted(reason)
            turn.total_s = time.perf_counter() - lease.ticket.arrived
            metrics.request_success.labels(turn.finish_reason).inc()
            metrics.prompt_tokens.inc(turn.prompt_tokens)
            metrics.prompt_tokens_cached.inc(turn.prompt_tokens_reused)
            metrics.e2e.observe(turn.total_s)
            st.record(turn)


def _aborted(reason: str) -> str:
    return "error" if reason == "error" else "cancelled"


def logprob_entry(lp: TokenLogprob, n_top: int) -> dict[str, Any]:
    """OpenAI chat ``logprobs.content[i]``."""
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.raw),
        "top_logprobs": [
            {"token": t, "logprob": v, "bytes": list(raw)}
            for (_, t, v), raw in zip(lp.top[:n_top], lp.top_raw[:n_top], strict=True)
        ],
    }


class TextOffsets:
    """Where each generated token's text begins in the returned text (legacy completions'
    ``text_offset``), in characters from ``start`` (the echoed prompt's length): the index of
    the character that holds the token's first byte, with the tokens' bytes decoded as the
    text is (UTF-8, an invalid sequence one U+FFFD). A character split over several tokens
    counts once, and each of its tokens begins where it does (their own texts are U+FFFD each:
    counting those put every later offset too far). One per response: a stream's deltas share
    it."""

    def __init__(self, start: int = 0) -> None:
        self.pos = start  # characters the bytes so far decode to, the pending ones left out
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, raw: bytes) -> int:
        """The offset of the token whose bytes are ``raw`` (the next one)."""
        pending, flag = self._utf8.getstate()
        at = self.pos
        if pending and raw and not self._continues(pending, flag, raw[:1]):
            # the pending bytes end as U+FFFD(s) and this token's first byte starts anew
            at += len(pending.decode("utf-8", errors="replace"))
        self.pos += len(self._utf8.decode(raw))
        return at

    @staticmethod
    def _continues(pending: bytes, flag: int, byte: bytes) -> bool:
        """Whether ``byte`` carries on the character whose first bytes are ``pending``."""
        probe = codecs.getincrementaldecoder("utf-8")(errors="strict")
        probe.setstate((pending, flag))
        try:
            probe.decode(byte)
        except UnicodeDecodeError:
            return False
        return True


def _by_text(top: Sequence[tuple[int, str, float]]) -> dict[str, float]:
    """The legacy completions' top_logprobs: one entry per token text. Tokens that render
    alike (byte pieces of a character as U+FFFD, special tokens as "") share one key, which
    keeps the most likely one's logprob (the last one's overwrote it: a -5.3 shown for a -1.95)."""
    out: dict[str, float] = {}
    for _, text, value in top:
        if text not in out or value > out[text]:
            out[text] = value
    return out


def completion_logprobs(
    lps: list[TokenLogprob],
    n_top: int,
    offsets: TextOffsets | None = None,
    *,
    unscored_first: bool = False,
) -> dict[str, Any]:
    """OpenAI legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs,
    text_offset); ``offsets`` carries the position on from earlier tokens of the response.
    ``unscored_first``: ``lps`` starts with an echoed prompt's first token, which nothing
    precedes: its logprob and alternatives are null (as OpenAI's)."""
    where = offsets if offsets is not None else TextOffsets()
    logprobs: list[float | None] = [lp.logprob for lp in lps]
    tops: list[dict[str, float] | None] = [_by_text(lp.top[:n_top]) for lp in lps]
    if unscored_first and lps:
        logprobs[0] = tops[0] = None
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": logprobs,
        "top_logprobs": tops if n_top else None,
        "text_offset": [where.take(lp.raw) for lp in lps],
    }


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (content a string, tool-call arguments dicts)."""

    def as_object(call: dict[str, Any], fn: dict[str, Any]) -> None:
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        call.setdefault("name", fn.get("name"))
        call.setdefault("arguments", fn.get("arguments"))

    out = map_tool_calls(messages, as_object)
    for d in out:
        if d.get("content") is None:
            d["content"] = ""
    return out


def map_tool_calls(
    messages: Sequence[Mapping[str, Any]], change: Callable[[dict[str, Any], dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose tool calls, and each call's ``function``, are copies too,
    each passed to ``change(call, function)`` to edit in place."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d = dict(m)
        calls = d.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                c = dict(c)
                fn = dict(c.get("function") or {})
                change(c, fn)
                c["function"] = fn
                fixed.append(c)
            d["tool_calls"] = fixed
        out.append(d)
    return out
