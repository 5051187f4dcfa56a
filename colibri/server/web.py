"""The web dashboard's server side: its static files, ``GET /atlas`` and the machine summary.

The dashboard (``colibri/web/``: plain HTML, CSS and JavaScript, no build step, nothing fetched
from outside) is a client of the public endpoints only, so ``coli web`` is ``coli serve`` plus
these files at ``/``.

* :class:`WebAssets`: serves the bundled files for ``GET``/``HEAD`` of ``/``, ``/index.html``,
  ``/app.js``, ... They are the same public files as in the package, so they need no API key
  (the page asks for the key itself when the API answers 401); the ``Host`` allowlist and the
  body cap still apply. Responses carry a strict Content-Security-Policy (``'self'`` only).
* :func:`atlas`: ``GET /atlas``, the routing-affinity layout that ``coli atlas`` writes to
  ``<state dir>/atlas.json`` (404 ``atlas_missing`` until then).
* :func:`machine_info`: CPU, cores, RAM and the model's storage devices (with their cumulative
  bytes read from ``/proc/diskstats``) for ``/profile``'s ``machine`` field.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from colibri._engine import Engine
from colibri.server.errors import ApiError
from colibri.server.security import SecurityMiddleware

__all__ = ["ATLAS_FILE", "WEB_DIR", "WebAssets", "atlas", "machine_info"]

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
ATLAS_FILE = "atlas.json"

_MEDIA = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
}


def _asset_map(directory: Path) -> dict[str, Path]:
    """URL path -> file, for the dashboard's files (one level, known types only)."""
    files: dict[str, Path] = {}
    if directory.is_dir():
        for f in sorted(directory.iterdir()):
            if f.is_file() and f.suffix in _MEDIA and not f.name.startswith("."):
                files["/" + f.name] = f
    if "/index.html" in files:
        files["/"] = files["/index.html"]
    return files


class WebAssets:
    """ASGI middleware serving the dashboard's static files before the API key check.

    ``GET``/``HEAD`` of a known asset path is answered here, behind the API's own ``Host``
    allowlist and body cap (a :class:`SecurityMiddleware` without a key); everything else goes
    on to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        hosts: frozenset[str] | None,
        max_body: int,
        directory: Path = WEB_DIR,
    ) -> None:
        self.app = app
        self._files = _asset_map(directory)
        self._guarded = SecurityMiddleware(
            self._serve, api_key=None, hosts=hosts, max_body=max_body
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope.get("method") not in ("GET", "HEAD")
            or path not in self._files
        ):
            await self.app(scope, receive, send)
            return
        await self._guarded(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        f = self._files[scope["path"]]
        resp = FileResponse(f, media_type=_MEDIA[f.suffix], headers=_HEADERS)
        await resp(scope, receive, send)


def state_dir_of(engine: Engine) -> Path:
    """The engine's state directory (where ``coli atlas`` writes ``atlas.json``)."""
    return engine.options.resolved_state_dir()


async def atlas(request: Request) -> Response:
    """``GET /atlas``: ``<state dir>/atlas.json`` as written by ``coli atlas``; 404 if none.
    With ``?missing=ok`` (the dashboard) a missing atlas is a 200 ``{"missing": true, ...}``
    with the commands that build it for this server (a 404 is a console error in a browser
    on every page load of a healthy server)."""
    st = request.app.state.colibri
    path = state_dir_of(st.engine) / ATLAS_FILE
    try:
        data = await anyio.to_thread.run_sync(path.read_bytes)
    except FileNotFoundError:
        model = st.engine.container.path
        state = path.parent
        url = str(request.base_url).rstrip("/")
        commands = [
            f"coli atlas --model {model} --state-dir {state}",
            f"coli atlas --server {url} --out {path}",
        ]
        message = (
            f"no routing atlas yet ({path} does not exist): run `{commands[0]}` (it loads the "
            f"model itself), or `{commands[1]}` on this machine (measured through this server)"
        )
        if request.query_params.get("missing") == "ok":
            return JSONResponse(
                {"missing": True, "path": str(path), "commands": commands, "message": message},
                headers={"cache-control": "no-cache"},
            )
        raise ApiError(404, message, code="atlas_missing") from None
    except OSError as exc:
        raise ApiError(500, f"cannot read {path}: {exc.strerror or exc}") from exc
    return Response(data, media_type="application/json", headers={"cache-control": "no-cache"})


# ------------------------------------------------------------------------------ machine


@lru_cache(maxsize=1)
def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _diskstats() -> dict[tuple[int, int], tuple[str, int]]:
    """(major, minor) -> (name, bytes read so far), from ``/proc/diskstats``."""
    out: dict[tuple[int, int], tuple[str, int]] = {}
    try:
        with open("/proc/diskstats", encoding="ascii", errors="replace") as fh:
            for line in fh:
                p = line.split()
                if len(p) >= 6:
                    out[(int(p[0]), int(p[1]))] = (p[2], int(p[5]) * 512)
    except (OSError, ValueError):
        pass
    return out


@lru_cache(maxsize=16)
def _device(path: str) -> dict[str, Any]:
    from storage.multidisk.identity import device_of

    try:
        d = device_of(path)
    except OSError:
        return {"path": path, "name": "", "mount": "", "fstype": "", "dev": None}
    return {
        "path": path,
        "name": d.name,
        "mount": d.mount,
        "fstype": d.fstype,
        "dev": [os.major(d.st_dev), os.minor(d.st_dev)],
    }


def machine_info(engine: Engine) -> dict[str, Any]:
    """CPU, cores, RAM, and each copy of the model (primary, then ``--mirror`` dirs) with its
    block device and that device's cumulative ``read_bytes`` (None when the filesystem has no
    block device of its own, e.g. overlay or tmpfs). Cheap enough for every ``/profile``."""
    mem = _meminfo()
    stats = _diskstats()
    disks = []
    paths = [engine.container.path, *engine.options.mirror]
    for i, p in enumerate(paths):
        d = dict(_device(str(p)))
        dev = d.pop("dev")
        hit = stats.get((dev[0], dev[1])) if dev else None
        d["role"] = "primary" if i == 0 else "mirror"
        d["block_device"] = hit[0] if hit else None
        d["read_bytes"] = hit[1] if hit else None
        disks.append(d)
    sizes = engine.container.expert_nbytes_by_layer()
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "ram_total_bytes": mem.get("MemTotal"),
        "ram_available_bytes": mem.get("MemAvailable"),
        "expert_bytes": int(engine.container.expert_nbytes),
        # the smallest and largest expert (MoE layers may store theirs differently)
        "expert_bytes_range": [
            min(sizes.values(), default=0),
            max(sizes.values(), default=0),
        ],
        "disks": disks,
        "time": time.time(),
    }
