"""colibri's log set-up: tracebacks never print local variables (a server's frames hold API
keys, request headers and users' prompts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_logged_traceback_shows_no_local_variables() -> None:
    code = """
import logging, structlog
from colibri._logging import configure_logging
configure_logging("console", logging.INFO)
def handler(api_key, prompt):
    raise RuntimeError("boom")
try:
    handler("SECRETKEY123", "my private prompt text")
except RuntimeError:
    structlog.get_logger("t").exception("request failed")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "request failed" in r.stderr and "RuntimeError: boom" in r.stderr, r.stderr
    assert "line 6, in handler" in r.stderr  # the frames are there
    assert "SECRETKEY123" not in r.stderr and "my private prompt" not in r.stderr, r.stderr


def test_the_python_api_keeps_its_log_lines_off_stdout(tmp_path: Path) -> None:
    """A script using the Python API got the engine's info lines ("loaded ...") on stdout
    (structlog's own default), mixed into its output: unless the program configured structlog,
    an engine opening logs warnings and errors to stderr; a program's own set-up is kept."""
    from _demo import demo_model

    run = f"""
import colibri
with colibri.open_model({str(demo_model())!r}, state_dir={str(tmp_path)!r}) as m:
    print("OUT", m.generate([5, 17, 99], max_new_tokens=2))
"""
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OUT [") and len(r.stdout.splitlines()) == 1, r.stdout
    assert "loaded" not in r.stderr, r.stderr
    own = (
        """
import logging, structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
"""
        + run
    )
    r = subprocess.run([sys.executable, "-c", own], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "loaded" in r.stdout, r.stdout  # the program's own configuration (stdout, info)


def test_an_unhandled_error_is_counted_as_500_not_499() -> None:
    """An error no handler answers reaches Starlette's outer error middleware, which answers
    500 after the metrics middleware has returned: it used to count (and log) such requests
    as 499, a client that went away."""
    import structlog
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from colibri.server.app import _MetricsMiddleware
    from colibri.server.metrics import Metrics

    def boom(request: object) -> JSONResponse:
        raise RuntimeError("boom")

    async def answer(request: object, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": "internal"}, status_code=500)

    metrics = Metrics(lambda: None)  # type: ignore[arg-type,return-value]
    app = Starlette(
        routes=[Route("/v1/boom", boom)],
        middleware=[
            Middleware(_MetricsMiddleware, metrics=metrics, routes=frozenset({"/v1/boom"}))
        ],
        exception_handlers={Exception: answer},
    )
    with structlog.testing.capture_logs():
        r = TestClient(app, raise_server_exceptions=False).get("/v1/boom")
    assert r.status_code == 500
    assert metrics.requests.labels("/v1/boom", "500")._value.get() == 1
    assert metrics.requests.labels("/v1/boom", "499")._value.get() == 0


def test_usage_that_cannot_be_saved_is_said_once(tmp_path: Path) -> None:
    """A state dir that cannot be written (read-only, full; here a file in its place) logged
    "usage not saved" at every turn end: in a chat, in the middle of each printed reply."""
    import structlog
    from _demo import demo_model

    import colibri

    blocked = tmp_path / "state"
    blocked.write_text("not a directory")
    with structlog.testing.capture_logs() as logs:
        with colibri.open_model(demo_model(), state_dir=blocked) as m:
            for _ in range(3):
                m.generate([5, 17, 99], max_new_tokens=2)
    said = [e for e in logs if e.get("event") == "usage not saved"]
    assert len(said) == 1, logs
