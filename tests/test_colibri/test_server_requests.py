"""Request bodies a client gets wrong or unusual, answered as the OpenAI / Anthropic APIs do:
strictly typed fields, template failures as 400s, grammars that can never match refused before
a stream starts, logprobs for exactly the returned text, Anthropic's usage and content rules.
In process (the ASGI app over httpx), the bundled demo model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _demo import demo_model
from test_server import tools_model

import colibri
from colibri.server import ServerConfig, create_app
from storage.container import Container
from storage.errors import ColibriError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _client(model_dir: Path, state: Path, **cfg: Any) -> AsyncIterator[httpx.AsyncClient]:
    opts = colibri.EngineOptions(state_dir=state)
    async with colibri.Engine.open(model_dir, options=opts) as engine:
        app = await create_app(engine, ServerConfig(served_model_name="m", kv_dir=state, **cfg))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://localhost", timeout=120
        ) as client:
            yield client


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(demo_model(), tmp_path):
        yield c


@pytest.fixture
async def tools_client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A model whose chat template renders tools (the demo model's does not)."""
    async for c in _client(tools_model(tmp_path), tmp_path / "state", kv_slots=0):
        yield c


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 2,
        **extra,
    }


async def test_fields_of_another_json_type_are_422s_naming_the_field(
    client: httpx.AsyncClient,
) -> None:
    """pydantic's lax mode used to turn ``true`` into 1 (``cache_slot: true`` ran in named
    slot 1 and saved it to disk), ``"1"`` into 1.0 and ``"yes"`` into True."""
    chat = "/v1/chat/completions"
    for path, body, field in (
        (chat, _chat(cache_slot=True), "cache_slot"),
        (chat, _chat(logprobs=True, top_logprobs=True), "top_logprobs"),
        (chat, _chat(seed=True), "seed"),
        (chat, _chat(n=True), "n"),
        (chat, _chat(temperature="1"), "temperature"),
        (chat, _chat(stream="yes"), "stream"),
        (chat, _chat(top_k=False), "top_k"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": False}, "logprobs"),
    ):
        r = await client.post(path, json=body)
        assert r.status_code == 422, (field, r.status_code, r.text)
        assert field in r.text, (field, r.text)
    # an integer still fills a number
    r = await client.post(chat, json=_chat(temperature=1, top_p=1, seed=3))
    assert r.status_code == 200, r.text


async def test_template_failures_are_400s(tools_client: httpx.AsyncClient) -> None:
    """A Python error inside the template (Jinja does not wrap it) used to be a 500."""
    r = await tools_client.post(
        "/v1/chat/completions", json=_chat(chat_template_kwargs={"tools": 5})
    )
    assert r.status_code == 400, r.text
    assert "chat template failed to render" in r.json()["error"]["message"]
    # an Anthropic tool_use block without a name: refused before the template sees it
    history = {
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "input": {"city": "Paris"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}],
            },
        ],
    }
    r = await tools_client.post("/v1/messages", json=history)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages.1.content.0.name")
    named = json.loads(json.dumps(history))
    named["messages"][1]["content"][0]["name"] = "get_weather"
    r = await tools_client.post("/v1/messages", json=named)
    assert r.status_code == 200, r.text


async def test_a_grammar_that_admits_nothing_is_a_400_before_the_stream(
    client: httpx.AsyncClient,
) -> None:
    """It compiled, so it used to pass the up-front check: 200, then an SSE error carrying
    the parser's internal state dump."""
    body = _chat(stream=True, response_format={"type": "gbnf", "grammar": "root ::= root"})
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        text = (await r.aread()).decode()
    assert r.status_code == 400, text
    message = json.loads(text)["error"]["message"]
    assert "admits no output" in message and "<state>" not in message, message


