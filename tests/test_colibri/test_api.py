"""The public Python API: colibri.open_model / SyncModel, colibri.Engine (asyncio and trio), the
error tree, and the tokenizer helpers the CLI streams text with. Real files, real threads."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri import DoneEvent, Engine, EngineOptions, TokenEvent
from colibri.tokenizer import ChatTokenizer
from runtime.models import Model, load_model
from runtime.sampling import log_softmax
from storage.container import Container
from storage.errors import ColibriError, ConfigError, ContainerError, ModelError

DEMO = demo_model()
PROMPT = [5, 17, 99, 3, 250, 42]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # `.coli_usage` goes here rather than into ~/.cache.
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def model(state_dir: Path) -> Iterator[colibri.SyncModel]:
    with colibri.open_model(DEMO, state_dir=state_dir) as m:
        yield m


@pytest.fixture(scope="module")
def reference_model() -> Model:
    """The same container loaded directly with the runtime, no engine in between."""
    return load_model(Container.open(DEMO))


def greedy_by_recompute(model: colibri.SyncModel, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation built from full-context forward() calls only (no KV cache)."""
    eos = set(model.container.eos_token_ids)
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(model.forward(ids)[-1]))
        out.append(tok)
        if tok in eos:
            break
        ids.append(tok)
    return out


# ----------------------------------------------------------------------------- sync facade


def test_open_model_without_path_uses_the_bundled_demo(state_dir: Path) -> None:
    bundled = colibri.default_model_path()
    assert bundled.is_dir() and (bundled / "config.json").is_file()
    with colibri.open_model(state_dir=state_dir) as model:
        assert model.container.path.resolve() == bundled.resolve()
        assert model.container.arch.model_type == "glm_moe_dsa"
        assert model.container.arch.num_mtp_layers == 1
        assert isinstance(model.engine, Engine)
        assert len(model.generate([5, 6, 7], max_new_tokens=4)) >= 1


def test_forward_is_bit_identical_to_the_runtime_model(
    model: colibri.SyncModel, reference_model: Model
) -> None:
    ids = np.array(PROMPT, dtype=np.int64)
    logits = model.forward(PROMPT)
    vocab = model.container.arch.vocab_size
    assert logits.dtype == np.float32
    assert logits.shape == (len(PROMPT), vocab)
    # The engine runs absorbed attention everywhere (batch-invariant; EngineOptions.fast_prefill
    # switches to the auto choice), as a call without a StepContext does.
    ref = reference_model.forward(ids, reference_model.new_cache()).logits
    np.testing.assert_array_equal(logits, ref)
    # a fresh context every call: same ids, same bits
    np.testing.assert_array_equal(model.forward(ids), logits)
    # numpy arrays and lists are accepted alike
    np.testing.assert_array_equal(model.forward(np.array(PROMPT, dtype=np.int32)), logits)


def test_generate_returns_n_ints_or_stops_at_eos(model: colibri.SyncModel) -> None:
    n = 12
    out = model.generate(PROMPT, max_new_tokens=n)
    assert isinstance(out, list) and all(type(t) is int for t in out)
    assert 1 <= len(out) <= n
    vocab = model.container.arch.vocab_size
    assert all(0 <= t < vocab for t in out)
    eos = set(model.container.eos_token_ids)
    if len(out) < n:
        assert out[-1] in eos
    assert not eos & set(out[:-1])
    assert model.generate(PROMPT, max_new_tokens=0) == []


def test_greedy_generate_equals_argmax_chaining_of_forward(model: colibri.SyncModel) -> None:
    n = 10
    assert model.generate(PROMPT, max_new_tokens=n) == greedy_by_recompute(model, PROMPT, n)
    other = [1, 2, 3]
    assert model.generate(other, max_new_tokens=n) == greedy_by_recompute(model, other, n)


def test_stop_token_ids_override_eos(model: colibri.SyncModel) -> None:
    full = model.generate(PROMPT, max_new_tokens=8, stop_token_ids=[])
    assert len(full) == 8  # no stop ids: always the full length
    stop_at = full[2]
    first = full.index(stop_at)
    out = model.generate(PROMPT, max_new_tokens=8, stop_token_ids=[stop_at])
    assert out == full[: first + 1]


