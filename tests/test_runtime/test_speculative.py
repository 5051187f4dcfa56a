"""Speculative decoding (runtime/speculative/): greedy output and the KV cache are exactly
those of plain decoding for MTP and prompt-lookup drafts, k = 1..4, three architectures,
resident and streaming; the rejection sampler draws from the target distribution (chi-square);
the cost model keeps acceptance per draft position, picks the source and k of the best
tokens/s per round, switches drafting off and back on; options, CLI flag and telemetry."""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri._engine import DoneEvent, TokenEvent
from runtime.kv import KVCache
from runtime.models import load_model
from runtime.sampling import Sampler, SamplingParams
from runtime.speculative import (
    CostModel,
    DraftPolicy,
    SpecStats,
    SpeculativeDecoder,
    accept_or_resample,
    expected_tokens,
    lookup_draft,
    lookup_match,
)
from storage.container import Container
from storage.errors import ModelError

DEMO = demo_model()
EOS = (0, 2)
N_TOKENS = 32
POLICIES = ["1", "2", "3", "4", "lookup:1", "lookup:2", "lookup:3", "lookup:4", "auto"]


pytestmark = pytest.mark.usefixtures("private_home")


def _prompts(n: int) -> list[list[int]]:
    """Random prompts, half of them with repeats so prompt lookup finds matches."""
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        p = [int(x) for x in rng.integers(3, 999, size=6 + i % 5)]
        out.append(p * 2 + p[:2] if i % 2 else p)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    """The demo model and the converted oracle glm_moe_dsa / deepseek_v3 (absorbed attention,
    as the engine runs them)."""
    from storage.convert import convert

    out = {"demo": load_model(Container.open(DEMO))}
    try:
        oracle = request.getfixturevalue("oracle_dir")
    except pytest.skip.Exception:
        oracle = None
    if oracle is not None:
        for name in ("glm_moe_dsa", "deepseek_v3"):
            dst = tmp_path_factory.mktemp(name) / name
            convert(oracle / name, dst)
            out[name] = load_model(Container.open(dst))
    return out  # the default StepContext runs absorbed attention, as the engine does


class Run(NamedTuple):
    tokens: list[int]
    cache: KVCache
    decoder: SpeculativeDecoder | None


def _plain(model: Any, prompt: list[int], n: int) -> Run:
    cache = model.new_cache()
    logits = model.forward(np.array(prompt), cache).logits[-1]
    out: list[int] = []
    for i in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        if tok in EOS or i + 1 == n:
            break
        logits = model.forward(np.array([tok]), cache).logits[-1]
    return Run(out, cache, None)