async def test_logprobs_cover_exactly_the_returned_text(client: httpx.AsyncClient) -> None:
    """Tokens of a matched stop string, and the token that ends the generation, are not part
    of the output; their logprobs used to be returned anyway (text_offset past the text)."""
    base = {"model": "m", "prompt": "Once upon a time", "max_tokens": 12, "logprobs": 0}
    free = (await client.post("/v1/completions", json={**base, "ignore_eos": True})).json()
    toks = free["choices"][0]["logprobs"]["tokens"]
    # a stop string made of tokens 3 and 4, found nowhere before them
    k = next(
        i
        for i in range(2, len(toks) - 1)
        if (toks[i] + toks[i + 1]).strip() and toks[i] + toks[i + 1] not in "".join(toks[: i + 1])
    )
    stop = toks[k] + toks[k + 1]
    for stream in (False, True):
        body = {**base, "ignore_eos": True, "stop": stop, "stream": stream}
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = [
                    json.loads(line[6:])
                    for line in [ln async for ln in r.aiter_lines()]
                    if line.startswith("data: {")
                ]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            got = [
                t
                for c in chunks
                if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]
            ]
        else:
            choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
            text, got = choice["text"], choice["logprobs"]["tokens"]
            assert all(o < len(text) for o in choice["logprobs"]["text_offset"]), choice
        assert text == "".join(toks[:k]), (stream, text, toks)
        assert got == toks[:k], (stream, got, toks)
    # a stop token (here one of the request's stop_token_ids): neither its text nor its logprob
    chat = _chat(max_tokens=12, logprobs=True, return_token_ids=True, ignore_eos=True)
    free = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]
    ids = free["token_ids"]
    entries = free["logprobs"]["content"]
    stop_id = ids[3]
    first = ids.index(stop_id)
    r = await client.post("/v1/chat/completions", json={**chat, "stop_token_ids": [stop_id]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ids[: first + 1]
    lps = choice["logprobs"]["content"]
    assert [e["token"] for e in lps] == [e["token"] for e in entries[:first]]
    assert bytes(b for e in lps for b in e["bytes"]).decode() == choice["message"]["content"]


async def test_anthropic_content_rules_and_usage(client: httpx.AsyncClient) -> None:
    for content in ("", []):
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 422 and "messages.0.content" in r.text, r.text
    # message_start reports the prompt's split as the final usage does: a repeated prompt
    # is read from the KV slot's cache
    body = {
        "model": "m",
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": "Once upon a time"}],
    }
    for _ in range(2):
        async with client.stream("POST", "/v1/messages", json=body) as r:
            events = [
                json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data:")
            ]
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    end = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert end["cache_read_input_tokens"] > 0, end
    for key in ("input_tokens", "cache_read_input_tokens"):
        assert start[key] == end[key], (start, end)


async def test_echo_with_logprobs_scores_the_prompt(client: httpx.AsyncClient) -> None:
    """OpenAI's way to score a prompt (echo, logprobs, max_tokens 0): every prompt token's
    logprob given the ones before it, the first null. It used to leave the prompt's tokens out
    and refuse max_tokens 0."""
    from runtime.sampling import log_softmax

    prompt = "Once upon a time"
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and r.json()["usage"]["completion_tokens"] == 0
    assert "".join(lp["tokens"]) == prompt
    # the scoring forward's time is the turn's (its /profile entry showed none of it)
    assert r.json()["colibri"]["score_ms"] > 0
    turn = (await client.get("/profile")).json()["turns"][0]
    assert (
        turn["score_ms"] == r.json()["colibri"]["score_ms"] and turn["total_ms"] >= turn["score_ms"]
    )
    plain = {"model": "m", "prompt": prompt, "max_tokens": 2}
    assert (await client.post("/v1/completions", json=plain)).json()["colibri"]["score_ms"] is None
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the reference: the model's own logits over the prompt, log-softmaxed
    async with colibri.Engine.open(demo_model()) as engine:
        tok = colibri.tokenizer.ChatTokenizer(
            engine.container.tokenizer_path(), engine.container.tokenizer_config()
        )
        ids = tok.encode(prompt)
        logits = await engine.forward(ids)
    assert len(ids) == len(lp["tokens"])
    for i in range(1, len(ids)):
        row = log_softmax(logits[i - 1])
        assert lp["token_logprobs"][i] == pytest.approx(float(row[ids[i]]), abs=1e-9)
        assert len(lp["top_logprobs"][i]) == 2
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(float(row.max()), abs=1e-9)
    # with tokens generated too: the prompt's entries, then the generated ones, in one list
    more = (await client.post("/v1/completions", json={**body, "max_tokens": 3})).json()
    both = more["choices"][0]["logprobs"]
    assert both["tokens"][: len(ids)] == lp["tokens"] and len(both["tokens"]) == len(ids) + 3
    assert both["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    assert more["choices"][0]["text"].startswith(prompt)
    # max_tokens 0 without echo would generate nothing: refused
    r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.text


async def test_an_echoed_prompt_with_special_tokens_keeps_its_offsets(
    client: httpx.AsyncClient,
) -> None:
    """A prompt that spells special tokens ("<|user|>hello") is echoed as sent; its special
    tokens stood for no text, so every later text_offset pointed too early."""
    c = Container.open(demo_model())
    tok = colibri.tokenizer.ChatTokenizer(c.tokenizer_path(), c.tokenizer_config())
    spelled = [
        tok.token_bytes(i, spelled=True).decode()
        for i in range(tok.vocab_size)
        if tok.is_special(i)
    ]
    special = [t for t in spelled if t.startswith("<|")][:2]
    assert len(special) == 2, spelled
    prompt = f"{special[0]}hello there{special[1]}ok you"
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    text = choice["text"]
    assert text == prompt and "".join(lp["tokens"]) == prompt
    for t, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[off : off + len(t)] == t, (t, off, text)


def test_legacy_top_logprobs_keep_the_most_likely_of_tokens_that_render_alike() -> None:
    """Byte pieces of characters all render as U+FFFD (special tokens as ""): in the legacy
    completions' dict they share one key, which must hold the most likely one's logprob (the
    least likely one's overwrote it)."""
    from colibri.server.generation import TokenLogprob, completion_logprobs

    top = ((7, "\ufffd", -1.95), (9, "a", -2.5), (8, "\ufffd", -2.8), (3, "\ufffd", -5.33))
    lp = TokenLogprob(7, "\ufffd", b"\xc3", -1.95, top, (b"\xc3", b"a", b"\xa9", b"\xbc"))
    doc = completion_logprobs([lp], 4)
    assert doc["top_logprobs"] == [{"\ufffd": -1.95, "a": -2.5}]


async def test_sampling_fields_colibri_does_not_serve_are_refused_not_ignored(
    client: httpx.AsyncClient,
) -> None:
    """min_p and repetition_penalty (vLLM's) ran as if absent, and top_logprobs without
    logprobs returned no logprobs: each is a 400 naming the field now; their neutral values
    (and a logit_bias of zeros) change nothing and are accepted."""
    chat = "/v1/chat/completions"
    for extra, param in (
        ({"min_p": 0.5}, "min_p"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logit_bias": {"5": 2}}, "logit_bias"),
    ):
        r = await client.post(chat, json=_chat(**extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    for extra in ({"min_p": 0}, {"repetition_penalty": 1}, {"logit_bias": {"5": 0}},
                  {"top_logprobs": 2, "logprobs": True}):  # fmt: skip
        r = await client.post(chat, json=_chat(**extra))
        assert r.status_code == 200, (extra, r.text)


async def test_a_request_sets_its_own_drafting(client: httpx.AsyncClient) -> None:
    """The `draft` extension: a request turns drafting off (coli atlas --server needs it: the
    rows a drafted step routes follow timing) or pins it; a bad value is a 400 naming it."""
    for value in ("off", "lookup:2", 2):
        r = await client.post("/v1/chat/completions", json=_chat(draft=value))
        assert r.status_code == 200, (value, r.text)
    bad = await client.post("/v1/chat/completions", json=_chat(draft="sometimes"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "draft", bad.text


async def test_content_of_the_wrong_shape_is_a_4xx_never_a_500(client: httpx.AsyncClient) -> None:
    """A tool_result whose content is a number, a lone block or a list of strings was a 500
    (which SDKs retry); a text block's null or object text went into the prompt as Python's
    "None" / "{'a': 1}"; an Anthropic server tool (web_search) was offered to the model as a
    function the client never defined."""
    user = {"role": "user", "content": "Weather?"}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w",
                                              "input": {}}]}  # fmt: skip
    base = {"model": "m", "max_tokens": 2}
    for content in (5, {"type": "text", "text": "x"}, ["sunny"], [None]):
        result = {"type": "tool_result", "tool_use_id": "t1", "content": content}
        msgs = [user, call, {"role": "user", "content": [result]}]
        r = await client.post("/v1/messages", json={**base, "messages": msgs})
        assert r.status_code == 400, (content, r.status_code, r.text)
    for text in (None, {"a": 1}):
        block = [{"type": "text", "text": text}]
        r = await client.post(
            "/v1/messages", json={**base, "messages": [{"role": "user", "content": block}]}
        )
        assert r.status_code == 400 and "string" in r.text, (text, r.text)
        r = await client.post("/v1/messages", json={**base, "messages": [user], "system": block})
        assert r.status_code == 400, r.text
        r = await client.post(
            "/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": block}])
        )
        assert r.status_code == 400 and "string" in r.text, (text, r.text)
    web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    r = await client.post("/v1/messages", json={**base, "messages": [user], "tools": [web]})
    assert r.status_code == 422 and "tools" in r.text, r.text


async def test_a_prompt_far_past_the_context_is_refused_without_tokenizing_it(
    client: httpx.AsyncClient,
) -> None:
    """A 3.9 MB prompt to a model of a 1,024-token context was tokenized whole (seconds of a
    text thread, GBs of memory) only to be refused: its byte count alone proves it too long."""
    r = await client.post(
        "/v1/completions", json={"model": "m", "prompt": "hello world " * 300_000, "max_tokens": 1}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err


async def test_a_tool_schema_the_server_cannot_read_is_refused_before_generating(
    client: httpx.AsyncClient,
) -> None:
    """``properties`` that is not an object was accepted; the whole answer was generated and
    then, when the model called that tool, the response was a 500 (streamed: an error event
    after the text)."""
    for bad in ("bad", [1]):
        schema = {"type": "object", "properties": bad}
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        r = await client.post("/v1/chat/completions", json=_chat(tools=tools))
        assert r.status_code == 422 and "tools.0.function.parameters" in r.text, r.text
        assert "'properties' must be an object" in r.text, r.text
        body = {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": schema}],
        }
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 422 and "tools.0.input_schema" in r.text, r.text


async def test_tool_calls_the_model_writes_are_always_strict_json(
    client: httpx.AsyncClient,
) -> None:
    """A call whose model-written value was NaN / 1e999 came back as arguments '{"n": NaN}'
    (JSON.parse refuses it), and one with a lone surrogate escape ("\\ud800") was a 500
    (streamed: an error event instead of the call): it cannot be encoded. Text around a call
    kept its spaces only when it had no line break ("See<call> you" came back "Seeyou")."""
    import re

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    glm = (
        "See<tool_call>f<arg_key>n</arg_key><arg_value>NaN</arg_value><arg_key>big</arg_key>"
        "<arg_value>1e999</arg_value><arg_key>ok</arg_key><arg_value>[1.5]</arg_value>"
        "</tool_call> you"
    )
    surrogate = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800x\\ud83d\\ude00"}}</tool_call>'
    not_json = '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'

    def strict(text: str) -> Any:
        def refuse(name: str) -> None:
            raise ValueError(name)

        return json.loads(text, parse_constant=refuse)

    for forced, content, args in (
        (glm, "See you", {"n": "NaN", "big": "1e999", "ok": [1.5]}),
        (surrogate, None, {"a": "\ufffdx\U0001f600"}),
        (not_json, not_json, None),  # not JSON at all: the block stays text
    ):
        fmt = {"type": "regex", "grammar": re.escape(forced)}
        body = _chat(tools=tools, response_format=fmt, max_tokens=200)
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == content, msg
        if args is None:
            assert not msg.get("tool_calls"), msg
            continue
        assert [strict(c["function"]["arguments"]) for c in msg["tool_calls"]] == [args]
        async with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as s:
            lines = [line[6:] async for line in s.aiter_lines() if line.startswith("data: {")]
        chunks = [json.loads(x) for x in lines]
        assert not [c for c in chunks if "error" in c], chunks
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        streamed = "".join(d["function"]["arguments"] for x in deltas
                           for d in x.get("tool_calls") or ())  # fmt: skip
        assert strict(streamed) == args
        assert "".join(x.get("content") or "" for x in deltas) == (content or "")


async def test_anthropic_blocks_in_the_wrong_role_say_so(client: httpx.AsyncClient) -> None:
    """A tool_use block in a user message was refused as 'not supported (text, thinking,
    tool_use, tool_result)', a list naming it; an image in a tool_result named the wrong path."""
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    for messages, say, param in (
        ([{"role": "user", "content": [use]}], "belongs in an assistant message", "0.content.0"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [result]}],
            "belongs in a user message",
            "1.content.0",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{**result, "content": [image]}]},
            ],
            "not supported here",
            "2.content.0.content.0",
        ),
    ):
        body = {"model": "m", "max_tokens": 2, "messages": messages}
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert say in err["message"] and err.get("param", "messages." + param) == (
            "messages." + param
        ), err


