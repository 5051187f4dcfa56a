"""Whether numba has compiled kernels cached for this checkout (``cache=True`` kernels keep an
index file, ``*.nbi``, per function): a first run compiles every kernel it meets, which takes
a minute or two on a small machine; later runs load them at once."""

from __future__ import annotations

from pathlib import Path


def kernels_cached() -> bool:
    """True when a numba cache index of this package's kernels is on disk: under numba's
    ``NUMBA_CACHE_DIR`` when set (as numba itself read it), else beside the modules."""
    from numba.core import config

    cache_dir = str(getattr(config, "CACHE_DIR", "") or "")  # set from NUMBA_CACHE_DIR
    if cache_dir:  # numba then caches there only
        root = Path(cache_dir)
        return root.is_dir() and any(root.rglob("_matmul_kernels*.nbi"))
    here = Path(__file__).resolve().parent
    return any((here / "__pycache__").glob("_matmul_kernels*.nbi"))
