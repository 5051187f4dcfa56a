"""Text post-processing of a generation as it streams: stop strings, a ``<think>`` section,
tool-call blocks. Pure functions and small state machines; no I/O.

Every stage holds back only the text that might still turn into a marker (a suffix that is a
prefix of ``</think>``, of a stop string, ...), so what it releases, concatenated, is final.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_START",
    "ParsedToolCall",
    "StopMatcher",
    "ThinkSplitter",
    "ToolCallSplitter",
    "parse_tool_calls",
]

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# MiniMax-M2's block: <minimax:tool_call><invoke name="f"><parameter name="k">v</parameter>
# </invoke>...</minimax:tool_call> (one block, any number of calls)
MINIMAX_CALL_START = "<minimax:tool_call>"
MINIMAX_CALL_END = "</minimax:tool_call>"
# DeepSeek-V3's section (｜ is U+FF5C, ▁ U+2581): <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>
# function<｜tool▁sep｜>NAME\n```json\n{ARGS}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>;
# V3.1 and V3.2 write <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>
DEEPSEEK_CALLS_START = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
# Kimi-K2's section: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
# <|tool_call_argument_begin|>{ARGS}<|tool_call_end|>...<|tool_calls_section_end|>
KIMI_CALLS_START = "<|tool_calls_section_begin|>"
KIMI_CALLS_END = "<|tool_calls_section_end|>"
# Mistral's: [TOOL_CALLS] [{"name": NAME, "arguments": {ARGS}}, ...], or from tokenizer v11 on
# [TOOL_CALLS]NAME[ARGS]{ARGS} per call. No closing marker: the block ends with its JSON.
MISTRAL_CALLS = "[TOOL_CALLS]"
_CALL_STARTS = (
    TOOL_CALL_START,
    MINIMAX_CALL_START,
    DEEPSEEK_CALLS_START,
    KIMI_CALLS_START,
    MISTRAL_CALLS,
)


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class StopMatcher:
    """Finds the first stop string in streamed text; the stop string itself is never released.

    ``feed`` returns (text safe to release, whether a stop string was hit)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.hit: str | None = None
        # characters released so far: once a stop string is hit, where the output ends in the
        # text fed (what comes at or after it is never released)
        self.released = 0

    def feed(self, text: str) -> tuple[str, bool]:
        out, hit = self._feed(text)
        self.released += len(out)
        return out, hit

    def _feed(self, text: str) -> tuple[str, bool]:
        if self.hit is not None:
            return "", True
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out, False
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = self._pending.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.hit = first[1]
            out, self._pending = self._pending[: first[0]], ""
            return out, True
        keep = _partial_suffix(self._pending, self.stops)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def would_hit(self, text: str) -> bool:
        """Whether feeding ``text`` next would complete a stop string (nothing is fed)."""
        return self.hit is None and any(s in self._pending + text for s in self.stops)

    def flush(self) -> str:
        """The held-back tail once the generation ended without completing a stop string."""
        out, self._pending = ("" if self.hit is not None else self._pending), ""
        self.released += len(out)
        return out


class ThinkSplitter:
    """Splits output into reasoning (inside ``<think>...</think>``) and content.

    ``inside``: the prompt already opened the think section (the template ended the generation
    prompt with ``<think>``). Otherwise a ``<think>`` at the very start of the output (after
    whitespace) opens it. ``enabled`` False passes everything through as content."""

    def __init__(self, *, enabled: bool, inside: bool = False) -> None:
        self.enabled = enabled
        self._state = "reasoning" if (enabled and inside) else ("start" if enabled else "content")
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """``[(kind, text)]`` with kind "reasoning" or "content", in order."""
        out: list[tuple[str, str]] = []
        self._buf += text
        while self._buf:
            if self._state == "content":
                out.append(("content", self._buf))
                self._buf = ""
            elif self._state == "after":  # newlines right after </think> are layout, not text
                self._buf = self._buf.lstrip("\n")
                if self._buf:
                    self._state = "content"
            elif self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START) :]
                    self._state = "reasoning"
                elif THINK_START.startswith(stripped):
                    break  # could still become "<think>"
                else:
                    self._state = "content"
            else:  # reasoning
                i = self._buf.find(THINK_END)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self._buf[:i]))
                    self._buf = self._buf[i + len(THINK_END) :]
                    self._state = "after"
                    continue
                cut = len(self._buf) - _partial_suffix(self._buf, [THINK_END])
                if cut:
                    out.append(("reasoning", self._buf[:cut]))
                self._buf = self._buf[cut:]
                break
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is held back, once the generation ended."""
        kind = "reasoning" if self._state == "reasoning" else "content"
        out = [(kind, self._buf)] if self._buf and self._state != "after" else []
        self._buf = ""
        return out


class ToolCallSplitter:
    """Holds back content from the first start of a tool-call block of any format (``<tool_call>``,
    ``[TOOL_CALLS]``, ...) on: it is parsed at the end."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._buf = ""
        self._calls = ""
        self.seen = False

    def feed(self, text: str) -> str:
        """Content safe to release now."""
        if not self.enabled:
            return text
        if self.seen:
            self._calls += text
            return ""
        self._buf += text
        found = [i for m in _CALL_STARTS if (i := self._buf.find(m)) >= 0]
        if found:
            i = min(found)
            out, self._calls, self._buf = self._buf[:i], self._buf[i:], ""
            self.seen = True
            return out
        keep = _partial_suffix(self._buf, _CALL_STARTS)
        cut = len(self._buf) - keep
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def finish(
        self, tools: Sequence[Mapping[str, Any]] | None = None, *, cut: bool = False
    ) -> tuple[str, list[ParsedToolCall]]:
        """(remaining content, parsed tool calls) at the end of the generation. ``cut``: it
        ended at max_tokens, so an unclosed last block is a truncated call (a name cut to
        "get", its arguments lost): it stays text instead of becoming a call."""
        rest, self._buf = self._buf, ""
        if not self.seen:
            return rest, []
        text, calls = parse_tool_calls(self._calls, tools, closed_only=cut)
        return rest + text, calls


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """A tool call found in the output: ``arguments`` is a JSON object text."""

    id: str
    name: str
    arguments: str


