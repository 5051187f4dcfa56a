#!/usr/bin/env python3
"""Build the routing atlas (same as ``coli atlas``): route the bundled topic prompt sets through
the model, lay the experts out in 3-D by topic affinity and write ``<state dir>/atlas.json``,
which ``coli web`` shows in its Atlas tab (``GET /atlas``).

    python tools/atlas.py                                  # the demo model, loaded here
    python tools/atlas.py --model DIR --state-dir DIR
    python tools/atlas.py --server http://127.0.0.1:8000   # through a running server

Options are ``coli atlas --help``'s; see colibri/atlas.py for the method.
"""

from __future__ import annotations

import sys

from colibri.cli import main

if __name__ == "__main__":
    main(["atlas", *sys.argv[1:]])
