"""What every generation route does before it generates: the shared request prelude.

Parse and validate the body (:func:`parse_body`: 400 bad JSON, 413 too big, 422 bad fields),
check the model name, turn the API's sampling fields into :class:`GenParams`
(:func:`common_params`: generation_config defaults, stops, KV slot, limits), render a chat
through the template off the loop (:func:`render_chat`), and build the envelope of an OpenAI
object (:func:`openai_object`). The OpenAI and Anthropic route modules only map their own
fields onto these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from colibri.server.errors import ApiError, validation_error
from colibri.server.generation import GenParams, check_prompt, map_tool_calls
from colibri.server.schemas import Extensions
from colibri.server.security import read_body, tenant_of
from colibri.server.state import AppState
from colibri.server.textproc import THINK_START
from runtime.speculative import DraftPolicy
from storage.errors import ColibriError

__all__ = [
    "MAX_JSON_DEPTH",
    "chat_params",
    "check_json_text",
    "check_model",
    "common_params",
    "openai_object",
    "parse_body",
    "queue_headers",
    "refuse_unsupported",
    "render_chat",
    "sampling_defaults",
    "state_of",
    "template_extra",
]

M = TypeVar("M", bound=BaseModel)


def state_of(request: Request) -> AppState:
    st: AppState = request.app.state.colibri
    return st


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model``: 400 for bad JSON, 413 too big, 422 bad fields."""
    st = state_of(request)
    raw = await read_body(request, st.config.max_body, st.config.header_timeout)
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return _parse(raw, model)
    # A large body takes a second to decode and validate (110k messages, a 1.3M-entry list):
    # off the event loop, which every stream and /health share
    return await anyio.to_thread.run_sync(_parse, raw, model)


#: Bodies up to this size are parsed on the event loop (well under a millisecond).
PARSE_ON_LOOP_BYTES = 64 * 1024


def _parse(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(
            400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    except ValueError as exc:  # an integer of more than 4300 digits (Python's limit): a 500
        raise ApiError(400, f"the body cannot be read: {exc}", code="invalid_json") from None
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


class SamplingRequest(Protocol):
    """The request fields :func:`common_params` reads (every generation API has them)."""

    temperature: float | None
    top_p: float | None
    seed: int | None
    top_k: int | None
    cache_slot: int | None
    ignore_eos: bool
    stop_token_ids: list[int] | None
    draft: str | int | None


def common_params(
    st: AppState,
    request: Request,
    req: SamplingRequest,
    *,
    ids: list[int],
    max_tokens: int | None,
    stop: str | list[str] | None,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> GenParams:
    """Sampling, stops, slot and limits shared by every API (``max_tokens`` and ``stop`` are
    named differently in each); the tenant (for prefix reuse) comes from the request's key."""
    tenant = tenant_of(request)
    seed = req.seed
    d = sampling_defaults(st)
    temp = d["temperature"] if req.temperature is None else float(req.temperature)
    tp = d["top_p"] if req.top_p is None else float(req.top_p)
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
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < st.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"stop token id {bad[0]} is outside the vocabulary (0..{st.vocab_size - 1})",
            param="stop_token_ids",
            code="invalid_token",
        )
    stop_ids: list[int] | None = None
    if req.ignore_eos:
        stop_ids = list(req.stop_token_ids or [])
    elif req.stop_token_ids:
        stop_ids = sorted(set(st.engine.container.eos_token_ids) | set(req.stop_token_ids))
    return GenParams(
        prompt_ids=ids,
        max_tokens=check_prompt(
            st, ids, max_tokens, param=prompt_param, max_tokens_param=max_tokens_param
        ),
        temperature=temp,
        top_p=tp,
        top_k=top_k,
        seed=None if seed is None else seed % 2**64,
        stop=stops,
        stop_token_ids=stop_ids,
        slot=req.cache_slot if req.cache_slot is not None else _auto_slot(st, ids, tenant),
        slot_explicit=req.cache_slot is not None,
        tenant=tenant,
        draft=_draft(st, req.draft),
    )


def _draft(st: AppState, value: str | int | None) -> str | int | None:
    """The request's ``draft`` checked against this model too (a 400 naming it, not an error
    mid-generation: ``mtp`` on a model without an MTP head)."""
    if value is None:
        return None
    try:
        st.engine.check_draft(DraftPolicy.parse(value))
    except (ColibriError, ValueError) as exc:
        raise ApiError(400, str(exc), param="draft") from exc
    return value


def _auto_slot(st: AppState, ids: list[int], tenant: str | None) -> int | None:
    """The slot a request without ``cache_slot`` runs in (automatic prefix matching), per
    ``--prefix-reuse``: None (a fresh cache) when it is off."""
    scope = st.config.reuse_scope
    if scope == "off":
        return None
    return st.slots.pick(ids, tenant=tenant if scope == "key" else None, scoped=scope == "key")


def refuse_unsupported(
    *,
    n: int,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    logit_bias: Mapping[str, float] | None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
) -> None:
    """A 400 for a field colibri knows but does not serve, set to anything but its neutral
    value (never silently dropped: the output would not be what the client asked for)."""
    if n != 1:
        raise ApiError(400, "n > 1 is not supported: send n=1 (or several requests)", param="n")
    for name, v in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
        ("min_p", min_p),
    ):
        if v:
            raise ApiError(400, f"{name} is not supported (send 0 or omit it)", param=name)
    if repetition_penalty is not None and repetition_penalty != 1.0:
        raise ApiError(
            400,
            "repetition_penalty is not supported (send 1 or omit it)",
            param="repetition_penalty",
        )
    if logit_bias and any(logit_bias.values()):
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")


def queue_headers(wait_s: float) -> dict[str, str]:
    return {"x-colibri-queue-wait-ms": f"{wait_s * 1000:.1f}"}


async def render_chat(
    st: AppState, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]
) -> tuple[str, list[int]]:
    """The prompt text of ``messages`` through the model's chat template (``extra``: template
    variables such as tools or enable_thinking) and its token ids, both off the event loop; a
    template error is a 400 naming ``messages``."""
    try:
        text = await st.off_loop(lambda: st.tokenizer.apply_chat_template(messages, **extra))
    except ColibriError as exc:
        # Tool-call arguments go to the template as objects (GLM's and MiniMax's iterate
        # them); DeepSeek-V3's adds them to a string, as the JSON text clients send: refused
        # as objects, rendered as that text
        as_text = _arguments_as_text(messages)
        if as_text is None:
            raise ApiError(400, str(exc), param="messages", code="template_error") from exc
        try:
            text = await st.off_loop(lambda: st.tokenizer.apply_chat_template(as_text, **extra))
        except ColibriError:
            raise ApiError(400, str(exc), param="messages", code="template_error") from exc
    return text, await st.encode_prompt(text)


