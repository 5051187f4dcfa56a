"""A real ``coli serve`` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from _demo import demo_model

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``coli serve`` (or ``command``: ``web``) subprocess on a loopback port; ``start`` again
    after ``stop`` restarts it on the same port."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        model: Path | None = None,
        command: str = "serve",
        home: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{command}-{self.port}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")} | {
            "COLI_MODEL": str(model or demo_model())
        }
        self.env["OMP_WAIT_POLICY"] = "PASSIVE"
        if home is not None:
            self.env["HOME"] = str(home)
        self.cmd = [sys.executable, "-m", "colibri.cli", command, "--port", str(self.port), *args]
        self.start()

    def start(self) -> Server:
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                self.cmd, cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT
            )
        return self

    def wait_ready(self, timeout: float = 90.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready in {timeout} s: {self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def oai(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def profile(self, key: str | None = None) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        data: dict[str, Any] = httpx.get(self.url + "/profile", headers=headers).json()
        return data
