"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Streaming answers are SSE ``data: {chunk}`` lines ending with ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries ``usage``.
Responses add ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens taken from a KV slot)
and a ``colibri`` object (queue wait, TTFT, tokens computed vs reused, decode speed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from contextlib import aclosing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from colibri.server.errors import ApiError, validation_error
from colibri.server.generation import (
    Generation,
    GenParams,
    Result,
    check_prompt,
    completion_logprobs,
    logprob_entry,
    new_id,
    template_messages,
)
from colibri.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Extensions,
)
from colibri.server.security import read_body, tenant_of
from colibri.server.sse import GenerationResponse, Responder, Runner, sse
from colibri.server.state import AppState, Ticket
from colibri.server.textproc import THINK_START
from storage.errors import ColibriError

__all__ = ["openai_routes", "parse_body", "sampling_defaults", "state_of"]

M = TypeVar("M", bound=BaseModel)


def state_of(request: Request) -> AppState:
    st: AppState = request.app.state.colibri
    return st


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model``: 400 for bad JSON, 413 too big, 422 bad fields."""
    st = state_of(request)
    raw = await read_body(request, st.config.max_body)
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(
            400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    problem = check_json_text(data)
    if problem is not None:
        raise ApiError(400, problem, code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; real requests need a handful


def check_json_text(data: Any) -> str | None:
    """Why a decoded body cannot be served, or None: nesting beyond :data:`MAX_JSON_DEPTH`, or
    a string (value or key) that is not valid Unicode text (a lone UTF-16 surrogate from a
    ``\\ud800`` escape: no tokenizer can encode it). Iterative, so depth costs no stack."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "$")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return f"{path}: the text holds a lone UTF-16 surrogate (not valid Unicode)"
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            return f"the body nests deeper than {MAX_JSON_DEPTH} levels (at {path})"
        if isinstance(node, dict):
            for k, v in node.items():
                stack.append((k, depth, f"{path} (a key)"))
                stack.append((v, depth + 1, f"{path}.{k}"))
        else:
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def check_model(st: AppState, name: str) -> None:
    if name != st.model_name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist here; this server serves {st.model_name!r}",
            param="model",
            code="model_not_found",
        )


def sampling_defaults(st: AppState) -> dict[str, Any]:
    """Defaults from the model's generation_config.json (greedy when it says do_sample false)."""
    gc = st.engine.container.generation_config
    sample = gc.get("do_sample", True) is not False
    return {
        "temperature": float(gc.get("temperature", 1.0)) if sample else 0.0,
        "top_p": float(gc.get("top_p", 1.0)) if sample else 1.0,
        "top_k": int(gc.get("top_k", 0) or 0) if sample else 0,
    }


def common_params(
    st: AppState,
    req: Extensions,
    *,
    ids: list[int],
    tenant: str | None = None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
) -> GenParams:
    """Sampling, stops, slot and limits shared by every API."""
    d = sampling_defaults(st)
    temp = d["temperature"] if temperature is None else float(temperature)
    tp = d["top_p"] if top_p is None else float(top_p)
    if tp == 0.0:  # "only the most likely token"
        temp, tp = 0.0, 1.0
    top_k = d["top_k"] if req.top_k is None else max(0, req.top_k)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise ApiError(400, "at most 16 stop sequences", param="stop")
    if req.cache_slot is not None and req.cache_slot >= len(st.slots):
        n = len(st.slots)
        raise ApiError(
            400,
            f"cache_slot {req.cache_slot} does not exist: this server has {n} KV slots "
            f"(0..{n - 1}; start it with --kv-slots N for more)"
            if n
            else "this server has no KV slots (start it with --kv-slots N)",
            param="cache_slot",
        )
    stop_ids: list[int] | None = None
    if req.ignore_eos:
        stop_ids = list(req.stop_token_ids or [])
    elif req.stop_token_ids:
        stop_ids = sorted(set(st.engine.container.eos_token_ids) | set(req.stop_token_ids))
    return GenParams(
        prompt_ids=ids,
        max_tokens=check_prompt(st, ids, max_tokens),
        temperature=temp,
        top_p=tp,
        top_k=top_k,
        seed=None if seed is None else seed % 2**64,
        stop=stops,
        stop_token_ids=stop_ids,
        slot=req.cache_slot if req.cache_slot is not None else _auto_slot(st, ids, tenant),
        slot_explicit=req.cache_slot is not None,
        tenant=tenant,
    )


def _auto_slot(st: AppState, ids: list[int], tenant: str | None) -> int | None:
    """The slot a request without ``cache_slot`` runs in (automatic prefix matching), per
    ``--prefix-reuse``: None (a fresh cache) when it is off."""
    scope = st.config.reuse_scope
    if scope == "off":
        return None
    return st.slots.pick(ids, tenant=tenant if scope == "key" else None, scoped=scope == "key")


