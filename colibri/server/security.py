"""Safe defaults for a server that holds a model and the user's conversations.

* Binds loopback by default; a non-loopback bind needs an API key (:func:`check_bind`).
* ``Host`` allowlist against DNS rebinding: a web page cannot reach a loopback server through
  a name that resolves to 127.0.0.1 (421 otherwise).
* API key: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``, compared in constant time;
  every route but ``/health`` (and CORS pre-flights) needs it when a key is set (401).
* Request bodies are capped (``Content-Length`` checked here, chunked bodies while reading): 413.
* CORS is off unless origins are listed (Starlette's middleware, added by the app factory).
"""

from __future__ import annotations

import hmac
import ipaddress
import math
from collections.abc import Iterable, Sequence

import anyio
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from colibri.server.errors import ApiError, error_response
from storage.errors import ColibriError

__all__ = [
    "LOOPBACK_HOSTS",
    "SecurityMiddleware",
    "allowed_hosts",
    "check_bind",
    "is_loopback",
    "read_body",
    "tenant_of",
]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Binds on every interface ("0" is 0.0.0.0 to the resolver: it was taken for a host name)
WILDCARD_HOSTS = ("0.0.0.0", "::", "", "0")
_PUBLIC_PATHS = frozenset({"/health"})
TENANT_KEY = "colibri_tenant"  # request.state attribute: which API key a request used


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is only reachable from this machine."""
    h = host.strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse a non-loopback bind without an API key (anyone on the network could use it)."""
    if not is_loopback(host) and not api_key:
        raise ColibriError(
            f"refusing to listen on {host!r} without an API key: anyone who can reach this "
            "machine could use the model and read conversations; pass --api-key KEY "
            "(or --api-key-file FILE), or bind 127.0.0.1"
        )


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """Host names accepted in the ``Host`` header; None accepts any (a wildcard bind with a key
    and no explicit list: the key is the protection there)."""
    names = {h.strip("[]").lower() for h in extra if h}
    wildcard = bind_host in WILDCARD_HOSTS
    if wildcard and not names:
        return None
    names.update(LOOPBACK_HOSTS)
    if not wildcard:
        names.add(bind_host.strip("[]").lower())
    return frozenset(names)


def _host_name(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):  # [::1]:8000
        return h[1 : h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.rsplit(":", 1)[0]
    return h


class SecurityMiddleware:
    """Host allowlist, body-size pre-check and API key, before any route runs."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        hosts: frozenset[str] | None,
        max_body: int,
        more_keys: Sequence[str] = (),
        origins: Sequence[str] = (),
    ) -> None:
        self.app = app
        self._origins = frozenset(o.lower() for o in origins)  # (ServerConfig's, normalized)
        keys = [k for k in (api_key, *more_keys) if k]
        # Digests of the keys, compared in constant time; a key's tenant is its position.
        self._keys = [hmac.digest(b"colibri", k.encode(), "sha256") for k in keys]
        self._hosts = hosts
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path = scope.get("path", "")
        anthropic = path.startswith("/v1/messages")
        try:
            tenant = self._check(headers, path, scope.get("method", "GET"))
        except ApiError as exc:
            await error_response(exc, anthropic=anthropic)(scope, receive, send)
            return
        scope.setdefault("state", {})[TENANT_KEY] = tenant
        await self.app(scope, receive, send)

    def _check(self, headers: Headers, path: str, method: str) -> str | None:
        """Raise for a refused request; else the tenant: which API key it used ("key-0",
        "key-1", ...), None on a server without keys or a public path."""
        if self._hosts is not None:
            host = _host_name(headers.get("host", ""))
            if host not in self._hosts:
                raise ApiError(
                    421,
                    f"Host {host or '(none)'!r} is not served here (DNS rebinding protection); "
                    "start the server with --allowed-host NAME to accept it",
                    code="invalid_host",
                )
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise ApiError(400, "bad Content-Length header", code="bad_request") from None
            if n > self._max_body:
                raise ApiError(
                    413,
                    f"request body of {n} bytes exceeds the {self._max_body}-byte limit",
                    code="request_too_large",
                )
        if not self._keys and method not in _SAFE_METHODS:
            self._check_origin(headers)
        if not self._keys or path in _PUBLIC_PATHS or method == "OPTIONS":
            return None
        given = headers.get("x-api-key") or None  # (an empty one hid a good Bearer token)
        auth = headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        match = None
        if given is not None:
            # compare_digest on equal-length digests, against every key (no early exit):
            # constant time whatever was sent and whichever key it is
            digest = hmac.digest(b"colibri", given.encode(), "sha256")
            for i, k in enumerate(self._keys):
                if hmac.compare_digest(digest, k) and match is None:
                    match = i
        if match is None:
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return f"key-{match}"

    def _check_origin(self, headers: Headers) -> None:
        """Without an API key, refuse a state-changing request a web page of another origin
        sent (403): a browser sends those (a form, a ``no-cors`` fetch of ``text/plain``)
        without asking the server first, and the page, though it cannot read the answer,
        could generate, fill the queue and overwrite a saved conversation's KV slot. The
        browser names the page in ``Origin``; clients that are not browsers send none. Same
        origin (the dashboard) and ``--cors-origin`` origins pass. (With a key, the key
        protects: such a page cannot send it.)"""
        origin = headers.get("origin")
        if origin is None:
            return
        o = origin.strip().rstrip("/").lower()
        if "*" in self._origins or o in self._origins:
            return
        netloc = o.split("://", 1)[1] if "://" in o else ""
        if netloc and netloc == headers.get("host", "").strip().lower():
            return
        raise ApiError(
            403,
            f"a request from the web page at {origin!r} is refused (cross-site request "
            "protection): start the server with --cors-origin ORIGIN to let that page use it, "
            "or set an API key",
            code="cross_origin_refused",
        )


#: Methods a browser may send cross-site that change nothing here.
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def tenant_of(request: Request) -> str | None:
    """The tenant :class:`SecurityMiddleware` found for this request (see ``_check``)."""
    t = getattr(request.state, TENANT_KEY, None)
    return t if isinstance(t, str) else None


#: the slowest a request body may arrive on average (bytes/s): read_body's overall deadline
MIN_BODY_RATE = 64 * 1024


async def read_body(request: Request, limit: int, idle_timeout: float | None = None) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes even without Content-Length,
    and (408) a body that stalls: nothing for ``idle_timeout`` seconds (a client that sent its
    headers then trickled or stopped held its connection and buffered body forever)."""
    chunks: list[bytes] = []
    total = 0
    stream = request.stream().__aiter__()
    idle = idle_timeout if idle_timeout is not None else math.inf
    # ... and as a whole: the pause limit plus the body at MIN_BODY_RATE, its declared length
    # when it has one, else the largest (a byte sent just before each pause limit kept a
    # connection and its buffer for ever; an 83-byte body could take 74 s)
    declared = request.headers.get("content-length", "")
    size = min(int(declared), limit) if declared.isdigit() else limit
    end = anyio.current_time() + idle + size / MIN_BODY_RATE
    while True:
        left = end - anyio.current_time()
        with anyio.move_on_after(min(idle, left)) as wait:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                break
        if wait.cancelled_caught:
            why = (
                f"nothing arrived for {idle:g} s"
                if idle <= left
                else f"it came slower than {MIN_BODY_RATE // 1024} KiB/s"
            )
            raise ApiError(408, f"the request body stalled: {why}", code="request_timeout")
        total += len(chunk)
        if total > limit:
            raise ApiError(
                413, f"request body exceeds the {limit}-byte limit", code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)