def test_anthropic_stop_sequence_is_set_only_with_its_stop_reason() -> None:
    """An answer that called tools and then hit a stop sequence said stop_reason tool_use
    with stop_sequence set (Anthropic's contract: non-null only for stop_sequence)."""
    from colibri.server.anthropic_routes import _stop_reason, _stop_sequence
    from colibri.server.generation import Result
    from colibri.server.textproc import ParsedToolCall

    call = ParsedToolCall("call_1", "f", "{}")
    for calls, finish, reason, seq in (
        ([call], "stop", "tool_use", None),
        ([], "stop", "stop_sequence", "END"),
        ([call], "length", "max_tokens", None),
    ):
        res = Result(finish, "END" if finish == "stop" else None, "", "", calls, [], [], None)  # type: ignore[arg-type]
        assert (_stop_reason(res), _stop_sequence(res)) == (reason, seq)


async def test_a_parser_limit_reached_mid_output_names_response_format(
    client: httpx.AsyncClient,
) -> None:
    """A wide anyOf after another property passes the up-front check (the first tokens are
    fine) and reaches the constraint parser's row limit later: the 400 had param null and
    called it 'the response grammar'."""
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}},
                       "required": [f"k{i}"], "additionalProperties": False}
                      for i in range(2500)]}  # fmt: skip
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3}, "b": wide},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = await client.post("/v1/chat/completions", json=_chat(response_format=fmt, max_tokens=64))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format", err
    assert "json_schema grammar is too large for the constraint parser" in err["message"], err


