"""Batch invariance: a token's rows do not depend on the shape of the call that computed them.

A token's cached KV (MLA latent and rope key, or GQA keys and values), DSA index keys, final
hidden state and logits must be bit-identical whether it is computed alone (one-token decode),
in a prefill chunk of any size, in a speculative verify block, or in a batched step beside other
sequences. That is what makes
greedy output independent of ``--draft``, ``--prefill-chunk`` and concurrent batching
(docs/speculative.md, docs/tuning.md). The prompts are long random-id sequences: flat logits and
many exact-0.0 DSA scores put near-ties and exact ties everywhere, so any order dependence
shows up as a flipped top-k or token.

Models: the bundled trained demo model (int4), the tiny random test model (int4, index_topk 16)
and the transformers oracle checkpoints converted to f32 (glm_moe_dsa with DSA, deepseek_v3
plain MLA, glm4_moe grouped-query attention: its cache rows are K and V). Exact equality on the
machine the suite runs on; no tolerance.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import anyio
import numpy as np
import numpy.typing as npt
import pytest
from _demo import TINY

import colibri
from colibri import Engine, EngineOptions
from colibri._config import default_model_path
from colibri._engine import TokenEvent
from runtime.compute import ExpertCompute
from runtime.context import StepContext
from runtime.kv import KVCache
from runtime.models import MLAMoEModel, load_model
from storage.container import Container
from storage.errors import ModelError

DEMO = default_model_path()
I64 = npt.NDArray[np.int64]


class Rows:
    """Everything a forward produced for one sequence, in token order."""

    def __init__(self, cache: KVCache, logits: np.ndarray, hidden: np.ndarray) -> None:
        self.cache, self.logits, self.hidden = cache, logits, hidden


def _prompt(seed: int, vocab: int, lo: int, hi: int) -> I64:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(lo, hi))
    return rng.integers(3, vocab, size=n).astype(np.int64)


def _schedule(
    m: MLAMoEModel, ids: I64, sizes: Sequence[int], ctx: StepContext | None = None
) -> Rows:
    """Forward ``ids`` in consecutive calls of ``sizes`` tokens (the last size repeats)."""
    cache = m.new_cache()
    logits, hidden = [], []
    a, k = 0, 0
    while a < ids.size:
        n = sizes[min(k, len(sizes) - 1)]
        out = (
            m.forward(ids[a : a + n], cache)
            if ctx is None
            else m.forward(ids[a : a + n], cache, ctx=ctx)
        )
        logits.append(out.logits)
        hidden.append(out.hidden)
        a, k = a + n, k + 1
    return Rows(cache, np.concatenate(logits), np.concatenate(hidden))


def assert_rows_equal(a: Rows, b: Rows, n: int, what: str) -> None:
    """Bit equality of every per-token row: KV and index keys of every layer, hidden, logits."""
    for layer in range(a.cache.n_layers):
        for name in ("latent", "k_rope"):
            x = getattr(a.cache, name)(layer, n)
            y = getattr(b.cache, name)(layer, n)
            bad = np.flatnonzero((x != y).any(axis=1))
            assert bad.size == 0, f"{what}: layer {layer} {name} rows {bad[:5]} differ"
        if layer in a.cache.indexed_layers:
            x, y = a.cache.index_keys(layer, n), b.cache.index_keys(layer, n)
            bad = np.flatnonzero((x != y).any(axis=1))
            assert bad.size == 0, f"{what}: layer {layer} index key rows {bad[:5]} differ"
    for name in ("hidden", "logits"):
        x, y = getattr(a, name)[:n], getattr(b, name)[:n]
        bad = np.flatnonzero((x != y).any(axis=1))
        assert bad.size == 0, f"{what}: {name} rows {bad[:5]} differ"


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def oracle_f32(oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from storage.convert import ConvertOptions, convert

    f32 = ConvertOptions(experts="f32", dense="f32", io="f32", mtp="f32")
    root = tmp_path_factory.mktemp("inv-oracle")
    out = {}
    for name in ("glm_moe_dsa", "deepseek_v3", "glm4_moe"):
        convert(oracle_dir / name, root / name, f32)
        out[name] = root / name
    return out


MODEL_NAMES = ("demo", "tiny", "oracle-glm_moe_dsa", "oracle-deepseek_v3", "oracle-glm4_moe")


@pytest.fixture(scope="module")
def model_of(request: pytest.FixtureRequest) -> Iterator[Callable[[str], MLAMoEModel]]:
    made: dict[str, MLAMoEModel] = {}

    def get(name: str) -> MLAMoEModel:
        if name not in made:
            if name.startswith("oracle-"):
                paths = request.getfixturevalue("oracle_f32")
                path = paths[name.removeprefix("oracle-")]
            else:
                path = DEMO if name == "demo" else TINY
            made[name] = load_model(Container.open(path))
        return made[name]

    yield get


def _limits(m: MLAMoEModel) -> tuple[int, int]:
    """Prompt lengths: 150-700 tokens, within the model's positions."""
    hi = min(700, m.config.max_position_embeddings - 16)
    return 150, hi


