"""Server-sent events and the response type every generation uses.

:class:`GenerationResponse` runs a request's generation inside the ASGI call while a second
task watches for the client going away: a disconnect cancels the generation at once (in the
admission queue, in prefill, between tokens), which closes the engine's generator and frees
its lock, the KV slot and the admission place. Nothing is sent before admission, so a request
that waited still gets its status line and ``x-colibri-queue-wait-ms`` header, and a failure
before the first byte is a proper JSON error; a failure mid-stream is sent as an SSE error
event.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import structlog
from starlette.types import Receive, Scope, Send

from colibri.server.errors import ApiError, error_body
from colibri.server.timeouts import _SendTimeout

__all__ = ["GenerationResponse", "Responder", "Runner", "sse"]

_log = structlog.get_logger(__name__)


def sse(data: Any, event: str | None = None) -> bytes:
    """One event: ``event: NAME`` (when given) and ``data: JSON`` (or a raw string)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class Responder:
    """What a generation runner sends through: a status line once, then body bytes."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.disconnected = False

    async def start(
        self, status: int, headers: Mapping[str, str], media_type: str = "application/json"
    ) -> None:
        raw = [(b"content-type", media_type.encode())]
        if media_type.startswith("text/event-stream"):
            raw += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        raw += [(k.lower().encode(), str(v).encode()) for k, v in headers.items()]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})
        self.started = True

    async def body(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def json(self, status: int, obj: Any, headers: Mapping[str, str] | None = None) -> None:
        """A complete JSON response (status line, body, end)."""
        data = json.dumps(obj, ensure_ascii=False).encode()
        await self.start(status, {"content-length": str(len(data)), **(headers or {})})
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


Runner = Callable[[Responder], Awaitable[None]]


class GenerationResponse:
    """An ASGI response that runs ``runner(responder)`` and cancels it on client disconnect.

    ``anthropic``: errors in Anthropic's shape (and as an ``error`` event mid-stream);
    ``stream``: the runner sends SSE (ended here); ``on_finish``: called however it ends;
    ``stopping``: set when the server shuts down: the generation stops and the client gets a
    503 (an ``error`` event mid-stream), instead of the request being cut off later."""

    def __init__(
        self,
        runner: Runner,
        *,
        anthropic: bool = False,
        stream: bool = False,
        on_finish: Callable[[], None] | None = None,
        stopping: anyio.Event | None = None,
    ) -> None:
        self._runner = runner
        self._anthropic = anthropic
        self._stream = stream
        self._on_finish = on_finish
        self._stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        responder = Responder(send)
        stopped = False
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            responder.disconnected = True
                            tg.cancel_scope.cancel()
                            return

                async def stop(event: anyio.Event) -> None:
                    nonlocal stopped
                    await event.wait()
                    stopped = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                if self._stopping is not None:
                    tg.start_soon(stop, self._stopping)
                try:
                    await self._run(responder)
                finally:
                    tg.cancel_scope.cancel()
            if stopped and not responder.disconnected:
                with anyio.move_on_after(1):  # (a client that stopped reading gets no more)
                    await self._fail(responder, ApiError(503, "the server is shutting down"))
        finally:
            if self._on_finish is not None:
                self._on_finish()

    async def _run(self, r: Responder) -> None:
        try:
            await self._runner(r)
            if r.started and self._stream:
                await r.end()
        except ApiError as exc:
            await self._fail(r, exc)
        except anyio.get_cancelled_exc_class():
            raise
        except _SendTimeout:
            # the client stopped reading for --send-timeout: it loses its request (documented;
            # not a server error), and nothing more is sent to it
            _log.warning("client stopped reading: request dropped")
            raise
        except Exception as exc:
            _log.error("request failed", error=repr(exc), exc_info=True)
            await self._fail(r, ApiError(500, "internal error while generating (see the log)"))

    async def _fail(self, r: Responder, exc: ApiError) -> None:
        body = error_body(exc.status, exc.message, exc.param, exc.code, anthropic=self._anthropic)
        if not r.started:
            await r.json(exc.status, body, exc.headers)
            return
        if self._stream:
            await r.body(sse(body, "error" if self._anthropic else None))
            await r.end()
