"""The ``coli`` command as a real subprocess, for the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def coli(
    *args: str, home: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``coli ARGS`` in a clean environment (no ``COLI_*`` variables unless given in
    ``env``; ``home``: its own HOME, so its state dirs stay out of the user's)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    if home is not None:
        base["HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=300,
    )