_STARTS = re.compile("|".join(re.escape(m) for m in _CALL_STARTS))
# a tagged format's closing marker (Mistral's block has none)
_ENDS = {
    TOOL_CALL_START: TOOL_CALL_END,
    MINIMAX_CALL_START: MINIMAX_CALL_END,
    DEEPSEEK_CALLS_START: DEEPSEEK_CALLS_END,
    KIMI_CALLS_START: KIMI_CALLS_END,
}
_DS_CALL = re.compile(
    "<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.S
)
_DS_FENCED = re.compile(r"([^\n]*)\n```(?:json)?\n(.*?)\n?```", re.S)
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)",
    re.S,
)
_KIMI_ID = re.compile(r"(?:functions\.)?(.*?)(?::\d+)?")
# v11's call: NAME[ARGS]; v13 may put [CALL_ID]ID between them
_MISTRAL_NAMED = re.compile(r"\s*([^\s\[\]{}]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")
_INVOKE = re.compile(r'<invoke name="([^"<>]*)">(.*?)</invoke>', re.S)
_MM_PARAM = re.compile(r'<parameter name="([^"<>]*)">(.*?)</parameter>', re.S)
_QC_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_QC_PARAM = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _param_types(tools: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    """Tool ``name``'s parameters -> the JSON types each admits (None: unknown, any)."""
    for t in tools or ():
        fn = t.get("function", t)
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            if not isinstance(props, Mapping):  # (the request schemas refuse anything else)
                return {}
            return {
                k: _json_types(v, params, 0) for k, v in props.items() if isinstance(v, Mapping)
            }
    return {}


def _json_types(schema: Any, root: Mapping[str, Any], depth: int) -> frozenset[str] | None:
    """The JSON types ``schema`` admits: its type (or list of types), its enum's or const's
    values, the union over anyOf / oneOf, through local ``$ref`` s; None when it does not say."""
    if not isinstance(schema, Mapping) or depth > 16:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#/"):
            return None
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return _json_types(target, root, depth + 1)
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset([t])
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return frozenset(t)
    if isinstance(schema.get("enum"), list):
        return frozenset(_json_type(v) for v in schema["enum"])
    if "const" in schema:
        return frozenset([_json_type(schema["const"])])
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if isinstance(subs, list) and subs:
            union: set[str] = set()
            for sub in subs:
                got = _json_types(sub, root, depth + 1)
                if got is None:
                    return None
                union |= got
            return frozenset(union)
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e999: Python reads infinity, which JSON cannot write back
        raise ValueError(f"{text} is out of range")
    return v


#: Deepest nesting a call's arguments may have (deeper: not a call; it stays text).
MAX_JSON_DEPTH = 128
# _strict_json's reader (Mistral's block reads a value that text goes on after with it)
_JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite)


