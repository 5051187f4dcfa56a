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


def share(text: str) -> float:
    """An argparse type: a share in (0, 1] (of experts the budget holds); NaN, 0 and negative
    shares are usage errors (NaN was a traceback inside the budget, -1 a reported figure)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < x <= 1.0:  # (False for NaN too)
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return x


def add_tokens(ap: argparse.ArgumentParser, default: int) -> None:
    """``--tokens``: the decode steps of one run, as the streaming benchmarks count them."""
    ap.add_argument(
        "--tokens",
        type=positive,
        default=default,
        help="decode steps per run (the turn generates one token more: its first comes from "
        "the prefill)",
    )