def test_seeded_sampling_is_reproducible_across_sessions(state_dir: Path) -> None:
    def session(seed: int) -> list[int]:
        with colibri.open_model(DEMO, state_dir=state_dir) as m:
            return m.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=seed)

    a = session(7)
    assert a == session(7)
    assert len(a) >= 1
    assert session(8) != a


def test_stats_counters_grow(model: colibri.SyncModel) -> None:
    before = model.stats()
    for key in ("forward_calls", "prompt_tokens", "generated_tokens", "compute_seconds"):
        assert key in before
    assert before["experts"]["mode"] in ("resident", "streaming")
    out = model.generate(PROMPT, max_new_tokens=4, stop_token_ids=[])
    after = model.stats()
    assert after["forward_calls"] >= before["forward_calls"] + 4
    assert (
        after["generated_tokens"]
        == before["generated_tokens"] + len(out)
        == (before["generated_tokens"] + 4)
    )
    assert after["prompt_tokens"] >= before["prompt_tokens"]
    assert after["compute_seconds"] > before["compute_seconds"]
    model.forward([1, 2])
    assert model.stats()["forward_calls"] == after["forward_calls"] + 1


def test_stats_count_work_once_and_when_done(tmp_path: Path) -> None:
    """Stats that ran ahead of the work: with calls queued for the compute thread,
    compute_seconds counted the queue wait too (4 concurrent generations: 2.2 s of compute in
    0.56 s of wall time); a cancelled prefill counted its steps, never its tokens; a forward
    (scoring a prompt) computed its tokens without counting them; lookahead_recall was 0.0
    before any prediction (hit_rate is None)."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 200, 480)]

    async def main() -> None:
        opts = EngineOptions(learn=False, max_batch=1, prefill_chunk=16, state_dir=tmp_path)
        async with Engine.open(DEMO, options=opts) as eng:
            before = eng.stats()
            t0 = anyio.current_time()

            async def one(k: int) -> None:
                async for _ in eng.generate([k + 5, 6, 7], max_new_tokens=24, stop_token_ids=[]):
                    pass

            async with anyio.create_task_group() as tg:
                for k in range(4):
                    tg.start_soon(one, k)
            wall = anyio.current_time() - t0
            spent = eng.stats()["compute_seconds"] - before["compute_seconds"]
            assert spent <= wall, (spent, wall)
            # a prefill cancelled part-way: its tokens are those its cache holds
            before = eng.stats()
            cache = eng.new_cache()

            async def long() -> None:
                async for _ in eng.generate(prompt, max_new_tokens=1, cache=cache):
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(long)
                while eng.stats()["prefill_steps"] - before["prefill_steps"] < 3:
                    await anyio.sleep(0.001)
                tg.cancel_scope.cancel()
            done = eng.stats()["prefill_tokens"] - before["prefill_tokens"]
            assert 0 < cache.length < len(prompt), cache.length
            assert done == cache.length
            before = eng.stats()
            await eng.forward(prompt[:100])
            assert eng.stats()["prefill_tokens"] - before["prefill_tokens"] == 100
        async with Engine.open(DEMO, ram_budget="20MiB", options=opts) as eng:
            experts = eng.stats()["experts"]
            assert experts["mode"] == "streaming"
            assert experts["hit_rate"] is None and experts["lookahead_recall"] is None

    anyio.run(main)


# ----------------------------------------------------------------------------- errors


def test_empty_token_list_is_an_error(model: colibri.SyncModel) -> None:
    with pytest.raises(ModelError, match="empty"):
        model.forward([])
    with pytest.raises(ModelError, match="empty"):
        model.generate([], max_new_tokens=4)
    with pytest.raises(ModelError, match="max_new_tokens"):
        model.generate(PROMPT, max_new_tokens=-1)
    with pytest.raises(ModelError, match="top_p"):
        model.generate(PROMPT, max_new_tokens=2, temperature=1.0, top_p=2.0)
    # the model still serves after a bad request
    assert len(model.generate(PROMPT, max_new_tokens=2, stop_token_ids=[])) == 2


@pytest.mark.parametrize(
    ("ids", "kw", "want"),
    [
        ([1.5, 2.0], {}, "must be integers, got float64"),
        ([True, False], {}, "must be integers, got bool"),
        ([True, 2], {}, "must be integers, got a bool"),  # ran as [1, 2]
        ([[1, 2], [3, 4]], {}, r"1-D sequence, got shape \(2, 2\)"),
        ("hello", {}, "encode text with the tokenizer"),
        (np.array([2**63], dtype=np.uint64), {}, "out of range"),
        (PROMPT, {"max_new_tokens": "3"}, "max_new_tokens must be an integer"),
        (PROMPT, {"max_new_tokens": True}, "max_new_tokens must be an integer"),
        (PROMPT, {"top_logprobs": -1}, "top_logprobs must be >= 0"),
        (PROMPT, {"grammar": "json"}, "grammar must be a GrammarSpec"),  # an AttributeError
        (PROMPT, {"stop_token_ids": [-5]}, "stop token ids must be in 0.."),
        (PROMPT, {"stop_token_ids": [10**6]}, "stop token ids must be in 0.."),
    ],
)
def test_bad_arguments_are_model_errors(
    model: colibri.SyncModel, ids: object, kw: dict[str, object], want: str
) -> None:
    """Token ids are integers in a 1-D sequence and counts are integers: anything else is a
    ModelError saying so, never a silent truncation (1.5 -> 1) or numpy's own error."""
    with pytest.raises(ModelError, match=want):
        model.generate(ids, **kw)  # type: ignore[arg-type]


