"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Streaming answers are SSE ``data: {chunk}`` lines ending with ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries ``usage``.
Responses add ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens taken from a KV slot)
and a ``colibri`` object (queue wait, TTFT, tokens computed vs reused, decode speed).
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from colibri.server.errors import ApiError
from colibri.server.generation import (
    Generation,
    GenParams,
    Result,
    TextOffsets,
    completion_logprobs,
    logprob_entry,
    new_id,
    template_messages,
)
from colibri.server.requests import (
    block_text,
    chat_params,
    check_model,
    common_params,
    openai_object,
    parse_body,
    queue_headers,
    refuse_unsupported,
    render_chat,
    state_of,
    template_extra,
)
from colibri.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
)
from colibri.server.sse import GenerationResponse, Responder, Runner, sse
from colibri.server.state import AppState, Ticket
from storage.errors import ColibriError

__all__ = ["openai_routes"]


def usage(res: Result) -> dict[str, Any]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": res.turn.prompt_tokens_reused},
    }


def _finish(res: Result) -> str:
    return res.finish_reason if res.finish_reason != "cancelled" else "stop"


# ------------------------------------------------------------------------------------ chat


def _message_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        content = d.get("content")
        if isinstance(content, list):
            parts: list[str] = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("text", "input_text"):
                    parts.append(block_text(part, "text", f"messages.{i}.content.{k}"))
                else:
                    raise ApiError(
                        400,
                        f"messages[{i}]: content part type {kind!r} is not supported (text only)",
                        param=f"messages.{i}.content",
                    )
            d["content"] = "".join(parts)
        out.append(d)
    return template_messages(out)


def _grammar_from(response_format: dict[str, Any] | None) -> Any:
    """``response_format`` (text / json_object / json_schema, or the gbnf extension) -> a
    sampling constraint; a bad schema or grammar is a 400."""
    from runtime.grammar import GrammarSpec

    if not response_format:
        return None
    try:
        return GrammarSpec.from_response_format(response_format)
    except ColibriError as exc:
        raise ApiError(400, f"response_format: {exc}", param="response_format") from exc


async def _checked_grammar(st: AppState, response_format: dict[str, Any] | None) -> Any:
    """:func:`_grammar_from`, compiled against the model's tokenizer now (off the loop): an
    invalid or unsatisfiable grammar is a 400 before a stream starts, not an SSE error."""
    grammar = _grammar_from(response_format)
    if grammar is not None:
        try:
            await st.engine.check_grammar(grammar)
        except ColibriError as exc:
            raise ApiError(400, f"response_format: {exc}", param="response_format") from exc
    return grammar


OpenAIRequest = TypeVar("OpenAIRequest", ChatCompletionRequest, CompletionRequest)


