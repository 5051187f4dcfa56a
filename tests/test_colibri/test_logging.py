"""colibri's log set-up: tracebacks never print local variables (a server's frames hold API
keys, request headers and users' prompts)."""

from __future__ import annotations

import subprocess
import sys


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