def _arguments_as_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` with every tool call's arguments as JSON text, or None when none are
    objects (nothing to try again)."""
    changed = []

    def as_text(call: dict[str, Any], fn: dict[str, Any]) -> None:
        if isinstance(fn.get("arguments"), dict):
            fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
            changed.append(True)
        if isinstance(call.get("arguments"), dict):
            call["arguments"] = fn.get("arguments")

    out = map_tool_calls(messages, as_text)
    return out if changed else None


def block_text(block: Any, key: str, where: str) -> str:
    """A content block's text field (``key``): a string, else a 400 (a null or an object
    went into the prompt as Python's "None" or "{'a': 1}"; a block that is no object was a
    500)."""
    if not isinstance(block, Mapping):
        raise ApiError(400, f"{where}: a content block is an object", param=where)
    value = block.get(key, "")
    if not isinstance(value, str):
        raise ApiError(
            400, f"{where}.{key}: a string, not {type(value).__name__}", param=f"{where}.{key}"
        )
    return value


def template_extra(req: Extensions, tools: Any, thinking: bool | None) -> dict[str, Any]:
    """The chat template's variables: the request's ``chat_template_kwargs``, then the tools
    and the thinking switch when given."""
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
    if tools:
        extra["tools"] = tools
    if thinking is not None:
        extra["enable_thinking"] = thinking
    return extra


def chat_params(st: AppState, params: GenParams, text: str, tools: Any) -> None:
    """The chat-only parameters: think-section handling from the template and the tools."""
    params.think = st.think_template
    params.think_open = st.think_template and text.rstrip().endswith(THINK_START)
    params.tools = tools


def openai_object(st: AppState, rid: str, obj: str, created: int) -> dict[str, Any]:
    """The fields every OpenAI response object and chunk starts with."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": st.model_name,
        "system_fingerprint": f"colibri-{st.engine_identity}",
    }
