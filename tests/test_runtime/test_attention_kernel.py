"""The absorbed MLA attention kernel (runtime/kernels/attention.py): against a float64 numpy
statement of the same math, batch invariance (a row alone equals the row among others), masks,
bad shapes, and that it releases the GIL.

# T query rows, NH heads, C latent width, R rope width, S keys
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from runtime.kernels import attention as att
from runtime.kernels._simd import vfma16, vload16, vsplat16, vstore16, vzero16


def _case(t: int, nh: int, c: int, r: int, s: int, rows_after: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, nh, c), dtype=np.float32)
    qr = rng.standard_normal((t, nh, r), dtype=np.float32)
    lat = rng.standard_normal((s, c), dtype=np.float32)
    kr = rng.standard_normal((s, r), dtype=np.float32)
    allowed = rng.random((t, s)) > 0.3
    allowed[np.arange(t), s - rows_after - t + np.arange(t)] = True  # each row sees itself
    return q, qr, lat, kr, allowed


def _reference(q, qr, lat, kr, allowed, scale, rows_after):  # type: ignore[no-untyped-def]
    t, s = q.shape[0], lat.shape[0]
    out = np.zeros(q.shape, np.float64)
    for i in range(t):
        end = s - rows_after - t + i + 1
        sc = (q[i].astype(np.float64) @ lat[:end].T + qr[i].astype(np.float64) @ kr[:end].T) * scale
        sc = np.where(allowed[i, :end], sc, -np.inf)
        p = np.exp(sc - sc.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[i] = p @ lat[:end]
    return out


@pytest.mark.parametrize(
    "shape",
    [(1, 16, 256, 64, 300, 0), (5, 4, 96, 16, 40, 3), (3, 2, 20, 5, 9, 1), (2, 3, 64, 32, 2, 0)],
)
def test_matches_float64_and_is_batch_invariant(shape: tuple[int, ...]) -> None:
    t, nh, c, r, s, ra = shape
    q, qr, lat, kr, allowed = _case(t, nh, c, r, s, ra)
    got = att.latent_attention(q, qr, lat, kr, allowed, 0.125, ra)
    want = _reference(q, qr, lat, kr, allowed, 0.125, ra)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    for i in range(t):  # each row alone, over only the keys it may see: the same bits
        end = s - ra - t + i + 1
        alone = att.latent_attention(
            q[i : i + 1], qr[i : i + 1], lat[:end], kr[:end], allowed[i : i + 1, :end], 0.125
        )
        np.testing.assert_array_equal(alone[0], got[i])
    np.testing.assert_array_equal(got, att.latent_attention(q, qr, lat, kr, allowed, 0.125, ra))


def test_masked_keys_do_not_count() -> None:
    q, qr, lat, kr, allowed = _case(1, 2, 32, 16, 10, 0)
    allowed[:] = False
    allowed[0, [2, 9]] = True
    got = att.latent_attention(q, qr, lat, kr, allowed, 0.5)
    lat2 = lat.copy()
    lat2[[0, 1, 3, 4, 5, 6, 7, 8]] = 1e6  # values of masked keys are never read into the sum
    np.testing.assert_array_equal(got, att.latent_attention(q, qr, lat2, kr, allowed, 0.5))


@njit(nogil=True, error_model="numpy")
def _one_head_one_key(  # type: ignore[no-untyped-def]
    q_lat, q_rope, latent, k_rope, allowed, n_rows, n_heads, c, r, s_all, scale, rows_after, out
):
    """The kernel's math written plainly (heads outer, keys inner, one key at a time): the
    operations and their order per (row, head, key) that the module docstring states, which
    the blocked kernel must reproduce bit for bit."""
    masked = allowed.size > 0
    scores = np.empty(s_all, np.float32)
    c16 = c // 16 * 16
    for i in range(n_rows):
        end = s_all - rows_after - n_rows + i + 1
        for h in range(n_heads):
            qi = (i * n_heads + h) * c
            qr = (i * n_heads + h) * r
            top = np.float32(-np.inf)
            for s in range(end):
                if not masked or allowed[i * s_all + s]:
                    v = (
                        att._dot(q_lat, qi, latent, s * c, c)
                        + att._dot(q_rope, qr, k_rope, s * r, r)
                    ) * scale
                    scores[s] = v
                    if v > top:
                        top = v
            total = np.float32(0.0)
            for s in range(end):
                if not masked or allowed[i * s_all + s]:
                    e = np.exp(scores[s] - top)
                    scores[s] = e
                    total += e
            for k in range(0, c16, 16):
                vstore16(out, qi + k, vzero16())
            for k in range(c16, c):
                out[qi + k] = np.float32(0.0)
            for s in range(end):
                if not masked or allowed[i * s_all + s]:
                    p = scores[s] / total
                    pv = vsplat16(p)
                    for k in range(0, c16, 16):
                        o = qi + k
                        vstore16(out, o, vfma16(pv, vload16(latent, s * c + k), vload16(out, o)))
                    for k in range(c16, c):
                        out[qi + k] += p * latent[s * c + k]


@pytest.mark.parametrize(
    "shape",
    [(1, 16, 256, 64, 111, 0), (3, 5, 40, 8, 29, 2), (2, 7, 512, 64, 300, 1), (1, 3, 17, 5, 9, 0)],
)
@pytest.mark.parametrize("masked", [False, True])
def test_blocked_kernel_is_the_plain_loop_bit_for_bit(shape: tuple[int, ...], masked: bool) -> None:
    """Keys outer, four heads per score pass, eight keys per pass over the output: the same
    bits as one head and one key at a time (odd head counts, widths not a multiple of 16 or
    64, a row's later rows, masks included)."""
    t, nh, c, r, s, ra = shape
    q, qr, lat, kr, allowed = _case(t, nh, c, r, s, ra, seed=5)
    got = att.latent_attention(q, qr, lat, kr, allowed if masked else None, 0.07, ra)
    want = np.empty(t * nh * c, np.float32)
    mask = allowed.view(np.uint8).reshape(-1) if masked else np.zeros(0, np.uint8)
    _one_head_one_key(
        q.reshape(-1), qr.reshape(-1), lat.reshape(-1), kr.reshape(-1), mask,
        t, nh, c, r, s, np.float32(0.07), ra, want,
    )  # fmt: skip
    np.testing.assert_array_equal(got, want.reshape(t, nh, c))


@pytest.mark.parametrize(
    "shape", [(1, 4, 64, 16, 50, 0), (4, 2, 40, 8, 30, 3), (2, 3, 512, 64, 37, 1)]
)
def test_no_mask_is_every_causal_key(shape: tuple[int, ...]) -> None:
    """``allowed=None`` (the batched decode step without a sparse selection: it builds no
    mask) gives the same bits as the full causal mask, and a key past a row's causal end
    never counts either way."""
    t, nh, c, r, s, ra = shape
    q, qr, lat, kr, _ = _case(t, nh, c, r, s, ra)
    causal = np.arange(s)[None, :] <= (np.arange(t) + (s - ra - t))[:, None]  # [T, S]
    got = att.latent_attention(q, qr, lat, kr, None, 0.25, ra)
    np.testing.assert_array_equal(got, att.latent_attention(q, qr, lat, kr, causal, 0.25, ra))
    everything = np.ones((t, s), dtype=bool)  # a mask that also marks later keys
    np.testing.assert_array_equal(got, att.latent_attention(q, qr, lat, kr, everything, 0.25, ra))
    want = _reference(q, qr, lat, kr, causal, 0.25, ra)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


def test_bad_shapes_are_refused() -> None:
    q, qr, lat, kr, allowed = _case(2, 2, 32, 16, 10, 0)
    with pytest.raises(ValueError, match="shapes do not agree"):
        att.latent_attention(q, qr, lat[:, :16], kr, allowed, 0.5)
    with pytest.raises(ValueError, match="rows_after"):
        att.latent_attention(q, qr, lat, kr, allowed, 0.5, rows_after=9)


def _queries(
    rng: np.random.Generator, rows: list[int], nh: int, c: int, r: int
) -> tuple[np.ndarray, list[np.ndarray | None], np.ndarray, np.ndarray]:
    """Four sequences' masks (the second one masked [3, 7], the last all-True [2, 2]) and
    their query rows: (that mask, the masks, q_lat [N, NH, C], q_rope [N, NH, R])."""
    mask = rng.random((3, 7)) < 0.6
    mask[:, 0] = True
    masks = [None, mask, None, np.ones((2, 2), bool)]
    n = sum(rows)
    q = rng.standard_normal((n, nh, c)).astype(np.float32)
    qr = rng.standard_normal((n, nh, r)).astype(np.float32)
    return mask, masks, q, qr


def _each_alone(got: np.ndarray, q: np.ndarray, qr: np.ndarray, rows: list[int],
                keys: list[tuple[np.ndarray, np.ndarray]],
                masks: list[np.ndarray | None]) -> None:  # fmt: skip
    """Every sequence's rows of one batched call ``got`` are the bits of its call alone."""
    b = np.cumsum([0, *rows])
    for j in range(len(rows)):
        want = att.latent_attention(
            q[b[j] : b[j + 1]], qr[b[j] : b[j + 1]], *keys[j], masks[j], 0.1
        )
        np.testing.assert_array_equal(got[b[j] : b[j + 1]].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(("nh", "c", "r"), [(4, 96, 32), (5, 40, 8), (16, 256, 64)])
def test_several_sequences_in_one_call_are_each_sequence_alone(nh: int, c: int, r: int) -> None:
    """``latent_attention_seqs`` (the rows of several sequences, each over its own cache, in
    one kernel call) gives every sequence's rows the bits of its own ``latent_attention``
    call: one row and several, a masked sequence among unmasked ones, rows whose offset in
    the batch is not 64-byte aligned (5 heads x 40); a mismatch is refused."""
    from runtime.kernels.aligned import zeros_aligned

    rng = np.random.default_rng(nh * c)
    rows, lens = [1, 3, 1, 2], [10, 7, 64, 2]
    keys = []
    for s in lens:  # cache-like: rows of a bigger aligned array
        lat = zeros_aligned((s + 5, c))
        lat[:] = rng.standard_normal((s + 5, c))
        rope = zeros_aligned((s + 5, r))
        rope[:] = rng.standard_normal((s + 5, r))
        keys.append((lat[:s], rope[:s]))
    mask, masks, q, qr = _queries(rng, rows, nh, c, r)
    got = att.latent_attention_seqs(q, qr, keys, rows, masks, 0.1)
    _each_alone(got, q, qr, rows, keys, masks)
    with pytest.raises(ValueError, match="masks"):
        att.latent_attention_seqs(q, qr, keys, rows[:3], masks, 0.1)
    with pytest.raises(ValueError, match="allowed"):
        att.latent_attention_seqs(q, qr, keys, rows, [None, mask[:2], None, None], 0.1)
    with pytest.raises(ValueError, match="aligned"):
        lat = zeros_aligned((7 * c + 1,))[1:].reshape(7, c)  # 4 bytes past a 64-byte line
        bad = [keys[0], (lat, keys[1][1]), *keys[2:]]
        att.latent_attention_seqs(q, qr, bad, rows, [None] * 4, 0.1)


def test_attention_over_kv_caches_by_address_is_each_sequence_alone() -> None:
    """``latent_attention_cached`` (a batched decode step's call: each sequence's keys where
    its ``KVCache`` holds them, no per-sequence array checks) gives every sequence's rows the
    bits of its own ``latent_attention`` over the cache's views, also after a cache grew
    (its rows moved: ``addresses`` follows them); bad row counts and masks are refused."""
    from runtime.kv import KVCache

    nh, c, r = 4, 96, 32
    rng = np.random.default_rng(5)
    rows, lens = [1, 3, 1, 2], [10, 7, 200, 2]
    caches = []
    for s in lens:
        kv = KVCache(2, c, r, capacity=16)
        kv.write(1, 0, rng.standard_normal((s, c)).astype(np.float32),
                 rng.standard_normal((s, r)).astype(np.float32))  # fmt: skip
        kv.commit(s)
        caches.append(kv)
    assert caches[2].addresses(1)[0] == caches[2].latent(1).ctypes.data  # (grew past 16)
    mask, masks, q, qr = _queries(rng, rows, nh, c, r)
    at = [kv.addresses(1) for kv in caches]
    got = att.latent_attention_cached(q, qr, at, lens, rows, masks, 0.1)
    _each_alone(got, q, qr, rows, [(kv.latent(1), kv.k_rope(1)) for kv in caches], masks)
    with pytest.raises(ValueError, match="rows"):
        att.latent_attention_cached(q, qr, at, [10, 2, 200, 2], rows, masks, 0.1)  # 3 > 2 keys
    with pytest.raises(ValueError, match="allowed"):
        att.latent_attention_cached(q, qr, at, lens, rows, [None, mask[:2], None, None], 0.1)
    with pytest.raises(ValueError, match="caches"):
        att.latent_attention_cached(q, qr, at[:3], lens, rows, masks, 0.1)


def test_batched_kv_writes_are_each_cache_written_alone() -> None:
    """``KVCache.write_seqs`` / ``write_index_seqs`` (a batched step's new KV rows, one kernel
    call per layer) leave every cache as one ``write`` / ``write_index`` per cache would, its
    other rows and layers untouched, also after a cache grew; rows a cache has not reserved,
    caches of another shape and mismatched row counts are refused before anything is written."""
    from runtime.kv import KVCache
    from storage.errors import ModelError

    c, r, di = 96, 32, 16
    rng = np.random.default_rng(8)
    starts, rows = [0, 5, 40, 3], [2, 1, 3, 1]
    bounds = np.cumsum([0, *rows])
    n = int(bounds[-1])
    latent = rng.standard_normal((n, c)).astype(np.float32)
    k_rope = rng.standard_normal((n, r)).astype(np.float32)
    keys = rng.standard_normal((n, di)).astype(np.float32)

    def fresh() -> list[KVCache]:
        out = []
        for j, (a, t) in enumerate(zip(starts, rows, strict=True)):
            kv = KVCache(3, c, r, di, indexed_layers=(0, 2), capacity=4)
            kv.reserve(a + t)  # (the third grows past 4)
            kv.write(1, 0, np.full((a + t, c), j, np.float32), np.full((a + t, r), j, np.float32))
            out.append(kv)
        return out

    batched, alone = fresh(), fresh()
    KVCache.write_seqs(batched, 1, starts, bounds, latent, k_rope)
    KVCache.write_index_seqs(batched, 2, starts, bounds, keys)
    for j, kv in enumerate(alone):
        lo, hi = bounds[j], bounds[j + 1]
        kv.write(1, starts[j], latent[lo:hi], k_rope[lo:hi])
        kv.write_index(2, starts[j], keys[lo:hi])
    for a, b in zip(batched, alone, strict=True):
        end = a._cap
        for layer in range(3):
            assert np.array_equal(a.latent(layer, end), b.latent(layer, end))
            assert np.array_equal(a.k_rope(layer, end), b.k_rope(layer, end))
        for layer in (0, 2):
            assert np.array_equal(a.index_keys(layer, end), b.index_keys(layer, end))
    assert not np.array_equal(batched[2].latent(1, 43), fresh()[2].latent(1, 43))  # it wrote
    short = fresh()
    short[3] = KVCache(3, c, r, di, indexed_layers=(0, 2), capacity=2)  # row 3 not reserved
    before = short[0].latent(1, 2).copy()
    with pytest.raises(ModelError, match="not reserved"):
        KVCache.write_seqs(short, 1, starts, bounds, latent, k_rope)
    assert np.array_equal(short[0].latent(1, 2), before)  # nothing written
    other = fresh()
    other[1] = KVCache(3, c + 16, r, di, indexed_layers=(0, 2), capacity=64)
    with pytest.raises(ModelError, match="different shapes"):
        KVCache.write_seqs(other, 1, starts, bounds, latent, k_rope)
    with pytest.raises(ModelError, match="rows"):
        KVCache.write_seqs(fresh(), 1, starts, bounds, latent[:-1], k_rope[:-1])
    with pytest.raises(ModelError, match="index keys"):
        KVCache.write_index_seqs(fresh(), 1, starts, bounds, keys)
    for layer in (-1, 3):  # (a negative slot would index from the end)
        with pytest.raises(ModelError, match="outside"):
            KVCache.write_seqs(fresh(), layer, starts, bounds, latent, k_rope)
    with pytest.raises(ModelError, match="0 caches"):
        KVCache.write_seqs([], 1, [], np.zeros(1, np.int64), latent[:0], k_rope[:0])


def test_kernels_release_the_gil() -> None:
    for k in att.KERNELS:
        assert k.targetoptions.get("nogil") is True, k


# ----------------------------------------------------------------------------- per-head matmuls


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-row", "int4-g32", "int4-g24"])
def test_heads_int4_rows_equal_per_head_linears(fmt: str) -> None:
    """W_UV through one numba call: bit-identical to one Linear per head (same kernels)."""
    from runtime.kernels.heads import HeadsMatmul
    from runtime.linear import Linear
    from runtime.weights import qtensor_rows
    from storage.quant import quantize

    nh, n, v, c = 3, 5, 7, 128
    per = n + v
    rng = np.random.default_rng(1)
    kv_b = quantize(rng.standard_normal((nh * per, c), dtype=np.float32), fmt)
    per_head = [Linear(qtensor_rows(kv_b, h * per + n, (h + 1) * per)) for h in range(nh)]
    assert kv_b.scales is not None
    fused = HeadsMatmul.int4_rows(
        np.asarray(kv_b.data), kv_b.scales, kv_b.fmt.group_size, c, n, per, v, per_head,
        per_head[0].lanes,
    )  # fmt: skip
    for t in (1, 4):
        x = rng.standard_normal((t, nh, c), dtype=np.float32)
        want = np.stack([lin(np.ascontiguousarray(x[:, h])) for h, lin in enumerate(per_head)], 1)
        np.testing.assert_array_equal(fused(x), want)
    assert fused(np.zeros((0, nh, c), np.float32)).shape == (0, nh, v)


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128", "int4-row", "int4-g16"])
def test_heads_axpy_from_int4_rows_is_the_float32_copys_bits(fmt: str) -> None:
    """W_UK read from its int4 rows as stored (``axpy_int4``: each value dequantized as it is
    used) gives the bits of the float32 copy's ``axpy`` (the dequantized values), for every
    group size it takes, 1 to 5 rows, and heads taken from inside a larger matrix (W_UK's
    rows of each head's block, W_UV's rows between them); a group size it does not take (16
    columns, or a width not a multiple of 32) gives None: the caller keeps the copy."""
    from runtime.kernels.heads import HeadsMatmul
    from storage.quant import dequantize, quantize

    rng = np.random.default_rng(7)
    nh, n, v, c = 6, 20, 12, 96
    kv_b = quantize((rng.standard_normal((nh * (n + v), c)) * 0.3).astype(np.float32), fmt)
    gs = kv_b.fmt.group_size
    f32 = dequantize(kv_b).reshape(nh, n + v, c)
    uk4 = HeadsMatmul.axpy_int4(np.asarray(kv_b.data), kv_b.scales, gs, c, 0, n + v, n, nh)
    if fmt == "int4-g16":
        assert uk4 is None and not HeadsMatmul.int4_axpy_fits(c, gs)
        return
    assert uk4 is not None and uk4.kind == "axpy_int4"
    assert HeadsMatmul.axpy_int4(np.asarray(kv_b.data), kv_b.scales, gs, 80, 0, 1, 1, 1) is None
    uk = HeadsMatmul.axpy(f32[:, :n])
    for t in (1, 2, 5):
        x = rng.standard_normal((t, nh, n)).astype(np.float32)
        np.testing.assert_array_equal(uk4(x), uk(x))
    # the W_UV rows of each block the same way (another first row), against their own copy
    uv4 = HeadsMatmul.axpy_int4(np.asarray(kv_b.data), kv_b.scales, gs, c, n, n + v, v, nh)
    assert uv4 is not None
    y = rng.standard_normal((3, nh, v)).astype(np.float32)
    np.testing.assert_array_equal(uv4(y), HeadsMatmul.axpy(f32[:, n:])(y))


def test_heads_axpy_matches_float64_and_is_batch_invariant() -> None:
    from runtime.kernels.heads import KERNELS, HeadsMatmul

    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 24, 70), dtype=np.float32)  # [NH, I, O], O not a multiple of 16
    x = rng.standard_normal((6, 4, 24), dtype=np.float32)
    got = HeadsMatmul.axpy(w)(x)
    want = np.einsum("thi,hio->tho", x.astype(np.float64), w.astype(np.float64))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    for t in range(6):
        np.testing.assert_array_equal(HeadsMatmul.axpy(w)(x[t : t + 1])[0], got[t])
    assert HeadsMatmul.axpy(w)(x[:0]).shape == (0, 4, 70)
    for k in KERNELS:
        assert k.targetoptions.get("nogil") is True
