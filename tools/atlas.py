#!/usr/bin/env python3
"""Build the routing atlas (same as ``coli atlas``): route the bundled topic prompt sets through
the model, lay the experts out in 3-D by topic affinity and write ``<state dir>/atlas.json``,
which ``coli web`` shows in its Atlas tab (``GET /atlas``).

    python tools/atlas.py                                  # the demo model, loaded here
    python tools/atlas.py --model DIR --state-dir DIR
    python tools/atlas.py --server http://127.0.0.1:8000   # through a running server

Options are ``coli atlas --help``'s, and ``coli``'s own -v, --debug and --log-format; see
colibri/atlas.py for the method.
"""

from __future__ import annotations

import sys

from colibri.cli import main


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """(the `coli` options among ``args``: -v, --debug, --log-format X; the atlas's own)."""
    top: list[str] = []
    rest: list[str] = []
    it = iter(args)
    for a in it:
        if a in ("--debug", "--verbose") or (a.startswith("-v") and set(a[1:]) == {"v"}):
            top.append(a)
        elif a == "--log-format":
            top += [a, next(it, "")]
        elif a.startswith("--log-format="):
            top.append(a)
        else:
            rest.append(a)
    return top, rest


if __name__ == "__main__":
    top, rest = _split(sys.argv[1:])
    main([*top, "atlas", *rest])
