"""The HTTP server, for real: ``coli serve`` subprocesses on loopback driven by the official
``openai`` and ``anthropic`` SDKs and httpx; outputs checked against the engine itself."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from _demo import demo_model
from _serve import Server

import colibri
from colibri.server.textproc import (
    StopMatcher,
    ThinkSplitter,
    ToolCallSplitter,
    parse_tool_calls,
)
from colibri.tokenizer import ChatTokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL = demo_model().name  # the served name is the model directory name
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """``main``: API key, 2 KV slots persisted; ``busy``: queue of 1, no key, no slots."""
    d = tmp_path_factory.mktemp("servers")
    main = Server(d, "--api-key", KEY, "--kv-slots", "2", "--kv-dir", str(d / "kv-main"))
    busy = Server(d, "--queue", "1", "--parallel", "1", "--kv-slots", "0")
    try:
        yield {"main": main.wait_ready(), "busy": busy.wait_ready()}
    finally:
        main.stop()
        busy.stop()


@pytest.fixture(scope="module")
def ref() -> Iterator[tuple[colibri.SyncModel, ChatTokenizer]]:
    """The engine itself (in this process) and the model's tokenizer."""
    with colibri.open_model(demo_model()) as m:
        c = m.container
        tok_path = c.tokenizer_path()
        assert tok_path is not None
        yield m, ChatTokenizer(tok_path, c.tokenizer_config())


