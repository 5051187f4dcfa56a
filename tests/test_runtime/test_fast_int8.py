"""The opt-in lossy kernels (``--kernels fast-int8``): int4 weights x int8 activations.

Checked here: the kernel computes exactly the quantized math it claims (against a float64
reference of the same int8 rounding), it is deterministic and batch-invariant, the VNNI and the
portable integer paths give the same bits, only eligible weights take it, and on the oracle
models and the trained demo model the greedy tokens agree with the exact kernels (>= 0.95).

# T tokens, I in features, O out features, G 64-column groups
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from numba import njit

from runtime.compute import ExpertCompute
from runtime.context import StepContext
from runtime.kernels import _q8 as q8mod
from runtime.kernels._simd import vstore16
from runtime.kernels.quant_matmul import matmul_int4, matmul_int4_q8, q8_eligible
from runtime.linear import Linear
from storage.container import Container
from storage.quant import QTensor, dequantize, quantize

F32 = npt.NDArray[np.float32]
FORMATS = ["int4-g64", "int4-row", "int4-g128"]
REL_TOL = 1e-5  # float32 rounding of the combination, relative to the sum of |terms|


def _weights(fmt: str, o: int, i: int, seed: int = 0) -> QTensor:
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((o, i), dtype=np.float32), fmt)


def _q8(q: QTensor, x: F32) -> F32:
    o, i = q.shape
    assert q.scales is not None
    return matmul_int4_q8(
        x, np.asarray(q.data).reshape(-1), q.scales.reshape(-1), o, i, q.fmt.group_size
    )


def _quantize_rows(x: F32) -> npt.NDArray[np.float64]:
    """numpy statement of the activation rounding (two int8 digits per value, per 64-column
    group): the values the kernel multiplies, [T, I]."""
    t, i = x.shape
    g = x.reshape(t, i // 64, 64)
    amax = np.abs(g).max(axis=2)  # [T, G] float32
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = (np.float32(127) / safe).astype(np.float32)
    v = (g * inv[:, :, None]).astype(np.float32)  # float32 product, as the kernel
    h = np.rint(v)
    lo = np.clip(np.rint(((v - h) * np.float32(256)).astype(np.float32)), -127, 127)
    assert np.abs(h).max() <= 127
    sx = np.where(amax > 0, amax / np.float32(127) / np.float32(256), 0).astype(np.float32)
    vals = (256 * h.astype(np.float64) + lo) * sx[:, :, None].astype(np.float64)
    return vals.reshape(t, i)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_tok", [1, 3, 11])
def test_computes_the_stated_int8_math(fmt: str, n_tok: int) -> None:
    """Against float64 of the same rounding: the layout (nibble order, groups, scales) is right."""
    o, i = 37, 512  # odd O: the pair loop's last single row
    q = _weights(fmt, o, i)
    x = np.random.default_rng(1).standard_normal((n_tok, i), dtype=np.float32)
    x[0, 64:128] = 0  # an all-zero group (scale 0)
    xs = _quantize_rows(x)  # [T, I] the rounded activations
    assert 0 < np.abs(xs - x).max() < 1e-4 * np.abs(x).max()  # lossy, and by how much
    w = dequantize(q).astype(np.float64)  # [O, I]
    want = xs @ w.T
    bound = np.abs(xs) @ np.abs(w).T
    got = _q8(q, x)
    assert np.all(np.abs(got - want) <= REL_TOL * bound + 1e-30)
    # and it is lossy: not the exact kernel's result
    assert not np.array_equal(
        got, matmul_int4(x, np.asarray(q.data), q.scales, o, i, q.fmt.group_size)
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("o", [64, 37])
def test_batch_invariant_and_deterministic(fmt: str, o: int) -> None:
    """Blocks of 16 rows (37: two and a zero-padded rest), 19 tokens in one tile or one at a
    time, and any run of them: every token's row is the same bits either way."""
    q = _weights(fmt, o, 256, seed=2)
    x = np.random.default_rng(3).standard_normal((19, 256), dtype=np.float32)  # > 2 tiles
    whole = _q8(q, x)
    alone = np.concatenate([_q8(q, x[t : t + 1]) for t in range(x.shape[0])])
    np.testing.assert_array_equal(whole, alone)
    np.testing.assert_array_equal(whole[5:9], _q8(q, np.ascontiguousarray(x[5:9])))
    np.testing.assert_array_equal(whole, _q8(q, x))