async def test_seeds_outside_openais_range_are_422s(client: httpx.AsyncClient) -> None:
    """Seeds were taken modulo 2**64 without a word: 5 and 5 + 2**64 drew the same text."""
    for seed in (2**64 + 5, 2**63, -(2**63) - 1):
        r = await client.post("/v1/chat/completions", json=_chat(seed=seed, temperature=1))
        assert r.status_code == 422 and "seed" in r.text, (seed, r.text)
    for seed in (2**63 - 1, -(2**63), -1):
        r = await client.post("/v1/chat/completions", json=_chat(seed=seed, temperature=1))
        assert r.status_code == 200, (seed, r.text)


async def test_cross_site_posts_are_refused_without_a_key(tmp_path: Path) -> None:
    """A web page could POST to a keyless loopback server (a form, or a no-cors fetch of
    text/plain, which browsers send without asking): it generated, filled the queue and
    overwrote a saved KV slot. A request naming another Origin is a 403; the server's own
    origin (the dashboard), --cors-origin origins and clients that send no Origin pass."""
    body = json.dumps(_chat())
    plain = {"content-type": "text/plain"}
    async for c in _client(demo_model(), tmp_path, cors_origins=("https://good.example",)):
        r = await c.post("/v1/chat/completions", content=body,
                         headers={**plain, "origin": "https://evil.example"})  # fmt: skip
        assert r.status_code == 403 and "cross-site" in r.text, r.text
        r = await c.post("/v1/messages", content=body, headers={"origin": "null"})
        assert r.status_code == 403, r.text
        for ok in ({"origin": "http://localhost"}, {"origin": "https://good.example"}, {}):
            r = await c.post("/v1/chat/completions", content=body, headers={**plain, **ok})
            assert r.status_code == 200, (ok, r.text)
        r = await c.get("/v1/models", headers={"origin": "https://evil.example"})
        assert r.status_code == 200  # (reading is CORS's business: the page sees nothing)
    async for c in _client(demo_model(), tmp_path / "k", api_key="sekret"):
        # with a key the key protects (a page cannot send it); an empty x-api-key header
        # no longer hides a good Bearer token
        headers = {"origin": "https://evil.example", "authorization": "Bearer sekret"}
        r = await c.post("/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions", content=body,
                         headers={"x-api-key": "", "authorization": "Bearer sekret"})  # fmt: skip
        assert r.status_code == 200, r.text