# ----------------------------------------------------------------------------- rows


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_rows_are_bit_identical_for_every_chunk_size(
    name: str, model_of: Callable[[str], MLAMoEModel]
) -> None:
    m = model_of(name)
    lo, hi = _limits(m)
    vocab = m.config.vocab_size
    for k in range(2):
        ids = _prompt(100 + k, vocab, lo, hi)
        whole = _schedule(m, ids, [ids.size])
        # token-by-token on the first prompt only (the slowest schedule)
        for chunk in (1, 7, 64, 512) if k == 0 else (7, 64, 512):
            got = _schedule(m, ids, [chunk])
            assert_rows_equal(whole, got, ids.size, f"{name} T={ids.size} chunk {chunk}")
        # uneven chunks, as a prefill resumed after a cancelled turn would run
        got = _schedule(m, ids, [37, 1, 200, 3, 64])
        assert_rows_equal(whole, got, ids.size, f"{name} uneven chunks")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_verify_blocks_equal_one_token_decode(
    name: str, model_of: Callable[[str], MLAMoEModel]
) -> None:
    """A speculative verify block of k + 1 rows computes what k + 1 decode steps compute."""
    m = model_of(name)
    lo, hi = _limits(m)
    ids = _prompt(7, m.config.vocab_size, lo, hi)
    tail = 20
    decode = _schedule(m, ids, [ids.size - tail, 1])
    for k in (1, 2, 3, 4):
        got = _schedule(m, ids, [ids.size - tail, k + 1])
        assert_rows_equal(decode, got, ids.size, f"{name} verify k={k}")


@pytest.mark.parametrize("name", ["demo", "tiny"])  # int4 containers (the oracles here are f32)
def test_fast_int8_rows_are_bit_identical_for_every_chunk_size(
    name: str, model_of: Callable[[str], MLAMoEModel]
) -> None:
    """The opt-in lossy kernels are batch-invariant too: chunked prefill and verify blocks give
    the rows of one-token decode, bit for bit (and not the exact kernels' rows)."""
    m = model_of(name)
    ctx = StepContext(compute=ExpertCompute(kernels="fast-int8"))
    lo, hi = _limits(m)
    ids = _prompt(11, m.config.vocab_size, lo, hi)
    whole = _schedule(m, ids, [ids.size], ctx)
    for sizes in ([1], [64], [37, 1, 200, 3, 64]):
        assert_rows_equal(whole, _schedule(m, ids, sizes, ctx), ids.size, f"{name} {sizes}")
    assert not np.array_equal(whole.logits, _schedule(m, ids, [ids.size]).logits)


def _pooled(m: MLAMoEModel, events: list[tuple[str, int, bytes]] | None = None) -> StepContext:
    """Two threads that split what they can from a small size on: the sequences of a batched
    decode step of up to 8 rows in groups, one per thread (just above the size where the
    model runs a batch's attention per sequence instead), and the matmuls' rows or
    features."""
    d = m.dims
    small = 8 * d.num_attention_heads * d.kv_lora_rank * 4 + 1
    ctx = StepContext(compute=ExpertCompute(2, parallel_min_macs=small))
    if events is None:
        return ctx
    caller = threading.current_thread()

    def seen(ev: str, layer: int, arr: npt.NDArray[np.generic]) -> None:
        # observers (telemetry, learned pinning) may keep unlocked state: called on the
        # thread that runs the step, never on a pool worker
        assert threading.current_thread() is caller, f"{ev} of layer {layer} on a worker"
        events.append((ev, layer, arr.tobytes()))

    return ctx.observing(seen)