def test_the_context_bounds_a_generation(model: colibri.SyncModel) -> None:
    """A prompt as long as the context is refused; a generation ends when prompt + output
    reach it (the server refuses such a request up front)."""
    ctx = model.engine.context_length
    assert ctx == model.container.config["max_position_embeddings"]
    with pytest.raises(ModelError, match=f"context is {ctx} tokens, but the prompt has {ctx}"):
        model.generate([5] * ctx, max_new_tokens=1)
    out = model.generate([5] * (ctx - 3), max_new_tokens=64, stop_token_ids=[])
    assert len(out) == 3


def test_missing_model_dir_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ContainerError) as info, colibri.open_model(missing):
        pass
    assert isinstance(info.value, ColibriError)
    assert str(missing) in str(info.value)
    assert "does not exist" in str(info.value)


def test_directory_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "out-00000.safetensors").write_bytes(b"")
    with pytest.raises(ContainerError) as info, colibri.open_model(tmp_path):
        pass
    assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_a_file_is_not_a_model_dir(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ContainerError, match="is not a directory"), colibri.open_model(f):
        pass


def test_unknown_option_is_rejected() -> None:
    with pytest.raises(ValueError, match="no_such_option"):
        EngineOptions(no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(ColibriError, match="size"):
        EngineOptions(ram_budget="lots")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "error", "want"),
    [
        ({"kv_reserve_tokens": -1}, ValueError, "kv_reserve_tokens"),
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"pin_fraction": 2.0}, ValueError, "pin_fraction"),
        ({"pin_min_selections": -3}, ValueError, "pin_min_selections"),
        ({"stripe_min_bytes": -1}, ValueError, "stripe_min_bytes"),
        ({"fast_prefill_rows": 0}, ValueError, "fast_prefill_rows"),
        ({"worker_threads": 0}, ValueError, "worker_threads"),
        ({"ram_budget": 0}, ColibriError, "positive size"),
        ({"ram_budget": -5}, ColibriError, "positive size"),
        ({"ram_budget": "0"}, ColibriError, "positive size"),
    ],
)
def test_out_of_range_options_are_refused(
    kw: dict[str, object], error: type[Exception], want: str
) -> None:
    with pytest.raises(error, match=want):
        EngineOptions(**kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- async engine


@pytest.mark.anyio
async def test_engine_open_streams_events(anyio_backend: str, state_dir: Path) -> None:
    opts = EngineOptions(model=DEMO, state_dir=state_dir)
    async with Engine.open(options=opts) as engine:
        assert engine.container.path.resolve() == DEMO.resolve()
        logits = await engine.forward(PROMPT)
        assert logits.dtype == np.float32 and logits.shape[0] == len(PROMPT)
        events = [ev async for ev in engine.generate(PROMPT, max_new_tokens=6)]
    tokens = [ev for ev in events if isinstance(ev, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert all(isinstance(ev, TokenEvent) for ev in events[:-1])
    assert [ev.index for ev in tokens] == list(range(len(tokens)))
    assert done.tokens == [ev.token_id for ev in tokens]
    assert done.reason in ("length", "stop")
    assert (done.reason == "length") == (len(tokens) == 6)
    assert done.stats["tokens"] == len(tokens)
    # greedy: the first token is the argmax of the prompt's last row, with its log-probability
    first = tokens[0]
    assert first.token_id == int(np.argmax(logits[-1]))
    assert first.logprob == pytest.approx(float(log_softmax(logits[-1])[first.token_id]))
    assert all(ev.logprob <= 0 for ev in tokens)


@pytest.mark.anyio
async def test_engine_does_not_block_the_event_loop(anyio_backend: str, state_dir: Path) -> None:
    # A long prompt makes the prefill compute of noticeable length (~80 ms here; 256 tokens
    # took ~35 ms, too close to the three ticks asked for): a loop blocked by model math could
    # tick at most once during it. (500 + 8 tokens fit the demo model's 512 positions.)
    long_prompt = [int(x) for x in np.arange(500) % 900 + 5]
    ticks_in_prefill = 0
    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            await anyio.sleep(0.01)
            ticks += 1

    async with Engine.open(options=EngineOptions(model=DEMO, state_dir=state_dir)) as engine:
        await engine.forward([1])  # warm-up (kernel compilation is not the point)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0)
            start = ticks
            n = 0
            async for ev in engine.generate(long_prompt, max_new_tokens=8, stop_token_ids=[]):
                if n == 0:
                    ticks_in_prefill = ticks - start
                n += isinstance(ev, TokenEvent)
            ticks_in_generation = ticks - start
            running = False
    assert n == 8
    assert ticks_in_prefill >= 3, f"the loop ticked {ticks_in_prefill} times during prefill"
    assert ticks_in_generation >= ticks_in_prefill


@pytest.mark.anyio
async def test_engine_errors_under_both_backends(anyio_backend: str, tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match=r"config\.json"):
        async with Engine.open(tmp_path):
            pass
    async with Engine.open(options=EngineOptions(model=DEMO, state_dir=tmp_path)) as engine:
        with pytest.raises(ModelError):
            await engine.forward([])
        with pytest.raises(ModelError):
            async for _ in engine.generate([], max_new_tokens=1):
                pass


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    c = Container.open(DEMO)
    path = c.tokenizer_path()
    assert path is not None
    return ChatTokenizer(path, c.tokenizer_config())


def test_token_bytes_rebuild_the_text(tok: ChatTokenizer) -> None:
    """Each token's bytes, also for tokens holding part of a UTF-8 character (their own
    decode is U+FFFD), joined give the text's bytes: what logprobs' "bytes" report."""
    text = "\u2018quote\u2019 \u201c \u2014 \u00e9 \u00fc \u4e2d\u6587 \U0001f389 plain words"
    ids = tok.encode(text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some tokens are partial characters
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    # special tokens are left out of the text, so they stand for no bytes (an <|assistant|> in
    # the output gave its name's bytes and pushed every later text_offset past the text)
    special = [i for i in range(tok.vocab_size) if not tok.token_bytes(i)]
    assert special and all(tok.decode([i]) == "" for i in special), special
    mixed = ids[:3] + special + ids[3:]
    assert b"".join(tok.token_bytes(i) for i in mixed).decode() == tok.decode(mixed) == text


def test_text_stream_holds_back_partial_characters(tok: ChatTokenizer) -> None:
    text = "é ok, naïve 日本語 text 🙂 end"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # byte-level tokens split some characters: a naive stream would print U+FFFD
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    stream = tok.stream()
    parts = [stream.push(t) for t in ids]
    parts.append(stream.flush())
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)


def test_text_stream_of_a_generation_equals_decode(
    model: colibri.SyncModel, tok: ChatTokenizer
) -> None:
    ids = model.generate(tok.encode("Hello"), max_new_tokens=24, temperature=1.0, seed=3)
    stream = tok.stream()
    assert "".join([stream.push(t) for t in ids] + [stream.flush()]) == tok.decode(ids)


def test_chat_template(tok: ChatTokenizer) -> None:
    assert tok.has_chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert "Hello" in text
    assert tok.encode_chat([{"role": "user", "content": "Hello"}]) == tok.encode(text)


def test_chat_template_jinja_file_wins_and_hf_helpers_work(tmp_path: Path) -> None:
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}"
        "{% endfor %}{{ bos_token }}"
    )
    config = {"chat_template": "IGNORED", "bos_token": {"content": "<s>", "special": True}}
    t = ChatTokenizer(tmp_path / "tokenizer.json", config)
    msgs = [
        {"role": "user", "content": "a<b & é"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "never rendered"},
    ]
    assert t.apply_chat_template(msgs) == '[user]"a<b & é"[assistant]"x"<s>'


def test_broken_chat_template_is_a_config_error(tmp_path: Path) -> None:
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTokenizer(tmp_path / "tokenizer.json", {"chat_template": "{% for x in %}"})
    t = ChatTokenizer(
        tmp_path / "tokenizer.json", {"chat_template": "{{ raise_exception('no system role') }}"}
    )
    with pytest.raises(ConfigError, match="no system role"):
        t.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        ChatTokenizer(tmp_path / "missing.json", {})


def test_a_closed_model_says_so(state_dir: Path) -> None:
    """After its block ends a model refuses work with one clear error (generate used to hang,
    forward to answer from a closed engine, the sync facade to fail in the portal)."""
    with colibri.open_model(DEMO, state_dir=state_dir) as m:
        engine = m.engine
        assert len(m.generate(PROMPT, max_new_tokens=2, stop_token_ids=[])) == 2
    for call in (lambda: m.generate(PROMPT, max_new_tokens=2), lambda: m.forward(PROMPT)):
        with pytest.raises(ColibriError, match="engine is closed"):
            call()

    async def after_close() -> None:
        with pytest.raises(ColibriError, match="engine is closed"):
            await engine.forward(PROMPT)
        with pytest.raises(ColibriError, match="engine is closed"):
            async for _ in engine.generate(PROMPT, max_new_tokens=2):
                pass

    anyio.run(after_close)


def test_forward_is_bounded_by_the_context(model: colibri.SyncModel) -> None:
    ctx = model.engine.context_length
    with pytest.raises(ModelError, match=f"context is {ctx} tokens, but {ctx + 1} were given"):
        model.forward([5] * (ctx + 1))


def test_the_byte_floor_of_a_prompt_is_used_only_where_it_holds(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    """A prompt whose bytes prove it longer than a limit is refused untokenized, counting the
    bytes of the normalized text (an NFC normalizer shrinks Hangul jamo 3x: counted before it,
    a prompt that fits could be turned away; Qwen's tokenizers carry one)."""
    from colibri.tokenizer import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="at least"):
        tok.encode("hello world " * 20_000, limit=100)
    c = Container.open(DEMO)
    path = c.tokenizer_path()
    assert path is not None
    spec = json.loads(Path(path).read_text())
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    nfc = ChatTokenizer(tmp_path / "tokenizer.json", c.tokenizer_config())
    with pytest.raises(PromptTooLongError, match="at least"):  # refused untokenized too
        nfc.encode("hello world " * 20_000, limit=100)
    jamo = "\u1100\u1161" * 600  # 3,600 bytes that NFC makes 1,800 (600 syllables)
    assert nfc.at_least_tokens(jamo) * 2 <= tok.at_least_tokens(jamo) + 1
    assert nfc.at_least_tokens(jamo) <= len(nfc.encode(jamo))


def test_expert_bytes_by_layer_are_what_a_read_brings() -> None:
    """The dashboard's tier bytes came from blob sizes without the scales (~9% low)."""
    c = Container.open(DEMO)
    sizes = c.expert_nbytes_by_layer()
    for x in c.expert_extents():
        read = x.nbytes + sum(t.nbytes for t in x.scales.values() if t is not None)
        assert sizes[x.layer] >= read
        assert any(t is not None for t in x.scales.values())
    assert set(sizes.values()) == {
        x.nbytes + sum(t.nbytes for t in x.scales.values() if t is not None)
        for x in c.expert_extents()
    }
