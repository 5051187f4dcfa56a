"""The code standards hold on every commit: ruff-clean (lint and format) everywhere, mypy strict
on storage/ and colibri/ (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY_DIRS = ("storage", "runtime", "colibri", "tests", "tools")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("cmd", [("ruff", "check", "."), ("ruff", "format", "--check", *PY_DIRS)])
def test_ruff(cmd: tuple[str, ...]) -> None:
    p = _run(*cmd)
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_strict_storage_and_colibri() -> None:
    p = _run("mypy", "storage", "colibri")
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_module_says_what_it_owns_and_runtime_modules_state_their_shapes() -> None:
    """Each package module opens with a docstring (what it owns); each runtime module's has a
    ``Shape legend:`` line (one format, so a reader finds the letters in the same place)."""
    import ast

    missing: list[str] = []
    for pkg in ("storage", "runtime", "colibri"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()))
            rel = str(path.relative_to(ROOT))
            if not doc:
                missing.append(f"{rel}: no module docstring")
            elif pkg == "runtime" and "Shape legend:" not in doc:
                missing.append(f"{rel}: no 'Shape legend:' in the docstring")
    assert not missing, "\n".join(missing)