def _prefilled(
    model: Any,
    prompt: list[int],
    policy: str,
    cost: CostModel | None = None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[SpeculativeDecoder, np.ndarray]:
    """A decoder over a new cache holding ``prompt`` (its rows queued for the MTP head), and
    the prompt's last logits [V]."""
    dec = SpeculativeDecoder(
        model,
        model.new_cache(),
        Sampler(SamplingParams(temperature=temperature, seed=seed)),
        prompt=prompt,
        policy=DraftPolicy.parse(policy),
        cost=cost if cost is not None else CostModel(top_k=model.config.num_experts_per_tok),
        stats=SpecStats(),
        stop_ids=EOS,
    )
    out = model.forward(np.array(prompt), dec.cache)
    dec.prefill_hook(np.array(prompt), out.hidden)
    return dec, out.logits[-1]


def _speculative(
    model: Any,
    prompt: list[int],
    n: int,
    policy: str,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    cost: CostModel | None = None,
) -> Run:
    dec, last = _prefilled(model, prompt, policy, cost, temperature=temperature, seed=seed)
    toks = [dec.first(last)]
    while len(toks) < n and toks[-1] not in EOS:
        toks += [t for t, _ in dec.step(toks[-1], n - len(toks))]
    return Run(toks, dec.cache, dec)


def _same_cache(a: KVCache, b: KVCache) -> bool:
    if a.length != b.length or not np.array_equal(a.tokens, b.tokens):
        return False
    for layer in range(a.n_layers):
        if not np.array_equal(a.latent(layer), b.latent(layer)):
            return False
        if not np.array_equal(a.k_rope(layer), b.k_rope(layer)):
            return False
    return all(np.array_equal(a.index_keys(i), b.index_keys(i)) for i in a.indexed_layers)


# ----------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("name", ["demo", "glm_moe_dsa", "deepseek_v3"])
def test_greedy_speculative_equals_plain_decoding_and_its_cache(name: str, models: dict) -> None:
    """10 prompts x 32 tokens; MTP and lookup drafts with k = 1..4 and auto, rotating over the
    prompts (each model starts the rotation elsewhere)."""
    if name not in models:
        pytest.skip("oracle checkpoints need torch + transformers")
    model = models[name]
    assert model.has_mtp
    shift = ["demo", "glm_moe_dsa", "deepseek_v3"].index(name) * 3
    drafted = {"mtp": 0, "lookup": 0}
    for i, prompt in enumerate(_prompts(10)):
        ref = _plain(model, prompt, N_TOKENS)
        policy = POLICIES[(i + shift) % len(POLICIES)]
        got = _speculative(model, prompt, N_TOKENS, policy)
        assert got.tokens == ref.tokens, (i, policy)
        # rollback left exactly the rows plain decoding wrote (all but the last token)
        assert _same_cache(got.cache, ref.cache), (i, policy)
        assert got.decoder is not None
        for src in drafted:
            drafted[src] += got.decoder.stats.proposed[src]
    assert drafted["mtp"] > 0 and drafted["lookup"] > 0


def test_mtp_cache_holds_exactly_the_real_rows(models: dict) -> None:
    """After speculative decoding (drafted rows rolled back, accepted ones re-run from the
    verify hidden states) the MTP head's cache equals one pass of the head over the final
    sequence."""
    model = models["demo"]
    prompt = _prompts(2)[1]
    run = _speculative(model, prompt, 24, "mtp:3")
    assert run.decoder is not None
    head = run.decoder._mtp
    assert head is not None and head.cache.length > len(prompt)
    seq = np.array([*prompt, *run.tokens[:-1]])
    n = head.cache.length
    ref_cache = model.new_mtp_cache()
    hidden = model.forward(seq, model.new_cache()).hidden  # [S, D]
    model.mtp_forward(hidden[:n], seq[1 : n + 1], ref_cache)
    assert np.array_equal(head.cache.tokens, ref_cache.tokens)
    assert np.array_equal(head.cache.latent(0), ref_cache.latent(0))
    assert np.array_equal(head.cache.k_rope(0), ref_cache.k_rope(0))


def test_mtp_step_is_mtp_forward(models: dict) -> None:
    model = models["demo"]
    ids = np.array(_prompts(1)[0])
    hidden = model.forward(ids, model.new_cache()).hidden
    nxt = np.append(ids[1:], 7)
    ref = model.mtp_forward(hidden, nxt, model.new_mtp_cache())
    got, normed = model.mtp_step(hidden, nxt, model.new_mtp_cache(), last_only=False)
    assert np.array_equal(got, ref)
    last, _ = model.mtp_step(hidden, nxt, model.new_mtp_cache())
    assert np.array_equal(last[0], ref[-1])
    assert normed.shape == hidden.shape


@pytest.mark.parametrize("name", ["demo", "glm_moe_dsa", "deepseek_v3"])
def test_mtp_step_batch_gives_each_sequence_its_bits_alone(name: str, models: dict) -> None:
    """Three sequences in one head call (caches of 0, 70 and 5 rows: the DSA head scores a
    cache beyond index_topk; 1, 3 and 1 new rows): every sequence's logits, normed output
    and cache are bit for bit those of its own ``mtp_step``, with and without last_only."""
    if name not in models:
        pytest.skip("oracle checkpoints need torch + transformers")
    model = models[name]
    rng = np.random.default_rng(3)
    d = model.config.hidden_size
    before = [0, 70, 5]
    new = [1, 3, 1]

    def caches() -> list[KVCache]:
        out = []
        for j, n in enumerate(before):
            c = model.new_mtp_cache()
            if n:
                h = np.random.default_rng(j).standard_normal((n, d)).astype(np.float32)
                model.mtp_step(h, np.arange(3, 3 + n), c)
            out.append(c)
        return out

    hs = [rng.standard_normal((t, d)).astype(np.float32) for t in new]
    ids = [rng.integers(3, 999, size=t) for t in new]
    for last_only in (True, False):
        alone_caches, batch_caches = caches(), caches()
        alone = [
            model.mtp_step(h, i, c, last_only=last_only)
            for h, i, c in zip(hs, ids, alone_caches, strict=True)
        ]
        got = model.mtp_step_batch(hs, ids, batch_caches, last_only=last_only)
        for (z0, g0), (z1, g1), c0, c1 in zip(alone, got, alone_caches, batch_caches, strict=True):
            assert z1.shape == z0.shape and np.array_equal(z1, z0)
            assert np.array_equal(g1, g0)
            assert _same_cache(c1, c0)


def test_draft_weighs_the_other_rows_of_its_step(models: dict) -> None:
    """``draft(..., others)`` reaches the cost model: an MTP draft that pays alone is not
    made when seven other generations share the step (their rows and its drafting cost all
    of them for one more token of one)."""
    model = models["demo"]
    prompt = _prompts(1)[0]

    def decoder() -> SpeculativeDecoder:
        cm = CostModel(top_k=model.config.num_experts_per_tok, max_k=3)
        for _ in range(10):
            cm.observe_step(1, 0.004)
            cm.observe_step(2, 0.005)
            cm.observe_draft("mtp", 1, 0.001)
            cm.observe_proposal("mtp", 1, 1)
        return _prefilled(model, prompt, "mtp", cm)[0]

    assert decoder().draft(5, 8).size > 1  # alone: drafts
    assert decoder().draft(5, 8, others=7).size == 1  # in a step of eight: none


def _engine_runs(
    opts: dict[str, Any], prompts: list[list[int]], drafts: list[str], n: int = N_TOKENS
) -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
    """Greedy tokens per ``generate(draft=...)`` override, all in one engine, and its stats."""

    async def main() -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
        options = colibri.EngineOptions(learn=False, reader="threads", **opts)
        async with colibri.Engine.open(DEMO, options=options) as eng:
            outs: dict[str, list[list[int]]] = {}
            for draft in drafts:
                for p in prompts:
                    toks: list[int] = []
                    async for ev in eng.generate(p, max_new_tokens=n, draft=draft):
                        if isinstance(ev, TokenEvent):
                            toks.append(ev.token_id)
                        else:
                            assert isinstance(ev, DoneEvent)
                            assert ev.tokens == toks
                    outs.setdefault(draft, []).append(toks)
            return outs, eng.stats()

    return anyio.run(main)


@pytest.mark.parametrize("budget", [None, "4600KiB"])
def test_engine_greedy_identical_resident_and_streaming(budget: str | None) -> None:
    drafts = ["off", "auto", "3", "lookup:2"]
    outs, st = _engine_runs({"ram_budget": budget}, _prompts(2), drafts, n=16)
    for draft in drafts[1:]:
        assert outs[draft] == outs["off"], draft
    spec = st["speculative"]
    assert spec["policy"] == "auto"  # the engine option; the calls overrode it
    assert spec["tokens"] == sum(len(t) - 1 for d in drafts[1:] for t in outs[d])
    assert spec["proposed"]["mtp"] > 0 and spec["proposed"]["lookup"] > 0
    if budget is not None:
        assert st["experts"]["mode"] == "streaming"
        assert spec["cost_model"]["hit_rate"] < 1.0


def test_engine_kept_cache_after_speculation_is_the_plain_one() -> None:
    prompt = _prompts(2)[1]

    async def main(draft: str) -> tuple[list[int], KVCache]:
        async with colibri.Engine.open(DEMO, options=colibri.EngineOptions(learn=False)) as eng:
            cache = eng.new_cache()
            toks: list[int] = []
            async for ev in eng.generate(prompt, max_new_tokens=20, cache=cache, draft=draft):
                if isinstance(ev, TokenEvent):
                    toks.append(ev.token_id)
            return toks, cache

    ref_toks, ref_cache = anyio.run(main, "off")
    got_toks, got_cache = anyio.run(main, "4")
    assert got_toks == ref_toks
    assert got_cache.length == len(prompt) + len(ref_toks) - 1
    assert _same_cache(got_cache, ref_cache)


@pytest.mark.parametrize("draft", ["mtp:3", "2"])
def test_seeded_sampling_with_pinned_mtp_drafts_is_the_same_on_a_kept_cache(draft: str) -> None:
    """A seeded generation with MTP drafts pinned gives the same tokens whether its prompt is
    computed in full or partly taken from a kept cache (a server's prefix reuse, a resumed
    chat): the head's history is the latest prompt rows computed in the call, so the engine
    reruns enough of them. The kept cache holds an earlier turn (its prompt and output)."""
    rng = np.random.default_rng(11)
    base = [int(t) for t in rng.integers(3, 1000, 300)]
    prompt = base + [int(t) for t in rng.integers(3, 1000, 20)]
    short = prompt[:100]  # shorter than the head's history: nothing is reused

    async def main() -> tuple[list[list[int]], list[int]]:
        async with colibri.Engine.open(DEMO, options=colibri.EngineOptions(learn=False)) as eng:

            async def gen(ids: list[int], cache: KVCache | None) -> tuple[list[int], int]:
                toks: list[int] = []
                reused = -1
                async for ev in eng.generate(
                    ids, max_new_tokens=40, temperature=0.9, seed=7, cache=cache, draft=draft
                ):
                    if isinstance(ev, TokenEvent):
                        toks.append(ev.token_id)
                    else:
                        reused = ev.stats["prompt_tokens_reused"]
                return toks, reused

            outs, reuses = [], []
            for ids in (prompt, short):
                fresh, _ = await gen(ids, None)
                kept = eng.new_cache()
                await gen(base if ids is prompt else ids, kept)
                again, reused = await gen(ids, kept)
                outs += [fresh, again]
                reuses.append(reused)
            return outs, reuses

    outs, reuses = anyio.run(main)
    assert outs[0] == outs[1] and outs[2] == outs[3]
    assert reuses == [len(prompt) - 129, 0]  # the last 128 (hidden, next token) pairs rerun


@pytest.mark.parametrize("draft", ["mtp:2", "lookup:3", "3"])
def test_a_smaller_token_limit_cuts_the_same_seeded_text(draft: str) -> None:
    """With drafts pinned, a seeded generation's rounds do not depend on max_new_tokens (the
    drafts of the last rounds were capped by the tokens left, which moved the random draws):
    a smaller limit gives a prefix of the larger one's tokens, as without drafting; the kept
    cache holds what was emitted (all but the last token)."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 1000, 24)] for _ in range(3)]
    # a repeated prompt, so that lookup drafts too
    prompts.append(prompts[0][:12] * 3)

    async def main() -> list[tuple[list[int], list[list[int]]]]:
        async with colibri.Engine.open(DEMO, options=colibri.EngineOptions(learn=False)) as eng:

            async def gen(ids: list[int], n: int) -> list[int]:
                cache = eng.new_cache()
                toks = [
                    ev.token_id
                    async for ev in eng.generate(
                        ids, max_new_tokens=n, temperature=1.0, seed=3, draft=draft,
                        stop_token_ids=[], cache=cache,
                    )
                    if isinstance(ev, TokenEvent)
                ]  # fmt: skip
                assert cache.length == len(ids) + len(toks) - 1
                return toks

            out = []
            for seed_prompt in prompts:
                full = await gen(seed_prompt, 40)
                out.append((full, [await gen(seed_prompt, n) for n in (5, 9, 14, 23)]))
            return out

    for full, cuts in anyio.run(main):
        assert len(full) == 40
        for short in cuts:
            assert short == full[: len(short)]


# ----------------------------------------------------------------------------- sampling


def _chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df/2, stat/2) (regularized gamma)."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    lg = math.lgamma(a)
    if x < a + 1:  # series for P
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
            if term < total * 1e-15:
                break
        return 1.0 - total * math.exp(-x + a * math.log(x) - lg)
    # continued fraction for Q (Lentz)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - lg) * h


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    return _chi2_pvalue(stat, int(keep.sum()) - 1)


def test_chi2_pvalue_reference_points() -> None:
    assert _chi2_pvalue(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert _chi2_pvalue(18.307, 10) == pytest.approx(0.05, abs=1e-3)
    assert _chi2_pvalue(2.0, 10) == pytest.approx(0.9963, abs=1e-3)


@pytest.mark.parametrize("draft_kind", ["sampled", "deterministic"])
def test_rejection_sampling_preserves_the_target_distribution(draft_kind: str) -> None:
    """Draft x ~ q (or a fixed token), accept with min(1, p/q), else resample from
    norm(max(0, p - q)): the result is distributed as p (chi-square p-value > 0.001)."""
    rng = np.random.default_rng(1234)
    p = np.array([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    q = np.array([0.3, 0.1, 0.2, 0.1, 0.3, 0.0])
    counts = np.zeros(p.size, np.int64)
    accepted = 0
    n = 20_000
    for i in range(n):
        if draft_kind == "sampled":
            d = int(rng.choice(p.size, p=q))
            ok, tok = accept_or_resample(p, q, d, rng)
        else:
            d = i % 3 * 2  # tokens 0, 2, 4 (2 has p = 0)
            ok, tok = accept_or_resample(p, None, d, rng)
        counts[tok] += 1
        accepted += ok
    assert _chi2(counts, p) > 1e-3
    if draft_kind == "sampled":  # acceptance rate is sum(min(p, q)) = 0.55
        assert accepted / n == pytest.approx(np.minimum(p, q).sum(), abs=0.02)


class _TableModel:
    """A fake model for the sampling test: the next-token logits depend on the previous token
    only (a fixed table), the KV cache only counts tokens. Same interface as MLAMoEModel."""

    class _Config:
        num_hidden_layers = 1
        max_position_embeddings = 1 << 20

    config = _Config()
    has_mtp = False

    def __init__(self, vocab: int, seed: int) -> None:
        self.table = np.random.default_rng(seed).normal(0, 1.5, (vocab, vocab)).astype(np.float32)

    def new_cache(self) -> KVCache:
        return KVCache(1, 1, 1)

    def forward(self, ids: np.ndarray, cache: KVCache, *, ctx: Any = None) -> Any:
        start = cache.length
        cache.write_tokens(start, ids)
        cache.commit(start + ids.size)
        logits = self.table[ids]  # [T, V]
        return type("Out", (), {"logits": logits, "hidden": np.zeros((ids.size, 1), np.float32)})


def test_speculative_sampling_end_to_end_matches_plain_distribution() -> None:
    """Tokens 2 and 3 of a generation (after the first; the first round verifies 2 lookup
    drafts): their joint distribution equals the model's (chi-square over the 36 pairs)."""
    vocab = 6
    model = _TableModel(vocab, seed=3)
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 1]  # every token has a lookup continuation
    params = SamplingParams(temperature=0.9)
    probs = np.stack([Sampler(params).probs(model.table[t]) for t in range(vocab)])  # [V, V]
    first = int(np.argmax(model.table[prompt[-1]]))
    joint = probs[first][:, None] * probs  # P(t2, t3 | t1 = first) [V, V]
    counts = np.zeros((vocab, vocab), np.int64)
    drafted = 0
    n = 3000
    for seed in range(n):
        cache = model.new_cache()
        dec = SpeculativeDecoder(
            model,
            cache,
            Sampler(SamplingParams(temperature=0.9, seed=seed)),
            prompt=prompt,
            policy=DraftPolicy.parse("lookup:2"),
            cost=CostModel(),
            stats=SpecStats(),
        )
        model.forward(np.array(prompt), cache)
        toks = [first]
        dec._commit(first)  # as if first() had sampled `first`
        while len(toks) < 4:
            toks += [t for t, _ in dec.step(toks[-1], 4 - len(toks))]
        counts[toks[1], toks[2]] += 1
        drafted += dec.stats.proposed["lookup"]
        assert cache.length == len(prompt) + 3
    assert drafted > 2 * n  # the rounds verified drafts
    assert _chi2(counts.reshape(-1), joint.reshape(-1)) > 1e-3


