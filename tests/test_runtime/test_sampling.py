"""runtime.sampling: greedy, seeded sampling, temperature / top-k / top-p, and a goodness-of-fit
test of the sampler against the distribution it claims to sample from."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runtime.sampling import Sampler, SamplingParams, log_softmax, logit_norm, top_ids
from storage.errors import ColibriError, ModelError

# A fixed small logits vector with distinct values (no ties) and a wide range of probabilities.
LOGITS = np.array([1.5, 0.3, -0.2, 0.9, -1.0, 0.0, 2.1, -2.5], dtype=np.float32)


def sampler(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> Sampler:
    return Sampler(SamplingParams(temperature, top_p, top_k, seed))


def softmax(x: np.ndarray) -> np.ndarray:
    """float64 reference (divide float32 logits by a temperature after the cast)."""
    e = np.exp(x - x.max())
    out: np.ndarray = e / e.sum()
    return out


def random_logits(seed: int, n: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    s = sampler(temperature=0.0)
    for k in range(20):
        x = random_logits(k)
        assert s.sample(x) == int(np.argmax(x))


def test_greedy_ties_go_to_the_lowest_id() -> None:
    s = sampler(temperature=0.0)
    assert s.sample(np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)) == 1
    assert s.sample(np.array([5.0, 5.0, 5.0], dtype=np.float32)) == 0
    x = np.full(10, -np.inf, dtype=np.float32)
    x[[7, 9]] = 2.0
    assert s.sample(x) == 7


def test_greedy_ignores_seed_and_filters() -> None:
    x = random_logits(3)
    picks = {Sampler(SamplingParams(0.0, 0.5, 3, seed)).sample(x) for seed in range(5)}
    assert picks == {int(np.argmax(x))}


# ----------------------------------------------------------------------------- seeding


def draws(s: Sampler, n: int, logits: np.ndarray = LOGITS) -> list[int]:
    return [s.sample(logits) for _ in range(n)]


def test_same_seed_same_sequence() -> None:
    a = draws(sampler(0.9, top_p=0.95, top_k=6, seed=1234), 2000)
    b = draws(sampler(0.9, top_p=0.95, top_k=6, seed=1234), 2000)
    assert a == b
    assert len(set(a)) > 1  # it really samples


def test_different_seeds_differ() -> None:
    seqs = {tuple(draws(sampler(1.0, seed=seed), 200)) for seed in range(5)}
    assert len(seqs) == 5


def test_sequence_over_changing_logits_is_reproducible() -> None:
    def run() -> list[int]:
        s = sampler(0.7, top_p=0.9, seed=99)
        return [s.sample(random_logits(k)) for k in range(300)]

    assert run() == run()


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, 0), (0.5, 1.0, 0), (2.0, 1.0, 0), (1.0, 1.0, 10), (0.8, 0.9, 0), (1.2, 0.7, 50)],
)
def test_probs_sum_to_one_and_vanish_outside_the_filters(
    temperature: float, top_p: float, top_k: int
) -> None:
    x = random_logits(7)
    p = sampler(temperature, top_p, top_k).probs(x)
    assert p.dtype == np.float64 and p.shape == x.shape
    assert abs(p.sum() - 1.0) < 1e-12
    assert (p >= 0).all()
    order = np.argsort(-x, kind="stable")
    if top_k:
        assert np.count_nonzero(p) <= top_k
        assert (p[order[top_k:]] == 0).all()
    if top_p < 1.0:
        # The support is the smallest prefix of the (temperature, top-k) distribution whose
        # mass reaches top_p: without its last token the mass is below top_p.
        base = sampler(temperature, 1.0, top_k).probs(x)
        support = np.flatnonzero(p)
        kept = np.sort(base[support])[::-1]
        assert kept.sum() >= top_p - 1e-12
        assert kept[:-1].sum() < top_p
        assert set(support) == set(order[: support.size])  # the most likely tokens
    # Inside the support the ratios are those of the tempered softmax.
    ref = softmax(x.astype(np.float64) / temperature)
    nz = np.flatnonzero(p)
    np.testing.assert_allclose(p[nz] / p[nz].sum(), ref[nz] / ref[nz].sum(), rtol=1e-10)


def test_temperature_scales_logits() -> None:
    for t in (0.25, 0.5, 1.0, 3.0):
        np.testing.assert_allclose(
            sampler(t).probs(LOGITS), softmax(LOGITS.astype(np.float64) / t), rtol=1e-12
        )
    # lower temperature = sharper
    assert sampler(0.5).probs(LOGITS).max() > sampler(2.0).probs(LOGITS).max()


def test_top_k_one_is_greedy() -> None:
    for k in range(30):
        x = random_logits(100 + k)
        s = sampler(1.5, top_k=1, seed=k)
        assert s.sample(x) == int(np.argmax(x))


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids() -> None:
    x = np.array([1.0, 2.0, 2.0, 0.0], dtype=np.float32)
    assert np.flatnonzero(sampler(1.0, top_k=1).probs(x)).tolist() == [1]
    assert np.flatnonzero(sampler(1.0, top_k=2).probs(x)).tolist() == [1, 2]
    assert np.flatnonzero(sampler(1.0, top_k=3).probs(x)).tolist() == [0, 1, 2]


def test_top_k_at_or_above_vocab_is_off() -> None:
    p_all = sampler(1.0).probs(LOGITS)
    np.testing.assert_array_equal(sampler(1.0, top_k=LOGITS.size).probs(LOGITS), p_all)
    np.testing.assert_array_equal(sampler(1.0, top_k=10 * LOGITS.size).probs(LOGITS), p_all)


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    for k in range(10):
        x = random_logits(200 + k)
        s = sampler(1.0, top_p=1e-9, seed=k)
        p = s.probs(x)
        assert np.flatnonzero(p).tolist() == [int(np.argmax(x))]
        assert p.max() == 1.0
        assert draws(s, 50, x) == [int(np.argmax(x))] * 50


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    assert np.flatnonzero(sampler(1.0, top_p=0.45).probs(x)).tolist() == [0]
    assert np.flatnonzero(sampler(1.0, top_p=0.75).probs(x)).tolist() == [0, 1]
    assert np.flatnonzero(sampler(1.0, top_p=0.9).probs(x)).tolist() == [0, 1, 2]
    np.testing.assert_allclose(
        sampler(1.0, top_p=0.75).probs(x), [0.625, 0.375, 0.0, 0.0], rtol=1e-6
    )


def test_samples_never_leave_the_support() -> None:
    x = random_logits(5, n=64)
    s = sampler(1.0, top_p=0.6, top_k=8, seed=5)
    support = set(np.flatnonzero(s.probs(x)).tolist())
    assert set(draws(s, 5000, x)) <= support


def test_masked_logits_are_never_sampled() -> None:
    x = LOGITS.copy()
    x[[0, 6]] = -np.inf  # the two most likely tokens, masked out
    s = sampler(1.0, seed=3)
    assert s.probs(x)[[0, 6]].tolist() == [0.0, 0.0]
    assert not {0, 6} & set(draws(s, 3000, x))


def test_log_softmax() -> None:
    x = random_logits(11)
    lp = log_softmax(x)
    assert lp.dtype == np.float64
    np.testing.assert_allclose(np.exp(lp).sum(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(lp, np.log(softmax(x.astype(np.float64))), rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- goodness of fit


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with ``df`` degrees of freedom (closed forms)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(float(h**i) / math.factorial(i) for i in range(df // 2))
    s = math.erfc(math.sqrt(h))
    tail = sum(float(h ** (i + 0.5)) / math.gamma(i + 1.5) for i in range(df // 2))
    return s + math.exp(-h) * tail


def test_chi2_sf_matches_published_critical_values() -> None:
    # chi-square critical values at p = 0.001 (any statistics table)
    for df, crit in [(1, 10.828), (2, 13.816), (3, 16.266), (4, 18.467), (5, 20.515), (7, 24.322)]:
        assert chi2_sf(crit, df) == pytest.approx(0.001, rel=2e-3)


N_DRAWS = 20_000
P_THRESHOLD = 0.001  # reject the sampler when the fit is this unlikely (fixed seeds: no flakes)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "seed"),
    [(1.0, 1.0, 0, 11), (0.7, 1.0, 5, 12), (1.3, 0.8, 0, 13), (1.0, 0.9, 6, 14)],
)
def test_sample_follows_probs_chi_square(
    temperature: float, top_p: float, top_k: int, seed: int
) -> None:
    s = sampler(temperature, top_p, top_k, seed)
    p = s.probs(LOGITS)
    counts = np.bincount(draws(s, N_DRAWS), minlength=LOGITS.size)
    support = p > 0
    assert counts[~support].sum() == 0, "sampled a token outside top-k / top-p"
    expected = p[support] * N_DRAWS
    assert expected.min() >= 5  # the chi-square approximation holds
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    df = int(support.sum()) - 1
    p_value = chi2_sf(stat, df)
    assert p_value > P_THRESHOLD, f"chi2 {stat:.2f} on {df} df, p = {p_value:.2g}"


# ----------------------------------------------------------------------------- invalid params


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -1.0},
        {"top_p": float("nan")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_k": True},
        {"seed": -1},
        {"seed": 1.5},
    ],
)
def test_invalid_params_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ModelError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ColibriError)
    assert next(iter(kwargs)) in str(info.value)


def test_valid_edge_params() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    SamplingParams(temperature=1e-9, top_p=1e-9, top_k=np.int64(3), seed=np.int64(2**40))  # type: ignore[arg-type]
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


def test_logit_norm_is_the_log_softmax_of_one_token_and_finds_bad_rows() -> None:
    """``logit_norm`` (what every emitted token's logprob uses) gives ``log_softmax(x)[tok]``
    bit for bit, for large and tiny spreads, and reports any NaN or inf."""
    rng = np.random.default_rng(11)
    for x in (
        rng.standard_normal(4096).astype(np.float32) * 8,
        np.full(7, 3.5, np.float32),
        np.array([1e30, -1e30, 0.0], np.float32),
        np.array([-2.0], np.float32),
    ):
        norm = logit_norm(x)
        assert norm.finite
        want = log_softmax(x)
        for tok in range(0, x.size, max(1, x.size // 13)):
            assert norm.logprob(x, tok) == want[tok]
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros(10, np.float32)
        x[6] = bad
        assert not logit_norm(x).finite


# ------------------------------------------------ the plain formulation (what the fast one keeps)


def _plain_probs(p: SamplingParams, logits: np.ndarray) -> np.ndarray:
    """The sampler's distribution written out plainly: whole-vocabulary stable argsorts,
    masks and a fresh array per step (its bits are the contract; it took 20+ ms a token on a
    155k vocabulary)."""
    x = logits.astype(np.float64) / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.size:
        order = np.argsort(-x, kind="stable")
        mask = np.full(x.shape, -np.inf)
        mask[order[: p.top_k]] = 0.0
        x = x + mask
    x = x - x.max()
    e = np.exp(x)
    probs = e / e.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = int(np.searchsorted(cum, p.top_p) + 1)
        kept = np.zeros_like(probs)
        kept[order[:keep]] = probs[order[:keep]]
        probs = kept / kept.sum()
    out: np.ndarray = probs
    return out


def _plain_draw(probs: np.ndarray, u: float) -> int:
    cum = np.cumsum(probs)
    idx = int(np.searchsorted(cum, u, side="right"))
    return idx if idx < probs.size else int(np.flatnonzero(probs)[-1])


def _hard_rows(v: int, seed: int) -> list[np.ndarray]:
    """Rows that stress the partial ordering: plain, many ties (rounded), the maximum
    repeated, spikes between the positions a sample of the row looks at, a few equal
    winners over zeros, all negative, and sample positions much larger than the rest (the
    guess overshoots: a lower guess, then the exact partition)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, v).astype(np.float32)
    rows = [x, np.round(x), np.where(rng.random(v) < 0.3, x.max(), x).astype(np.float32)]
    spikes = x.copy()
    step = max(1, v // 4096)
    at = rng.integers(0, max(1, v // step - 1), 200) * step + 1
    spikes[at % v] = x.max() + rng.random(200).astype(np.float32) * 5
    rows.append(spikes)
    few = np.zeros(v, np.float32)
    few[rng.integers(0, v, 50)] = 1.0
    rows += [few, -np.abs(x)]
    grid = np.zeros(v, np.float32)
    grid[::step] = 10.0
    rows.append(grid)
    return rows


@pytest.mark.parametrize("v", [7, 1000, 8193, 154880])
def test_the_sampler_keeps_the_bits_of_the_plain_formulation(v: int) -> None:
    """Probabilities bit for bit and the same draws as the plain formulation, for every
    filter, on rows built to mislead the partial ordering (ties at the boundary, leading
    values where the row's sample does not look, a top-k larger than the sample can see)."""
    settings = [(0.7, 1.0, 40), (1.0, 0.9, 0), (0.5, 0.95, 100), (1.3, 0.5, 6000),
                (1.0, 1.0, 1), (2.0, 0.99, 0), (0.8, 0.3, 5), (1.0, 1.0, 0)]  # fmt: skip
    for i, x in enumerate(_hard_rows(v, seed=v)):
        for temp, top_p, top_k in settings:
            params = SamplingParams(temp, top_p, top_k, seed=i)
            fast = Sampler(params)
            want = _plain_probs(params, x)
            assert np.array_equal(fast.probs(x), want), (i, temp, top_p, top_k)
            rng = np.random.Generator(np.random.PCG64(i))
            draws = [fast.sample(x) for _ in range(4)]
            assert draws == [_plain_draw(want, rng.random()) for _ in range(4)]


def test_log_softmax_and_logit_norm_keep_their_bits() -> None:
    """In place, one buffer: the same values as the formulas with a fresh array per step."""
    for x in _hard_rows(154880, seed=3)[:3]:
        x64 = x.astype(np.float64)
        m = x64.max()
        plain = x64 - m - np.log(np.exp(x64 - m).sum())
        assert np.array_equal(log_softmax(x), plain)
        norm = logit_norm(x)
        assert (norm.max, norm.log_sum) == (float(m), float(np.log(np.exp(x64 - m).sum())))


def test_top_ids_are_the_first_ids_of_a_stable_descending_sort() -> None:
    """What a top-logprobs list takes: the same ids, in the same order, ties to the lowest."""
    for v in (5, 8193, 154880):
        for x in _hard_rows(v, seed=v + 1):
            x64 = x.astype(np.float64)
            order = np.argsort(-x64, kind="stable")
            for n in (1, 3, 20, 5000, v):
                assert np.array_equal(top_ids(x64, n), order[:n]), (v, n)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.7, 1.0, 40), (1.0, 0.9, 0), (1.0, 1.0, 0)]
)
def test_logits_that_cannot_be_sampled_are_refused(
    temperature: float, top_p: float, top_k: int
) -> None:
    """NaN or +inf logits (damaged weights), or every token masked out: a ModelError that says
    so, for every filter (a speculative round samples before the engine checks the row)."""
    for v in (100, 20000):
        base = random_logits(v, v)
        nan, inf, none = base.copy(), base.copy(), np.full(v, -np.inf, np.float32)
        nan[5] = np.nan
        inf[7] = np.inf
        for x in (nan, inf, none):
            with pytest.raises(ModelError, match="cannot sample"):
                sampler(temperature, top_p, top_k).sample(x)
