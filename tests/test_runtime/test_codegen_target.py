"""The kernels under numba's narrower code-generation targets.

``NUMBA_CPU_NAME=generic`` (numba's advice for caches shared between machines) makes numba
generate code without the host's vector extensions. The kernels used to decide on their
ISA-specific intrinsics (``vpermps``, ``vpdpbusd``) from the host CPU alone, and LLVM then
aborted the process compiling them ("Do not know how to split the result of this operator").
They now follow numba's own target (``host_codegen_features``) and fall back to their portable
forms, which must give the same bits as the host's.

# T tokens, I in features, O out features
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from runtime.kernels.quant_matmul import matmul_int4, matmul_int4_q8

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
import numpy as np
from runtime.kernels._simd import host_codegen_features
from runtime.kernels._q8 import q8dot_kind
from runtime.kernels.quant_matmul import matmul_int4, matmul_int4_q8
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 256)).astype(np.float32)
p = rng.integers(0, 256, 40 * 128, dtype=np.uint8)
s = rng.random(40 * 4).astype(np.float32)
out = {
    "features": sorted(host_codegen_features()),
    "kind": q8dot_kind(),
    "exact16": matmul_int4(x, p, s, 40, 256, 64, lanes=16).tobytes().hex(),
    "exact16_one": matmul_int4(x[:1], p, s, 40, 256, 64, lanes=16).tobytes().hex(),
    "q8": matmul_int4_q8(x, p, s, 40, 256, 64).tobytes().hex(),
}
print(json.dumps(out))
"""


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    p = rng.integers(0, 256, 40 * 128, dtype=np.uint8)
    s = rng.random(40 * 4).astype(np.float32)
    return x, p, s


def test_generic_target_compiles_the_portable_kernels_with_the_same_bits(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": "generic",
        "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("NUMBA_CPU_FEATURES", None)
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["features"] == [] and got["kind"] == "portable"
    x, p, s = _inputs()
    want = {
        "exact16": matmul_int4(x, p, s, 40, 256, 64, lanes=16),
        "exact16_one": matmul_int4(x[:1], p, s, 40, 256, 64, lanes=16),
        "q8": matmul_int4_q8(x, p, s, 40, 256, 64),
    }
    for name, here in want.items():  # the host's intrinsics here, the portable forms there
        assert bytes.fromhex(got[name]) == here.tobytes(), name