def test_seeded_sampling_reproducible_with_fixed_drafts() -> None:
    model = load_model(Container.open(DEMO))
    prompt = _prompts(2)[1]
    a = _speculative(model, prompt, 16, "lookup:3", temperature=1.0, seed=5)
    b = _speculative(model, prompt, 16, "lookup:3", temperature=1.0, seed=5)
    assert a.tokens == b.tokens


# ----------------------------------------------------------------------------- cost model


def test_cost_model_turns_drafting_off_and_back_on() -> None:
    cm = CostModel(top_k=8, n_experts=256, moe_layers=4, max_k=4, probe_interval=8)
    for _ in range(5):
        cm.observe_step(1, 0.010)
        cm.observe_step(4, 0.013)
    assert cm.plan("mtp") > 0  # prior acceptance 0.6: drafting pays
    for _ in range(12):  # the head misses every time
        cm.observe_proposal("mtp", 3, 0)
    assert cm.acceptance("mtp") < 0.1
    plans = [cm.plan("mtp") for _ in range(24)]
    # off; probed after 8 rounds, then after 16 (the gap doubles while probes find it off)
    assert [i for i, k in enumerate(plans) if k] == [7, 23]
    assert set(plans) == {0, 1}
    for _ in range(24):  # acceptance rises (probes and drafts match)
        cm.observe_proposal("mtp", 3, 3)
    assert cm.acceptance("mtp") > 0.8
    assert cm.plan("mtp") >= 3
    assert cm.speedup("mtp", 3) > 2.0


