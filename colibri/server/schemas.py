"""Request bodies (pydantic): the OpenAI Chat Completions and Completions APIs, Anthropic's
Messages API, and colibri's extension fields.

Unknown fields are ignored (clients send newer fields than any server knows); known fields are
type-checked strictly (422 when malformed): JSON ``true`` never fills an integer field
(pydantic's lax mode would make it 1: ``"cache_slot": true`` would pick slot 1), ``"1"`` never
fills a number and ``"yes"`` never a boolean; an integer does fill a float field. Fields
colibri knows but cannot honour (``n`` > 1, penalties, ``logit_bias``) are refused with a 400
by the routes, never silently dropped.

Extensions accepted in every generation request: ``cache_slot`` (KV slot index), ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``chat_template_kwargs``, ``enable_thinking``,
``return_token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AnthropicMessage",
    "AnthropicTool",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Extensions",
    "FunctionDef",
    "MessagesRequest",
    "StreamOptions",
    "Tool",
]


# Template variables a request may not set through chat_template_kwargs.
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt", "continue_final_message"})


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Extensions(_Loose):
    """colibri's extension fields, shared by every generation request."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default is that default (OpenAI declares
        ``n``, ``stream``, ``logprobs``, ``echo``... nullable, and SDKs and wrappers send
        ``None`` for what they leave unset): it was a 422. A required field stays required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        unset = [
            k
            for k, v in data.items()
            if v is None and k in fields and not fields[k].is_required()
            and fields[k].default is not None
        ]  # fmt: skip
        return {k: v for k, v in data.items() if k not in unset} if unset else data

    cache_slot: int | None = Field(
        default=None, ge=0, description="KV slot: keep this conversation's cache between turns"
    )
    top_k: int | None = Field(default=None, ge=-1, description="Top-k sampling (0 or -1: off)")
    ignore_eos: bool = Field(default=False, description="Do not stop at end-of-sequence tokens")
    stop_token_ids: list[int] | None = Field(default=None, description="Extra stop token ids")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra variables for the chat template"
    )
    enable_thinking: bool | None = Field(
        default=None, description="Passed to the chat template (models with a think section)"
    )
    return_token_ids: bool = Field(
        default=False, description="Add the prompt and generated token ids to the response"
    )
    draft: str | int | None = Field(
        default=None,
        description="Speculative drafting for this request: off, auto, lookup[:k], mtp[:k] or "
        "k (default: the server's --draft); output tokens are the same either way",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_keys(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # The server sets these itself; letting a request override them would render another
        # conversation than the one it sent (or fail inside the template).
        bad = sorted(set(v or {}) & RESERVED_TEMPLATE_KEYS)
        if bad:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
        return v


class StreamOptions(_Loose):
    include_usage: bool = False


def _tool_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema, checked where the server reads it (a call's argument types
    come from its ``properties``): refused before generating, not when the model calls it."""
    props = schema.get("properties")
    if props is not None and not isinstance(props, dict):
        raise ValueError("'properties' must be an object (JSON Schema: name -> schema)")
    return schema


ToolSchema = Annotated[dict[str, Any], AfterValidator(_tool_schema)]


class FunctionDef(_Loose):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: ToolSchema | None = None


class Tool(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Loose):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message; extra keys are passed through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _OpenAIGeneration(Extensions):
    """The fields both OpenAI generation routes share."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    # OpenAI's range (int64); a negative seed is taken as its two's complement (s + 2**64),
    # so every seed in the range draws its own numbers (a wider one aliased another)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extensions colibri does not serve: named so that they are refused
    # (refuse_unsupported), not ignored as unknown fields are
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)


class ChatCompletionRequest(_OpenAIGeneration):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_OpenAIGeneration):
    """``POST /v1/completions`` (the legacy text completion API)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: score the prompt (its logprobs), generate nothing; an explicit null is the
    # default, 16 (it generated up to the whole context): Extensions._null_is_the_default
    max_tokens: int | None = Field(default=16, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    # not in OpenAI's legacy API; honoured as in chat completions (structured output)
    response_format: dict[str, Any] | None = None


class AnthropicMessage(_Loose):
    role: Literal["user", "assistant"]
    # never empty (Anthropic's rule): dropping an empty message instead would answer another
    # conversation than the one sent
    content: (
        Annotated[str, Field(min_length=1)] | Annotated[list[dict[str, Any]], Field(min_length=1)]
    )


class AnthropicTool(_Loose):
    # a client tool ("custom", or no type); Anthropic's server tools (web_search_20250305,
    # ...) are tools the server would run: refused rather than offered to the model as
    # functions the client never defined
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: ToolSchema = Field(default_factory=dict)


class ThinkingConfig(_Loose):
    type: Literal["enabled", "disabled", "adaptive"] = "disabled"
    budget_tokens: int | None = None


class MessagesRequest(Extensions):
    """``POST /v1/messages`` (Anthropic Messages API)."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_type(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") not in ("auto", "any", "tool", "none"):
            raise ValueError("tool_choice.type must be one of 'auto', 'any', 'tool', 'none'")
        return v

    metadata: dict[str, Any] | None = None
