"""64-byte alignment of the arrays the 16-lane kernels load whole lines from
(runtime/kernels/aligned.py, ``_intrinsics.zeros64``): the helpers, the activation planes and
scratch the int4 / fast-int8 kernels allocate, the KV cache, and that alignment changes no bit.

# T tokens, I in features, O out features, S keys, C latent width, R rope width
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from runtime.kernels import _matmul_kernels as mk
from runtime.kernels._intrinsics import zeros64
from runtime.kernels._q8 import _q8_round
from runtime.kernels.aligned import is_aligned, zeros_aligned
from runtime.kernels.attention import latent_attention
from runtime.kv import KVCache

# numba's own np.zeros aligns to 32 bytes: across these sizes about half of the arrays start
# mid-line, so a helper that did not align would fail these tests
_SIZES = [*range(1, 400, 7), 4096, 12_345, 100_000]


@njit(cache=False)
def _nb_addresses(sizes, proto):  # type: ignore[no-untyped-def]
    """(address % 64, size if all zero else -1) of ``zeros64(n, proto.dtype)`` per size."""
    out = np.empty((len(sizes), 2), np.int64)
    for k in range(len(sizes)):
        a = zeros64(sizes[k], proto.dtype)
        out[k, 0] = a.ctypes.data % 64
        out[k, 1] = a.size if np.all(a == 0) else -1
    return out


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float32, np.float64])
def test_zeros64_in_numba_is_aligned_zeroed_and_sized(dtype: type) -> None:
    sizes = np.array(_SIZES, np.int64)
    got = _nb_addresses(sizes, np.zeros(1, dtype))
    assert (got[:, 0] == 0).all()
    np.testing.assert_array_equal(got[:, 1], sizes)


def test_zeros_aligned() -> None:
    for n in _SIZES[:20]:
        for dt in (np.float32, np.int32, np.uint8):
            a = zeros_aligned((n, 3), dt)
            assert a.shape == (n, 3) and a.dtype == dt and is_aligned(a) and not a.any()
            assert a.flags.c_contiguous and a.flags.writeable


def test_int4_activation_planes_and_padded_rows_are_aligned() -> None:
    rng = np.random.default_rng(0)
    for i in (6, 64, 130, 2048, 6144):
        nb = (i + 1) // 2
        ys = (nb + 7) // 8 * 8 + 16
        for t in (1, 2, 5):
            x = rng.standard_normal((t, i), dtype=np.float32)
            for _ in range(6):
                assert mk._i4_prep(x, nb, ys).ctypes.data % 64 == 0
                assert mk._pad_rows(x, (i + 7) // 8 * 8).ctypes.data % 64 == 0


def test_fast_int8_digits_are_aligned() -> None:
    rng = np.random.default_rng(1)
    for t in (1, 3):
        for i in (64, 2048, 6144):
            xq, bias, _sx, _xs, _bs = _q8_round(rng.standard_normal((t, i), dtype=np.float32))
            assert xq.ctypes.data % 64 == 0 and bias.ctypes.data % 64 == 0


def test_kv_cache_rows_start_aligned_after_growth() -> None:
    kv = KVCache(2, 512, 64, index_head_dim=128, indexed_layers=[1], capacity=3)
    rng = np.random.default_rng(2)
    first = rng.standard_normal((3, 512), dtype=np.float32)
    kv.write(0, 0, first, rng.standard_normal((3, 64), dtype=np.float32))
    for cap in (3, 50, 700):
        kv.reserve(cap)
        for layer in (0, 1):
            assert is_aligned(kv.latent(layer, 1)) and is_aligned(kv.k_rope(layer, 1))
    np.testing.assert_array_equal(kv.latent(0, 3), first)  # growth kept the rows


def test_attention_gives_the_same_bits_from_misaligned_inputs() -> None:
    rng = np.random.default_rng(3)
    t, nh, c, r, s = 2, 8, 64, 16, 40
    parts = [
        rng.standard_normal(shape, dtype=np.float32)
        for shape in ((t, nh, c), (t, nh, r), (s, c), (s, r))
    ]

    def shifted(a: np.ndarray) -> np.ndarray:
        buf = zeros_aligned(a.size + 1, np.float32)
        view = buf[1:].reshape(a.shape)  # 4 bytes past a line: misaligned
        view[...] = a
        return view

    want = latent_attention(*parts, None, 0.125)
    moved = [shifted(a) for a in parts]
    assert not any(is_aligned(a) for a in moved)
    got = latent_attention(*moved, None, 0.125)
    assert is_aligned(want) and is_aligned(got)
    np.testing.assert_array_equal(got, want)
