"""A loopback stand-in for the Hugging Face hub (its HTTP layout, no network): the tests of
``coli pull`` serve real repositories from directories with it.

Routes, as the hub answers them: ``GET /api/models/{repo}[/revision/{rev}]`` (model info with
``siblings`` and their sizes), ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with
``X-Repo-Commit``, ``ETag`` and ``Content-Length``, and byte ``Range`` requests. Every request
is recorded (``requests``: method, path, range) so a test can see what a client fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []
        self.url = ""
        self.commit = COMMIT  # what the main branch points at (a test may move it)

    def files(self, repo: str) -> list[Path]:
        root = self.repos[repo]
        return sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts)


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _route(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            rng = self.headers.get("Range")
            hub.requests.append((self.command, path, rng))
            m = re.match(r"^/api/models/(.+?)(?:/revision/([^/]+))?$", path)
            if m and m.group(1) in hub.repos:
                repo = m.group(1)
                root = hub.repos[repo]
                rev = m.group(2)
                # a full commit id is served as that commit (the same files); a branch is
                # where the hub's main branch points now
                sha = rev if rev is not None and re.fullmatch(r"[0-9a-f]{40}", rev) else hub.commit
                siblings = [
                    {"rfilename": p.relative_to(root).as_posix(), "size": p.stat().st_size}
                    for p in hub.files(repo)
                ]
                info = {
                    "id": repo,
                    "modelId": repo,
                    "sha": sha,
                    "private": False,
                    "siblings": siblings,
                }
                self._send(
                    200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head
                )
                return
            m = re.match(r"^/(.+?)/resolve/([^/]+)/(.+)$", path)
            if m and m.group(1) in hub.repos:
                f = hub.repos[m.group(1)] / m.group(3)
                if not f.is_file():
                    self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)
                    return
                data = f.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                hdrs = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
                if rng and (r := re.match(r"bytes=(\d+)-(\d*)", rng)):
                    a = int(r.group(1))
                    b = int(r.group(2)) if r.group(2) else len(data) - 1
                    part = data[a : b + 1]
                    hdrs["Content-Range"] = f"bytes {a}-{a + len(part) - 1}/{len(data)}"
                    self._send(206, part, hdrs, head)
                    return
                self._send(200, data, hdrs, head)
                return
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, head)

        def do_GET(self) -> None:
            self._route(head=False)

        def do_HEAD(self) -> None:
            self._route(head=True)

    return Handler


@contextmanager
def serve_hub(repos: dict[str, Path]) -> Iterator[Hub]:
    hub = Hub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