async def _openai_request(
    request: Request, model: type[OpenAIRequest]
) -> tuple[AppState, OpenAIRequest]:
    """The validated body of an OpenAI generation route, its model checked and the fields
    colibri does not serve refused."""
    st = state_of(request)
    req = await parse_body(request, model)
    check_model(st, req.model)
    refuse_unsupported(
        n=req.n,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
    )
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return st, req


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    st, req = await _openai_request(request, ChatCompletionRequest)
    grammar = await _checked_grammar(st, req.response_format)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if isinstance(choice, dict) or choice == "required":
        raise ApiError(
            400,
            "tool_choice 'required' or a named function is not supported (the model is not "
            "constrained to call a tool); use 'auto' or 'none'",
            param="tool_choice",
        )
    if choice == "none":
        tools = None
    # Structured output is the answer: a template that would open a think section first is
    # asked not to for any grammar (unless the request sets enable_thinking), and JSON output
    # comes back as content even where the prompt still ends inside <think> (it went to
    # reasoning_content, content empty: a JSON grammar never lets the model close the
    # section). A regex, GBNF or Lark grammar with thinking asked for may close the section
    # itself ("</think>" in the grammar): its output is split as usual.
    thinking = req.enable_thinking
    asked = "enable_thinking" in (req.chat_template_kwargs or {})
    if grammar is not None and thinking is None and not asked:
        thinking = False
    extra = template_extra(req, tools, thinking)
    if req.reasoning_effort is not None:
        extra["reasoning_effort"] = req.reasoning_effort
    messages = _message_dicts(req)
    text, ids = await render_chat(st, messages, extra)
    params = common_params(
        st,
        request,
        req,
        ids=ids,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        stop=req.stop,
        max_tokens_param=(
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        ),
    )
    params.logprobs = req.logprobs
    params.top_logprobs = req.top_logprobs or 0
    chat_params(st, params, text, tools)
    params.one_call = req.parallel_tool_calls is False
    params.grammar = grammar
    if grammar is not None and grammar.kind in ("json_object", "json_schema"):
        params.think = params.think_open = False
    rid = new_id("chatcmpl-")
    gen = Generation(st, params, "/v1/chat/completions", rid)
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    ticket = st.admission.reserve()

    def base(obj: str) -> dict[str, Any]:
        return openai_object(st, rid, obj, created)

    async def stream(r: Responder) -> None:
        async with gen.admitted(ticket) as lease:
            await r.start(200, queue_headers(ticket.wait_s), "text/event-stream")
            first = {
                **base("chat.completion.chunk"),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            await r.body(sse(first))
            async with aclosing(gen.run(lease)) as deltas:
                async for d in deltas:
                    key = "content" if d.kind == "content" else "reasoning_content"
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": {key: d.text},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if req.logprobs and d.logprobs:
                        n = params.top_logprobs
                        choice["logprobs"] = {"content": [logprob_entry(x, n) for x in d.logprobs]}
                    await r.body(sse({**base("chat.completion.chunk"), "choices": [choice]}))
        res = gen.final()
        if res.tool_calls:
            calls = [
                {
                    "index": i,
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(res.tool_calls)
            ]
            await r.body(
                sse(
                    {
                        **base("chat.completion.chunk"),
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"tool_calls": calls},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            )
        end: dict[str, Any] = {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": _finish(res),
        }
        last = {**base("chat.completion.chunk"), "choices": [end], "colibri": res.stats()}
        if req.return_token_ids:
            end["token_ids"] = res.token_ids
            last["prompt_token_ids"] = params.prompt_ids
        await r.body(sse(last))
        if include_usage:
            await r.body(sse({**base("chat.completion.chunk"), "choices": [], "usage": usage(res)}))
        await r.body(sse("[DONE]"))

    async def whole(r: Responder) -> None:
        async with gen.admitted(ticket) as lease:
            res = await gen.complete(lease)
        message: dict[str, Any] = {"role": "assistant", "content": res.content}
        if res.reasoning or params.think:
            message["reasoning_content"] = res.reasoning
        if res.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in res.tool_calls
            ]
            message["content"] = res.content or None
        logprobs = None
        if req.logprobs:
            logprobs = {"content": [logprob_entry(x, params.top_logprobs) for x in res.logprobs]}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _finish(res),
        }
        body = _whole_body(base("chat.completion"), choice, res, req, params)
        await r.json(200, body, queue_headers(ticket.wait_s))

    return _respond(st, ticket, stream if req.stream else whole, req.stream)


def _whole_body(
    head: dict[str, Any],
    choice: dict[str, Any],
    res: Result,
    req: ChatCompletionRequest | CompletionRequest,
    params: GenParams,
) -> dict[str, Any]:
    """A non-streamed answer: the object's envelope, its one choice, usage and colibri's
    stats; with ``return_token_ids`` the choice's and the prompt's token ids."""
    body = {**head, "choices": [choice], "usage": usage(res), "colibri": res.stats()}
    if req.return_token_ids:
        choice["token_ids"] = res.token_ids
        body["prompt_token_ids"] = params.prompt_ids
    return body


def _respond(st: AppState, ticket: Ticket, runner: Runner, stream: bool) -> Response:
    """The response that runs ``runner``; the queue place is given back however it ends."""
    resp = GenerationResponse(
        runner, stream=stream, on_finish=lambda: st.admission.cancel(ticket), stopping=st.stopping
    )
    return resp  # type: ignore[return-value]  # an ASGI app; Starlette just awaits it


# ------------------------------------------------------------------------------ completions

#: the most logits bytes ([T, V] float32) scoring an echoed prompt may hold at once
PROMPT_SCORE_MAX_BYTES = 1 << 30


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    st, req = await _openai_request(request, CompletionRequest)
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of")
    if req.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(
            400,
            "max_tokens 0 generates nothing; with echo (and logprobs) it scores the prompt",
            param="max_tokens",
        )
    prompt = req.prompt
    prompt_text: str | None = None
    if isinstance(prompt, str):
        prompt_text = prompt
    elif prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, "several prompts in one request are not supported", param="prompt")
        first = prompt[0]
        if isinstance(first, str):
            prompt_text = first
        else:
            ids = [int(t) for t in first]
    else:
        ids = [int(t) for t in prompt if isinstance(t, int)]
    if prompt_text is not None:
        ids = await st.encode_prompt(prompt_text, "prompt", raw=True)
    params = common_params(
        st, request, req, ids=ids, max_tokens=req.max_tokens, stop=req.stop, prompt_param="prompt"
    )
    params.grammar = await _checked_grammar(st, req.response_format)
    n_top = req.logprobs or 0
    params.logprobs = req.logprobs is not None
    params.top_logprobs = n_top
    rid = new_id("cmpl-")
    gen = Generation(st, params, "/v1/completions", rid)
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = ""
    if req.echo:
        echo = (
            prompt_text if prompt_text is not None else await st.off_loop(st.tokenizer.decode, ids)
        )
    # echo with logprobs: the prompt's tokens are scored too (each given the ones before it),
    # one forward whose logits [T, V] are held at once
    score = req.echo and params.logprobs
    if score and len(ids) * st.vocab_size * 4 > PROMPT_SCORE_MAX_BYTES:
        most = PROMPT_SCORE_MAX_BYTES // (4 * st.vocab_size)
        raise ApiError(
            400,
            f"echo with logprobs scores at most {most} prompt tokens on this model (the "
            f"prompt has {len(ids)})",
            param="prompt",
        )
    ticket = st.admission.reserve()

    async def echoed() -> dict[str, Any] | None:
        """The echoed prompt's logprobs (None without them)."""
        if not score:
            return None
        lps = await gen.prompt_logprobs(n_top, prompt_text)
        return completion_logprobs(lps, n_top, unscored_first=True)

    def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
        if a is None or b is None:
            return a or b
        return {k: None if a[k] is None else a[k] + b[k] for k in a}

    def base() -> dict[str, Any]:
        return openai_object(st, rid, "text_completion", created)

    async def stream(r: Responder) -> None:
        async with gen.admitted(ticket) as lease:
            await r.start(200, queue_headers(ticket.wait_s), "text/event-stream")
            offsets = TextOffsets(len(echo))
            if echo:
                c = {"index": 0, "text": echo, "logprobs": await echoed()}
                c["finish_reason"] = None
                await r.body(sse({**base(), "choices": [c]}))
            async with aclosing(gen.run(lease)) as deltas:
                async for d in deltas:
                    lp = (
                        completion_logprobs(d.logprobs, n_top, offsets) if params.logprobs else None
                    )
                    c = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": None}
                    await r.body(sse({**base(), "choices": [c]}))
        res = gen.final()
        c = {"index": 0, "text": "", "logprobs": None, "finish_reason": _finish(res)}
        last = {**base(), "choices": [c], "colibri": res.stats()}
        if req.return_token_ids:
            c["token_ids"] = res.token_ids
            last["prompt_token_ids"] = params.prompt_ids
        await r.body(sse(last))
        if include_usage:
            await r.body(sse({**base(), "choices": [], "usage": usage(res)}))
        await r.body(sse("[DONE]"))

    async def whole(r: Responder) -> None:
        async with gen.admitted(ticket) as lease:
            prompt_lp = await echoed()
            res = await gen.complete(lease)
        text = res.reasoning + res.content
        lp = (
            completion_logprobs(res.logprobs, n_top, TextOffsets(len(echo)))
            if params.logprobs
            else None
        )
        lp = joined(prompt_lp, lp)
        choice = {"index": 0, "text": echo + text, "logprobs": lp, "finish_reason": _finish(res)}
        body = _whole_body(base(), choice, res, req, params)
        await r.json(200, body, queue_headers(ticket.wait_s))

    return _respond(st, ticket, stream if req.stream else whole, req.stream)


# ------------------------------------------------------------------------------------ models


def model_card(st: AppState) -> dict[str, Any]:
    return {
        "id": st.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "colibri",
        "max_model_len": st.context_length,
    }


async def list_models(request: Request) -> Response:
    """``GET /v1/models``."""
    st = state_of(request)
    return JSONResponse({"object": "list", "data": [model_card(st)]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``."""
    st = state_of(request)
    check_model(st, request.path_params["model"])
    return JSONResponse(model_card(st))


def openai_routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