def _no_surrogates(v: Any, depth: int = 1) -> Any:
    """``v`` with every lone surrogate (a ``\\ud800`` escape without its pair) in its strings
    and keys replaced by U+FFFD: such a string cannot be encoded as UTF-8 for the response.
    ValueError when ``v`` nests deeper than ``MAX_JSON_DEPTH``: what cleans and writes it again
    recurses once per level (a RecursionError was a 500)."""
    if isinstance(v, str):
        return _SURROGATE.sub("\ufffd", v)
    if isinstance(v, list | dict) and depth > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested more than {MAX_JSON_DEPTH} deep")
    if isinstance(v, list):
        return [_no_surrogates(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {_no_surrogates(k): _no_surrogates(x, depth + 1) for k, x in v.items()}
    return v


def _strict_json(text: str) -> Any:
    """Model-written JSON, read as RFC 8259 JSON: ``NaN`` / ``Infinity`` and numbers beyond a
    double (which Python's reader accepts and its writer would put back) raise ValueError, lone
    surrogate escapes become U+FFFD. A call's arguments are then always JSON a client's strict
    parser reads, and always encodable."""
    try:
        return _no_surrogates(_JSON_DECODER.decode(text))
    except RecursionError:  # (nested past Python's reader: a model's bracket run)
        raise ValueError("JSON nested too deep") from None


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "null")


def _value(raw: str, declared: frozenset[str] | None) -> Any:
    """A GLM-format argument value: the raw text where the schema admits a string, unless it
    admits another type the text is JSON of ("12345" for ``str | None`` stays a string; it
    became the integer 12345); JSON where it can be read as JSON otherwise."""
    if declared is not None and declared == {"string"}:
        return raw
    try:
        parsed = _strict_json(raw)
    except ValueError:  # (json.JSONDecodeError is one)
        return raw
    if declared is None or "string" not in declared:
        return parsed
    kind = _json_type(parsed)
    fits = kind in declared or (kind == "integer" and "number" in declared)
    return parsed if fits and kind != "string" else raw


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None, *, closed_only: bool = False
) -> tuple[str, list[ParsedToolCall]]:
    """Tool-call blocks in ``text`` -> (the text outside them, calls).

    The format is told by the block's start marker, so no model needs naming: GLM's
    ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`` (values are
    JSON unless the tool's schema declares a string), the JSON one ``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>``, Qwen3-Coder's, MiniMax-M2's, DeepSeek-V3's, Kimi-K2's and
    Mistral's (see the markers above). A block that parses as none stays in the text. An
    unclosed last block (a model that ended without the closing tag) is parsed too, unless
    ``closed_only`` (the generation was cut by max_tokens: the block is a truncated call);
    Mistral's block closes with its JSON, so a cut one never parses."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    pos = at = 0
    while (m := _STARTS.search(text, at)) is not None:
        start = m.group()
        end_tag = _ENDS.get(start)
        if end_tag is None:
            found, end = _parse_mistral(text, m.end(), tools)
            at = end if found else m.end()
        else:
            close = text.find(end_tag, m.end())
            end = len(text) if close < 0 else close + len(end_tag)
            at = end  # a block that is no call stays text whole (a call inside it too)
            if closed_only and close < 0:
                continue
            found = _BODY_PARSERS[start](text[m.end() : len(text) if close < 0 else close], tools)
        if not found:
            continue
        kept.append(text[pos : m.start()])
        pos = end
        calls += found
    if not calls:
        return text, calls
    kept.append(text[pos:])
    # A block goes with the line breaks around it (text on both sides stays on two lines)
    # and blank text between blocks goes; spaces stay ("See<tool_call>..</tool_call> you" is
    # "See you", not "Seeyou"), but for trailing ones at the end.
    out = kept[0]
    for i, piece in enumerate(kept[1:], 1):
        if i < len(kept) - 1 and not piece.strip():
            continue
        left, right = out.rstrip("\n"), piece.lstrip("\n")
        broke = len(left) < len(out) or len(right) < len(piece)
        out = left + ("\n" if broke and left.strip() and right.strip() else "") + right
    return out.rstrip(), calls


def _declared(tools: Sequence[Mapping[str, Any]] | None, name: str) -> bool:
    """Whether ``name`` is a tool the request declared (any non-empty name without tools)."""
    if not name:
        return False
    if tools is None:
        return True
    for t in tools:
        fn = t.get("function", t)
        if isinstance(fn, Mapping) and fn.get("name") == name:
            return True
    return False


def _parse_tool_call_block(
    body: str, tools: Sequence[Mapping[str, Any]] | None
) -> list[ParsedToolCall] | None:
    one = _parse_block(body.strip(), tools)
    return None if one is None else [one]


def _parse_block(body: str, tools: Sequence[Mapping[str, Any]] | None) -> ParsedToolCall | None:
    """One block's call, or None (it stays text): a block that parses as neither format, or
    names a tool the request did not declare (a client would run what it never offered)."""
    if body.startswith("{"):
        try:
            obj = _strict_json(body)
        except ValueError:  # (json.JSONDecodeError is one)
            return None
        return _json_call(obj, tools)
    qc = _QC_FUNCTION.fullmatch(body)
    if qc is not None:  # Qwen3-Coder's: <function=NAME><parameter=K>\nV\n</parameter></function>
        return _named_call(qc.group(1), _QC_PARAM.findall(qc.group(2)), tools)
    first, _, rest = body.partition("<arg_key>")  # GLM's
    return _named_call(first, _ARG.findall("<arg_key>" + rest if rest else ""), tools)


def _json_call(obj: Any, tools: Sequence[Mapping[str, Any]] | None) -> ParsedToolCall | None:
    """A ``{"name": ..., "arguments": {...}}`` object's call (``parameters`` for
    ``arguments`` too; arguments given as JSON text are read), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _args_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), tools)