def _chat_ids(tok: ChatTokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode_chat(messages)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------ basics


def test_refuses_a_public_bind_without_an_api_key() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "refusing to listen on '0.0.0.0' without an API key" in r.stderr
    assert "Traceback" not in r.stderr


def test_health_models_and_api_key(servers: dict[str, Server]) -> None:
    s = servers["main"]
    assert httpx.get(s.url + "/health").json()["status"] == "ok"  # no key needed
    r = httpx.get(s.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(s.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    wrong = httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        s.oai("sk-wrong").models.list()
    models = s.oai(KEY).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_greedy_equals_the_engine(servers: dict[str, Server], ref: Any) -> None:
    model, tok = ref
    client = servers["main"].oai(KEY)
    messages = _user("Hello there, how are you?")
    want_ids = model.generate(_chat_ids(tok, messages), max_new_tokens=24)
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == want_ids
    assert choice.message.content == tok.decode(want_ids)
    assert r.usage is not None and r.usage.completion_tokens == len(want_ids)
    assert r.usage.prompt_tokens == len(_chat_ids(tok, messages))
    assert choice.finish_reason == ("length" if len(want_ids) == 24 else "stop")
    # streaming gives the same text, then a usage chunk
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(want_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_null_optional_fields_are_their_defaults(servers: dict[str, Server]) -> None:
    """The SDK types ``n``, ``stream``, ``logprobs``, ``echo`` as optional and wrappers send
    ``None`` for what they leave unset: each was a 422; null is the field's default now (a
    required field stays required)."""
    s = servers["main"]
    auth = {"authorization": f"Bearer {KEY}"}
    nulls = {"n": None, "stream": None, "ignore_eos": None, "return_token_ids": None}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    r = httpx.post(
        f"{s.url}/v1/chat/completions",
        json={**chat, **nulls, "logprobs": None},
        headers=auth,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    comp = {"model": MODEL, "prompt": "Once", "max_tokens": 3, "echo": None}
    r = httpx.post(f"{s.url}/v1/completions", json={**comp, **nulls}, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    assert not r.json()["choices"][0]["text"].startswith("Once")  # echo off
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY)
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=None
    )
    assert len(got.choices) == 1
    r = httpx.post(f"{s.url}/v1/chat/completions", json={**chat, "model": None}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "model"


def test_errors_name_the_fields_as_sent(servers: dict[str, Server]) -> None:
    """A too-large ``max_completion_tokens`` was reported as ``max_tokens`` (never sent); a
    field of several accepted types had pydantic's branch tags in ``param``
    (``tool_choice.literal['none','auto','required']``, ``messages.0.content.str``)."""
    s = servers["main"]
    auth = {"authorization": f"Bearer {KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}

    def err(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        return r.status_code, r.json()["error"]

    code, e = err({**chat, "max_completion_tokens": 5000})
    assert code == 400 and e["param"] == "max_completion_tokens"
    assert "max_completion_tokens 5000" in e["message"] and "max_tokens " not in e["message"]
    code, e = err({**chat, "max_tokens": 5000})
    assert code == 400 and e["param"] == "max_tokens"
    code, e = err({**chat, "tool_choice": "maybe"})
    assert code == 422 and e["param"] == "tool_choice", e
    code, e = err({**chat, "messages": [{"role": "user", "content": 5}]})
    assert code == 422 and e["param"] == "messages.0.content", e


def test_a_json_schema_of_true_allows_any_json(servers: dict[str, Server]) -> None:
    """``true`` is a valid JSON Schema (any value): it was refused as a missing schema."""
    s = servers["main"]
    auth = {"authorization": f"Bearer {KEY}"}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Give me JSON"}],
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}},
    }
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    false = {**body, "response_format": {"type": "json_schema", "json_schema": {"schema": False}}}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=false, headers=auth, timeout=60)
    assert r.status_code == 400 and "false" in r.json()["error"]["message"]


def test_a_stop_in_the_text_held_to_the_end_is_a_stop(servers: dict[str, Server]) -> None:
    """A stop string found in the text held back to the end (a trailing partial character,
    U+FFFD) cut the text, but finish_reason stayed "length" (Anthropic's said stop)."""
    s = servers["main"]
    auth = {"authorization": f"Bearer {KEY}"}
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Emoji party 😀🎉 日本"}],
            "max_tokens": 12, "temperature": 2.0, "ignore_eos": True}  # fmt: skip
    for seed in range(200):
        r = httpx.post(f"{s.url}/v1/chat/completions", json={**base, "seed": seed},
                       headers=auth, timeout=60).json()  # fmt: skip
        text = r["choices"][0]["message"]["content"] or ""
        cut = r["choices"][0]["finish_reason"] == "length"  # (not an end-of-sequence token)
        if cut and text.endswith("\ufffd") and "\ufffd" not in text[:-1]:
            break
    else:
        pytest.skip("no sampled output ends in a partial character here")
    got = httpx.post(f"{s.url}/v1/chat/completions",
                     json={**base, "seed": seed, "stop": ["\ufffd"]}, headers=auth,
                     timeout=60).json()  # fmt: skip
    choice = got["choices"][0]
    assert choice["message"]["content"] == text[:-1]
    assert choice["finish_reason"] == "stop", choice


def test_completions_max_tokens_null_is_the_default_16(servers: dict[str, Server]) -> None:
    """An explicit ``"max_tokens": null`` (clients that send every field) generated up to the
    whole context; it is OpenAI's default, 16."""
    s = servers["main"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}
    r = httpx.post(
        f"{s.url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16, r.json()["usage"]


def test_completions_text_and_token_prompts(servers: dict[str, Server], ref: Any) -> None:
    model, tok = ref
    client = servers["main"].oai(KEY)
    ids = tok.encode("The quick brown fox")
    want = model.generate(ids, max_new_tokens=12)
    for prompt in ("The quick brown fox", ids):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert r.choices[0].model_extra is not None
        assert r.choices[0].model_extra["token_ids"] == want
        assert r.choices[0].text == tok.decode(want)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=ids, max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == tok.decode(want)


def test_legacy_text_offsets_count_a_split_character_once() -> None:
    """Tokens holding parts of one character ("\u20ac": three bytes over two tokens) both begin
    where the character does, and what follows begins one character later (their own texts
    are U+FFFD each: counting those put every later offset one too far)."""
    from colibri.server.generation import TextOffsets, TokenLogprob, completion_logprobs

    def lp(raw: bytes) -> TokenLogprob:
        return TokenLogprob(0, raw.decode("utf-8", errors="replace"), raw, -1.0)

    toks = [lp(b"a"), lp(b"\xe2\x82"), lp(b"\xac"), lp(b" b"), lp(b"\xf0\x9f"), lp(b"\x98\x80!")]
    toks += [lp(b"\xe2"), lp(b"lob"), lp(b"\xe2\x82"), lp(b"\xe2")]  # never completed: U+FFFD
    text = b"".join(t.raw for t in toks).decode(errors="replace")
    assert text == "a\u20ac b\U0001f600!\ufffdlob\ufffd\ufffd"
    got = completion_logprobs(toks, 0)["text_offset"]
    assert got == [0, 1, 1, 2, 4, 4, 6, 7, 10, 11]
    assert [text[o] for o in got] == [
        "a", "\u20ac", "\u20ac", " ", "\U0001f600", "\U0001f600", "\ufffd", "l", "\ufffd", "\ufffd"
    ]  # fmt: skip
    # a stream's deltas share one TextOffsets, after an echoed prompt of 5 characters
    offsets = TextOffsets(5)
    parts = [completion_logprobs(toks[:2], 0, offsets), completion_logprobs(toks[2:], 0, offsets)]
    assert [o for p in parts for o in p["text_offset"]] == [5 + o for o in got]


def test_legacy_logprobs_offsets_index_the_returned_text(servers: dict[str, Server]) -> None:
    client = servers["main"].oai(KEY)
    for echo in (False, True):
        r = client.completions.create(
            model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
            logprobs=2, echo=echo,
        )  # fmt: skip
        text, lps = r.choices[0].text, r.choices[0].logprobs
        assert lps is not None and lps.tokens and lps.text_offset
        # with echo the prompt's tokens come first (scored: test_server_requests.py)
        assert lps.text_offset[0] == 0
        assert lps.text_offset == sorted(lps.text_offset)
        assert r.usage is not None
        n_prompt = len(lps.tokens) - r.usage.completion_tokens
        assert n_prompt == (r.usage.prompt_tokens if echo else 0)
        assert "".join(lps.tokens[:n_prompt]) == ("The quick brown fox" if echo else "")
        for tok, at in zip(lps.tokens, lps.text_offset, strict=True):
            if "\ufffd" not in tok:
                assert text[at : at + len(tok)] == tok, (tok, at, text)


def test_seed_gives_the_same_sample(servers: dict[str, Server]) -> None:
    client = servers["main"].oai(KEY)

    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            messages=_user("Tell me a story"),  # type: ignore[arg-type]
            temperature=1.0,
            top_p=0.95,
            max_tokens=20,
            seed=seed,
            extra_body={"ignore_eos": True, "top_k": 50},
        )
        return r.choices[0].message.content or ""

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_stop_strings_end_generation_and_are_removed(servers: dict[str, Server]) -> None:
    client = servers["main"].oai(KEY)
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=_user("List some words"),
        temperature=0,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw).choices[0].message.content or ""
    m = re.search(r"[A-Za-z]{3}", full[6:])
    assert m is not None, full
    stop = m.group(0)
    cut = full.find(stop)
    r = client.chat.completions.create(**kw, stop=[stop, "zzzz-never"])
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens < 40
    streamed = client.chat.completions.create(**kw, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:cut]


def test_logprobs(servers: dict[str, Server]) -> None:
    client = servers["main"].oai(KEY)
    r = client.chat.completions.create(
        model=MODEL,
        messages=_user("Hi"),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 8
    for entry in lp.content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].bytes == entry.bytes
    # the tokens' bytes rebuild the content, even where a token is part of a character (this
    # greedy output begins with a lone continuation byte: its text is U+FFFD, its byte 0x94)
    joined = b"".join(bytes(e.bytes or []) for e in lp.content)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content
    assert all(e.bytes != list("\ufffd".encode()) for e in lp.content)  # not the text's bytes
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=_user("Hi"),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = [
        e.logprob for c in streamed if c.choices and c.choices[0].logprobs
        for e in (c.choices[0].logprobs.content or [])
    ]  # fmt: skip
    assert got == pytest.approx([e.logprob for e in lp.content])


def test_anthropic_messages_with_the_official_sdk(servers: dict[str, Server], ref: Any) -> None:
    model, tok = ref
    s = servers["main"]
    client = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Hello Claude-compatible server"}]
    system = "You are terse."
    want = model.generate(
        _chat_ids(tok, [{"role": "system", "content": system}, *messages]), max_new_tokens=16
    )
    r = client.messages.create(
        model=MODEL,
        max_tokens=16,
        system=system,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text" and r.content[0].text == tok.decode(want)
    assert r.usage.output_tokens == len(want)
    assert r.stop_reason == ("max_tokens" if len(want) == 16 else "end_turn")
    with client.messages.stream(
        model=MODEL,
        max_tokens=16,
        system=system,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == r.content[0].text
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == len(want)
    # raw event names, in order
    with httpx.stream(
        "POST",
        s.url + "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": MODEL, "max_tokens": 4, "messages": messages, "stream": True},
    ) as resp:
        events = [ln[7:] for ln in resp.iter_lines() if ln.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(events)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=messages)  # type: ignore[arg-type]
    # a final assistant message is a prefill: the model continues its text (rendered without a
    # new turn, as transformers' continue_final_message), the response holds only the rest
    prefill = [*messages, {"role": "assistant", "content": "The answer is"}]
    prompt = tok.apply_chat_template(prefill, continue_final_message=True)
    assert prompt.endswith("The answer is")
    assert not tok.apply_chat_template(prefill).endswith("The answer is")  # a new turn
    want = model.generate(tok.encode(prompt), max_new_tokens=8)
    r = client.messages.create(
        model=MODEL, max_tokens=8, messages=prefill,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert r.content[0].type == "text" and r.content[0].text == tok.decode(want)
    cached = r.usage.cache_read_input_tokens or 0
    assert r.usage.input_tokens + cached == len(tok.encode(prompt))


def test_error_responses(servers: dict[str, Server]) -> None:
    s = servers["main"]
    h = {"authorization": f"Bearer {KEY}"}
    url = s.url + "/v1/chat/completions"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def post(body: Any, **kw: Any) -> httpx.Response:
        return httpx.post(url, json=body, headers={**h, **kw.pop("headers", {})}, **kw)

    def check(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
        assert r.status_code == status, r.text
        err: dict[str, Any] = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert "Traceback" not in r.text
        if param is not None:
            assert err["param"] == param
        return err

    check(post({**ok, "model": "gpt-4"}), 404, "model")
    check(httpx.get(s.url + "/v1/nothing", headers=h), 404)
    check(post({**ok, "temperature": "hot"}), 422, "temperature")
    check(post({**ok, "messages": []}), 422, "messages")
    check(post({**ok, "max_tokens": 0}), 422, "max_tokens")
    check(post({**ok, "max_tokens": True}), 422, "max_tokens")  # not one token
    for bad_limit in ("\u00b2", "-1", "x"):  # "²" passed str.isdigit and int() failed: a 500
        r = httpx.get(s.url + "/profile", params={"limit": bad_limit}, headers=h)
        check(r, 400, "limit")
    assert httpx.get(s.url + "/profile", params={"limit": "1"}, headers=h).status_code == 200
    assert check(post({**ok, "stop_token_ids": [-1]}), 400, "stop_token_ids")["code"] == (
        "invalid_token"
    )
    check(post({**ok, "stop_token_ids": [10**6]}), 400, "stop_token_ids")
    cmpl = s.url + "/v1/completions"
    empty = httpx.post(cmpl, json={"model": MODEL, "prompt": ""}, headers=h)
    assert check(empty, 400, "prompt")["code"] == "empty_prompt"
    check(httpx.post(cmpl, json={"model": MODEL, "prompt": [True]}, headers=h), 422)
    check(post({**ok, "n": 2}), 400, "n")
    check(post({**ok, "cache_slot": 9}), 400, "cache_slot")
    check(post({**ok, "max_tokens": 100000}), 400, "max_tokens")
    long = {**ok, "messages": [{"role": "user", "content": "word " * 600}]}
    assert check(post(long), 400)["code"] == "context_length_exceeded"
    check(httpx.post(url, content=b"{not json", headers=h), 400)
    big = b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    check(httpx.post(url, content=big, headers=h), 413)
    chunked = iter([b"x" * (1 << 20)] * 6)  # no Content-Length: counted while reading
    check(httpx.post(url, content=chunked, headers=h), 413)
    # Host header attack (DNS rebinding): refused before the key is even looked at
    check(httpx.get(s.url + "/v1/models", headers={**h, "host": "attacker.example"}), 421)
    assert httpx.get(s.url + "/health", headers={"host": f"localhost:{s.port}"}).status_code == 200
    # Anthropic errors carry Anthropic's shape
    r = httpx.post(s.url + "/v1/messages", json={"model": MODEL}, headers={"x-api-key": KEY})
    assert r.status_code == 422
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    # the server is still fine
    assert post(ok).status_code == 200


# ------------------------------------------------------------------------------ concurrency


def test_eight_concurrent_streams_match_their_solo_outputs(
    servers: dict[str, Server], ref: Any
) -> None:
    model, tok = ref
    s = servers["main"]
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    want = [model.generate(_chat_ids(tok, _user(p)), max_new_tokens=16) for p in prompts]
    start = threading.Barrier(8)

    def run(p: str) -> tuple[str, float]:
        client = s.oai(KEY)
        start.wait()
        with client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=_user(p),  # type: ignore[arg-type]
            temperature=0,
            max_tokens=16,
            stream=True,
        ) as resp:
            wait = float(resp.headers["x-colibri-queue-wait-ms"])
            text = "".join(c.choices[0].delta.content or "" for c in resp.parse() if c.choices)
        return text, wait

    before = httpx.get(f"{s.url}/health").json()
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, prompts))
    assert [g[0] for g in got] == [tok.decode(w) for w in want]
    after = httpx.get(f"{s.url}/health").json()
    steps = after["decode_batches"] - before["decode_batches"]
    rows = after["decode_batched_rows"] - before["decode_batched_rows"]
    assert steps > 0 and rows / steps > 1  # the streams shared decode steps
    turns = s.profile(KEY)["turns"][:8]
    assert all(t["finish_reason"] in ("stop", "length") for t in turns)


def _wait_for(s: Server, key: str, value: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(s.url + "/health").json()[key] != value:
        assert time.monotonic() < deadline, f"/health {key} never became {value}"
        time.sleep(0.02)


def test_queue_full_gets_429_and_a_disconnect_stops_generation(servers: dict[str, Server]) -> None:
    s = servers["busy"]
    url = s.url + "/v1/chat/completions"
    long = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long essay"}],
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as c1, c1.stream("POST", url, json=long) as first:
        lines = first.iter_lines()
        got = [next(lines) for _ in range(6)]  # the generation is running
        assert got[0].startswith("data: ")
        # tokens are counted as they are generated, not when the request ends
        m = httpx.get(s.url + "/metrics").text
        counted = float(m.split("\ncolibri:generation_tokens_total ")[1].split()[0])
        assert counted >= 5, m
        # a client that gives up while queued frees its place at once
        body = json.dumps({**long, "stream": False}).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as raw:
            raw.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            _wait_for(s, "waiting", 1)
        _wait_for(s, "waiting", 0)
        assert httpx.get(s.url + "/health").json()["running"] == 1
        waiter = cf.ThreadPoolExecutor(1).submit(
            httpx.post, url, json={**long, "stream": False, "max_tokens": 4}, timeout=60
        )
        _wait_for(s, "waiting", 1)
        r = httpx.post(url, json={**long, "stream": False})
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        msg = r.json()["error"]["message"]  # counts that add up: 1 generating + 1 waiting
        assert "1 generating and 1 admitted or waiting" in msg and "a queue of 1" in msg, msg
        # leave the stream after a few chunks: closing the connection cancels the generation
    queued = waiter.result(timeout=60)
    assert queued.status_code == 200
    assert float(queued.headers["x-colibri-queue-wait-ms"]) > 0
    turns = s.profile()["turns"]
    cancelled = [t for t in turns if t["max_tokens"] == 480]
    # the one that gave up while queued (no token, all of its time in the queue) and the
    # stream left after a few chunks
    assert [t["finish_reason"] for t in cancelled] == ["cancelled", "cancelled"], cancelled
    queued_out = [t for t in cancelled if t["completion_tokens"] == 0]
    assert len(queued_out) == 1 and queued_out[0]["queue_wait_ms"] > 0, cancelled
    assert all(t["completion_tokens"] < 480 for t in cancelled)
    metrics = httpx.get(s.url + "/metrics").text
    assert 'colibri:request_success_total{finished_reason="cancelled"} 2.0' in metrics
    assert 'colibri:requests_rejected_total{reason="queue_full"} 1.0' in metrics
    assert httpx.get(s.url + "/health").json()["running"] == 0


def test_metrics_experts_and_profile(servers: dict[str, Server]) -> None:
    s = servers["main"]
    h = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(s.url + "/metrics").status_code == 401
    text = httpx.get(s.url + "/metrics", headers=h).text
    for name in (
        "colibri:time_to_first_token_seconds_bucket",
        "colibri:inter_token_latency_seconds_bucket",
        "colibri:request_queue_time_seconds_count",
        "colibri:prompt_tokens_total",
        "colibri:prompt_tokens_cached_total",
        "colibri:generation_tokens_total",
        "colibri:num_requests_running",
        "colibri:engine_forward_calls_total",
        "colibri:engine_prefill_chunks_total",
        "colibri:engine_prefill_steps_total",
        'colibri:http_requests_total{route="/v1/chat/completions",status="200"}',
    ):
        assert name in text, name
    ex = httpx.get(s.url + "/experts", headers=h).json()
    assert ex["layers"] == [1, 2, 3, 4] and ex["n_experts"] == 16  # 4: the MTP layer
    assert len(ex["tiers"]) == 4 and set(ex["tiers"][0]) == {"ram"}
    assert len(ex["codes"][0]) == 16
    prof = s.profile(KEY)
    t = prof["turns"][0]
    assert {"prompt_tokens", "completion_tokens", "ttft_ms", "queue_wait_ms"} <= set(t)
    assert prof["queue"]["limit"] == 8 and len(prof["slots"]) == 2


# ------------------------------------------------------------------------------ KV slots


def _converse(server: Server, key: str, slot: int, turns: list[str]) -> list[dict[str, Any]]:
    """Chat turn after turn in ``slot``; returns each response's colibri stats + content."""
    client = server.oai(key)
    messages: list[dict[str, str]] = []
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=12,
            extra_body={"cache_slot": slot, "ignore_eos": True},
        )
        content = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": content})
        extra = r.model_extra or {}
        out.append({"content": content, **extra["colibri"]})
    return out


@pytest.mark.reliability
def test_kv_slot_survives_kill_9(servers: dict[str, Server], tmp_path: Path) -> None:
    turns = ["My name is Ada.", "What is my name?", "And again, what is it?"]
    # an uninterrupted server: all three turns in slot 1
    whole = _converse(servers["main"], KEY, 1, turns)
    assert whole[1]["prompt_tokens_reused"] > 0
    kv = tmp_path / "kv"
    first = Server(tmp_path, "--kv-slots", "1", "--kv-dir", str(kv)).wait_ready()
    try:
        before = _converse(first, "none", 0, turns[:2])
    finally:
        first.kill9()
    assert [b["content"] for b in before] == [w["content"] for w in whole[:2]]
    saved = (kv / ".coli_kv.0").stat().st_size
    assert saved > 40
    again = Server(tmp_path, "--kv-slots", "1", "--kv-dir", str(kv)).wait_ready()
    try:
        history = [
            m
            for t, b in zip(turns[:2], before, strict=True)
            for m in (
                {"role": "user", "content": t},
                {"role": "assistant", "content": b["content"]},
            )
        ]
        r = again.oai().chat.completions.create(
            model=MODEL,
            messages=[*history, {"role": "user", "content": turns[2]}],  # type: ignore[list-item]
            temperature=0,
            max_tokens=12,
            extra_body={"cache_slot": 0, "ignore_eos": True},
        )
        stats = (r.model_extra or {})["colibri"]
        slot = again.profile()["slots"][0]
    finally:
        again.stop()
    # the persisted conversation was not prefilled again, and the answer is the same bytes
    assert r.choices[0].message.content == whole[2]["content"]
    assert stats["prompt_tokens_reused"] == whole[2]["prompt_tokens_reused"] > 20
    assert stats["prompt_tokens_computed"] == whole[2]["prompt_tokens_computed"]
    assert slot["persisted_tokens"] == slot["tokens"] > stats["prompt_tokens_reused"]
    # and reuse is exact: the same conversation without a slot (all prefilled) agrees
    fresh = (
        servers["main"]
        .oai(KEY)
        .chat.completions.create(
            model=MODEL,
            messages=[*history, {"role": "user", "content": turns[2]}],  # type: ignore[list-item]
            temperature=0,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
    )
    assert fresh.choices[0].message.content == whole[2]["content"]


# ------------------------------------------------------------------------------ tools, think


_TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "{% endif %}"
    "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\\n<think>{% endif %}"
)


# A tool whose schema says which arguments are text (city) and which JSON (days).
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


def tools_model(tmp_path: Path, template: str | None = None) -> Path:
    """The demo model with a chat template that renders tools and opens a think section
    (its own does neither), or with ``template``: links to its files, a
    tokenizer_config.json of its own."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in demo_model().iterdir():
        if f.name != "tokenizer_config.json":
            (model_dir / f.name).symlink_to(f)
    cfg = json.loads((demo_model() / "tokenizer_config.json").read_text())
    cfg["chat_template"] = _TOOLS_TEMPLATE if template is None else template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model_dir


@pytest.mark.anyio
async def test_tools_and_reasoning_plumbing(tmp_path: Path, anyio_backend: str) -> None:
    """A model whose template renders tools and opens a think section (the demo model's does
    neither): tools reach the prompt, tool calls in history render, and output inside the
    unclosed think section comes back as reasoning_content (JSON output as content). In process,
    on asyncio and trio."""
    from colibri.server import ServerConfig, create_app

    model_dir = tools_model(tmp_path)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    async with colibri.Engine.open(model_dir) as engine:
        app = await create_app(engine, ServerConfig(kv_slots=0, served_model_name="m"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            base = {"model": "m", "messages": history, "max_tokens": 6, "temperature": 0}
            plain = (await client.post("/v1/chat/completions", json=base)).json()
            r = await client.post("/v1/chat/completions", json={**base, "tools": tools})
            assert r.status_code == 200, r.text
            body = r.json()
            none = await client.post(
                "/v1/chat/completions", json={**base, "tools": tools, "tool_choice": "none"}
            )
            refused = await client.post(
                "/v1/chat/completions", json={**base, "tools": tools, "tool_choice": "required"}
            )
            # a tool call forced by a grammar: finished it is "tool_calls"; cut by max_tokens
            # (28 tokens: the name whole, the arguments not) it is "length" and the cut block
            # stays text, never a call with its arguments lost
            call = (
                "</think>\n\n<tool_call>get_weather<arg_key>city</arg_key>"
                "<arg_value>Paris</arg_value></tool_call>"
            )
            fmt = {"type": "regex", "grammar": re.escape(call)}
            # a thinking-only answer (6 tokens never leave <think>): the same blocks whole and
            # streamed, and no empty text block
            anth = {
                "model": "m",
                "max_tokens": 6,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "ignore_eos": True,
            }
            whole = (await client.post("/v1/messages", json=anth)).json()
            streamed = await client.post("/v1/messages", json={**anth, "stream": True})
            starts = [
                json.loads(line[6:])["content_block"]["type"]
                for line in streamed.text.splitlines()
                if line.startswith("data: ") and '"content_block_start"' in line
            ]
            assert [b["type"] for b in whole["content"]] == starts == ["thinking"], (whole, starts)
            reasons = {}
            for n in (64, 28):
                r = await client.post(
                    "/v1/chat/completions",
                    json={**base, "tools": tools, "max_tokens": n, "response_format": fmt},
                )
                assert r.status_code == 200, r.text
                reasons[n] = r.json()["choices"][0]["finish_reason"]
                got = r.json()["choices"][0]["message"]
                if n == 64:
                    args = got["tool_calls"][0]["function"]["arguments"]
                    assert json.loads(args) == {"city": "Paris"}
                else:
                    assert not got.get("tool_calls") and "<tool_call>get_weather" in got["content"]
            # a stop string inside the block cuts it as max_tokens does: text, "stop", no call
            # (it was a finished call with its arguments lost)
            r = await client.post(
                "/v1/chat/completions",
                json={**base, "tools": tools, "max_tokens": 64, "response_format": fmt,
                      "stop": ["</arg_key>"]},
            )  # fmt: skip
            cutmsg = r.json()["choices"][0]
            assert cutmsg["finish_reason"] == "stop" and not cutmsg["message"].get("tool_calls")
            assert "<tool_call>get_weather" in cutmsg["message"]["content"], cutmsg
            # ... and so does a stop token id the request adds (the first token of "Paris")
            whole = await client.post(
                "/v1/chat/completions",
                json={**base, "tools": tools, "max_tokens": 64, "response_format": fmt,
                      "return_token_ids": True},
            )  # fmt: skip
            ids = whole.json()["choices"][0]["token_ids"]
            tok = ChatTokenizer(model_dir / "tokenizer.json", {})
            at = next(k for k in range(len(ids)) if "<arg_value>" in tok.decode(ids[:k]))
            r = await client.post(
                "/v1/chat/completions",
                json={**base, "tools": tools, "max_tokens": 64, "response_format": fmt,
                      "stop_token_ids": [ids[at]]},
            )  # fmt: skip
            cutmsg = r.json()["choices"][0]
            assert cutmsg["finish_reason"] == "stop" and not cutmsg["message"].get("tool_calls")
            # two calls, parallel_tool_calls false: the first only (both were returned)
            two = {"type": "regex", "grammar": re.escape(call + call[len("</think>\n\n") :])}
            counts = []
            for parallel in (True, False):
                r = await client.post(
                    "/v1/chat/completions",
                    json={**base, "tools": tools, "max_tokens": 200, "response_format": two,
                          "parallel_tool_calls": parallel},
                )  # fmt: skip
                counts.append(len(r.json()["choices"][0]["message"]["tool_calls"]))
            assert counts == [2, 1], counts
            # JSON output is the answer even though this template always opens <think> (it
            # came back as reasoning_content with the content empty)
            js = await client.post(
                "/v1/chat/completions",
                json={**base, "max_tokens": 32, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
                        "type": "object", "required": ["a"], "additionalProperties": False,
                        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}}},
            )  # fmt: skip
            assert js.status_code == 200, js.text
            jm = js.json()["choices"][0]["message"]
            assert isinstance(json.loads(jm["content"]), dict), jm
            assert not jm.get("reasoning_content"), jm
    assert body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert none.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    assert reasons == {64: "tool_calls", 28: "length"}, reasons
    msg = body["choices"][0]["message"]
    assert msg["content"] == "" and msg["reasoning_content"]  # never left <think>


def test_text_processing() -> None:
    m = StopMatcher(["END", "xy"])
    out = "".join(m.feed(ch)[0] for ch in "abcxEN")
    rest, hit = m.feed("D tail")
    assert out + rest == "abcx" and hit and m.hit == "END" and m.flush() == ""
    t = ThinkSplitter(enabled=True)
    parts = [p for ch in " <think>plan</think>\n\nanswer" for p in t.feed(ch)] + t.flush()
    assert "".join(x for k, x in parts if k == "reasoning") == "plan"
    assert "".join(x for k, x in parts if k == "content") == "answer"
    tools = WEATHER_TOOLS
    glm = (
        "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    text, calls = parse_tool_calls(glm, tools)
    assert text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "42", "days": 3})
    ]
    # a schema that admits a string keeps the text as written unless it admits the JSON's own
    # type too: str | None (pydantic's anyOf), type lists, a $ref to a string enum
    wide = {
        "$defs": {"Unit": {"enum": ["c", "f"]}},
        "properties": {
            "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"type": ["string", "integer"]},
            "unit": {"$ref": "#/$defs/Unit"},
            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
    }
    args = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
        for k, v in (("zip", "02139"), ("zip", "12345"), ("code", "7"), ("unit", "true"),
                     ("n", "null"))
    )  # fmt: skip
    wide_tools = [{"type": "function", "function": {"name": "w", "parameters": wide}}]
    _, calls = parse_tool_calls(f"<tool_call>w{args}</tool_call>", wide_tools)
    assert json.loads(calls[0].arguments) == {"zip": "12345", "code": 7, "unit": "true", "n": None}
    # a call to a tool the request did not declare, or to no name, stays text
    for block in ("<tool_call>rm_rf<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>",
                  '<tool_call>{"name": "", "arguments": {}}</tool_call>'):  # fmt: skip
        assert parse_tool_calls(block, tools) == (block, [])
    text, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>')
    assert text == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": [1]}
    assert parse_tool_calls("no calls <tool_call>not valid json{")[1] == []
    split = ToolCallSplitter(enabled=True)
    released = "".join(split.feed(ch) for ch in "Sure. <tool_call>f<arg_key>x</arg_key>")
    rest, calls = split.finish()
    assert released == "Sure. " and [c.name for c in calls] == ["f"]


def test_structured_output_json_schema_parses_and_validates(servers: dict[str, Server]) -> None:
    """response_format is a real sampling constraint: even a random model's answer parses and
    matches the schema (greedy and sampled)."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    client = servers["main"].oai(KEY)
    for temperature, seed in ((0.0, None), (0.9, 1), (0.9, 2)):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give me JSON."}],
            temperature=temperature,
            seed=seed,
            max_tokens=200,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": schema},
            },
        )
        text = r.choices[0].message.content or ""
        assert r.choices[0].finish_reason == "stop"  # the grammar closed the document
        jsonschema.validate(json.loads(text), schema)


