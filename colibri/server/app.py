"""The app factory and ``coli serve``'s runner.

:func:`create_app` builds one server around an open :class:`~colibri.Engine`: its state, its
Prometheus registry, middleware (send timeout -> metrics -> CORS -> security) and routes.
:func:`serve` opens the engine and runs uvicorn's ``Server.serve()`` (with the deadlines of
``timeouts.py``) inside the same anyio (asyncio) loop, so requests, the engine's compute threads
and its expert reads share one scheduler.

Routes: the OpenAI and Anthropic APIs (see their modules), ``GET /health``, ``GET /metrics``,
``GET /experts`` (tier and routing heat per expert), ``GET /profile`` (recent turns, queue,
slots, engine counters, machine), ``GET /atlas`` (``coli atlas``'s layout),
``POST /admin/replicas/{index}/enable`` (re-enable a copy of the model a read error demoted:
:meth:`~colibri.Engine.enable_replica`); with ``web=True`` the dashboard's files at ``/``
(:mod:`colibri.server.web`).
"""

from __future__ import annotations

import errno
import math
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri import __version__
from colibri._config import EngineOptions, default_model_path
from colibri._engine import Engine
from colibri.server.anthropic_routes import anthropic_routes
from colibri.server.errors import ApiError, error_response, is_anthropic
from colibri.server.metrics import CONTENT_TYPE, Metrics
from colibri.server.openai_routes import openai_routes
from colibri.server.openapi import openapi_route
from colibri.server.requests import state_of
from colibri.server.security import SecurityMiddleware, allowed_hosts, check_bind
from colibri.server.slots import SlotPool
from colibri.server.state import ACCESS, Admission, AppState, ServerConfig
from colibri.server.timeouts import SendTimeoutMiddleware, guarded_protocol
from colibri.server.web import WebAssets, atlas, machine_info
from colibri.tokenizer import ChatTokenizer
from storage.atomic import remove_leftovers
from storage.errors import ColibriError
from storage.kvfile import model_identity

__all__ = ["ServerConfig", "create_app", "serve"]

_log = structlog.get_logger(__name__)

TIER_CODES = {"disk": 0, "lru": 1, "pinned": 2, "ram": 3, "worker": 4}


def default_model_name(model_dir: Path) -> str:
    """The name clients pass as ``model``: the directory name (``colibri-demo`` for the bundled
    demo model)."""
    if model_dir.resolve() == default_model_path().resolve():
        return "colibri-demo"
    return model_dir.resolve().name


# ------------------------------------------------------------------------------ middleware


class _MetricsMiddleware:
    """Counts every answered request by route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app = app
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 0}

        async def tap(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        access: dict[str, Any] = {}
        token = ACCESS.set(access)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, tap)
        except Exception:
            # an error no handler turned into a response: the outer error middleware answers
            # 500 after this one has returned (499 is for a client that went away)
            if not status["code"]:
                status["code"] = 500
            raise
        finally:
            ACCESS.reset(token)
            path = scope.get("path", "")
            route = path if path in self._routes else "other"
            if path.startswith("/v1/models/"):
                route = "/v1/models/{model}"
            elif path.startswith("/admin/replicas/") and path.endswith("/enable"):
                route = "/admin/replicas/{index}/enable"
            code = status["code"] or 499
            self._metrics.requests.labels(route, str(code)).inc()
            _access_line(scope, route, code, time.perf_counter() - t0, access.get("turn"))


_access = structlog.get_logger("colibri.access")
_QUIET_ROUTES = frozenset({"/health", "/metrics", "/experts", "/profile"})  # polled: debug level


def _access_line(scope: Scope, route: str, status: int, seconds: float, turn: Any) -> None:
    """One structured line per request; a generation's adds its tokens, cache hits and speed."""
    fields: dict[str, Any] = {
        "method": scope.get("method", ""),
        "route": route,
        "status": status,
        "ms": round(seconds * 1e3, 1),
    }
    if turn is not None:
        d = turn.as_dict()
        fields.update(
            prompt_tokens=d["prompt_tokens"],
            cached_tokens=d["prompt_tokens_reused"],
            completion_tokens=d["completion_tokens"],
            ttft_ms=None if d["ttft_ms"] is None else round(d["ttft_ms"], 1),
            tok_per_s=None if d.get("decode_tokens_per_s") is None
            else round(d["decode_tokens_per_s"], 1),
            finish=d["finish_reason"],
        )  # fmt: skip
    if route in _QUIET_ROUTES and status < 400:
        _access.debug("request", **fields)
    else:
        _access.info("request", **fields)


