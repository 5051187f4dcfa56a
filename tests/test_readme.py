"""The README contract: its first Quick-start command installs colibri into a clean virtualenv
and generates with the bundled model; its second command is what .ci/run runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    blocks = _quick_start()
    assert len(blocks) == 2
    assert "coli run" in blocks[0]
    assert "pytest" in blocks[1]
    assert blocks[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_first_command_runs_in_a_fresh_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    clone = tmp_path / "clone"
    for f in files:
        if not f:
            continue
        src = ROOT / f.decode()
        if src.is_file():
            dst = clone / f.decode()
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLI_", "VIRTUAL_ENV"))}
    env["HOME"] = str(tmp_path / "home")
    proc = subprocess.run(
        ["bash", "-c", _quick_start()[0]],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip(), "no generated text"
    assert (clone / ".venv" / "bin" / "coli").exists()