def test_bad_response_format_is_a_400(servers: dict[str, Server]) -> None:
    s = servers["main"]
    r = httpx.post(
        f"{s.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "yaml"},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format"
    # a grammar that does not compile is a 400 before the stream starts (it was a 200 and an
    # error event inside the stream), on both generation routes
    h = {"Authorization": f"Bearer {KEY}"}
    bad = {"type": "regex", "grammar": "(unclosed"}
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ):
        r = httpx.post(
            f"{s.url}{path}",
            headers=h,
            json={"model": MODEL, **body, "stream": True, "response_format": bad},
        )
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "response_format"
    # /v1/completions honours response_format (it was dropped silently)
    r = httpx.post(
        f"{s.url}/v1/completions",
        headers=h,
        json={"model": MODEL, "prompt": "x", "max_tokens": 8,
              "response_format": {"type": "regex", "grammar": "yes|no"}},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_automatic_prefix_matching_without_cache_slot(servers: dict[str, Server], ref: Any) -> None:
    """A request that names no slot reuses the longest cached prefix (agents resend the same
    preamble): the second turn computes only its new tokens and answers as a fresh run would."""
    model, tok = ref
    client = servers["main"].oai(KEY)
    preamble = "You are a careful assistant. " * 12
    first = [{"role": "system", "content": preamble}, {"role": "user", "content": "One?"}]
    r1 = client.chat.completions.create(
        model=MODEL,
        messages=first,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=4,
    )
    second = [
        *first,
        {"role": "assistant", "content": r1.choices[0].message.content or ""},
        {"role": "user", "content": "Two?"},
    ]
    r2 = client.chat.completions.create(
        model=MODEL,
        messages=second,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=4,
    )
    details = r2.usage.prompt_tokens_details if r2.usage else None
    cached = details.cached_tokens if details else 0
    assert cached and cached >= 40
    want = model.generate(_chat_ids(tok, second), max_new_tokens=4)
    assert r2.choices[0].message.content == tok.decode(want)


def test_cached_tokens_are_what_the_engine_reused_with_pinned_mtp_drafts(
    tmp_path: Path,
) -> None:
    """With MTP drafts pinned and a seed the engine runs the prompt's last 129 tokens again
    (the head's history): cached_tokens and colibri.prompt_tokens_reused say what it reused,
    not the common prefix (it reported 19 of 20 cached while all 20 were computed)."""
    s = Server(tmp_path, "--draft", "mtp:2", "--kv-slots", "1").wait_ready()
    try:
        prompt = "You are a careful assistant. " * 4

        def ask(**over: Any) -> dict[str, Any]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "cache_slot": 0, **over}
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return dict(r.json()["usage"])

        ask(temperature=0)
        greedy = ask(temperature=0)  # the same prompt again: all but its last token reused
        seeded = ask(temperature=0.9, seed=1)
    finally:
        s.stop()
    n = greedy["prompt_tokens"]
    assert n < 129  # shorter than the head's history: a seeded run reuses nothing
    assert greedy["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert seeded["prompt_tokens_details"]["cached_tokens"] == 0


def test_qwen3_coder_and_minimax_m2_tool_calls_are_parsed() -> None:
    """Only GLM's and the JSON block were read: a Qwen3-Coder or MiniMax-M2 model's calls came
    back as content with finish_reason stop."""
    tools = WEATHER_TOOLS
    coder = (
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    text, calls = parse_tool_calls(coder, tools)
    assert text == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "42", "days": 3})
    ]
    minimax = (
        'Ok.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n<invoke name='
        '"get_weather">\n<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>'
    )
    split = ToolCallSplitter(enabled=True)
    released = "".join(split.feed(ch) for ch in minimax)
    rest, calls = split.finish(tools)
    assert released == "Ok.\n" and rest == ""
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 2},
                                                        {"city": "Rome"}]  # fmt: skip
    # a block calling a tool the request did not declare stays text, as in the other formats
    undeclared = '<minimax:tool_call><invoke name="rm"></invoke></minimax:tool_call>'
    assert parse_tool_calls(undeclared, tools) == (undeclared, [])