def _stated(x: F32, q: QTensor) -> F32:
    """numpy statement of the kernel's whole arithmetic, bit for bit: the digits of
    ``q8_prep``, the exact group integers ``D`` (int64), then per row and token the chain
    ``acc = fma(sw * sx, float32(D), acc)`` over the groups in order. The float32 fma is
    computed in float64 (``sw * sx`` and ``D`` are float32, so their product is exact there)
    and rounded once more to float32: that double rounding could differ from a true fma only
    on a float64 tie, which these seeded inputs do not hit (the test fails if they did)."""
    t, i = x.shape
    n_g = i // 64
    xs, bs = q8mod.q8_strides(i)
    xq = np.zeros(t * xs, np.int8)
    bias = np.zeros(t * bs, np.int32)
    sx = np.zeros(t * n_g, np.float32)
    q8mod.q8_prep(x, xq, bias, sx, xs, bs)
    o = q.shape[0]
    assert q.scales is not None
    w = np.asarray(q.data).reshape(o, n_g, 32)
    nib = np.concatenate([w & 15, w >> 4], axis=2).astype(np.int64)  # [O, G, 64] by position
    sw = np.asarray(q.scales, np.float32).reshape(o, -1)
    sw = np.repeat(sw, n_g // sw.shape[1], axis=1)  # one per 64-column group
    out = np.empty((t, o), np.float32)
    for tok in range(t):
        row = xq[tok * xs : tok * xs + 2 * i].astype(np.int64)
        h, lo = row[:i].reshape(n_g, 64), row[i:].reshape(n_g, 64)
        assert np.abs(h).max() <= 127 and np.abs(lo).max() <= 127
        d = 256 * np.einsum("ogj,gj->og", nib - 8, h) + np.einsum("ogj,gj->og", nib - 8, lo)
        assert np.abs(d).max() < 2**24  # exact as float32
        # the bias holds the "- 8" part: the kernel's integers are the same
        d_kernel = 256 * np.einsum("ogj,gj->og", nib, h) + np.einsum("ogj,gj->og", nib, lo)
        np.testing.assert_array_equal(d_kernel + bias[tok * bs : tok * bs + n_g], d)
        acc = np.zeros(o, np.float32)
        for g in range(n_g):
            m = (sw[:, g] * sx[tok * n_g + g]).astype(np.float32)
            acc = (m.astype(np.float64) * d[:, g].astype(np.float32) + acc).astype(np.float32)
        out[tok] = acc
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("o", "n_tok"), [(48, 1), (37, 3), (16, 40), (5, 2)])
def test_kernel_is_the_stated_arithmetic_bit_for_bit(fmt: str, o: int, n_tok: int) -> None:
    """Whole blocks of 16 rows, the zero-padded last block (37, 5), one token and more than a
    tile (40 > TILE): every output is the chain of the module docstring, bit for bit."""
    q = _weights(fmt, o, 1280, seed=11)  # 20 groups: 16 by the register transpose + 4
    x = np.random.default_rng(12).standard_normal((n_tok, 1280), dtype=np.float32)
    x[0, 128:192] = 0  # an all-zero group
    x[-1, :64] *= 1e4  # digits at the extremes
    np.testing.assert_array_equal(_q8(q, x), _stated(x, q))


def test_vnni_and_portable_integer_paths_agree() -> None:
    """The transposed block (``i4block16``) and the 16 rows' group integers from ``vpdpbusd``
    (where present) and from plain integer ops are the same numbers, the stated ones, so the
    block kernels give the same bits on every x86-64 CPU. ``q8blockdot`` is the one the
    kernels use here."""
    block, dot, portable = q8mod.i4block16, q8mod.q8blockdot, q8mod.q8blockdot_portable

    @njit(nogil=True)
    def both(packed, nb, xq, bias, n):  # type: ignore[no-untyped-def]
        a = np.zeros(n * 16, np.float32)
        b = np.zeros(n * 16, np.float32)
        for g in range(n):  # h digits at xq[g*64:], l digits n*64 later
            w = block(packed, g * 32, nb)
            vstore16(a, g * 16, dot(w, xq, g * 64, n * 64, bias[g]))
            vstore16(b, g * 16, portable(w, xq, g * 64, n * 64, bias[g]))
        return a, b

    rng = np.random.default_rng(4)
    n = 40
    nb = n * 32 + 96  # rows a little longer than the groups used: the stride is honoured
    packed = rng.integers(0, 256, 16 * nb, dtype=np.uint8)
    xq = rng.integers(-127, 128, 2 * n * 64).astype(np.int8)
    xq[:64] = 127  # extremes
    xq[n * 64 : n * 64 + 64] = -127
    packed[:32] = 0xFF
    bias = rng.integers(-(1 << 20), 1 << 20, n).astype(np.int32)
    a, b = both(packed, nb, xq, bias, n)
    np.testing.assert_array_equal(a, b)
    # and both are the stated integers: 256 * (h . w) + (l . w) + bias per row and group
    rows = packed.reshape(16, nb)[:, : n * 32].reshape(16, n, 32)
    w = np.concatenate([rows & 15, rows >> 4], axis=2).astype(np.int64)  # [16, n, 64]
    xh, xl = xq[: n * 64].reshape(n, 64), xq[n * 64 :].reshape(n, 64)
    want = 256 * np.einsum("kgj,gj->gk", w, xh) + np.einsum("kgj,gj->gk", w, xl) + bias[:, None]
    np.testing.assert_array_equal(a.reshape(n, 16), want.astype(np.float32))
    print(f"integer dot in use: {q8mod.q8dot_kind()}")