def test_cost_model_streaming_reads_can_make_drafting_lose() -> None:
    """85% hits, one extra distinct expert set per row: the wider union costs more reads
    than the accepted drafts save (the C engine measured -32% here)."""
    cm = CostModel(top_k=8, n_experts=256, moe_layers=75, max_k=3)
    cm.observe_step(1, 0.30, stall=0.25, misses=90, lookups=600)
    cm.observe_proposal("mtp", 3, 2)
    cm.hit_rate = 0.85
    assert cm.union(4) == 32
    assert cm.speedup("mtp", 3) < 1.0
    assert cm.plan("mtp") == 0
    # the routing of wider steps turns out to overlap a lot: drafting pays again
    for _ in range(30):
        cm.observe_union(4, 9.0)
    assert cm.overlap < 0.1
    assert cm.speedup("mtp", 3) > 1.0
    cm.hit_rate = 1.0  # resident: only compute
    assert cm.plan("mtp") > 0


def test_cost_model_weighs_drafts_against_the_whole_batched_step() -> None:
    """Measured on the demo model: a one-row step 4 ms, each further row 1 ms, an MTP draft
    1 ms, acceptance 0.6. Alone a draft pays; in a step of eight generations its row and its
    drafting cost all eight, for one more token of one: it does not."""
    cm = CostModel(top_k=4, n_experts=64, moe_layers=2, max_k=3)
    for _ in range(10):
        cm.observe_step(1, 0.004)
        cm.observe_step(2, 0.005)
        cm.observe_draft("mtp", 1, 0.001)
    assert cm.t_row == pytest.approx(0.001)
    assert cm.speedup("mtp", 1) == cm.speedup("mtp", 1, others=0)
    alone = cm.speedup("mtp", 1)
    assert alone == pytest.approx(1.6 * 0.004 / (0.005 + 0.001))
    assert cm.plan("mtp") > 0
    # (7 + E) tokens in step(9) + draft, against 8 tokens in step(8)
    wide = cm.speedup("mtp", 1, others=7)
    assert wide == pytest.approx((7 + 1.6) * 0.011 / (8 * (0.012 + 0.001)))
    assert wide < 1.0 < alone
    assert cm.best("mtp", others=7) == (0, 1.0)
    assert cm.choose({"mtp": 3}, others=7) == (None, 0, False)
    assert cm.choose({"mtp": 3}, others=0)[1] > 0
    # a server whose steps were all batched from the start: each row is taken as costing the
    # same until a one-row step is seen, and a draft in a step of eight does not pay
    cm = CostModel(top_k=4, n_experts=64, moe_layers=2, max_k=3)
    cm.observe_draft("mtp", 1, 0.001)
    cm.observe_step(8, 0.012, seqs=8)
    assert cm.t1 == pytest.approx(0.0015) and cm.t_seq == pytest.approx(0.0015)
    assert cm.speedup("mtp", 1, others=7) < 1.0
    assert cm.choose({"mtp": 3}, others=7) == (None, 0, False)