async def test_an_integer_python_cannot_read_is_a_400(client: httpx.AsyncClient) -> None:
    """A 5000-digit integer literal (past Python's 4300-digit limit) was a 500 with two
    tracebacks in the log."""
    body = json.dumps(_chat())[:-1] + ', "seed": ' + "1" * 5000 + "}"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "cannot be read" in r.text, (path, r.text)


def test_security_odds_and_ends(tmp_path: Path) -> None:
    """--host 0 binds every interface but was taken for a host name (every LAN request 421);
    a key file saved with a BOM was refused as 'not printable ASCII' without naming it."""
    from colibri.cli import _key_file
    from colibri.server.security import allowed_hosts

    assert allowed_hosts("0") is None and allowed_hosts("0.0.0.0") is None
    # an origin with a trailing slash matched no page (the CORS middleware compares exactly)
    assert ServerConfig(cors_origins=(" http://good.example/",)).cors_origins == (
        "http://good.example",
    )
    f = tmp_path / "keys"
    f.write_bytes(b"\xef\xbb\xbfmykey123\r\n# comment\nsecond\n")
    assert _key_file(f) == ["mykey123", "second"]
    f.write_bytes("caf\u00e9\n".encode())
    with pytest.raises(ColibriError, match=f"--api-key-file {f}: a key holds"):
        _key_file(f)