# DeepSeek-V3's (V3.1's: NAME<｜tool▁sep｜>ARGS), Kimi-K2's and Mistral's (the list before
# tokenizer v11, NAME[ARGS]ARGS per call from it on) calls, each with text before and two
# calls: (output, the text before the block)
_DS_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>"
)
_DS31_CALL = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
_KIMI_CALL = (
    "<|tool_call_begin|>functions.get_weather:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
)
_PARIS, _ROME = '{"city": "Paris", "days": 2}', '{"city": "Rome"}'
NATIVE_CALLS = {
    "deepseek_v3": (
        "Let me look.\n<｜tool▁calls▁begin｜>"
        + _DS_CALL.format(_PARIS) + "\n" + _DS_CALL.format(_ROME) + "<｜tool▁calls▁end｜>",
        "Let me look.\n",
    ),
    "deepseek_v31": (
        "Let me look.<｜tool▁calls▁begin｜>"
        + _DS31_CALL.format(_PARIS) + _DS31_CALL.format(_ROME) + "<｜tool▁calls▁end｜>",
        "Let me look.",
    ),
    "kimi_k2": (
        "Let me look. <|tool_calls_section_begin|>"
        + _KIMI_CALL.format(0, _PARIS) + _KIMI_CALL.format(1, _ROME)
        + "<|tool_calls_section_end|>",
        "Let me look. ",
    ),
    "mistral": (
        f'Let me look.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {_PARIS}}}, '
        f'{{"name": "get_weather", "arguments": {_ROME}}}]',
        "Let me look.",
    ),
    "mistral_v11": (
        f"Let me look.\n[TOOL_CALLS]get_weather[ARGS]{_PARIS}[TOOL_CALLS]get_weather[ARGS]{_ROME}",
        "Let me look.\n",
    ),
}  # fmt: skip
_WANT = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("fmt", sorted(NATIVE_CALLS))
def test_deepseek_kimi_and_mistral_tool_calls_are_parsed(fmt: str) -> None:
    """Only the <tool_call> formats and MiniMax-M2's were read: a DeepSeek-V3, Kimi-K2 or
    Mistral model's calls came back as content with finish_reason stop."""
    out, before = NATIVE_CALLS[fmt]
    text, calls = parse_tool_calls(out, WEATHER_TOOLS)
    assert text == before.rstrip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == _WANT
    assert len({c.id for c in calls}) == 2
    # streamed: the text before the block is released, the block held back, wherever the
    # chunks split it (at every point, and a character at a time)
    for k in range(len(out) + 1):
        split = ToolCallSplitter(enabled=True)
        released = split.feed(out[:k]) + split.feed(out[k:])
        rest, calls = split.finish(WEATHER_TOOLS)
        assert (released, rest) == (before, ""), (k, released, rest)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == _WANT, k
    split = ToolCallSplitter(enabled=True)
    assert "".join(split.feed(ch) for ch in out) == before
    assert [c.name for c in split.finish(WEATHER_TOOLS)[1]] == ["get_weather"] * 2