def test_cost_model_recovers_from_step_costs_learned_while_kernels_compiled() -> None:
    """A server's first steps load or compile kernels: a one-row step of 30 ms and a step of
    eight of 400 ms, then every step is batched (one-row steps never come to correct them).
    Steps of eight cost 6.9 ms, with eight draft rows 13.3 ms; an MTP draft 1 ms, right ~60%
    of the time. Estimating the further rows against the stale fixed part clipped their
    cost to 0, so drafts looked free (eight streams of the demo model ran at 590-850 tok/s,
    920-990 with drafting off). Steps cheaper than their estimated plain part now pull those
    estimates down, and a draft in the step of eight no longer pays."""
    cm = CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=3)
    cm.observe_step(1, 0.030)
    cm.observe_step(8, 0.40, seqs=8)
    for i in range(40):
        cm.observe_draft("mtp", 1, 0.001)
        cm.observe_proposal("mtp", 1, 1 if i % 5 < 3 else 0)
        cm.observe_step(8, 0.0069, seqs=8)
        cm.observe_step(16, 0.0133, seqs=8)
    assert cm.t1 is not None and cm.t1 <= 0.0069
    assert cm.t_wide is not None and cm.t_wide > 0.0005
    assert cm.step_cost(8, 8) == pytest.approx(0.0069, rel=0.05)
    assert cm.step_cost(16, 8) == pytest.approx(0.0133, rel=0.05)
    assert cm.speedup("mtp", 1, others=7, other_seqs=7) < 1.0
    assert cm.choose({"mtp": 3}, others=7, other_seqs=7) == (None, 0, False)


def test_cost_model_probes_only_where_a_draft_could_pay() -> None:
    """Drafting off (acceptance 0.3): a probe (k = 1) is due every ``probe_interval`` rounds,
    but in a step of eight generations not even an always-accepted draft would pay there
    (demo model costs: 2.03 ms alone, +0.67 ms per generation, +0.8 ms per draft row, 1 ms
    per MTP draft), so none is made there; the first round alone makes the due one."""
    cm = CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=3)
    for i in range(20):
        cm.observe_step(1, 0.00203)
        cm.observe_step(2, 0.00268)
        cm.observe_step(8, 0.00673, seqs=8)
        cm.observe_step(10, 0.00833, seqs=8)
        cm.observe_draft("mtp", 1, 0.001)
        cm.observe_proposal("mtp", 1, 1 if i % 10 < 3 else 0)
    assert not cm._could_pay("mtp", 7, 7) and cm._could_pay("mtp", 0, None)
    wide = [cm.choose({"mtp": 3}, others=7, other_seqs=7) for _ in range(3 * cm.probe_interval)]
    assert wide == [(None, 0, False)] * len(wide)
    assert cm.choose({"mtp": 3}) == ("mtp", 1, True)