# ------------------------------------------------------------------------------ info routes


async def health(request: Request) -> Response:
    """``GET /health``: 200 while the server runs (no API key needed)."""
    st = state_of(request)
    snap = st.engine.snapshot()
    sched = snap.scheduler
    kernels = snap.compute.kernels or {}
    return JSONResponse(
        {
            "status": "ok",
            "model": st.model_name,
            "running": st.admission.running,
            "waiting": st.admission.waiting,
            "decode_batches": sched.decode_batches,
            "decode_batched_rows": sched.decode_batched_rows,
            # "fast-int8" is the opt-in lossy mode: said here so a client can tell
            "kernels": {"mode": kernels.get("mode", "exact"), "lossy": kernels.get("lossy", False)},
        }
    )


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text format."""
    st = state_of(request)
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


async def experts(request: Request) -> Response:
    """``GET /experts``: per MoE layer and expert, its tier and routing heat."""
    st = state_of(request)
    m = st.engine.expert_map()
    by_layer = st.engine.container.expert_nbytes_by_layer()
    counts: list[list[int]] | None = m.get("counts")
    codes: list[list[int]] = []
    for i, row in enumerate(m["tiers"]):
        heat = counts[i] if counts is not None and i < len(counts) else [0] * len(row)
        codes.append(
            [
                (TIER_CODES.get(t, 0) << 6) | min(63, int(math.log2(h + 1)) if h > 0 else 0)
                for t, h in zip(row, heat or [0] * len(row), strict=False)
            ]
        )
    return JSONResponse(
        {
            **m,
            "tier_codes": TIER_CODES,
            "codes": codes,
            "expert_bytes": int(st.engine.container.expert_nbytes),
            # one expert's bytes in each of `layers` (they may differ: the tier sizes are
            # per-layer sums, not counts times the largest expert)
            "layer_expert_bytes": [by_layer.get(layer, 0) for layer in m["layers"]],
        }
    )


async def profile(request: Request) -> Response:
    """``GET /profile``: recent turns (newest first) with their time breakdown, the queue, the
    KV slots and the engine's counters."""
    st = state_of(request)
    limit = request.query_params.get("limit")
    turns = [t.as_dict() for t in reversed(st.turns)]
    if limit is not None:
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses (a 500)
        if not (limit.isascii() and limit.isdigit()):
            raise ApiError(400, f"limit must be a count, got {limit!r}", param="limit")
        turns = turns[: int(limit)]
    return JSONResponse(
        {
            "model": st.model_name,
            "context_length": st.context_length,
            "queue": {
                "running": st.admission.running,
                "waiting": st.admission.waiting,
                "limit": st.admission.queue,
                "parallel": st.admission.parallel,
            },
            "slots": st.slots.describe(),
            "kv_dir": None if st.kv_dir is None else str(st.kv_dir),
            "turns": turns,
            "engine": st.engine.stats(),
            "machine": machine_info(st.engine),
        }
    )


async def enable_replica(request: Request) -> Response:
    """``POST /admin/replicas/{index}/enable``: re-enable a copy of the model (0: the primary,
    then each ``--mirror`` in order) that a read error demoted; answers its entry of
    ``stats()["experts"]["devices"]`` plus ``re_enabled`` (false when it was not demoted)."""
    st = state_of(request)
    raw = str(request.path_params["index"])
    devices = st.engine.snapshot().experts.devices
    if not devices:
        raise ApiError(
            400,
            "the experts are resident in RAM: there is no copy of the model to re-enable (copies "
            "serve streamed experts only; see --ram and --mirror)",
            code="not_streaming",
        )
    try:
        index = int(raw)
    except ValueError:
        index = -1
    if index < 0 or index >= len(devices) or not (raw.isascii() and raw.isdigit()):
        raise ApiError(
            404,
            f"no copy {raw!r}: the model has {len(devices)} (index 0 is the primary, then each "
            f"--mirror in order: 0..{len(devices) - 1})",
            param="index",
            code="replica_not_found",
        )
    was_demoted = devices[index].demoted
    try:
        entry = await st.engine.enable_replica(index)
    except ColibriError as exc:
        raise ApiError(400, str(exc), param="index", code="replica_error") from exc
    if was_demoted:
        _log.info("copy re-enabled by request", copy=index, root=entry.get("root"))
    return JSONResponse({**entry, "re_enabled": was_demoted})


