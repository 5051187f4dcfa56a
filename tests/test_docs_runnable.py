"""Every command block of README.md and docs/cli.md marked ``<!-- runnable -->`` runs as written
(bash, ``set -e``, the installed ``coli`` on PATH, a fresh HOME and working directory): the
documented commands exist, take those flags and succeed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/cli.md")
_BLOCK = re.compile(r"<!-- runnable -->\s*\n```bash\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for k, m in enumerate(_BLOCK.finditer(text)):
            out.append((doc, k, m.group(1)))
    return out


def test_there_are_runnable_blocks() -> None:
    assert {doc for doc, _, _ in _blocks()} == set(DOCS)


@pytest.mark.parametrize(("doc", "k", "script"), _blocks(), ids=lambda v: str(v)[:20])
def test_block_runs(doc: str, k: int, script: str, tmp_path: Path) -> None:
    env = {key: v for key, v in os.environ.items() if not key.startswith("COLI_")}
    env["HOME"] = str(tmp_path / "home")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    (tmp_path / "home").mkdir()
    r = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (
        f"{doc} block {k} failed:\n{script}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    )