def test_cost_model_tells_a_further_generation_from_a_further_draft_row() -> None:
    """Measured on the demo model (forward_batch, medians): one row 2.03 ms, each further row
    of that sequence +0.65 ms; eight sequences of one row 6.73 ms (+0.67 ms per sequence), and
    each draft row added to a step of eight +0.4 ms. A prompt-lookup draft right 87% of the
    time pays in the step of eight (0.4 ms for 0.87 of a token worth 0.84 ms), which a model
    charging every row as a whole generation (0.67 ms) cannot see."""
    cm = CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=1)
    for _ in range(20):
        cm.observe_step(1, 0.00203)
        cm.observe_step(2, 0.00268)
        cm.observe_step(8, 0.00673, seqs=8)
        cm.observe_step(10, 0.00753, seqs=8)
        cm.observe_draft("lookup-3", 1, 0.00005)
        cm.observe_proposal("lookup-3", 1, 1)
    assert cm.t_row == pytest.approx(0.00065)
    assert cm.t_seq == pytest.approx(0.0047 / 7, rel=1e-6)
    assert cm.t_wide == pytest.approx(0.0004, rel=1e-6)
    assert cm.step_cost(9, 8) == pytest.approx(0.00713, rel=1e-6)
    assert cm.speedup("lookup-3", 1, others=7, other_seqs=7) > 1.03
    assert cm.choose({"lookup-3": 1}, others=7, other_seqs=7)[:2] == ("lookup-3", 1)
    # the draft row charged as a whole further generation (as before): it does not pay
    e = cm.expected("lookup-3", 1)
    as_a_generation = cm.step_cost(9, 9) + cm.draft_seconds("lookup-3", 1)
    assert (7 + e) * cm.step_cost(8, 8) / (8 * as_a_generation) < 1.03


def test_cost_model_reads_through_the_long_tail_of_step_times() -> None:
    """Step times on a busy 2-vCPU guest have a long right tail (the GIL, the guest's
    scheduler): here every fifth step takes twice its time. Measured on the demo model
    (medians): one row 1.78 ms, three rows 2.49 ms; eight sequences 5.40 ms, with eight
    draft rows 8.10 ms. Averages of raw times, and of what the earlier estimates left of them,
    put a draft row in the step of eight at 0.55-1.55 ms (truth 0.34) and drafting stayed off
    where forcing it was 25% faster; the medians give the costs, and a lookup draft right 90%
    of the time is taken in the step of eight."""
    cm = CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=2)
    shapes = [(1, 1, 0.00178), (3, 1, 0.00249), (8, 8, 0.00540), (16, 8, 0.00810)]
    for i in range(60):
        for rows, seqs, t in shapes:
            cm.observe_step(rows, t * (2.0 if i % 5 == 4 else 1.0), seqs=seqs)
        cm.observe_draft("lookup-3", 1, 0.00002)
        cm.observe_proposal("lookup-3", 2, 2 if i % 10 else 1)
    assert cm.t1 == pytest.approx(0.00178)
    assert cm.t_row == pytest.approx(0.000355)
    assert cm.t_wide == pytest.approx(0.0027 / 8)
    assert cm.step_cost(8, 8) == pytest.approx(0.0054)
    assert cm.step_cost(10, 8) == pytest.approx(0.0054 + 2 * 0.0027 / 8)
    assert cm.choose({"lookup-3": 2}, others=7, other_seqs=7)[:2] == ("lookup-3", 2)


def test_cost_model_keeps_probing_batched_steps_until_their_draft_cost_is_measured() -> None:
    """Recorded on eight streams of the demo model: the first batched steps with draft rows
    ran slow (one draft row +1.1 ms, nine +8.8 ms: first runs of their shapes), so a draft
    row looked like ~1 ms and not even an always-right draft would pay; probes were skipped
    in steps that wide and the guess stayed (drafting off, 1180 tok/s where it runs at
    1370-1530). Until ``_TRUST`` such steps are measured the probes of cheap drafts go on;
    theirs (+0.3 ms a row) bring the estimate down and drafting on."""
    cm = CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=2, probe_interval=4)
    for _ in range(16):
        cm.observe_step(1, 0.0018)
        cm.observe_step(3, 0.0025)
        cm.observe_step(8, 0.0050, seqs=8)
        cm.observe_draft("lookup-3", 1, 0.00002)
        cm.observe_proposal("lookup-3", 2, 2)
    for rows, t in ((9, 0.0061), (10, 0.0064), (17, 0.01375)):
        cm.observe_step(rows, t, seqs=8)
    assert cm.t_wide is not None and cm.t_wide > 0.0009
    assert cm.speedup("lookup-3", 2, others=7, other_seqs=7) < 1.0
    picks = [cm.choose({"lookup-3": 2}, others=7, other_seqs=7) for _ in range(4)]
    assert ("lookup-3", 1, True) in picks  # a probe, though the guess says no
    # not for a draft that is costly to make (an MTP head's catch-up holds up the other seven)
    cm.observe_draft("mtp", 1, 0.001)
    assert not cm._could_pay("mtp", 7, 7) and cm._could_pay("lookup-3", 7, 7)
    for _ in range(8):  # what the probes measure
        cm.observe_step(9, 0.0053, seqs=8)
    assert cm.t_wide == pytest.approx(0.0003, rel=0.1)
    assert cm.choose({"lookup-3": 2}, others=7, other_seqs=7)[:2] == ("lookup-3", 2)