# ------------------------------------------------------------------------------ errors


async def _api_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, ApiError):  # pragma: no cover - registered for ApiError only
        return await _internal_error(request, exc)
    return error_response(exc, anthropic=is_anthropic(request))


async def _http_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, HTTPException):  # pragma: no cover - registered for it only
        return await _internal_error(request, exc)
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    err = ApiError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None)
    return error_response(err, anthropic=is_anthropic(request))


async def _internal_error(request: Request, exc: Exception) -> Response:
    _log.error("unhandled error", path=request.url.path, error=repr(exc), exc_info=exc)
    err = ApiError(500, "internal server error (details are in the server log)")
    return error_response(err, anthropic=is_anthropic(request))


# ------------------------------------------------------------------------------ factory


async def create_app(
    engine: Engine, config: ServerConfig | None = None, *, web: bool = False
) -> Starlette:
    """One server around ``engine`` (which the caller keeps open while the app serves);
    ``web``: also serve the dashboard (``colibri/web``) at ``/`` (``coli web``)."""
    cfg = config or ServerConfig()
    c = engine.container
    tok_path = c.tokenizer_path()
    if tok_path is None:
        raise ColibriError(f"{c.path}: no tokenizer.json: the server needs one to read text")
    tokenizer = await anyio.to_thread.run_sync(ChatTokenizer, tok_path, c.tokenizer_config())
    name = cfg.served_model_name or default_model_name(c.path)
    identity = await anyio.to_thread.run_sync(model_identity, c.path)
    kv_dir: Path | None = None
    if cfg.kv_slots and cfg.kv_persist:
        kv_dir = made = cfg.kv_dir or engine.options.resolved_state_dir()
        try:
            await anyio.to_thread.run_sync(lambda: made.mkdir(parents=True, exist_ok=True))
        except OSError as exc:
            raise ColibriError(
                f"cannot create the KV slot directory {kv_dir}: {exc.strerror or exc}; pass "
                "--kv-dir DIR or --no-kv-persist"
            ) from exc
    if kv_dir is not None and kv_dir != engine.options.resolved_state_dir():
        await anyio.to_thread.run_sync(remove_leftovers, kv_dir)  # killed slot saves
    vocab = int(c.arch.vocab_size)
    slots = SlotPool(
        cfg.kv_slots, engine.new_cache, vocab=vocab, identity=identity, directory=kv_dir,
        files_named=not cfg.kv_persist_auto,
    )  # fmt: skip
    await slots.check_files()
    kv_dir = slots.directory  # None when another server holds that directory
    m = Metrics(engine.snapshot)
    template = getattr(tokenizer, "_template_src", None) or ""
    state = AppState(
        config=cfg,
        engine=engine,
        tokenizer=tokenizer,
        model_name=name,
        context_length=engine.context_length,
        vocab_size=vocab,
        metrics=m,
        admission=Admission(cfg.queue, cfg.parallel, m),
        slots=slots,
        turns=deque(maxlen=cfg.profile_turns),
        think_template="<think>" in template,
        engine_identity=f"{identity:08x}",
        kv_dir=kv_dir,
    )
    routes = [
        Route(
            "/openapi.json",
            openapi_route(name, __version__, vocab_size=vocab, n_slots=len(slots)),
            methods=["GET"],
        ),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/experts", experts, methods=["GET"]),
        Route("/profile", profile, methods=["GET"]),
        Route("/atlas", atlas, methods=["GET"]),
        Route("/admin/replicas/{index}/enable", enable_replica, methods=["POST"]),
        *openai_routes(),
        *anthropic_routes(),
    ]
    known = frozenset(r.path for r in routes)
    middleware = [
        # outermost: a client that stops reading ends its request wherever it is
        Middleware(SendTimeoutMiddleware, timeout=cfg.send_timeout),
        Middleware(_MetricsMiddleware, metrics=m, routes=known),
    ]
    if web:  # the dashboard's static files: no API key (the Host allowlist still applies)
        hosts = allowed_hosts(cfg.host, cfg.allowed_hosts)
        middleware.append(Middleware(WebAssets, hosts=hosts, max_body=cfg.max_body))
    if cfg.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cfg.cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
                expose_headers=["x-colibri-queue-wait-ms", "retry-after"],
            )
        )
    middleware.append(
        Middleware(
            SecurityMiddleware,
            api_key=cfg.api_key,
            more_keys=cfg.api_keys,
            hosts=allowed_hosts(cfg.host, cfg.allowed_hosts),
            max_body=cfg.max_body,
            origins=cfg.cors_origins,
        )
    )
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.colibri = state
    return app


