"""Argument types the benchmarks share."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a count of rounds, tokens, reads, requests); a
    usage error naming the value otherwise, not a traceback after minutes of set-up."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n