def _args_call(
    name: str, args: Any, tools: Sequence[Mapping[str, Any]] | None
) -> ParsedToolCall | None:
    """A call given as a name and its arguments, an object or the JSON text of one, or None
    (the arguments are no object, the name no declared tool's)."""
    if isinstance(args, str):
        try:
            args = _strict_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or not _declared(tools, name):
        return None
    return ParsedToolCall(_call_id(), name, _dump(args))


def _parse_deepseek(
    body: str, tools: Sequence[Mapping[str, Any]] | None
) -> list[ParsedToolCall] | None:
    """DeepSeek's section: its calls, or None (it stays text) when it holds none or one that
    does not parse. V3's call is ``function<｜tool▁sep｜>NAME`` and the arguments fenced as
    Markdown JSON; V3.1's ``NAME<｜tool▁sep｜>ARGS``."""
    calls = []
    for head, rest in _DS_CALL.findall(body):
        fenced = _DS_FENCED.fullmatch(rest.strip())
        if head.strip() == "function" and fenced is not None:
            head, rest = fenced.groups()
        call = _args_call(head.strip(), rest, tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_kimi(
    body: str, tools: Sequence[Mapping[str, Any]] | None
) -> list[ParsedToolCall] | None:
    """Kimi-K2's section: its calls, or None (it stays text) when it holds none or one that
    does not parse. A call's id is ``functions.NAME:IDX``."""
    calls = []
    for call_id, args in _KIMI_CALL.findall(body):
        name = _KIMI_ID.fullmatch(call_id.strip())
        call = None if name is None else _args_call(name.group(1).strip(), args, tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_mistral(
    text: str, at: int, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[ParsedToolCall] | None, int]:
    """Mistral's block after its ``[TOOL_CALLS]`` at ``at``: (its calls or None, where it
    ends). It has no closing marker; the JSON value that follows is its end, and text after
    it is text (a value cut short never parses)."""
    named = _MISTRAL_NAMED.match(text, at)
    if named is not None:
        at = named.end()
    while at < len(text) and text[at].isspace():
        at += 1
    try:
        value, end = _JSON_DECODER.raw_decode(text, at)
        value = _no_surrogates(value)
    except (ValueError, RecursionError):  # (RecursionError: as in _strict_json)
        return None, at
    if named is not None:
        one = _args_call(named.group(1), value, tools) if isinstance(value, dict) else None
        return (None if one is None else [one]), end
    if not isinstance(value, list) or not value:
        return None, end
    calls = []
    for obj in value:
        call = _json_call(obj, tools)
        if call is None:
            return None, end
        calls.append(call)
    return calls, end


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _named_call(
    name: str,
    params: Sequence[tuple[str, str]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> ParsedToolCall | None:
    """A call given as a name and (key, value text) pairs (GLM's, Qwen3-Coder's and
    MiniMax-M2's formats): values are text where the tool's schema admits a string, else JSON
    where they read as JSON (:func:`_value`)."""
    name = name.strip()
    if any(c.isspace() for c in name) or "<" in name or not _declared(tools, name):
        return None
    types = _param_types(tools, name)
    args = {k.strip(): _value(v, types.get(k.strip())) for k, v in params}
    return ParsedToolCall(_call_id(), name, _dump(args))


def _parse_invokes(
    body: str, tools: Sequence[Mapping[str, Any]] | None
) -> list[ParsedToolCall] | None:
    """MiniMax-M2's block: its ``<invoke>`` calls, or None (it stays text) when it holds
    none or one that is not a declared tool's."""
    calls = []
    for name, inner in _INVOKE.findall(body):
        call = _named_call(name, _MM_PARAM.findall(inner), tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _dump(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False, allow_nan=False)


# a tagged block's body -> its calls, or None (it stays text)
_BODY_PARSERS = {
    TOOL_CALL_START: _parse_tool_call_block,
    MINIMAX_CALL_START: _parse_invokes,
    DEEPSEEK_CALLS_START: _parse_deepseek,
    KIMI_CALLS_START: _parse_kimi,
}
