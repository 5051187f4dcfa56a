"""Everything one server instance holds: its settings, the engine, the tokenizer, the admission
queue, KV slots, metrics and the recent-turn profile. Built by the app factory; nothing here is
module-level state.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, field_validator

from colibri._engine import Engine
from colibri.server.errors import ApiError
from colibri.server.metrics import Metrics
from colibri.server.slots import Slot, SlotPool
from colibri.tokenizer import ChatTokenizer, PromptTooLongError

T = TypeVar("T")

# Filled while a request runs (the access-log middleware sets a fresh dict per request): the
# turn a generation recorded, so the request's one access line can report its tokens.
ACCESS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("colibri_access")

__all__ = ["Admission", "AppState", "Lease", "ServerConfig", "Ticket", "Turn"]

MAX_BODY = 4 * 1024 * 1024


class ServerConfig(BaseModel):
    """Server settings (each is a ``coli serve`` flag)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = None
    api_keys: tuple[str, ...] = Field(
        default=(), description="more API keys; each is its own tenant (with api_key the first)"
    )

    @field_validator("api_key", "api_keys")
    @classmethod
    def _printable_ascii(cls, v: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        """A key no client could send: HTTP header values reach the server as latin-1, while
        clients encode a non-ASCII key as UTF-8, so such a key would lock every client out."""
        for key in (v,) if isinstance(v, str) else v or ():
            if not key or not key.isascii() or not key.isprintable() or key != key.strip():
                raise ValueError(
                    "an API key must be non-empty printable ASCII without surrounding spaces"
                )
        return v

    prefix_reuse: Literal["auto", "key", "all", "off"] = Field(
        default="auto",
        description="automatic prefix matching for requests without cache_slot: 'all' across "
        "every client, 'key' only among requests with the same API key, 'off' never; 'auto' "
        "is 'key' with several keys, else 'all'",
    )
    kv_persist_auto: bool = Field(
        default=False,
        description="also save slots used by automatic prefix matching (requests without "
        "cache_slot) to disk; off: they are kept in memory only",
    )
    served_model_name: str | None = None
    queue: int = Field(default=8, ge=0, description="requests allowed to wait; more get 429")
    parallel: int = Field(default=8, ge=1, description="generations admitted at once")
    kv_slots: int = Field(default=4, ge=0, le=256)
    kv_dir: Path | None = None
    kv_persist: bool = True
    cors_origins: tuple[str, ...] = ()

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        """Origins as browsers send them: 'http://good.example/' matched no page."""
        return tuple(o.strip().rstrip("/") for o in v)

    allowed_hosts: tuple[str, ...] = ()
    max_body: int = Field(default=MAX_BODY, ge=1024)
    profile_turns: int = Field(default=64, ge=1)
    stats_interval: float = Field(
        default=10.0,
        ge=0,
        description="seconds between throughput lines while the server is busy (0: none)",
    )
    header_timeout: float = Field(
        default=10.0,
        gt=0,
        description="seconds a connection has to send a request's headers, and the longest "
        "pause allowed inside its body",
    )
    keep_alive_timeout: int = Field(
        default=5, ge=1, description="seconds an idle keep-alive connection stays open"
    )
    send_timeout: float = Field(
        default=30.0,
        gt=0,
        description="seconds a client has to take each response chunk; past it the request "
        "ends (its generation is cancelled)",
    )

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key, ``api_key`` first."""
        return tuple(k for k in (self.api_key, *self.api_keys) if k)

    @property
    def reuse_scope(self) -> Literal["key", "all", "off"]:
        """``prefix_reuse`` with "auto" decided."""
        if self.prefix_reuse == "auto":
            return "key" if len(self.keys) > 1 else "all"
        return self.prefix_reuse


@dataclass
class Ticket:
    """A place in the admission queue, taken synchronously when the request arrives."""

    arrived: float
    waiting: bool = True
    admitted: float | None = None

    @property
    def wait_s(self) -> float:
        return (self.admitted if self.admitted is not None else time.perf_counter()) - self.arrived


@dataclass
class Lease:
    """An admitted request: its KV slot (if any) and its compute place until released."""

    ticket: Ticket
    slot: Slot | None
    _release: Any = None

    def release_compute(self) -> None:
        """Let the next request compute (this one still holds its slot, e.g. to save it)."""
        if self._release is not None:
            self._release()
            self._release = None


class Admission:
    """At most ``parallel`` generations at once and ``queue`` waiting; more are refused with
    429 and a Retry-After estimate. Waiting covers the KV slot too (one request per slot)."""

    def __init__(
        self,
        queue: int,
        parallel: int,
        metrics: Metrics,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.queue = queue
        self.parallel = parallel
        self._sem = anyio.Semaphore(parallel)
        self._metrics = metrics
        self._clock = clock
        self.waiting = 0
        self.running = 0
        self._recent: deque[float] = deque(maxlen=16)  # seconds per finished generation
        self._started: dict[int, float] = {}  # running generations' start times, by lease

    def reserve(self) -> Ticket:
        """Join the queue now or raise 429 (synchronous: no await between check and join)."""
        # a request that finds a free compute place is not really waiting
        if self.waiting >= self.queue + max(0, self.parallel - self.running):
            self._metrics.rejected.labels("queue_full").inc()
            retry = self.retry_after()
            raise ApiError(
                429,
                f"server busy: {self.running} generating and {self.waiting} admitted or "
                f"waiting, the most it takes ({self.parallel} generating at once + a queue "
                f"of {self.queue}); retry in about {retry} s",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
        self.waiting += 1
        self._metrics.waiting.set(self.waiting)
        return Ticket(time.perf_counter())

    def retry_after(self) -> int:
        """Seconds until a place is likely free: a place opens in the queue when one running
        generation ends (the first waiting one takes its compute place), so the least time
        one running is expected to take still, by the recent generations' mean. (It said
        mean x (waiting + running) / parallel, the time to drain the whole queue: a client
        told to come back after 16 generations found room after one.)"""
        per = sum(self._recent) / len(self._recent) if self._recent else 1.0
        now = self._clock()
        left = min((per - (now - t) for t in self._started.values()), default=per)
        return max(1, min(600, math.ceil(left)))

    def _leave_queue(self, ticket: Ticket) -> None:
        if ticket.waiting:
            ticket.waiting = False
            self.waiting -= 1
            self._metrics.waiting.set(self.waiting)

    def cancel(self, ticket: Ticket) -> None:
        """Give the place back without running (request failed before admission)."""
        self._leave_queue(ticket)

    @asynccontextmanager
    async def enter(
        self, ticket: Ticket, slots: SlotPool, slot: int | None, *, named: bool = False
    ) -> AsyncIterator[Lease]:
        """Wait for the slot (if any; ``named``: the request named it), then for a compute
        place."""
        try:
            async with AsyncExitStack() as stack:
                held = (
                    None
                    if slot is None
                    else await stack.enter_async_context(slots.use(slot, named=named))
                )
                await self._sem.acquire()
                ticket.admitted = time.perf_counter()
                self._leave_queue(ticket)
                self.running += 1
                self._metrics.running.set(self.running)
                self._metrics.queue_time.observe(ticket.wait_s)
                started = self._clock()
                key = id(ticket)
                self._started[key] = started

                def release() -> None:
                    self.running -= 1
                    self._metrics.running.set(self.running)
                    self._started.pop(key, None)
                    self._recent.append(self._clock() - started)
                    self._sem.release()

                lease = Lease(ticket, held, release)
                try:
                    yield lease
                finally:
                    lease.release_compute()
        finally:
            self._leave_queue(ticket)


@dataclass
class Turn:
    """One generation, as ``/profile`` shows it."""

    id: str
    route: str
    started: float  # unix time of arrival
    slot: int | None
    prompt_tokens: int
    prompt_tokens_computed: int
    prompt_tokens_reused: int
    completion_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str = "running"
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float = 0.0
    total_s: float = 0.0
    # legacy completions' echo with logprobs: the forward that scored the prompt (before the
    # generation's own prefill; None: no scoring)
    score_s: float | None = None
    # the engine's time breakdown over this turn (runtime.scheduler.TimeBreakdown, seconds)
    time: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        decode_tps = (
            (self.completion_tokens - 1) / self.decode_s
            if self.completion_tokens > 1 and self.decode_s > 0
            else None
        )
        prefill_tps = (
            self.prompt_tokens_computed / self.prefill_s
            if self.prefill_s and self.prompt_tokens_computed
            else None
        )
        return {
            "id": self.id,
            "route": self.route,
            "started": self.started,
            "slot": self.slot,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "completion_tokens": self.completion_tokens,
            "max_tokens": self.max_tokens,
            "finish_reason": self.finish_reason,
            "queue_wait_ms": round(self.queue_wait_s * 1000, 3),
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000, 3),
            "prefill_ms": None if self.prefill_s is None else round(self.prefill_s * 1000, 3),
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens_per_s": decode_tps,
            "total_ms": round(self.total_s * 1000, 3),
            "score_ms": None if self.score_s is None else round(self.score_s * 1000, 3),
            "time": self.time,
        }


@dataclass
class AppState:
    """One server's objects (``request.app.state.colibri``)."""

    config: ServerConfig
    engine: Engine
    tokenizer: ChatTokenizer
    model_name: str
    context_length: int
    vocab_size: int
    metrics: Metrics
    admission: Admission
    slots: SlotPool
    created: int = field(default_factory=lambda: int(time.time()))
    turns: deque[Turn] = field(default_factory=lambda: deque(maxlen=64))
    think_template: bool = False
    engine_identity: str = "0"
    kv_dir: Path | None = None
    # set when the server shuts down: generations in flight stop (sse.GenerationResponse)
    stopping: anyio.Event = field(default_factory=anyio.Event)
    _text_limiter: anyio.CapacityLimiter | None = None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work on request text (template rendering, tokenization, detokenization) in
        a worker thread: a 4 MB prompt takes seconds to tokenize and must not stall the loop
        (``/health``, other streams). Two threads at most, beside the compute limiter."""
        if self._text_limiter is None:
            self._text_limiter = anyio.CapacityLimiter(2)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._text_limiter)

    async def encode_prompt(
        self, text: str, param: str = "messages", *, raw: bool = False
    ) -> list[int]:
        """``text``'s ids, tokenized off the loop (``raw``: a prompt without a chat template,
        with the special tokens the tokenizer adds, :meth:`ChatTokenizer.encode`); a prompt
        longer than the context is a 400 found before its ids are materialized."""
        try:
            return await self.off_loop(
                lambda: self.tokenizer.encode(text, limit=self.context_length, raw=raw)
            )
        except PromptTooLongError as exc:
            raise ApiError(
                400,
                f"this model's context is {self.context_length} tokens, but the prompt has "
                f"{'at least ' if exc.at_least else ''}{exc.n_tokens} tokens; shorten it",
                param=param,
                code="context_length_exceeded",
            ) from None

    def record(self, turn: Turn) -> None:
        self.turns.append(turn)
        access = ACCESS.get(None)
        if access is not None:  # the request's access line (app.py) reports the generation
            access["turn"] = turn