@pytest.mark.parametrize(
    ("name", "pool"),
    [
        ("demo", False),
        ("tiny", False),
        ("oracle-glm_moe_dsa", False),
        ("oracle-glm4_moe", False),
        ("demo", True),
        ("oracle-glm_moe_dsa", True),
        ("oracle-deepseek_v3", True),
    ],
)
def test_batched_steps_equal_each_sequence_alone(
    name: str, pool: bool, model_of: Callable[[str], MLAMoEModel]
) -> None:
    """``forward_batch`` over 1..8 sequences, each advancing by its own step sizes (prefill
    chunks, verify blocks and decode rows mixed in one step), equals each sequence alone; on a
    pool of two threads too (a step's sequences then split in groups over the threads)."""
    m = model_of(name)
    ctx = _pooled(m) if pool else StepContext()
    lo, hi = _limits(m)
    vocab = m.config.vocab_size
    rng = np.random.default_rng(5)
    seqs = [_prompt(300 + j, vocab, lo // 2, hi // 2) for j in range(8)]
    solo = [_schedule(m, s, [s.size]) for s in seqs]
    for b in (1, 2, 3, 5, 8):
        group = seqs[:b]
        caches = [m.new_cache() for _ in group]
        logits: list[list[np.ndarray]] = [[] for _ in group]
        hidden: list[list[np.ndarray]] = [[] for _ in group]
        pos = [0] * b
        while any(p < s.size for p, s in zip(pos, group, strict=True)):
            live = [j for j in range(b) if pos[j] < group[j].size]
            steps = {j: int(rng.choice([1, 1, 2, 4, 5, 16, 64])) for j in live}
            outs = m.forward_batch(
                [group[j][pos[j] : pos[j] + steps[j]] for j in live],
                [caches[j] for j in live],
                ctx=ctx,
            )
            for j, out in zip(live, outs, strict=True):
                logits[j].append(out.logits)
                hidden[j].append(out.hidden)
                pos[j] += steps[j]
        for j in range(b):
            got = Rows(caches[j], np.concatenate(logits[j]), np.concatenate(hidden[j]))
            assert_rows_equal(solo[j], got, group[j].size, f"{name} batch of {b}, sequence {j}")


def test_last_only_per_sequence(model_of: Callable[[str], MLAMoEModel]) -> None:
    """A prefill chunk beside decode rows (``last_only`` per sequence): the chunk gets its last
    row's logits, the others every row's, each the bits of its own call; flags that do not
    match the sequences are refused."""
    m = model_of("demo")
    vocab = m.config.vocab_size
    seqs = [_prompt(500 + j, vocab, 30, 60) for j in range(3)]
    alone, caches = [], []
    for j, s in enumerate(seqs):
        a, b = m.new_cache(), m.new_cache()
        m.forward(s[:-3], a)
        m.forward(s[:-3], b)
        alone.append(m.forward(s[-3:], a, last_only=j == 1))
        caches.append(b)
    outs = m.forward_batch([s[-3:] for s in seqs], caches, last_only=[False, True, False])
    for j, (x, y) in enumerate(zip(alone, outs, strict=True)):
        assert x.logits.shape == y.logits.shape == ((1 if j == 1 else 3), vocab)
        assert np.array_equal(x.logits, y.logits) and np.array_equal(x.hidden, y.hidden)
    with pytest.raises(ModelError, match="last_only"):
        m.forward_batch([seqs[0][:2]], [m.new_cache()], last_only=[True, False])


@pytest.mark.parametrize("name", ["demo", "oracle-glm_moe_dsa"])
def test_pooled_decode_steps_observe_what_one_thread_observes(
    name: str, model_of: Callable[[str], MLAMoEModel]
) -> None:
    """Decode steps of 6 sequences on a pool of two threads (the attention half in two groups of
    three) report the same routing and DSA events, in the same order, with the same values,
    as on one thread, and on the calling thread: telemetry and learned pinning do not depend
    on the thread count."""
    m = model_of(name)
    vocab = m.config.vocab_size
    seqs = [_prompt(400 + j, vocab, 40, 120) for j in range(6)]
    runs: list[list[tuple[str, int, bytes]]] = []
    for pool in (False, True):
        events: list[tuple[str, int, bytes]] = []
        ctx = (
            _pooled(m, events)
            if pool
            else StepContext().observing(
                lambda ev, layer, arr, got=events: got.append((ev, layer, arr.tobytes()))
            )
        )
        caches = [m.new_cache() for _ in seqs]
        for s, c in zip(seqs, caches, strict=True):
            m.forward(s, c)  # the prompts, unobserved
        rng = np.random.default_rng(9)
        for _ in range(3):
            m.forward_batch([rng.integers(3, vocab, 1) for _ in seqs], caches, ctx=ctx)
        runs.append(events)
    kinds = {ev for ev, _, _ in runs[0]}
    assert "route" in kinds and (name == "demo" or "dsa_select" in kinds), kinds
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------- greedy tokens

N_PROMPTS = 40
NEW = 8


def _demo_prompts() -> list[list[int]]:
    vocab = Container.open(DEMO).arch.vocab_size
    return [[int(t) for t in _prompt(1000 + k, vocab, 150, 700)] for k in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def greedy_off() -> list[list[int]]:
    """The reference: --draft off, the planned prefill chunk, one generation at a time."""
    with colibri.open_model(DEMO, draft="off", learn=False) as m:
        return [m.generate(p, max_new_tokens=NEW) for p in _demo_prompts()]


@pytest.mark.parametrize("draft", ["auto", "mtp:3", "lookup:3"])
def test_greedy_tokens_identical_for_every_draft_mode(
    draft: str, greedy_off: list[list[int]], private_home: None
) -> None:
    with colibri.open_model(DEMO, draft=draft, learn=False) as m:
        got = [m.generate(p, max_new_tokens=NEW) for p in _demo_prompts()]
        spec = m.stats()["speculative"]
    assert spec["verify_steps"] > 0, spec  # drafts really were verified
    bad = [k for k, (a, b) in enumerate(zip(got, greedy_off, strict=True)) if a != b]
    assert not bad, f"--draft {draft} changed the greedy tokens of prompts {bad}"


@pytest.mark.parametrize("chunk", [64])
def test_greedy_tokens_identical_for_every_prefill_chunk(
    chunk: int, greedy_off: list[list[int]], private_home: None
) -> None:
    """(Rows for chunks 1, 7, 64 and 512 are compared bit for bit above; this is the end to end
    check through the engine's planned chunking.)"""
    prompts = _demo_prompts()
    with colibri.open_model(DEMO, draft="off", prefill_chunk=chunk, learn=False) as m:
        got = [m.generate(p, max_new_tokens=NEW) for p in prompts]
    bad = [k for k, (a, b) in enumerate(zip(got, greedy_off, strict=True)) if a != b]
    assert not bad, f"--prefill-chunk {chunk} changed the greedy tokens of prompts {bad}"


def test_greedy_tokens_identical_under_concurrent_batching(
    greedy_off: list[list[int]], private_home: None
) -> None:
    """8 generations at a time (default draft auto, as `coli serve` runs), each starting a
    little after the one before: each one's greedy tokens equal its solo --draft off run while
    they share batched steps, and while prompts ride in the others' decode steps."""
    prompts = _demo_prompts()
    got: list[list[int]] = [[] for _ in prompts]
    batched = mixed = 0

    async def main() -> None:
        nonlocal batched, mixed
        opts = EngineOptions(model=DEMO, learn=False, max_batch=8)
        async with Engine.open(options=opts) as engine:

            async def one(k: int) -> None:
                await anyio.sleep(0.004 * (k % 8))
                async for ev in engine.generate(prompts[k], max_new_tokens=NEW):
                    if isinstance(ev, TokenEvent):
                        got[k].append(ev.token_id)

            for wave in range(0, len(prompts), 8):
                async with anyio.create_task_group() as tg:
                    for k in range(wave, min(wave + 8, len(prompts))):
                        tg.start_soon(one, k)
            batched = int(engine.stats()["decode_batched_sequences"])
            mixed = int(engine.stats()["mixed_steps"])

    anyio.run(main)
    assert batched > 0  # steps really were shared
    assert mixed > 0  # and prompts' chunks rode in decode steps
    bad = [k for k, (a, b) in enumerate(zip(got, greedy_off, strict=True)) if a != b]
    assert not bad, f"concurrent batching changed the greedy tokens of prompts {bad}"
