"""Whether numba has compiled kernels cached for this checkout (``cache=True`` kernels keep an
index file, ``*.nbi``, per function): a first run compiles every kernel it meets, which takes
a minute or two on a small machine; later runs load them at once.

Shape legend: no arrays (file names and counts)."""

from __future__ import annotations

from pathlib import Path

#: index files that mean a run has compiled most of what it needs (a generation on the demo
#: model compiles a few dozen kernels)
CACHED_AT_LEAST = 12


def kernels_cached() -> bool:
    """True when a numba cache index of this package's kernels is on disk: under numba's
    ``NUMBA_CACHE_DIR`` when set (as numba itself read it), else beside the modules."""
    from numba.core import config

    here = Path(__file__).resolve().parent
    ours = {p.stem for p in here.glob("*.py")}  # index files are named <module>.<function>-...
    cache_dir = str(getattr(config, "CACHE_DIR", "") or "")  # set from NUMBA_CACHE_DIR
    if cache_dir:  # numba then caches there only, under a directory named after ours
        root = Path(cache_dir)
        files = list(root.rglob(f"{here.name}_*/*.nbi")) if root.is_dir() else []
    else:
        files = list((here / "__pycache__").glob("*.nbi"))
    # another package's kernels in a shared cache dir are not ours
    found = sum(1 for f in files if f.name.split(".", 1)[0] in ours)
    # one index is not enough: a first run stopped after its first kernel left one
    return found >= CACHED_AT_LEAST