@pytest.mark.parametrize(("o", "n_tok"), [(48, 1), (37, 2), (13, 9), (5, 40)])
def test_avx2_word_rows_are_the_block_bits(o: int, n_tok: int) -> None:
    """AVX2 without VNNI takes 8 rows at a time through 16-bit activation words
    (``q8_rows_words``); here, whichever path this CPU uses, both give the same bits: whole
    8-row blocks and a zero-padded rest, one token and many, every scale layout."""
    if not q8mod.has_avx2_codegen():
        pytest.skip("this CPU has no AVX2 (vpmaddwd)")
    for fmt in FORMATS:
        q = _weights(fmt, o, 384, seed=o + n_tok)
        assert q.scales is not None
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 384), dtype=np.float32)
        x[0, 64:128] = 0
        x[-1, :64] *= 1e4
        xs, bs = q8mod.q8_strides(384)
        xq = np.zeros(n_tok * xs, np.int8)
        bias = np.zeros(n_tok * bs, np.int32)
        sx = np.zeros(n_tok * 6, np.float32)
        q8mod.q8_prep(x, xq, bias, sx, xs, bs)
        packed = np.asarray(q.data).reshape(-1)
        scales = np.repeat(q.scales.reshape(o, -1), 6 // q.scales.reshape(o, -1).shape[1], axis=1)
        scales = np.ascontiguousarray(scales).reshape(-1)
        words = np.zeros((n_tok, o), np.float32)
        q8mod.q8_rows_words(packed, scales, o, 192, xq, bias, sx, xs, bs, words, 4096)
        np.testing.assert_array_equal(words, _q8(q, x))
        np.testing.assert_array_equal(words, _stated(x, q))


def test_vector_rounding_is_the_scalar_rounding() -> None:
    """``q8_prep`` (one vector pass per group) writes the digits, biases and scales of the
    scalar loop byte for byte: ties at .5 (round half to even, both digits), an all-zero group,
    huge and tiny groups, several tokens (a NaN activation has no digits to agree on: the
    engine stops on non-finite logits)."""
    rng = np.random.default_rng(9)
    n_tok, n_in = 5, 384
    x = rng.standard_normal((n_tok, n_in), dtype=np.float32)
    x[0, :64] = np.float32(0.5) * rng.integers(-200, 200, 64)  # max 127 after scaling ...
    x[0, 0] = 127.0  # ... so inv = 1 and v = x: h ties at .5
    x[0, 1] = 2.5 + 0.5 / 256  # an l tie
    x[1, 64:128] = 0  # an all-zero group
    x[2, 128:192] *= 1e30
    x[3, 192:256] *= 1e-30
    xs, bs = q8mod.q8_strides(n_in)
    got = []
    for prep in (q8mod.q8_prep, q8mod.q8_prep_scalar):
        xq = np.full(n_tok * xs, 99, np.int8)
        bias = np.zeros(n_tok * bs, np.int32)
        sx = np.zeros(n_tok * (n_in // 64), np.float32)
        prep(x, xq, bias, sx, xs, bs)
        got.append((xq, bias, sx))
    for a, b in zip(*got, strict=True):
        np.testing.assert_array_equal(a, b)
    h = got[0][0][:64].astype(np.int64)
    assert h[0] == 127 and np.count_nonzero(h % 2 == 0) > 32  # the ties went to even


def test_scale_transpose() -> None:
    """``scales16``: 16 rows' scales of 16 groups land group-major, from any row stride."""

    @njit(nogil=True)
    def run(src, idx, stride):  # type: ignore[no-untyped-def]
        dst = np.zeros(256 + 16, np.float32)
        q8mod.scales16(src, idx, stride, dst, 16)
        return dst

    src = np.arange(40 * 23, dtype=np.float32)
    got = run(src, 5, 23)
    want = src[5 : 5 + 16 * 23].reshape(16, 23)[:, :16].T.reshape(-1)
    np.testing.assert_array_equal(got[16:], want)
    assert not got[:16].any()


def test_eligibility_and_linear_fallback() -> None:
    assert q8_eligible(128, 64) and q8_eligible(128, None) and q8_eligible(256, 128)
    assert not q8_eligible(96, 32) and not q8_eligible(200, 64) and not q8_eligible(192, 128)
    x = np.random.default_rng(5).standard_normal((2, 96), dtype=np.float32)
    for fmt in ("f32", "bf16", "int8", "int4-g32"):
        lin = Linear(_weights(fmt, 16, 96))
        assert not lin.has_int8
        np.testing.assert_array_equal(lin(x, fast_int8=True), lin(x))  # exact kernel, as is
    lin = Linear(_weights("int4-g64", 16, 128))
    assert lin.has_int8
    x2 = np.random.default_rng(6).standard_normal((2, 128), dtype=np.float32)
    np.testing.assert_array_equal(lin(x2, fast_int8=True), _q8(lin.q, x2))
    with pytest.raises(ValueError, match="multiple of 64"):
        _q8(_weights("int4-g32", 4, 96), x)
    with pytest.raises(ValueError, match="kernels must be one of"):
        ExpertCompute(kernels="fast")  # type: ignore[arg-type]


def test_split_matmul_keeps_the_int8_bits() -> None:
    """``ExpertCompute.linear`` splitting output features over threads gives the same bits."""
    lin = Linear(_weights("int4-g64", 4096, 2048, seed=7))
    x = np.random.default_rng(8).standard_normal((1, 2048), dtype=np.float32)
    comp = ExpertCompute(2, kernels="fast-int8")
    try:
        got = comp.linear(lin, x)
        assert comp.split_calls == 1
    finally:
        comp.close()
    np.testing.assert_array_equal(got, lin(x, fast_int8=True))


def test_one_rounding_serves_several_weights() -> None:
    """``q8_input`` rounds ``x`` once; each weight given it computes the same bits as when it
    rounds ``x`` itself (an MLP's gate and up share one rounding under ``ExpertCompute``)."""
    from runtime.kernels.quant_matmul import q8_input
    from runtime.layers.swiglu import MLPWeights, swiglu

    gate, up = Linear(_weights("int4-g64", 512, 256, 1)), Linear(_weights("int4-g64", 512, 256, 2))
    down = Linear(_weights("int4-g64", 256, 512, 3))
    x = np.random.default_rng(4).standard_normal((3, 256), dtype=np.float32)
    prepared = q8_input(x)
    for lin in (gate, up):
        np.testing.assert_array_equal(lin(x, fast_int8=True, q8=prepared), lin(x, fast_int8=True))
    with pytest.raises(ValueError, match="rounded from x of shape"):
        gate(x[:2], fast_int8=True, q8=prepared)
    with pytest.raises(ValueError, match="multiple of 64"):
        q8_input(x[:, :100])
    w = MLPWeights(gate, up, down)
    want = swiglu(x, w, lambda lin, xx: lin(xx, fast_int8=True))
    for threads in (1, 2):
        comp = ExpertCompute(threads, kernels="fast-int8")
        try:
            np.testing.assert_array_equal(comp.swiglu(x, w), want)
            np.testing.assert_array_equal(comp.swiglu(x[:1], w), want[:1])
        finally:
            comp.close()


# ----------------------------------------------------------------------------- models

AGREEMENT = 0.95  # the bar for greedy tokens of the lossy mode against exact


def _int8_share(c: Container) -> float:
    """Fraction of the container's int4 matrix bytes whose shape takes the int8 kernel: the
    agreement test would prove nothing if it were ~0."""
    total = eligible = 0
    for name in c.names():
        if not name.endswith(".weight") or c.entry(name).fmt is None:
            continue
        q = c.load_qtensor(name)
        if q.fmt.kind == "int4":
            total += q.nbytes
            eligible += q.nbytes if q8_eligible(q.shape[1], q.fmt.group_size) else 0
    return eligible / max(total, 1)


def _greedy(m: Any, prompt: npt.NDArray[np.int64], n: int, ctx: StepContext) -> list[int]:
    cache = m.new_cache()
    logits = m.forward(prompt, cache, ctx=ctx).logits
    out = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        logits = m.forward(np.array(out[-1:], np.int64), cache, ctx=ctx).logits
        out.append(int(np.argmax(logits[-1])))
    return out


def _agreement(m: Any, prompts: list[npt.NDArray[np.int64]], n: int) -> tuple[float, float]:
    """(teacher-forced argmax agreement over the exact greedy continuations, first-divergence
    share of greedy tokens), fast-int8 against exact."""
    exact, fast = StepContext(), StepContext(compute=ExpertCompute(kernels="fast-int8"))
    same = total = prefix = 0
    for prompt in prompts:
        want = _greedy(m, prompt, n, exact)
        seq = np.concatenate([prompt, np.array(want[:-1], np.int64)])
        a = m.forward(seq, m.new_cache(), ctx=exact).logits[len(prompt) - 1 :]
        b = m.forward(seq, m.new_cache(), ctx=fast).logits[len(prompt) - 1 :]
        assert not np.array_equal(a, b)  # the lossy kernels ran
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(want)
        got = _greedy(m, prompt, n, fast)
        k = next((j for j, (u, v) in enumerate(zip(want, got, strict=True)) if u != v), n)
        prefix += k
    return same / total, prefix / total


@pytest.fixture(scope="module")
def q_containers(oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _oracle import container_maker

    return container_maker(oracle_dir, tmp_path_factory.mktemp("q8"))


def _oracle_names() -> tuple[str, ...]:
    from _oracle import oracle_tool

    return tuple(oracle_tool().MODEL_NAMES)


@pytest.mark.parametrize(
    "name",
    [
        "glm_moe_dsa",
        "deepseek_v3",
        "deepseek_v32",
        "olmoe",
        "qwen3_moe",
        "mixtral",
        "glm4_moe",
        "minimax_m2",
    ],
)
def test_greedy_agreement_on_oracle_models(name: str, oracle_dir: Path, q_containers: Any) -> None:
    from _oracle import reference

    from runtime.models import load_model

    assert name in _oracle_names()
    c = q_containers(name, "q")
    m = load_model(c)
    share = _int8_share(c)
    assert share > 0.3, share
    ref = reference(oracle_dir, name)
    prompts = [ref[k].astype(np.int64) for k in sorted(ref) if k.startswith("prompt_")]
    forced, prefix = _agreement(m, prompts, 16)
    print(
        f"{name}: int8 share of int4 bytes {share:.2f}; teacher-forced agreement {forced:.3f}; "
        f"greedy tokens before the first divergence {prefix:.3f}"
    )
    assert forced >= AGREEMENT, forced


def test_greedy_agreement_on_demo_model() -> None:
    from colibri._config import default_model_path
    from runtime.models import load_model

    c = Container.open(default_model_path())
    m = load_model(c)
    assert _int8_share(c) > 0.5
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 200, 8).astype(np.int64) for _ in range(3)]
    forced, prefix = _agreement(m, prompts, 24)
    print(f"demo: teacher-forced agreement {forced:.3f}; before first divergence {prefix:.3f}")
    assert forced >= AGREEMENT, forced


def _fast_int8_logits(model: Any, ids: npt.NDArray[np.int64], threads: int) -> F32:
    comp = ExpertCompute(threads, parallel_min_macs=0 if threads > 1 else 1 << 24,
                         kernels="fast-int8")  # fmt: skip
    try:
        return np.asarray(model.forward(ids, model.new_cache(), ctx=StepContext(comp)).logits)
    finally:
        comp.close()


def test_fast_int8_rows_in_blocks_on_the_pool_are_the_rows_of_one_call() -> None:
    """A long prompt chunk on 2+ threads projected and attended its rows in blocks with the
    exact kernels while one block (1 thread, or a short chunk) used the fast-int8 ones: logits
    (and on the tiny model greedy tokens) changed with the thread count and chunk size, against
    the mode's promise of batch invariance."""
    from _demo import TINY

    from runtime.models import load_model

    model = load_model(Container.open(TINY))
    ids = (np.arange(200, dtype=np.int64) * 37) % 900 + 3
    one = _fast_int8_logits(model, ids, 1)
    assert np.array_equal(_fast_int8_logits(model, ids, 2), one)
    assert np.array_equal(_fast_int8_logits(model, ids, 3), one)
