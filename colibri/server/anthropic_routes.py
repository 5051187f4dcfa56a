"""Anthropic Messages API: ``POST /v1/messages``.

Non-streaming: a ``message`` object with ``content`` blocks (``thinking`` when the template has
a think section, ``text``, ``tool_use``), ``stop_reason`` (end_turn, max_tokens, stop_sequence,
tool_use) and ``usage`` (``input_tokens`` computed, ``cache_read_input_tokens`` reused from a KV
slot, ``output_tokens``). Streaming: the SSE events ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta`` (``text_delta`` / ``thinking_delta`` / ``input_json_delta``),
``content_block_stop``, ``message_delta``, ``message_stop``; errors mid-stream as ``error``.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from colibri.server.errors import ApiError
from colibri.server.generation import Generation, Result, new_id, template_messages
from colibri.server.requests import (
    block_text,
    chat_params,
    check_model,
    common_params,
    parse_body,
    render_chat,
    state_of,
    template_extra,
)
from colibri.server.schemas import MessagesRequest
from colibri.server.sse import GenerationResponse, Responder, sse

__all__ = ["anthropic_routes", "to_template_messages"]


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):  # an int or a lone block was a 500
        raise ApiError(400, f"{where}: a string or a list of text blocks", param=where)
    parts: list[str] = []
    for k, block in enumerate(content):
        at = f"{where}.{k}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(block_text(block, "text", at))
        else:
            raise ApiError(400, f"{at}: block type {kind!r} is not supported here", param=at)
    return "".join(parts)


# Blocks only one role may send (Anthropic's API refuses them in the other).
_ROLE_OF_BLOCK = {"thinking": "an assistant", "tool_use": "an assistant", "tool_result": "a user"}


def to_template_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic messages -> chat-template messages (system, tool calls and results included)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(block_text(block, "text", where))
            elif kind == "thinking" and m.role == "assistant":
                thinking.append(block_text(block, "thinking", where))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and m.role == "assistant":
                name, args = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not name:
                    raise ApiError(400, f"{where}.name: a tool_use block needs a name", param=where)
                if not isinstance(args, dict):
                    raise ApiError(
                        400, f"{where}.input: a tool_use block's input is an object", param=where
                    )
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {
                            "name": name,
                            "arguments": json.dumps(args),
                        },
                    }
                )
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(
                        400, f"{where}.tool_use_id: a tool_result names its tool_use", param=where
                    )
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": _text_of(block.get("content", ""), f"{where}.content"),
                    }
                )
            elif kind in _ROLE_OF_BLOCK:
                raise ApiError(
                    400,
                    f"{where}: a {kind} block belongs in {_ROLE_OF_BLOCK[kind]} message, "
                    f"not a {m.role} one",
                    param=where,
                )
            else:
                raise ApiError(
                    400,
                    f"{where}: block type {kind!r} is not supported (text, thinking, tool_use, "
                    "tool_result)",
                    param=where,
                )
        if text or calls or thinking or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return template_messages(out)


def _stop_reason(res: Result) -> str:
    if res.tool_calls and res.finish_reason != "length":  # a call max_tokens cut is unfinished
        return "tool_use"
    if res.stop_sequence is not None:
        return "stop_sequence"
    if res.finish_reason == "length":
        return "max_tokens"
    return "end_turn"


def _stop_sequence(res: Result) -> str | None:
    """The stop sequence that ended the answer: only with stop_reason stop_sequence (an
    answer that called tools ends as tool_use, whatever stopped the text after the calls)."""
    return res.stop_sequence if _stop_reason(res) == "stop_sequence" else None


def _usage(res: Result) -> dict[str, Any]:
    return {
        "input_tokens": res.turn.prompt_tokens_computed,
        "cache_read_input_tokens": res.turn.prompt_tokens_reused,
        "cache_creation_input_tokens": 0,
        "output_tokens": res.completion_tokens,
    }


def _tool_blocks(res: Result) -> list[dict[str, Any]]:
    return [
        {"type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name,
         "input": json.loads(c.arguments)}
        for c in res.tool_calls
    ]  # fmt: skip


async def messages(request: Request) -> Response:
    """``POST /v1/messages``."""
    st = state_of(request)
    req = await parse_body(request, MessagesRequest)
    check_model(st, req.model)
    tools: list[dict[str, Any]] | None = None
    if req.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    choice = (req.tool_choice or {}).get("type", "auto")
    if choice in ("any", "tool"):
        raise ApiError(
            400,
            "tool_choice 'any' or a named tool is not supported (the model is not constrained "
            "to call a tool)",
            param="tool_choice",
        )
    if choice == "none":
        tools = None
    thinking = req.enable_thinking
    if thinking is None and req.thinking is not None:
        thinking = req.thinking.type != "disabled"
    extra = template_extra(req, tools, thinking)
    if req.messages and req.messages[-1].role == "assistant":
        # a prefill: Anthropic's model continues the final assistant text (no new turn); the
        # response holds only what it adds
        extra["continue_final_message"] = True
    text, ids = await render_chat(st, to_template_messages(req), extra)
    params = common_params(
        st, request, req, ids=ids, max_tokens=req.max_tokens, stop=req.stop_sequences
    )
    chat_params(st, params, text, tools)
    params.one_call = bool((req.tool_choice or {}).get("disable_parallel_tool_use"))
    mid = new_id("msg_")
    gen = Generation(st, params, "/v1/messages", mid)
    ticket = st.admission.reserve()
    headers = {"x-colibri-queue-wait-ms": "0"}

    def message_obj(
        content: list[dict[str, Any]], res: Result | None, reused: int = 0
    ) -> dict[str, Any]:
        # before the run (message_start): the prompt's split already known, as the final usage
        # reports it (input_tokens computed, cache_read_input_tokens reused)
        start = {
            "input_tokens": len(ids) - reused,
            "cache_read_input_tokens": reused,
            "cache_creation_input_tokens": 0,
            "output_tokens": 0,
        }
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": st.model_name,
            "content": content,
            "stop_reason": None if res is None else _stop_reason(res),
            "stop_sequence": None if res is None else _stop_sequence(res),
            "usage": _usage(res) if res is not None else start,
        }

    async def stream(r: Responder) -> None:
        async with gen.admitted(ticket) as lease:
            headers["x-colibri-queue-wait-ms"] = f"{ticket.wait_s * 1000:.1f}"
            await r.start(200, headers, "text/event-stream")
            await r.body(
                sse(
                    {"type": "message_start", "message": message_obj([], None, gen.admit(lease))},
                    "message_start",
                )
            )
            await r.body(sse({"type": "ping"}, "ping"))
            index = -1
            open_kind: str | None = None

            async def open_block(kind: str) -> None:
                nonlocal index, open_kind
                if open_kind is not None:
                    await r.body(
                        sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                    )
                index += 1
                open_kind = kind
                block: dict[str, Any] = (
                    {"type": "thinking", "thinking": "", "signature": ""}
                    if kind == "thinking"
                    else {"type": "text", "text": ""}
                )
                await r.body(
                    sse(
                        {"type": "content_block_start", "index": index, "content_block": block},
                        "content_block_start",
                    )
                )

            async with aclosing(gen.run(lease)) as deltas:
                async for d in deltas:
                    if not d.text:
                        continue
                    kind = "thinking" if d.kind == "reasoning" else "text"
                    if kind != open_kind:
                        await open_block(kind)
                    delta = (
                        {"type": "thinking_delta", "thinking": d.text}
                        if kind == "thinking"
                        else {"type": "text_delta", "text": d.text}
                    )
                    await r.body(
                        sse(
                            {"type": "content_block_delta", "index": index, "delta": delta},
                            "content_block_delta",
                        )
                    )
        res = gen.final()
        if open_kind is None and not res.tool_calls:
            await open_block("text")  # Anthropic always sends at least one content block
        for tb in _tool_blocks(res):
            if open_kind is not None:
                await r.body(
                    sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                )
            index += 1
            open_kind = "tool_use"
            start = {**tb, "input": {}}
            await r.body(
                sse(
                    {"type": "content_block_start", "index": index, "content_block": start},
                    "content_block_start",
                )
            )
            delta = {"type": "input_json_delta", "partial_json": json.dumps(tb["input"])}
            await r.body(
                sse(
                    {"type": "content_block_delta", "index": index, "delta": delta},
                    "content_block_delta",
                )
            )
        if open_kind is not None:
            await r.body(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        await r.body(
            sse(
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": _stop_reason(res),
                        "stop_sequence": _stop_sequence(res),
                    },
                    "usage": _usage(res),
                    "colibri": res.stats(),
                },
                "message_delta",
            )
        )
        await r.body(sse({"type": "message_stop"}, "message_stop"))

    async def whole(r: Responder) -> None:
        async with gen.admitted(ticket) as lease:
            res = await gen.complete(lease)
        content: list[dict[str, Any]] = []
        if res.reasoning:
            content.append({"type": "thinking", "thinking": res.reasoning, "signature": ""})
        # an empty text block only when it is the whole answer (as the stream: a thinking-only
        # or tool-only answer has no text block)
        if res.content or not (res.tool_calls or res.reasoning):
            content.append({"type": "text", "text": res.content})
        content += _tool_blocks(res)
        body = {**message_obj(content, res), "colibri": res.stats()}
        if req.return_token_ids:
            body["colibri"]["token_ids"] = res.token_ids
            body["colibri"]["prompt_token_ids"] = params.prompt_ids
        await r.json(200, body, {"x-colibri-queue-wait-ms": f"{ticket.wait_s * 1000:.1f}"})

    resp = GenerationResponse(
        stream if req.stream else whole,
        anthropic=True,
        stream=req.stream,
        on_finish=lambda: st.admission.cancel(ticket),
        stopping=st.stopping,
    )
    return resp  # type: ignore[return-value]  # an ASGI app Starlette sends as the response


def anthropic_routes() -> list[Route]:
    return [Route("/v1/messages", messages, methods=["POST"])]
