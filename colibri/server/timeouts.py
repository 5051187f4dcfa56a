"""Deadlines that keep idle or stalled clients from holding the server's places.

* **Headers**: a connection must finish a request's headers within ``header_timeout`` seconds of
  opening (or of its previous response): a client that connects and says nothing, or trickles
  half a header (slowloris), is disconnected. uvicorn's own keep-alive timer stops at the first
  byte received, so it does not cover this (:class:`GuardedH11Protocol`).
* **Idle keep-alive**: uvicorn's ``timeout_keep_alive`` (``keep_alive_timeout`` here).
* **Sending**: a response chunk that the client does not take within ``send_timeout`` seconds
  (a client that stopped reading: the socket buffer is full and uvicorn waits for it to drain)
  ends the request; its generation is cancelled and its compute place freed
  (:class:`SendTimeoutMiddleware`).
"""

from __future__ import annotations

import asyncio

import anyio
import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "SendTimeoutMiddleware", "guarded_protocol"]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's headers."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the request's headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers, on this keep-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request headers")
            self.transport.close()


def guarded_protocol(header_timeout: float) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` class with this deadline (uvicorn takes a class)."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout": float(header_timeout)})


class _SendTimeout(Exception):
    """A client did not take a response chunk in time (internal: ends the request; an
    expected event, not an error: :class:`colibri.server.sse.GenerationResponse` lets it
    through to this middleware, which closes the connection)."""


class SendTimeoutMiddleware:
    """Ends a request whose client stops reading: each ``send`` gets ``timeout`` seconds."""

    def __init__(self, app: ASGIApp, *, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stalled = False

        async def guarded_send(message: Message) -> None:
            nonlocal stalled
            if stalled:  # (the error event after a stall waited a whole timeout more)
                raise _SendTimeout
            with anyio.move_on_after(self.timeout) as scope_:
                await send(message)
            if scope_.cancelled_caught:
                stalled = True
                raise _SendTimeout

        try:
            await self.app(scope, receive, guarded_send)
        except BaseException as exc:  # the app may wrap it (task groups)
            if not (stalled and _only_send_timeouts(exc)):
                raise
            # Returning with the response unfinished makes uvicorn close the connection.


def _only_send_timeouts(exc: BaseException) -> bool:
    if isinstance(exc, _SendTimeout):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_send_timeouts(e) for e in exc.exceptions)
    return False