@pytest.mark.parametrize("fmt", sorted(NATIVE_CALLS))
def test_native_tool_call_blocks_cut_or_undeclared_stay_text(fmt: str) -> None:
    """A block naming a tool the request did not declare, and one cut by max_tokens, stay
    text as in the <tool_call> formats."""
    out, before = NATIVE_CALLS[fmt]
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert parse_tool_calls(out, other) == (out, [])
    # one of the two calls undeclared: the whole block stays (a list, a section) or that
    # call's block (Mistral v11's, one block per call)
    rm = out.replace("get_weather", "rm_rf", 1)
    text, calls = parse_tool_calls(rm, WEATHER_TOOLS)
    assert "rm_rf" in text and len(calls) == (1 if fmt == "mistral_v11" else 0), (text, calls)
    # cut inside the last call's arguments: no call from the unfinished block; the generation
    # ended there on its own (no max_tokens), an unclosed section's finished calls count
    cut = out[: out.rindex("Rome") + 2]
    for closed_only in (True, False):
        text, calls = parse_tool_calls(cut, WEATHER_TOOLS, closed_only=closed_only)
        assert text.endswith('{"city": "Ro'), text
        split = ToolCallSplitter(enabled=True)
        assert split.feed(cut) == before
        rest, streamed = split.finish(WEATHER_TOOLS, cut=closed_only)
        assert before + rest == text and len(streamed) == len(calls)
        assert len(calls) == (1 if fmt == "mistral_v11" else 0), (closed_only, calls)
    # a section that lost only its closing marker: a call at the end of a generation, not
    # when max_tokens cut it there
    if fmt in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        unclosed = out[: out.rindex("<")]
        assert len(parse_tool_calls(unclosed, WEATHER_TOOLS)[1]) == 2
        assert parse_tool_calls(unclosed, WEATHER_TOOLS, closed_only=True) == (unclosed, [])


