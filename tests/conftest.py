"""Shared fixtures. Heavy artefacts (oracle checkpoints) are built once per tool version and
cached under tests/.cache so repeated runs are fast; CI starts from a clean clone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "tests" / ".cache"

# Tests run on the tiny model (see tests/_demo.py); `coli` subprocesses inherit it.
os.environ.setdefault("COLI_MODEL", str(ROOT / "tests" / "data" / "tiny-glm"))


def _tool_digest(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    """Directory with the seeded tiny HF checkpoints + references from tools/make_oracle.py."""
    pytest.importorskip("torch", reason="the oracle needs torch (test dependency)")
    pytest.importorskip("transformers", reason="the oracle needs transformers (test dependency)")
    tool = ROOT / "tools" / "make_oracle.py"
    out = CACHE / f"oracle-{_tool_digest(tool)}"
    done = out / ".complete"
    if not done.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(tool), "--out", str(out)], check=True, cwd=ROOT)
        done.write_text("ok\n")
    return out


@pytest.fixture
def env_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("COLI_"):
            monkeypatch.delenv(k)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def private_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME in a fresh temporary directory: the engine's default state dir
    (~/.cache/colibri/...) starts empty and the user's is never touched."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
