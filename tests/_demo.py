"""The model most tests run on: the tiny random glm_moe_dsa container in tests/data/tiny-glm
(fast, every path of the architecture), exported as COLI_MODEL by conftest so that `coli`
subprocesses use it too. The trained demo model bundled in the package stays the default of
`coli` and `colibri.open_model()` for users; tests that mean it use default_model_path()."""

from __future__ import annotations

import os
from pathlib import Path

TINY = Path(__file__).resolve().parent / "data" / "tiny-glm"


def demo_model() -> Path:
    return Path(os.environ.get("COLI_MODEL") or TINY)