# ------------------------------------------------------------------------------ runner


class _Server(uvicorn.Server):
    """uvicorn without its signal re-raise: SIGINT/SIGTERM end ``serve()`` gracefully and the
    engine then closes normally (usage saved, reads drained); ``stopped_by`` keeps the signal
    for the exit status (130 / 143)."""

    stopped_by: int | None = None
    on_shutdown: Callable[[], None] | None = None  # (AppState.stopping.set)

    async def shutdown(self, sockets: Any = None) -> None:
        # generations in flight end now (a 503 / error event), not when uvicorn's grace
        # period runs out and it cancels their tasks from outside
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            cfg = self.config
            host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
            print(f"colibri: serving on http://{host}:{cfg.port}", file=sys.stderr, flush=True)


async def serve(config: ServerConfig, options: EngineOptions, *, web: bool = False) -> int | None:
    """Open the engine, build the app and serve until SIGINT/SIGTERM (asyncio only: uvicorn);
    ``web``: with the dashboard at ``/``. Returns the signal that stopped it (None: stopped
    otherwise). In-flight requests get one second to finish, then they are cancelled."""
    check_bind(config.host, config.keys[0] if config.keys else None)
    if "*" in config.cors_origins and not config.keys:
        _log.warning(
            "--cors-origin '*' without an API key: any web page the user opens can use this "
            "server and read its answers (conversations, /profile); list the origins instead"
        )
    sock = _listen(config.host, config.port)  # before the (long) model load: fail fast
    async with Engine.open(options=options) as engine:
        app = await create_app(engine, config, web=web)
        uv = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            ws="none",
            timeout_graceful_shutdown=1,
            http=guarded_protocol(config.header_timeout),
            timeout_keep_alive=config.keep_alive_timeout,
        )
        async with anyio.create_task_group() as tg:
            if config.stats_interval > 0:
                tg.start_soon(_throughput_lines, app.state.colibri, config.stats_interval)
            server = _Server(uv)
            server.on_shutdown = app.state.colibri.stopping.set
            try:
                await server.serve(sockets=[sock])
            finally:
                app.state.colibri.slots.close()
            tg.cancel_scope.cancel()
    return server.stopped_by


async def _throughput_lines(st: AppState, interval: float) -> None:
    """Every ``interval`` seconds while generations ran: one log line with the tokens/s served,
    the queue and the expert hit rate over that interval."""
    last = st.engine.snapshot()
    t_last = time.perf_counter()
    while True:
        await anyio.sleep(interval)
        now, t_now = st.engine.snapshot(), time.perf_counter()
        made = now.generated_tokens - last.generated_tokens
        if made or st.admission.running:
            fields: dict[str, Any] = {
                "tokens_per_s": round(made / (t_now - t_last), 2),
                "prompt_tokens": now.prompt_tokens - last.prompt_tokens,
                "running": st.admission.running,
                "waiting": st.admission.waiting,
            }
            a, b = last.experts.tiers, now.experts.tiers
            if a is not None and b is not None:
                hits = (b.hits_pinned + b.hits_lru) - (a.hits_pinned + a.hits_lru)
                looked = hits + b.misses - a.misses
                if looked:
                    fields["expert_hit_rate"] = round(hits / looked, 3)
            _log.info("throughput", **fields)
        last, t_last = now, t_now


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port or a bad address is one clear error
    before anything is loaded (uvicorn would report it only after the model load).

    Made with ``IPPROTO_TCP`` as its protocol, not 0: the connections it accepts inherit it,
    and asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on sockets that say TCP.
    With Nagle on, a response's body waited for the client's delayed ACK of its headers: every
    request after the first on a kept-alive connection took 40 ms more, and streamed tokens
    arrived in bursts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ColibriError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            + ("; another server runs there: stop it or pick another --port"
               if exc.errno == errno.EADDRINUSE else "")
        ) from exc  # fmt: skip
    sock.set_inheritable(True)
    return sock
