"""JSON text read from files and requests: the one place that turns every way a text can fail
to be JSON into a ``ValueError`` that says why."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(text: str | bytes, **kw: Any) -> Any:
    """``json.loads(text, **kw)``, where every failure is a ``ValueError`` whose message is the
    reason: bad syntax stays a ``json.JSONDecodeError`` (a ValueError), an integer past
    Python's digit limit is already a ValueError, and text nested past the parser's
    recursion limit (a ``RecursionError`` from ``json``) becomes ``ValueError("nested too
    deeply")``."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