def _refuse_unsupported(
    *,
    n: int,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    logit_bias: Mapping[str, float] | None,
) -> None:
    if n != 1:
        raise ApiError(400, "n > 1 is not supported: send n=1 (or several requests)", param="n")
    for name, v in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        if v:
            raise ApiError(400, f"{name} is not supported (send 0 or omit it)", param=name)
    if logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")


def queue_headers(wait_s: float) -> dict[str, str]:
    return {"x-colibri-queue-wait-ms": f"{wait_s * 1000:.1f}"}


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
            for part in content:
                kind = part.get("type")
                if kind in ("text", "input_text"):
                    parts.append(str(part.get("text", "")))
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


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    st = state_of(request)
    req = await parse_body(request, ChatCompletionRequest)
    check_model(st, req.model)
    _refuse_unsupported(
        n=req.n,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias,
    )
    grammar = _grammar_from(req.response_format)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if isinstance(choice, dict) or choice == "required":
        raise ApiError(
            400,
            "tool_choice 'required' or a named function is not supported (no constrained "
            "decoding yet); use 'auto' or 'none'",
            param="tool_choice",
        )
    if choice == "none":
        tools = None
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
    if tools:
        extra["tools"] = tools
    if req.enable_thinking is not None:
        extra["enable_thinking"] = req.enable_thinking
    if req.reasoning_effort is not None:
        extra["reasoning_effort"] = req.reasoning_effort
    messages = _message_dicts(req)
    try:
        text = await st.off_loop(lambda: st.tokenizer.apply_chat_template(messages, **extra))
    except ColibriError as exc:
        raise ApiError(400, str(exc), param="messages", code="template_error") from exc
    ids = await st.encode_prompt(text)
    params = common_params(
        st,
        req,
        ids=ids,
        tenant=tenant_of(request),
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=req.stop,
    )
    params.logprobs = req.logprobs
    params.top_logprobs = req.top_logprobs or 0
    params.think = st.think_template
    params.think_open = st.think_template and text.rstrip().endswith(THINK_START)
    params.tools = tools
    params.grammar = grammar
    rid = new_id("chatcmpl-")
    gen = Generation(st, params, "/v1/chat/completions", rid)
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    ticket = st.admission.reserve()

    def base(obj: str) -> dict[str, Any]:
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": st.model_name,
            "system_fingerprint": f"colibri-{st.engine_identity}",
        }

    async def stream(r: Responder) -> None:
        async with st.admission.enter(ticket, st.slots, params.slot) as lease:
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
        async with st.admission.enter(ticket, st.slots, params.slot) as lease:
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
        body = {
            **base("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": _finish(res),
                }
            ],
            "usage": usage(res),
            "colibri": res.stats(),
        }
        if req.return_token_ids:
            body["choices"][0]["token_ids"] = res.token_ids
            body["prompt_token_ids"] = params.prompt_ids
        await r.json(200, body, queue_headers(ticket.wait_s))

    return _respond(st, ticket, stream if req.stream else whole, req.stream)


def _respond(st: AppState, ticket: Ticket, runner: Runner, stream: bool) -> Response:
    """The response that runs ``runner``; the queue place is given back however it ends."""
    resp = GenerationResponse(runner, stream=stream, on_finish=lambda: st.admission.cancel(ticket))
    return resp  # type: ignore[return-value]  # an ASGI app; Starlette just awaits it


# ------------------------------------------------------------------------------ completions


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    st = state_of(request)
    req = await parse_body(request, CompletionRequest)
    check_model(st, req.model)
    _refuse_unsupported(
        n=req.n,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias,
    )
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of")
    if req.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
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
        ids = await st.encode_prompt(prompt_text, "prompt")
    params = common_params(
        st,
        req,
        ids=ids,
        tenant=tenant_of(request),
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=req.stop,
    )
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
    ticket = st.admission.reserve()

    def base() -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": st.model_name,
            "system_fingerprint": f"colibri-{st.engine_identity}",
        }

    async def stream(r: Responder) -> None:
        async with st.admission.enter(ticket, st.slots, params.slot) as lease:
            await r.start(200, queue_headers(ticket.wait_s), "text/event-stream")
            offset = len(echo)
            if echo:
                c = {"index": 0, "text": echo, "logprobs": None, "finish_reason": None}
                await r.body(sse({**base(), "choices": [c]}))
            async with aclosing(gen.run(lease)) as deltas:
                async for d in deltas:
                    lp = completion_logprobs(d.logprobs, n_top, offset) if params.logprobs else None
                    offset += len(d.text)
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
        async with st.admission.enter(ticket, st.slots, params.slot) as lease:
            res = await gen.complete(lease)
        text = res.reasoning + res.content
        lp = completion_logprobs(res.logprobs, n_top, len(echo)) if params.logprobs else None
        body = {
            **base(),
            "choices": [
                {"index": 0, "text": echo + text, "logprobs": lp, "finish_reason": _finish(res)}
            ],
            "usage": usage(res),
            "colibri": res.stats(),
        }
        if req.return_token_ids:
            body["choices"][0]["token_ids"] = res.token_ids
            body["prompt_token_ids"] = params.prompt_ids
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
