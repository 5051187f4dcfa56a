"""Shared by the oracle tests: the converted containers of the seeded HF checkpoints, their
reference arrays and the oracle tool's own functions (``tools/make_oracle.py``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from storage.container import Container
from storage.convert import ConvertOptions, convert

ROOT = Path(__file__).resolve().parents[1]
F32 = ConvertOptions(experts="f32", dense="f32", io="f32", mtp="f32")


def container_maker(oracle_dir: Path, root: Path) -> Callable[[str, str], Container]:
    """``get(name, "f32" | "q")``: the oracle checkpoint ``name`` converted (f32, or the
    default int4 policy) under ``root``, once per maker."""
    made: dict[tuple[str, str], Container] = {}

    def get(name: str, kind: str) -> Container:
        if (name, kind) not in made:
            dst = root / f"{name}-{kind}"
            convert(oracle_dir / name, dst, F32 if kind == "f32" else ConvertOptions())
            made[(name, kind)] = Container.open(dst)
        return made[(name, kind)]

    return get


def reference(oracle_dir: Path, name: str) -> dict[str, np.ndarray]:
    """The oracle's reference arrays of ``name`` (``NAME.ref.npz``)."""
    with np.load(oracle_dir / f"{name}.ref.npz") as z:
        return {k: z[k] for k in z.files}


def oracle_tool() -> Any:
    """``tools/make_oracle.py`` imported as a module (its model classes, forwards, greedy)."""
    spec = importlib.util.spec_from_file_location("make_oracle", ROOT / "tools" / "make_oracle.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_oracle", mod)
    spec.loader.exec_module(mod)
    return mod