def test_tool_call_splitter_releases_what_only_looked_like_a_marker() -> None:
    """Text that could begin a marker is held only until it cannot: "[", "<｜tool" and
    "<|tool_calls" that go on otherwise are content, released as they are decided."""
    split = ToolCallSplitter(enabled=True)
    assert split.feed("See [") == "See "
    assert split.feed("1] and <｜tool") == "[1] and "
    assert split.feed("▁x <|tool_calls_") == "<｜tool▁x "
    assert split.feed("done") == "<|tool_calls_done"
    assert split.feed(" [TOOL_CALL") == " "
    assert split.feed("S]x") == ""
    # [TOOL_CALLS] that opens no call (not followed by JSON) comes back whole at the end
    assert split.finish(WEATHER_TOOLS) == ("[TOOL_CALLS]x", [])


def test_a_bracket_run_in_a_tool_call_is_text_not_a_server_error() -> None:
    """JSON nested past Python's reader (a model writing thousands of ``[``) raised
    RecursionError out of the parser: a 500 for the request. Arguments nested deeper than
    MAX_JSON_DEPTH are no call (the block stays text); a GLM value that deep is a string."""
    from colibri.server.textproc import MAX_JSON_DEPTH

    tools = WEATHER_TOOLS
    deep, ok = "[" * 5000 + "]" * 5000, "[" * (MAX_JSON_DEPTH - 4) + "]" * (MAX_JSON_DEPTH - 4)
    # (the block's own objects and lists are levels too: "ok" is 124 inside at most 4)
    for nest, calls in ((deep, 0), ("[" * 900 + "]" * 900, 0), (ok, 1)):
        blocks = [
            f'<tool_call>{{"name": "get_weather", "arguments": {{"a": {nest}}}}}</tool_call>',
            f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"a": {nest}}}}}]',
            f'[TOOL_CALLS]get_weather[ARGS]{{"a": {nest}}}',
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            f'{{"a": {nest}}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ]
        for block in blocks:
            text, got = parse_tool_calls(block, tools)
            assert len(got) == calls and (calls or text == block), block[:60]
    assert parse_tool_calls("[TOOL_CALLS]" + "[" * 20000, tools)[1] == []
    text, got = parse_tool_calls(
        f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{deep}</arg_value></tool_call>",
        tools,
    )
    assert json.loads(got[0].arguments) == {"city": deep}