def test_cost_model_forgets_step_shapes_it_no_longer_sees() -> None:
    """A shape not measured for ``_AGE`` observations is dropped: its times no longer say
    what the machine does now (e.g. the kernels' first calls, or another load on the host)."""
    from runtime.speculative.cost import _AGE

    cm = CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=2)
    cm.observe_step(1, 0.030)
    cm.observe_step(2, 0.031)
    for _ in range(_AGE + 1):
        cm.observe_step(3, 0.0025)
    assert set(cm._cells) == {(1, 3)}  # the one-row and two-row times of 30 ms are gone
    cm.observe_step(1, 0.0018)
    assert (cm.t1, cm.t_row) == (pytest.approx(0.0018), pytest.approx(0.00035))


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # per position: 1 + a1 + a1 a2 + a1 a2 a3 (the last value repeats)
    assert expected_tokens([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def _timed(cm: CostModel, t1: float = 0.0065, t_row: float = 0.0013) -> CostModel:
    for _ in range(3):
        cm.observe_step(1, t1)
        cm.observe_step(3, t1 + 2 * t_row)
    return cm


def test_cost_model_acceptance_per_position_sets_k() -> None:
    """An MTP head whose first draft (from real hidden states) matches 85% of the time but
    whose chained drafts rarely do: one draft pays, more do not. A single pooled acceptance
    (old model: 0.6 over all drafts) would pick k = 2..3."""
    cm = _timed(CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=4))
    cm.observe_draft_parts("mtp", 0.0015, 2, 0.0030)
    rng = np.random.default_rng(0)
    for _ in range(200):
        if rng.random() < 0.85:
            cm.observe_proposal("mtp", 3, 1 + int(rng.random() < 0.2))
        else:
            cm.observe_proposal("mtp", 3, 0)
    assert cm.acceptance("mtp", 1) > 0.75
    assert cm.acceptance("mtp", 2) < 0.35
    assert cm.draft_seconds("mtp", 3) == pytest.approx(0.0015 + 2 * 0.0015)
    k, s = cm.best("mtp")
    assert k == 1 and s > 1.1
    assert cm.expected("mtp", 1) == pytest.approx(1 + cm.acceptance("mtp", 1))


def test_cost_model_chooses_best_rate_across_sources() -> None:
    """Per round: a 3-gram lookup match (almost always right, free) beats the MTP head; a
    1-gram match that is mostly wrong loses to it; nothing paying gives a plain step, and a
    probe once the gap is up."""
    cm = _timed(CostModel(top_k=4, n_experts=32, moe_layers=5, max_k=4, probe_interval=4))
    cm.observe_draft_parts("mtp", 0.0015, 1, 0.0015)
    cm.observe_draft("lookup", 1, 0.00005)
    for _ in range(40):
        cm.observe_proposal("mtp", 2, 1)
        cm.observe_proposal("lookup-3", 4, 4)
        cm.observe_proposal("lookup-1", 1, 0)
    assert cm.choose({"mtp": 4, "lookup-3": 4}) == ("lookup-3", 4, False)
    assert cm.choose({"mtp": 4, "lookup-3": 2}) == ("lookup-3", 2, False)
    assert cm.choose({"mtp": 4, "lookup-1": 4}) == ("mtp", 1, False)
    # the head stops matching: lookup-1 and mtp are both off, plain steps, then one probe
    for _ in range(40):
        cm.observe_proposal("mtp", 1, 0)
    picks = [cm.choose({"mtp": 4, "lookup-1": 4}) for _ in range(4)]
    assert picks[:3] == [(None, 0, False)] * 3
    assert picks[3][1:] == (1, True)


def test_mtp_draft_cost_split_first_and_chained(models: dict) -> None:
    """A fixed mtp:3 run teaches the cost model the head's first-draft and chained-draft
    seconds separately (both measured, both > 0)."""
    run = _speculative(models["demo"], _prompts(2)[1], 24, "mtp:3")
    assert run.decoder is not None
    cost = run.decoder.cost
    assert cost.draft_cost["mtp"] > 0 and cost.chain_cost["mtp"] > 0
    assert cost.draft_seconds("mtp", 3) == pytest.approx(
        cost.draft_cost["mtp"] + 2 * cost.chain_cost["mtp"]
    )


def test_auto_combines_lookup_and_mtp_in_one_generation(models: dict) -> None:
    """With a cost model that has seen 3-gram lookup matches and the MTP head pay, auto drafts
    from prompt lookup where a 3-gram matches (the repeated prompt) and from the head elsewhere,
    within one generation; greedy output and cache stay exactly plain decoding's."""
    model = models["demo"]

    class SeededTimings(CostModel):
        """Step and draft timings stay those seeded below: what a loaded CI machine measures
        mid-run must not decide whether drafts pay (acceptance is still learned live)."""

        frozen = False

        def observe_step(self, *args: Any, **kw: Any) -> None:
            if not self.frozen:
                super().observe_step(*args, **kw)

        def observe_draft(self, *args: Any, **kw: Any) -> None:
            if not self.frozen:
                super().observe_draft(*args, **kw)

        def observe_draft_parts(self, *args: Any, **kw: Any) -> None:
            if not self.frozen:
                super().observe_draft_parts(*args, **kw)

    cm = _timed(SeededTimings(top_k=model.config.num_experts_per_tok, n_experts=32, moe_layers=5))
    cm.observe_draft_parts("mtp", 0.0015, 1, 0.0015)
    cm.frozen = True
    for _ in range(30):
        cm.observe_proposal("mtp", 2, 1)
        cm.observe_proposal("lookup-3", 4, 4)
    rng = np.random.default_rng(3)
    head = [int(x) for x in rng.integers(3, 999, size=10)]
    prompt = head * 3
    ref = _plain(model, prompt, N_TOKENS)
    got = _speculative(model, prompt, N_TOKENS, "auto", cost=cm)
    assert got.tokens == ref.tokens
    assert _same_cache(got.cache, ref.cache)
    assert got.decoder is not None
    assert got.decoder.stats.proposed["lookup"] > 0 and got.decoder.stats.proposed["mtp"] > 0


# ----------------------------------------------------------------------------- drafts, options


def test_lookup_draft() -> None:
    assert lookup_draft([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # "2 3" seen before
    assert lookup_draft([5, 1, 2, 7, 1, 2], 2) == [7, 1]
    assert lookup_draft([1, 2, 3], 2) == []
    assert lookup_draft([4, 4], 3) == [4]
    assert lookup_draft([1, 5, 1, 6, 1], 1) == [6]  # the latest match wins
    assert lookup_match([1, 2, 3, 4, 9, 2, 3], 3) == ([4, 9, 2], 2)  # the n-gram length too
    assert lookup_match([7, 1, 2, 3, 8, 1, 2, 3], 2) == ([8, 1], 3)
    assert lookup_match([1, 2, 3], 2) == ([], 0)
    assert lookup_match(np.array([3, 3, 3, 3]), 5) == ([3], 3)  # overlapping occurrences


def _lookup_by_windows(t: list[int], k: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """The prompt lookup by numpy windows (how ``lookup_match`` searched before its scan)."""
    a = np.asarray(t, dtype=np.int64)
    for n in range(min(max_ngram, a.size - 1), 0, -1):
        win = np.lib.stride_tricks.sliding_window_view(a[: a.size - 1], n)
        hit = np.flatnonzero((win == a[a.size - n :]).all(axis=1))
        if hit.size:
            i = int(hit[-1])
            return [int(x) for x in a[i + n : i + n + k]], n
    return [], 0


def test_lookup_match_equals_the_window_search() -> None:
    """The scan finds what a search over every window finds: the longest suffix n-gram, its
    latest earlier occurrence and what followed it, on histories with many repeats."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        t = [int(x) for x in rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(2, 40)))]
        for k, m in ((1, 3), (4, 3), (7, 1), (3, 5)):
            assert lookup_match(t, k, max_ngram=m) == _lookup_by_windows(t, k, m), (t, k, m)


def test_draft_policy_parse() -> None:
    assert str(DraftPolicy.parse("auto")) == "auto"
    assert DraftPolicy.parse(None) == DraftPolicy()
    assert DraftPolicy.parse("off").mode == "off"
    assert DraftPolicy.parse(0).mode == "off"
    assert DraftPolicy.parse(3) == DraftPolicy("fixed", 3, "any")
    assert DraftPolicy.parse("lookup:2") == DraftPolicy("fixed", 2, "lookup")
    assert str(DraftPolicy.parse("mtp")) == "mtp"
    for bad in ("fast", "-1", "99", "mtp:x"):
        with pytest.raises(ModelError):
            DraftPolicy.parse(bad)
    assert colibri.EngineOptions(draft=2).draft == "2"
    assert colibri.EngineOptions(draft="LOOKUP:3").draft == "lookup:3"
    with pytest.raises(ModelError):
        colibri.EngineOptions(draft="sometimes")


def test_draft_env_var_and_cli_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from colibri._config import env_defaults
    from colibri.cli import main

    monkeypatch.setenv("COLI_DRAFT", "lookup:2")
    assert env_defaults()["draft"] == "lookup:2"
    monkeypatch.delenv("COLI_DRAFT")
    res = CliRunner().invoke(
        main, ["run", "hello", "--raw", "-n", "6", "--draft", "lookup:2", "--stats"]
    )
    assert res.exit_code == 0, res.output
    stats = json.loads(res.output.strip().splitlines()[-1])
    assert stats["speculative"]["policy"] == "lookup:2"
    res = CliRunner().invoke(main, ["run", "hello", "--draft", "often"])
    assert res.exit_code != 0
    assert "draft" in res.output


def test_stats_report_speculative_telemetry() -> None:
    _, st = _engine_runs({"draft": "3"}, _prompts(2), ["3"], n=12)
    spec = st["speculative"]
    assert spec["policy"] == "3"
    for key in ("proposed", "accepted", "acceptance", "tokens_per_forward", "estimated_speedup"):
        assert key in spec
    assert spec["proposed"]["mtp"] > 0
    assert spec["tokens_per_forward"] >= 1.0
    assert {"grammar", "mtp", "lookup"} <= set(spec["cost_model"]["sources"])
    assert len(spec["cost_model"]["sources"]["mtp"]["acceptance_by_position"]) == 4


def test_a_pinned_source_drafts_under_seeded_sampling() -> None:
    """draft="mtp" (or "lookup") with a seed drafted nothing at all, as if off: its adaptive
    schedule follows timings, which a seed's output must not depend on. It drafts a fixed
    SEEDED_K a round there: reproducible, the same as asking for mtp:SEEDED_K."""
    from runtime.speculative.policy import SEEDED_K

    prompt = _prompts(2)[0]

    async def main() -> list[tuple[list[int], int]]:
        async with colibri.Engine.open(DEMO, options=colibri.EngineOptions(learn=False)) as eng:
            out = []
            for draft in ("mtp", "mtp", f"mtp:{SEEDED_K}"):
                before = eng.stats()["speculative"]["proposed"]["mtp"]
                toks = [
                    ev.token_id
                    async for ev in eng.generate(
                        prompt, max_new_tokens=24, temperature=0.8, seed=5, draft=draft
                    )
                    if isinstance(ev, TokenEvent)
                ]
                out.append((toks, eng.stats()["speculative"]["proposed"]["mtp"] - before))
            return out

    (a, na), (b, nb), (c, nc) = anyio.run(main)
    assert na > 0 and a == b == c and na == nb == nc
