"""The kernels under numba's narrower code-generation targets.

``NUMBA_CPU_NAME=generic`` (numba's advice for caches shared between machines) makes numba
generate code without the host's vector extensions. The kernels used to decide on their
ISA-specific intrinsics (``vpermps``, ``vpdpbusd``) from the host CPU alone, and LLVM then
aborted the process compiling them ("Do not know how to split the result of this operator").
They now follow numba's own target (``host_codegen_features``) and fall back to their portable
forms, which must give the same bits as the host's; an AVX2 target (Haswell's features) runs
the AVX2 machines' forms on this CPU the same way.

# T tokens, I in features, O out features
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.kernels._simd import host_codegen_features
from runtime.kernels.quant_matmul import matmul_int4, matmul_int4_q8

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
import numpy as np
from runtime.kernels._simd import host_codegen_features
from runtime.kernels._q8 import q8dot_kind
from runtime.kernels.isa import kernel_info
from runtime.kernels.quant_matmul import matmul_int4, matmul_int4_q8
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 256)).astype(np.float32)
p = rng.integers(0, 256, 37 * 128, dtype=np.uint8)
s = rng.random(37 * 4).astype(np.float32)
out = {
    "features": sorted(host_codegen_features()),
    "kind": q8dot_kind(),
    "reported": kernel_info().int8_kind,
    "exact16": matmul_int4(x, p, s, 37, 256, 64, lanes=16).tobytes().hex(),
    "exact16_one": matmul_int4(x[:1], p, s, 37, 256, 64, lanes=16).tobytes().hex(),
    "q8": matmul_int4_q8(x, p, s, 37, 256, 64).tobytes().hex(),
}
print(json.dumps(out))
"""


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    p = rng.integers(0, 256, 37 * 128, dtype=np.uint8)
    s = rng.random(37 * 4).astype(np.float32)
    return x, p, s


#: An AVX2 machine's target (Haswell's features), so that the AVX2 paths run on any newer CPU.
_HASWELL = (
    "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+mmx,+movbe,+popcnt,+sse,"
    "+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave"
)


@pytest.mark.parametrize(
    ("cpu", "features", "kind"),
    [("generic", None, "portable"), ("haswell", _HASWELL, "avx2")],
)
def test_a_narrower_target_compiles_other_kernel_forms_with_the_same_bits(
    tmp_path: Path, cpu: str, features: str | None, kind: str
) -> None:
    """``generic``: no vector extension at all, the portable forms; ``haswell``: AVX2 without
    AVX-512 or VNNI, the 8-lane integer paths (fast-int8 through 16-bit words) an AVX2 machine
    runs. Both give the bits this CPU's own kernels give."""
    if kind == "avx2" and "avx2" not in host_codegen_features():
        pytest.skip("this CPU cannot run AVX2 code")
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": cpu,
        "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("NUMBA_CPU_FEATURES", None)
    if features is not None:
        env["NUMBA_CPU_FEATURES"] = features
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["kind"] == kind and got["reported"] == kind  # what stats() / coli info say
    assert (got["features"] == []) == (features is None)
    x, p, s = _inputs()
    want = {
        "exact16": matmul_int4(x, p, s, 37, 256, 64, lanes=16),
        "exact16_one": matmul_int4(x[:1], p, s, 37, 256, 64, lanes=16),
        "q8": matmul_int4_q8(x, p, s, 37, 256, 64),
    }
    for name, here in want.items():  # the host's intrinsics here, the portable forms there
        assert bytes.fromhex(got[name]) == here.tobytes(), name