async def test_a_template_that_adds_arguments_to_a_string_renders_them(tmp_path: Path) -> None:
    """DeepSeek-V3's template adds a tool call's arguments to a string (the JSON text clients
    send); colibri hands templates objects (GLM's and MiniMax's iterate them), and every
    conversation that went on after a tool call was a 400 template_error."""
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
        "{% for tc in m.tool_calls or [] %}"
        "{{ 'call ' + tc['function']['name'] + ' ' + tc['function']['arguments'] }}"
        "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model_dir = tools_model(tmp_path, template)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    async for c in _client(model_dir, tmp_path / "state", kv_slots=0):
        r = await c.post("/v1/chat/completions", json=_chat(messages=messages))
        assert r.status_code == 200, r.text


async def test_a_draft_mode_the_model_cannot_run_is_a_400_naming_draft(tmp_path: Path) -> None:
    """draft 'mtp' to a model without an MTP head failed once generating: a 400 with param
    null telling an HTTP client to pass '--draft'."""
    import shutil

    model_dir = Path(shutil.copytree(demo_model(), tmp_path / "no_mtp"))
    (model_dir / "colibri-manifest.json").unlink(missing_ok=True)
    next(model_dir.glob("out-mtp-*.safetensors")).unlink()
    async for c in _client(model_dir, tmp_path / "state", kv_slots=0):
        r = await c.post("/v1/chat/completions", json=_chat(draft="mtp"))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "draft" and "needs the model's MTP head" in err["message"], err
        assert "use draft 'lookup' or 'auto'" in err["message"], err
        r = await c.post("/v1/chat/completions", json=_chat(draft="lookup"))
        assert r.status_code == 200, r.text


async def test_a_deepseek_tool_call_comes_back_as_tool_calls(tmp_path: Path) -> None:
    """A DeepSeek-V3 model's call (forced here by a grammar) came back as content with
    finish_reason stop: now as tool_calls, whole and streamed, with the text before it as
    content and none of the block's markers; cut by max_tokens it stays text."""
    import re

    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    call = (
        "Let me look.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    body = _chat(
        tools=tools,
        max_tokens=200,
        temperature=0,
        response_format={"type": "regex", "grammar": re.escape(call)},
    )
    async for c in _client(tools_model(tmp_path, template), tmp_path / "state", kv_slots=0):
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice, n = r.json()["choices"][0], r.json()["usage"]["completion_tokens"]
        assert choice["finish_reason"] == "tool_calls", choice
        msg = choice["message"]
        assert msg["content"] == "Let me look.\n", msg  # (what the stream sent before it)
        [got] = msg["tool_calls"]
        assert got["function"]["name"] == "get_weather"
        assert json.loads(got["function"]["arguments"]) == {"city": "Paris"}
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [
            json.loads(line[6:])["choices"]
            for line in r.text.splitlines()
            if line.startswith("data: {")
        ]
        deltas = [ch[0]["delta"] for ch in chunks if ch]
        content = "".join(d.get("content") or "" for d in deltas)
        streamed = [t for d in deltas for t in d.get("tool_calls") or []]
        assert content == msg["content"], deltas
        assert [t["function"]["name"] for t in streamed] == ["get_weather"], deltas
        assert [ch[0]["finish_reason"] for ch in chunks if ch][-1] == "tool_calls"
        # cut by max_tokens before the section closes: a truncated call stays text
        r = await c.post("/v1/chat/completions", json={**body, "max_tokens": n - 3})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
        assert "<｜tool▁calls▁begin｜>" in choice["message"]["content"], choice