def test_retry_after_is_when_one_place_frees_not_the_whole_queue() -> None:
    """Retry-After said mean generation time x (waiting + running) / parallel: the time to
    drain the whole queue. A place opens when the first running generation ends."""
    import anyio

    from colibri.server.errors import ApiError
    from colibri.server.metrics import Metrics
    from colibri.server.state import Admission

    now = [100.0]

    async def main() -> None:
        adm = Admission(4, 2, Metrics(lambda: None), clock=lambda: now[0])  # type: ignore[arg-type, return-value]
        adm._recent.extend([10.0, 10.0])  # generations have taken 10 s
        async with anyio.create_task_group() as tg:
            release = anyio.Event()

            async def run(started: float) -> None:
                now[0] = started
                t = adm.reserve()
                async with adm.enter(t, None, None):  # type: ignore[arg-type]  (no slot)
                    await release.wait()

            tg.start_soon(run, 100.0)  # started at 100 s: 2 s left at 108 s
            await anyio.sleep(0.01)
            tg.start_soon(run, 105.0)  # 7 s left
            await anyio.sleep(0.01)
            now[0] = 108.0
            for _ in range(4):
                adm.reserve()  # the queue of 4 fills
            with pytest.raises(ApiError) as exc:
                adm.reserve()
            assert exc.value.status == 429
            assert adm.retry_after() == 2  # (was ceil(10 x 6 / 2) = 30)
            release.set()

    anyio.run(main)
