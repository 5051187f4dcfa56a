"""numba matmul kernels: accuracy vs a float64 reference, batch invariance, determinism,
argument checks, nogil, and the Linear layer on top of them.

# T tokens, I in features, O out features
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from runtime.kernels import quant_matmul as qm
from runtime.kernels._intrinsics import f16_bits_to_f32, u32_bits_to_f32
from runtime.kernels.quant_matmul import (
    matmul_bf16,
    matmul_f16,
    matmul_f32,
    matmul_int4,
    matmul_int8,
)
from runtime.linear import Linear, linear_from_array
from storage.errors import FormatError
from storage.quant import QTensor, dequantize, quantize

F32 = npt.NDArray[np.float32]

# int4-g24 / int4-g17: group sizes that are not a multiple of 16 take the exact fallback path.
FORMATS = [
    "f32",
    "bf16",
    "f16",
    "int8",
    "int4-row",
    "int4-g16",
    "int4-g32",
    "int4-g48",
    "int4-g64",
    "int4-g128",
    "int4-g24",
    "int4-g17",
]
# I a multiple of every group size, not a multiple (partial last group), odd (half last byte).
IN_FEATURES = [256, 200, 77]

# Float32 rounding error of a dot product is bounded by ~n * eps * sum|x_i * w_i|; our kernels
# sum in short chains, so 1e-5 of the absolute-product sum is a generous, shape-free bound.
REL_TOL = 1e-5


def _weights(fmt: str, o: int, i: int, seed: int = 0) -> QTensor:
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((o, i), dtype=np.float32), fmt)


def _matmul(q: QTensor, lanes: int = 8) -> Callable[..., F32]:
    """The kernel wrapper for ``q``'s format, as ``f(x, **kw) -> y`` (int4 / int8: ``lanes``
    wide)."""
    o, i = q.shape
    f = q.fmt
    data: npt.NDArray[Any] = q.data
    if f.kind == "f32":
        return lambda x, **kw: matmul_f32(x, data, **kw)
    if f.kind == "bf16":
        return lambda x, **kw: matmul_bf16(x, data, **kw)
    if f.kind == "f16":
        return lambda x, **kw: matmul_f16(x, data, **kw)
    assert q.scales is not None
    scales: F32 = q.scales
    if f.kind == "int8":
        return lambda x, **kw: matmul_int8(x, data, scales, o, i, lanes=lanes, **kw)
    return lambda x, **kw: matmul_int4(x, data, scales, o, i, f.group_size, lanes=lanes, **kw)


def _x(t: int, i: int, seed: int = 1) -> F32:
    return np.random.default_rng(seed).standard_normal((t, i), dtype=np.float32)


def _assert_close(y: F32, x: F32, q: QTensor) -> None:
    w = dequantize(q).astype(np.float64)  # [O, I]
    ref = x.astype(np.float64) @ w.T  # [T, O]
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T  # [T, O] sum of |products|
    assert y.dtype == np.float32 and y.shape == ref.shape
    err = np.abs(y - ref)
    assert np.all(err <= REL_TOL * bound + 1e-30), float(np.max(err / (bound + 1e-30)))


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_in", IN_FEATURES)
@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("lanes", [8, 16])
def test_matches_float64_reference(fmt: str, n_in: int, n_tok: int, lanes: int) -> None:
    q = _weights(fmt, 21, n_in)
    x = _x(n_tok, n_in)
    _assert_close(_matmul(q, lanes)(x), x, q)


@pytest.mark.parametrize("lanes", [8, 16])
def test_realistic_expert_gemv_shapes(lanes: int) -> None:
    # One GLM-5 expert matrix each way (gate/up 2048x6144 and down 6144x2048), int4 gs64.
    for o, i in [(2048, 6144), (6144, 2048)]:
        q = _weights("int4-g64", o, i, seed=o)
        for t in (1, 5):
            x = _x(t, i)
            _assert_close(_matmul(q, lanes)(x), x, q)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-row", "int4-g128"])
@pytest.mark.parametrize("n_in", [128, 2048, 2112])
@pytest.mark.parametrize("lanes", [8, 16])
def test_int4_small_t_kernels_equal_one_token_calls(fmt: str, n_in: int, lanes: int) -> None:
    """T = 2..9, 12 and 17, 41 rows. 16 lanes: rows of 64-column groups (and per-row scales)
    take the register-tile kernel (full tiles of 4 tokens take the rows in pairs, the odd
    last row alone; a last tile of 1 to 3 tokens four rows a quarter of the matrix apart, the
    last 1 of 41 rows alone), larger groups the blocked one. 8 lanes:
    up to 4 tokens on 64-column groups or per-row scales (whole 32-byte chunks: not 2112
    columns) take the few-token kernel, the rest the blocked one. Every token's row equals its
    one-token call bit for bit."""
    q = _weights(fmt, 41, n_in, seed=n_in)
    mm = _matmul(q, lanes)
    x = _x(17, n_in, seed=1)
    x[2] *= -1e4
    alone = np.concatenate([mm(x[t : t + 1]) for t in range(17)])
    for n_tok in (*range(2, 10), 12, 17):
        got = mm(x[:n_tok])
        np.testing.assert_array_equal(got.view(np.uint32), alone[:n_tok].view(np.uint32))
    _assert_close(mm(x), x, q)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-row", "int4-g128"])
@pytest.mark.parametrize("n_in", [128, 2112, 330])
@pytest.mark.parametrize("lanes", [8, 16])
def test_int4_gemv_row_streams_equal_one_row_calls(fmt: str, n_in: int, lanes: int) -> None:
    """One token on 64-column groups or per-row scales: the rows are computed four at a time,
    a quarter of the matrix apart (four read streams), two groups per pass, the last rows
    alone. Every row is the same bits as that row computed by itself, with or without the
    prefetch, for row counts that leave 0-3 rows over; 2112 columns: an odd group count;
    330: a partial last group (one row at a time throughout)."""
    x = _x(1, n_in, seed=5)
    x[0, 7] *= -1e4
    for o in (4, 17, 41, 42, 43):
        q = _weights(fmt, o, n_in, seed=o)
        assert q.scales is not None
        nb = (n_in + 1) // 2
        rows = q.data.reshape(o, nb)
        s_rows = q.scales.reshape(o, -1)
        gs = q.fmt.group_size
        alone = np.concatenate(
            [
                matmul_int4(x, rows[r].copy(), s_rows[r].copy(), 1, n_in, gs, lanes=lanes)[0]
                for r in range(o)
            ]
        )
        for pf in (0, 1000, 4096):
            got = matmul_int4(x, q.data, q.scales, o, n_in, gs, lanes=lanes, prefetch_distance=pf)
            np.testing.assert_array_equal(got[0].view(np.uint32), alone.view(np.uint32))
        _assert_close(got, x, q)


@pytest.mark.parametrize("n_in", [15, 77, 1024, 2056])
def test_int8_16_lane_row_blocks_equal_one_row_one_token_calls(n_in: int) -> None:
    """16 lanes: one token takes the rows in blocks of four (one activation load for four
    rows) and the last one to three alone; more tokens take each row against register tiles
    of up to four tokens (one conversion of each weight block per tile), rows in blocks of
    16, tokens in passes of 32. A row's result is the same bits whether it came from a block,
    alone or from a tile of any size (a split of the rows over threads moves the block
    boundaries), for every T, with and without the prefetch."""
    o = 41  # ten blocks of four and one row alone
    q = _weights("int8", o, n_in, seed=n_in)
    assert q.scales is not None
    x = _x(35, n_in, seed=3)
    x[4] *= -1e4
    rows = q.data.reshape(o, n_in)

    def one(t: int, r: int) -> float:  # token t, weight row r, computed alone
        y = matmul_int8(x[t : t + 1], rows[r].copy(), q.scales[r : r + 1], 1, n_in, lanes=16)
        return float(y[0, 0])

    alone = np.array([[one(t, r) for r in range(o)] for t in range(35)], dtype=np.float32)
    for n_tok in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 17, 33, 35):
        for pf in (0, 4096):
            got = matmul_int8(x[:n_tok], q.data, q.scales, o, n_in, lanes=16, prefetch_distance=pf)
            np.testing.assert_array_equal(got.view(np.uint32), alone[:n_tok].view(np.uint32))
    _assert_close(matmul_int8(x, q.data, q.scales, o, n_in, lanes=16), x, q)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "int8"])
@pytest.mark.parametrize("n_in", [5, 77, 256])
def test_8_lane_row_pairs_equal_one_row_one_token_calls(fmt: str, n_in: int) -> None:
    """The 8-lane kernel of f32 / bf16 / f16 / int8 takes, for one token, rows in pairs half
    the matrix apart that share each activation load (an odd last row alone) and, for
    several, tokens in pairs that share each weight block (an odd last token alone); every
    (token, row) is the same bits as that row alone with that token alone, for every T, with
    and without the prefetch."""
    o = 9  # four pairs (rows r and r + 4) and one row alone
    q = _weights(fmt, o, n_in, seed=n_in)
    x = _x(10, n_in, seed=5)
    x[3] *= -1e4

    def row(r: int) -> QTensor:
        if q.scales is None:  # float formats: [O, I]
            return QTensor(q.fmt, (1, n_in), q.data[r : r + 1].copy())
        data = q.data.reshape(o, n_in)[r].copy()
        return QTensor(q.fmt, (1, n_in), data, q.scales[r : r + 1].copy())

    singles = [_matmul(row(r), 8) for r in range(o)]
    alone = np.array(
        [[float(singles[r](x[t : t + 1])[0, 0]) for r in range(o)] for t in range(10)],
        dtype=np.float32,
    )
    mm = _matmul(q, 8)
    for n_tok in (1, 2, 5, 8, 10):
        for pf in (0, 4096):
            got = mm(x[:n_tok], prefetch_distance=pf)
            np.testing.assert_array_equal(got.view(np.uint32), alone[:n_tok].view(np.uint32))
    _assert_close(mm(x), x, q)


def test_int8_both_widths_exact_and_differently_ordered() -> None:
    """int8 takes 16 lanes at every width (the tail block is zero padded); the widths agree to
    float rounding, not bit for bit."""
    for n_in in (1, 15, 16, 77, 200, 2048):
        q = _weights("int8", 9, n_in, seed=n_in)
        x = _x(3, n_in)
        y8, y16 = _matmul(q, 8)(x), _matmul(q, 16)(x)
        _assert_close(y16, x, q)
        if n_in >= 64:
            assert not np.array_equal(y8, y16)
    with pytest.raises(ValueError, match="lanes"):
        _matmul(_weights("int8", 2, 8), 32)(_x(1, 8))


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int4-row", "int4-g32", "int4-g24"])
def test_int4_width_choice_and_both_widths_exact(fmt: str) -> None:
    """16 lanes where groups are whole 64-column chunks tiling the row; the two widths sum in
    different orders (different last bits), each within the float64 bound."""
    from runtime.kernels.quant_matmul import int4_lanes

    wide_at = {  # in features where the 16-lane kernel serves (of 256, 320, 200)
        "int4-g64": {256, 320},
        "int4-g128": {256},  # 320 = 2.5 groups of 128
        "int4-row": {256, 320},  # 64-column virtual groups
        "int4-g32": set(),  # 16-byte groups
        "int4-g24": set(),
    }[fmt]
    for n_in in (256, 320, 200):
        q = _weights(fmt, 19, n_in)
        gs = q.fmt.group_size
        wide = n_in in wide_at
        assert int4_lanes(n_in, gs, 16) == (16 if wide else 8), (fmt, n_in)
        assert int4_lanes(n_in, gs, 8) == 8
        x = _x(6, n_in)
        y8, y16 = _matmul(q, 8)(x), _matmul(q, 16)(x)
        _assert_close(y16, x, q)
        if not wide:
            assert np.array_equal(y8, y16)  # the 8-lane kernel served both
    q = _weights("int4-g64", 64, 2048)
    x = _x(4, 2048)
    assert not np.array_equal(_matmul(q, 8)(x), _matmul(q, 16)(x))  # really another kernel
    with pytest.raises(ValueError, match="lanes"):
        _matmul(q, 4)(x)


def test_tiny_and_empty_shapes() -> None:
    q = _weights("int4-g64", 3, 1)
    _assert_close(_matmul(q)(_x(2, 1)), _x(2, 1), q)
    y = _matmul(q)(np.zeros((0, 1), dtype=np.float32))
    assert y.shape == (0, 3)
    q0 = _weights("int8", 0, 16)
    assert _matmul(q0)(_x(2, 16)).shape == (2, 0)


def test_special_values_propagate() -> None:
    q = _weights("int4-g64", 4, 64)
    x = _x(2, 64)
    x[1, 5] = np.inf
    y = _matmul(q)(x)
    assert np.all(np.isfinite(y[0])) and not np.any(np.isfinite(y[1]))


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_in", [200, 77, 384])
@pytest.mark.parametrize("lanes", [8, 16])
def test_batch_invariant(fmt: str, n_in: int, lanes: int) -> None:
    # 37 rows: not a multiple of the kernels' row blocks; 64 tokens: several token tiles.
    # 384 columns: the int4 16-lane kernels (groups tiling the row), 200 / 77: the 8-lane ones.
    if lanes == 16 and not fmt.startswith(("int4", "int8")):
        pytest.skip("16 lanes is an int4 / int8 kernel width")
    q = _weights(fmt, 37, n_in)
    mm = _matmul(q, lanes)
    x = _x(64, n_in, seed=7)
    x[5] *= 1e3  # rows of very different magnitude must not influence each other
    x[6] = 0.0
    full = mm(x)
    for t in range(x.shape[0]):
        assert np.array_equal(mm(x[t : t + 1])[0], full[t]), f"row {t} alone differs"
    for a, b in [(0, 3), (3, 11), (11, 19), (50, 64)]:
        assert np.array_equal(mm(x[a:b]), full[a:b]), f"rows {a}:{b} differ"


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g128", "int8", "bf16"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_deterministic_and_prefetch_neutral(fmt: str, lanes: int) -> None:
    q = _weights(fmt, 40, 384)
    mm = _matmul(q, lanes)
    for t in (1, 5):
        x = _x(t, 384)
        y = mm(x)
        assert np.array_equal(y, mm(x))
        assert np.array_equal(y, mm(x, prefetch_distance=0))
        out = np.full((t, 40), np.nan, dtype=np.float32)
        assert mm(x, out=out) is out and np.array_equal(out, y)


# ----------------------------------------------------------------------------- argument checks


def test_wrappers_reject_bad_arguments() -> None:
    q = _weights("int4-g64", 8, 128)
    assert q.scales is not None
    p: npt.NDArray[Any] = q.data
    s: F32 = q.scales
    x = _x(2, 128)
    x64: npt.NDArray[Any] = x.astype(np.float64)
    bad_calls: list[Callable[[], object]] = [
        lambda: matmul_int4(x64, p, s, 8, 128, 64),
        lambda: matmul_int4(x[0], p, s, 8, 128, 64),  # 1-D x
        lambda: matmul_int4(x[:, :64], p, s, 8, 128, 64),  # wrong I
        lambda: matmul_int4(np.asfortranarray(_x(3, 128)), p, s, 8, 128, 64),
        lambda: matmul_int4(x, p[:-1], s, 8, 128, 64),  # short packed
        lambda: matmul_int4(x, p.view(np.int8), s, 8, 128, 64),
        lambda: matmul_int4(x, p, s[:-1], 8, 128, 64),  # short scales
        lambda: matmul_int4(x, p, s.astype(np.float64), 8, 128, 64),
        lambda: matmul_int4(x, p, s, 8, 128, 32),  # scales do not match gs
        lambda: matmul_int4(x, p, s, 8, 128, 0),
        lambda: matmul_int4(x, p, s, 8, 128, 64, out=np.empty((2, 7), np.float32)),
        lambda: matmul_int4(x, p, s, 8, 128, 64, out=np.empty((2, 8), x64.dtype)),
        lambda: matmul_int4(x, p, s, 8, 128, 64, prefetch_distance=-1),
        lambda: matmul_int8(x, p, s, 8, 128),  # int4 bytes are too few for int8
        lambda: matmul_f32(x, np.ones((4, 128), dtype=x64.dtype)),
        lambda: matmul_f32(x, np.ones(128, dtype=np.float32)),  # 1-D weight
        lambda: matmul_bf16(x, np.ones((4, 128), dtype=np.int16)),
        lambda: matmul_f16(x, np.ones((4, 64), dtype=np.uint16)),  # wrong I
    ]
    for k, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {k} was accepted")
    assert matmul_int4(x, p, s, 8, 128, 64).shape == (2, 8)


def test_kernels_release_the_gil() -> None:
    assert qm.KERNELS
    for kernel in qm.KERNELS:
        assert kernel.targetoptions.get("nogil") is True, kernel.py_func.__name__
        assert kernel.targetoptions.get("fastmath", False) is False, kernel.py_func.__name__
        assert not kernel.targetoptions.get("parallel", False), kernel.py_func.__name__


def test_scalar_intrinsics() -> None:
    from numba import njit

    @njit(nogil=True)
    def convert(h: np.uint16, b: np.uint32) -> tuple[float, float]:
        return f16_bits_to_f32(h), u32_bits_to_f32(b)

    h = np.array([1.5, -0.0, 65504.0, 6e-8], dtype=np.float16)
    for v in h:
        got, _ = convert(v.view(np.uint16), np.uint32(0))
        assert got == np.float32(v)
    _, got = convert(np.uint16(0), np.float32(-2.75).view(np.uint32))
    assert got == np.float32(-2.75)


def test_nibble_decode_by_table_lookup_gives_the_portable_floats() -> None:
    """``i4lo16`` (one ``vpermps`` lookup where the code may use AVX-512F) and the portable
    and + or + sub decode give the same float for every byte, so the 16-lane kernels give the
    same bits on AVX2 and AVX-512 CPUs; both are ``lo - 8``."""
    from numba import njit

    from runtime.kernels._simd import i4lo16, i4lo16_portable, vstore16

    @njit(nogil=True)
    def both(packed):  # type: ignore[no-untyped-def]
        a = np.zeros(packed.size, np.float32)
        b = np.zeros(packed.size, np.float32)
        for i in range(0, packed.size, 16):
            vstore16(a, i, i4lo16(packed, i))
            vstore16(b, i, i4lo16_portable(packed, i))
        return a, b

    packed = np.arange(256, dtype=np.uint8)[::-1].copy()
    a, b = both(packed)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    np.testing.assert_array_equal(a, (packed & 15).astype(np.float32) - 8)


def test_lane_sums_add_in_the_documented_order() -> None:
    """``vhsum`` / ``vhsum16`` (a few shuffles and vector adds), and ``vhsum16x4`` (four
    vectors folded side by side), give, bit for bit, the fixed
    order every kernel's result is defined by: fold the halves lane by lane down to 8 lanes,
    then ``((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))``; another order differs on these values
    (magnitudes 1e-8 to 1e8, so that float32 rounding depends on the order)."""
    from numba import njit

    from runtime.kernels._simd import vhsum, vhsum16, vhsum16x4, vload, vload16

    @njit(nogil=True)
    def sums(a):  # type: ignore[no-untyped-def]
        n = a.size // 16
        s8 = np.empty(n, np.float32)
        s16 = np.empty(n, np.float32)
        s4 = np.empty(n, np.float32)  # vhsum16x4 of rows r .. r + 3
        for r in range(n):
            s8[r] = vhsum(vload(a, 16 * r))
            s16[r] = vhsum16(vload16(a, 16 * r))
        for r in range(0, n - 3, 4):
            got = vhsum16x4(
                vload16(a, 16 * r), vload16(a, 16 * (r + 1)), vload16(a, 16 * (r + 2)),
                vload16(a, 16 * (r + 3)),
            )  # fmt: skip
            s4[r], s4[r + 1], s4[r + 2], s4[r + 3] = got
        return s8, s16, s4

    def fold(v: npt.NDArray[np.float32]) -> np.float32:
        while v.size > 8:
            v = v[: v.size // 2] + v[v.size // 2 :]
        h = v[:4] + v[4:]
        return (h[0] + h[2]) + (h[1] + h[3])

    rng = np.random.default_rng(11)
    a = (rng.standard_normal(16 * 400) * 10.0 ** rng.integers(-8, 9, 16 * 400)).astype(np.float32)
    s8, s16, s4 = sums(a)
    rows = a.reshape(-1, 16)
    want8 = np.array([fold(r[:8]) for r in rows], np.float32)
    want16 = np.array([fold(r) for r in rows], np.float32)
    np.testing.assert_array_equal(s8.view(np.uint32), want8.view(np.uint32))
    np.testing.assert_array_equal(s16.view(np.uint32), want16.view(np.uint32))
    np.testing.assert_array_equal(s4.view(np.uint32), want16.view(np.uint32))  # four at once
    sequential = np.array([np.cumsum(r, dtype=np.float32)[-1] for r in rows], np.float32)
    assert not np.array_equal(sequential, want16)  # the order matters on these values


@pytest.mark.parametrize(
    ("fmt", "d", "f", "lanes"),
    [
        ("int4-g64", 256, 128, 16),
        ("int4-g64", 256, 128, 8),
        ("int4-row", 200, 96, 16),  # per-row scales, 8-lane kernel for the odd widths
        ("int4-g32", 192, 64, 16),  # groups of 32: the 8-lane kernel at either width
        ("int4-g16", 77, 48, 8),  # a partial last group and an odd column count
    ],
)
def test_fused_swiglu_is_the_three_projections_bit_for_bit(
    fmt: str, d: int, f: int, lanes: int
) -> None:
    """``swiglu_int4`` (one kernel call) gives the bits of gate, up, ``silu_times`` and down
    called one by one, for one token and for several, and stays batch-invariant."""
    from runtime.kernels.quant_matmul import silu_times, swiglu_int4

    gate, up, down = (
        _weights(fmt, o, i, seed=s) for s, (o, i) in enumerate([(f, d), (f, d), (d, f)])
    )
    lin = [Linear(q, lanes=lanes) for q in (gate, up, down)]
    w4 = [x.int4 for x in lin]
    assert all(w is not None for w in w4)
    x = _x(11, d, seed=3)
    x[4] *= 1e3
    want = lin[2](silu_times(lin[0](x), lin[1](x)))
    got = swiglu_int4(x, *w4)  # type: ignore[misc]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for t in (0, 4, 10):
        np.testing.assert_array_equal(swiglu_int4(x[t : t + 1], *w4)[0], got[t])  # type: ignore[misc]
    assert swiglu_int4(x[:0], *w4).shape == (0, d)  # type: ignore[misc]
    with pytest.raises(ValueError, match="features"):
        swiglu_int4(x[:, :-1], *w4)  # type: ignore[misc]
    with pytest.raises(ValueError, match="not \\[F, D\\]"):
        swiglu_int4(x, w4[0], w4[2], w4[1])  # type: ignore[arg-type]


def test_routed_expert_in_one_call_is_the_numpy_path_bit_for_bit() -> None:
    """``routed_expert_int4`` (row selection, gather, fused SwiGLU, gate product in one call)
    gives the rows and bits of ``moe.expert_output`` for experts routed to no row, one row and
    several rows; bad arguments raise."""
    from runtime.kernels.quant_matmul import routed_expert_int4
    from runtime.layers import moe
    from runtime.layers.swiglu import MLPWeights, fused

    d, f = 128, 64
    w = MLPWeights(*(Linear(_weights("int4-g64", o, i, seed=s)) for s, (o, i) in
                     enumerate([(f, d), (f, d), (d, f)])))  # fmt: skip
    f3 = fused(w)
    assert f3 is not None
    rng = np.random.default_rng(2)
    ids = np.array([rng.permutation(16)[:4] for _ in range(9)], np.int64)  # [T, K]
    ids[:, 2] = np.arange(9) % 3 + 20  # experts 20-22 get three rows each
    gates = rng.random(ids.shape, dtype=np.float32)
    x = _x(9, d, seed=4)
    for e in (0, 3, 20, 21, 99):
        want_rows, want = moe.expert_output(x, ids, gates, e, w)
        rows, got = routed_expert_int4(x, ids, gates, e, *f3)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert routed_expert_int4(x, ids, gates, 99, *f3)[1].shape == (0, d)
    with pytest.raises(ValueError, match="int64"):
        routed_expert_int4(x, ids.astype(np.int32), gates, 0, *f3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gates"):
        routed_expert_int4(x, ids, gates[:, :2], 0, *f3)
    with pytest.raises(ValueError, match="rows"):
        routed_expert_int4(x[:4], ids, gates, 0, *f3)


@pytest.mark.parametrize("lanes", [8, 16])
def test_routed_layer_in_one_call_is_the_experts_and_combine_bit_for_bit(lanes: int) -> None:
    """``routed_layer_int4`` (every routed expert of a layer in one call) gives the bits of
    ``routed_expert_int4`` per expert summed by ``moe.combine`` (ascending expert id, from
    zeros), for one row and several, experts routed to one row and to many; a row's result
    does not depend on the other rows; layers whose experts differ in shape get no table;
    bad arguments raise."""
    from runtime.kernels.quant_matmul import Int4Layer, routed_expert_int4, routed_layer_int4
    from runtime.layers import moe
    from runtime.layers.swiglu import MLPWeights, fused

    d, f, n_e = 128, 64, 12
    experts = [
        fused(MLPWeights(*(Linear(_weights("int4-g64", o, i, seed=10 * e + s), lanes=lanes)
                           for s, (o, i) in enumerate([(f, d), (f, d), (d, f)]))))
        for e in range(n_e)
    ]  # fmt: skip
    table = Int4Layer.build(experts)
    assert table is not None and table.n_experts == n_e
    rng = np.random.default_rng(5)
    ids = np.array([rng.permutation(n_e)[:4] for _ in range(7)], np.int64)  # [T, K]
    for row in ids:  # expert 7: every row
        if 7 not in row:
            row[1] = 7
    gates = rng.random(ids.shape, dtype=np.float32)
    x = _x(7, d, seed=6)
    x[3] *= 1e3
    outputs = {}
    for e in moe.union(ids):
        f3 = experts[int(e)]
        assert f3 is not None
        outputs[int(e)] = routed_expert_int4(x, ids, gates, int(e), *f3)
    want = moe.combine(x, ids, outputs)
    got = routed_layer_int4(x, ids, gates, table)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for t in (0, 3, 6):  # one row alone: the same bits
        one = routed_layer_int4(x[t : t + 1], ids[t : t + 1], gates[t : t + 1], table)
        np.testing.assert_array_equal(one[0].view(np.uint32), got[t].view(np.uint32))
    assert routed_layer_int4(x[:0], ids[:0], gates[:0], table).shape == (0, d)
    other = fused(MLPWeights(*(Linear(_weights("int4-g64", o, i, seed=99), lanes=lanes)
                               for o, i in [(2 * f, d), (2 * f, d), (d, 2 * f)])))  # fmt: skip
    assert Int4Layer.build([*experts[:3], other]) is None
    assert Int4Layer.build([*experts[:3], None]) is None
    with pytest.raises(ValueError, match="expert ids"):
        routed_layer_int4(x, np.where(ids == 7, n_e, ids), gates, table)
    with pytest.raises(ValueError, match="gates"):
        routed_layer_int4(x, ids, gates[:, :2], table)
    with pytest.raises(ValueError, match="features"):
        routed_layer_int4(x[:, :-1], ids, gates, table)


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize(("fmt", "d", "f"), [("int4-g64", 256, 192), ("int4-row", 160, 320),
                                             ("int4-g32", 96, 48)])  # fmt: skip
def test_split_expert_parts_are_the_one_call_bit_for_bit(
    fmt: str, d: int, f: int, lanes: int
) -> None:
    """``SplitExpert``: the activation ranges then the output ranges, run in any order within
    a phase, give the rows and bits of ``routed_expert_int4`` for experts routed to one row
    and to several (the ranges start at multiples of 16 columns; a range starting elsewhere
    changes ``silu_mul``'s or the kernels' walk and would fail this)."""
    from runtime.kernels.quant_matmul import SplitExpert, routed_expert_int4
    from runtime.layers.swiglu import MLPWeights, fused

    w = MLPWeights(*(Linear(_weights(fmt, o, i, seed=s), lanes=lanes) for s, (o, i) in
                     enumerate([(f, d), (f, d), (d, f)])))  # fmt: skip
    f3 = fused(w)
    assert f3 is not None
    rng = np.random.default_rng(7)
    ids = np.array([rng.permutation(16)[:4] for _ in range(6)], np.int64)  # [T, K]
    ids[:, 1] = np.arange(6) % 2 + 20  # experts 20 and 21 get three rows each
    ids[0, 3] = 30  # expert 30: one row
    gates = rng.random(ids.shape, dtype=np.float32)
    x = _x(6, d, seed=8)
    for e in (20, 30):
        want_rows, want = routed_expert_int4(x, ids, gates, e, *f3)
        for parts in (2, 3):
            sp = SplitExpert(x, ids, gates, e, *f3, parts)
            assert sp.f_edges[0] == 0 and sp.f_edges[-1] == f and len(sp.f_edges) == parts + 1
            assert all(a % 16 == 0 for a in sp.f_edges[:-1] + sp.d_edges[:-1])
            for i in reversed(range(len(sp.f_edges) - 1)):
                sp.h_part(i)
            for i in reversed(range(len(sp.d_edges) - 1)):
                sp.out_part(i)
            rows, got = sp.result()
            np.testing.assert_array_equal(rows, want_rows)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="no row routes"):
        SplitExpert(x, ids, gates, 99, *f3, 2)
    with pytest.raises(ValueError, match="rows"):
        SplitExpert(x[:4], ids, gates, 20, *f3, 2)


@pytest.mark.parametrize(("fmt", "d", "f"), [("int4-g64", 256, 128), ("int4-row", 192, 320)])
def test_fast_int8_swiglu_and_expert_in_one_call_are_the_projections_bit_for_bit(
    fmt: str, d: int, f: int
) -> None:
    """Under fast-int8, ``swiglu_int4_q8`` (one kernel call: ``x`` rounded once for gate and
    up, the activation, the product rounded for down) gives the bits of ``matmul_int4_q8``
    for gate and up on one rounding, ``silu_times`` and ``matmul_int4_q8`` for down, for one
    token and several; ``routed_expert_int4_q8`` gives the rows and bits of the numpy expert
    path on those projections; bad arguments raise."""
    from runtime.kernels.quant_matmul import (
        q8_input,
        routed_expert_int4_q8,
        silu_times,
        swiglu_int4_q8,
    )
    from runtime.layers import moe
    from runtime.layers.swiglu import MLPWeights, fused_q8

    w = MLPWeights(*(Linear(_weights(fmt, o, i, seed=s)) for s, (o, i) in
                     enumerate([(f, d), (f, d), (d, f)])))  # fmt: skip
    f3 = fused_q8(w)
    assert f3 is not None

    def unfused(x: F32) -> F32:
        q = q8_input(x)
        g = w.gate(x, fast_int8=True, q8=q)
        u = w.up(x, fast_int8=True, q8=q)
        return w.down(silu_times(g, u), fast_int8=True)

    x = _x(11, d, seed=3)
    x[4] *= 1e3
    got = swiglu_int4_q8(x, *f3)
    np.testing.assert_array_equal(got.view(np.uint32), unfused(x).view(np.uint32))
    for t in (0, 4, 10):
        np.testing.assert_array_equal(swiglu_int4_q8(x[t : t + 1], *f3)[0], got[t])
    assert swiglu_int4_q8(x[:0], *f3).shape == (0, d)
    # lossy but close: the exact kernels' result to the activations' 16-bit rounding
    np.testing.assert_allclose(got, w.down(silu_times(w.gate(x), w.up(x))), rtol=0.05, atol=0.5)
    with pytest.raises(ValueError, match="features"):
        swiglu_int4_q8(x[:, :-1], *f3)
    with pytest.raises(ValueError, match="not \\[F, D\\]"):
        swiglu_int4_q8(x, f3[0], f3[2], f3[1])

    rng = np.random.default_rng(2)
    ids = np.array([rng.permutation(16)[:4] for _ in range(9)], np.int64)  # [T, K]
    ids[:, 2] = np.arange(9) % 3 + 20  # experts 20-22 get three rows each
    gates = rng.random(ids.shape, dtype=np.float32)
    xe = x[:9]
    for e in (0, 3, 20, 99):
        want_rows, want = moe.expert_output(xe, ids, gates, e, w, lambda v, _w: unfused(v))
        rows, out = routed_expert_int4_q8(xe, ids, gates, e, *f3)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="rows"):
        routed_expert_int4_q8(xe[:4], ids, gates, 0, *f3)


def test_linear_q8_arguments_only_where_the_int8_kernel_applies() -> None:
    assert Linear(_weights("int4-g64", 8, 128)).q8 is not None
    assert Linear(_weights("int4-g128", 8, 256)).q8 is not None
    assert Linear(_weights("int4-g32", 8, 128)).q8 is None  # groups smaller than a chunk
    assert Linear(_weights("int4-row", 8, 100)).q8 is None  # not whole 64-column chunks
    assert Linear(_weights("int8", 8, 128)).q8 is None


def test_silu_times_values_and_layouts() -> None:
    from runtime.kernels.quant_matmul import silu_times

    g = np.array([[-200.0, -3.0, -0.0, 0.0, 1e-30, 2.5, 90.0, np.inf]], np.float32)
    u = np.full_like(g, 2.0)
    got = silu_times(g, u)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * 2
    np.testing.assert_allclose(got[:, :-1], want[:, :-1], rtol=3e-7, atol=1e-37)
    assert got[0, -1] == np.inf and got.dtype == np.float32
    # a row's values do not depend on the other rows, nor on the layout it came in
    big = _x(5, 300, seed=9)
    ones = np.ones_like(big)
    full = silu_times(big, ones)
    np.testing.assert_array_equal(silu_times(big[2:3], ones[2:3])[0], full[2])
    np.testing.assert_array_equal(silu_times(np.asfortranarray(big), ones), full)
    with pytest.raises(ValueError, match="two \\[T, F\\] arrays"):
        silu_times(big, ones[:, :5])


def test_linear_int4_arguments_only_for_int4_with_whole_16_column_groups() -> None:
    assert Linear(_weights("int4-g64", 8, 128)).int4 is not None
    assert Linear(_weights("int4-row", 8, 77)).int4 is not None
    assert Linear(_weights("int4-g24", 8, 96)).int4 is None  # the slow exact path
    assert Linear(_weights("int8", 8, 128)).int4 is None
    assert Linear(_weights("f32", 8, 128)).int4 is None


# ----------------------------------------------------------------------------- Linear


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "int8", "int4-row", "int4-g64", "int4-g24"])
def test_linear_uses_the_kernels_and_keeps_stored_weights(fmt: str) -> None:
    q = _weights(fmt, 24, 96)
    lin = Linear(q)
    assert (lin.out_features, lin.in_features) == (24, 96)
    assert lin.nbytes == q.nbytes
    x = _x(4, 96)
    y = lin(x)
    from runtime.kernels.isa import exact_lanes

    assert lin.lanes == exact_lanes()
    assert np.array_equal(y, _matmul(q, lin.lanes)(x))
    for lanes in (8, 16):
        pinned = Linear(q, lanes=lanes)
        assert np.array_equal(pinned(x), _matmul(q, lanes)(x))
        parts = pinned.split(3)
        assert all(p.lanes == lanes for _, _, p in parts)
        assert np.array_equal(np.concatenate([p(x) for _, _, p in parts], axis=1), pinned(x))
    with pytest.raises(ValueError, match="lanes"):
        Linear(q, lanes=32)
    assert np.array_equal(lin(x[1:2])[0], y[1])
    # No dequantized copy: nothing the layer holds is a float32 [O, I] matrix beyond f32 itself.
    if q.fmt.kind != "f32":
        held = [v for v in vars(lin).values() if isinstance(v, np.ndarray)]
        assert not any(a.dtype == np.float32 and a.size == 24 * 96 for a in held)
    with pytest.raises(ValueError):
        lin(x[0])  # 1-D: must be [1, I]


def test_linear_converts_input_and_validates_weights() -> None:
    w = _x(5, 12)
    lin = linear_from_array(w)
    x64 = _x(3, 12).astype(np.float64)
    assert np.array_equal(lin(x64), lin(x64.astype(np.float32)))
    strided = linear_from_array(_x(12, 5).T)  # non-contiguous input matrix
    _assert_close(strided(_x(2, 12)), _x(2, 12), strided.q)
    q = _weights("int4-g64", 4, 64)
    with pytest.raises(FormatError):
        Linear(QTensor(q.fmt, (4, 64), q.data[:-2], q.scales))
    with pytest.raises(FormatError):
        Linear(QTensor(q.fmt, (4, 64), q.data, None))
    assert q.scales is not None
    with pytest.raises(FormatError):
        Linear(QTensor(q.fmt, (4, 64), q.data, q.scales[:-1]))
    with pytest.raises(ValueError):
        linear_from_array(np.ones(3, dtype=np.float32))


def test_kernel_report_names_the_variant_and_the_cpu_isa(tmp_path: Path) -> None:
    from runtime.kernels.isa import kernel_info

    f = tmp_path / "cpuinfo"
    f.write_text("processor: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n")
    k = kernel_info(f)
    assert (k.variant, k.lanes, k.isa, k.int8_kind) == ("f32x8", 8, "avx2", "avx2")
    assert k.cpu_flags == ("sse4_2", "avx", "avx2", "fma", "f16c")
    f.write_text("flags: sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni\n")
    assert kernel_info(f).isa == "avx512f" and "avx512_vnni" in kernel_info(f).cpu_flags
    assert (kernel_info(f).variant, kernel_info(f).lanes) == ("f32x16", 16)
    assert kernel_info(f).int8_kind == "vnni"
    f.write_text("flags: sse4_2\n")
    assert kernel_info(f).int8_kind == "portable" and "portable" in kernel_info(f).int8_dot
    assert kernel_info(tmp_path / "nope").isa == "unknown"
    assert "8 float32 lanes, fixed order" in k.describe()
    here = kernel_info()
    from runtime.kernels._q8 import q8dot_kind

    assert here.int8_kind == q8dot_kind()  # numba's target in this process, not the flags alone
    import colibri

    with colibri.open_model(None, learn=False) as m:
        assert m.stats()["compute"]["kernels"] == here.as_dict()


@pytest.mark.parametrize(("fmt", "lanes"), [("int4-g64", 16), ("int4-g64", 8), ("int4-row", 16),
                                             ("int4-g32", 16), ("int4-g24", 16)])  # fmt: skip
def test_int4_weight_checked_once_gives_the_matmul_bits(fmt: str, lanes: int) -> None:
    """An int4 ``Linear`` checks its weight when bound (``matmul_int4_checked``: per call only
    ``x`` and ``out``) and gives ``matmul_int4``'s bits for one token and several; a group
    size the fast kernels do not take keeps the checked-per-call path; a bad ``x`` or ``out``
    is still refused."""
    rng = np.random.default_rng(21)
    o, i = 40, 192
    q = quantize(rng.standard_normal((o, i)).astype(np.float32), fmt)
    raw = np.asarray(q.data).reshape(-1).view(np.uint8)
    assert q.scales is not None
    lin = Linear(q, lanes=lanes)
    w4 = qm.int4_weight(raw, q.scales, o, i, q.fmt.group_size, lanes)
    assert (w4 is None) == (fmt == "int4-g24")
    for t in (1, 3, 9):
        x = rng.standard_normal((t, i)).astype(np.float32)
        want = qm.matmul_int4(x, raw, q.scales, o, i, q.fmt.group_size, lanes=lanes)
        assert np.array_equal(lin(x), want)
        if w4 is not None:
            out = np.empty((t, o), np.float32)
            assert qm.matmul_int4_checked(x, w4, out=out) is out
            assert np.array_equal(out, want)
    if w4 is not None:
        with pytest.raises(ValueError, match="features"):
            qm.matmul_int4_checked(np.zeros((1, i + 1), np.float32), w4)
        with pytest.raises(ValueError, match="out must be"):
            qm.matmul_int4_checked(
                np.zeros((2, i), np.float32), w4, out=np.empty((1, o), np.float32)
            )
