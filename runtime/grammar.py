"""Structured output: a grammar as a real sampling constraint, and its forced spans as drafts.

A :class:`GrammarSpec` says what the output must match: any JSON object (OpenAI
``response_format: json_object``), a JSON Schema (``json_schema``), a GBNF grammar (llama.cpp
syntax), a Lark grammar or a regular expression. :class:`TokenGrammar` compiles it against the
model's own tokenizer (``tokenizer.json``) into a :class:`GrammarMatcher`, one per generation,
which

* masks logits before sampling (disallowed tokens get ``-inf``), so every sampler and the
  speculative verifier draw from the constrained distribution;
* consumes each emitted token, and ends in a state where only an end-of-sequence token remains;
* reports *forced* tokens: where the grammar admits exactly one continuation, the tokens of that
  continuation (``{"name":"`` after ``{`` in a schema with one required key). The speculative
  decoder uses them as free drafts: one batched forward checks them all.

The engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (Rust, CPU only, one
small wheel, no dependencies; reads a Hugging Face ``tokenizer.json`` as is; computes a token
mask lazily in microseconds; rollback and forced tokens built in). docs/speculative.md compares
it with xgrammar and outlines-core.

Shape legend: V vocab (the model's logits width; ids past the tokenizer's vocabulary are never
allowed), W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from storage import jsontext
from storage.errors import ModelError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["GrammarError", "GrammarMatcher", "GrammarSpec", "TokenGrammar"]

F32Array = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]
GrammarKind = Literal["json_object", "json_schema", "gbnf", "lark", "regex"]


class GrammarError(ModelError):
    """A grammar or schema that does not compile, or a token the grammar rejects."""


#: bounds on a JSON schema's shape (far above what real schemas use; see GrammarSpec.json_schema)
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_REFS = 1000
#: Compiled grammars a :class:`TokenGrammar` keeps for reuse (the most recently used).
COMPILED_KEPT = 32


def _check_schema_size(schema: dict[str, Any]) -> None:
    """Raise :class:`GrammarError` when ``schema`` nests deeper than ``MAX_SCHEMA_DEPTH`` or
    holds more than ``MAX_SCHEMA_REFS`` ``$ref`` s (an iterative walk: no recursion here)."""
    refs = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            refs += "$ref" in node
            if refs > MAX_SCHEMA_REFS:
                raise GrammarError(f"the JSON schema holds more than {MAX_SCHEMA_REFS} $refs")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


_KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "gbnf", "lark", "regex")
#: The largest integer a double holds exactly (llguidance keeps numeric bounds as doubles).
_EXACT_INT = 2**53
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _check_schema_exact(schema: dict[str, Any]) -> None:
    """Refuse what the constraint parser would accept but enforce wrongly, so that an output
    it lets through never fails its schema: integer bounds past 2**53 (kept as doubles,
    rounded: ``minimum`` 2**53 + 1 forced 2**53, below it), and ``minProperties`` that only
    keys outside ``required`` can meet where other keys are allowed (it does not keep such
    keys unique: ``{"a":8,"a":0}`` counted two)."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in _BOUNDS:
            v = node.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _EXACT_INT:
                raise GrammarError(
                    f"{key} {v} is beyond 2**53: the constraint parser keeps bounds as "
                    "doubles and would round it (a string with a pattern can hold such ids)"
                )
        least = node.get("minProperties")
        required = node.get("required")
        n_required = len(set(required)) if isinstance(required, list) else 0
        others = node.get("additionalProperties", True) is not False or bool(
            node.get("patternProperties")
        )
        if isinstance(least, int) and least > n_required and least > 1 and others:
            raise GrammarError(
                f"minProperties {least} needs keys beyond the {n_required} required ones, "
                "and the constraint parser does not keep keys outside 'properties' unique (it "
                "could repeat one key to count); name the keys under 'properties' and "
                "'required', or set additionalProperties false"
            )
        stack.extend(node.values())


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a generation's output must match. Build with the classmethods.

    ``kind``: "json_object" (any JSON object), "json_schema" (``source`` is the schema, a dict
    or its JSON text), "gbnf" (llama.cpp GBNF, e.g. ``root ::= "yes" | "no"``), "lark" or
    "regex" (``source`` is the text)."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:  # ('xml', 'JSON_SCHEMA': compiled as a regex of the text)
            raise GrammarError(
                f"unknown grammar kind {self.kind!r}: use one of {', '.join(_KINDS)}"
            )
        if not isinstance(self.source, str):
            if self.kind != "json_schema" or not isinstance(self.source, Mapping):
                raise GrammarError(
                    f"a {self.kind} grammar's source is text, got {type(self.source).__name__}"
                )
            # (a dict was a TypeError from the compiled-grammar cache: unhashable)
            object.__setattr__(self, "source", GrammarSpec.json_schema(self.source).source)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> GrammarSpec:
        """A JSON schema (a dict or its JSON text), bounded: at most :data:`MAX_SCHEMA_DEPTH`
        levels of nesting and :data:`MAX_SCHEMA_REFS` ``$ref`` s (the compiler recurses along
        both; a ``$ref`` chain a few thousand long overflowed its stack and killed the
        process)."""
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema)
            parsed = jsontext.loads(text)
        # RecursionError: json.dumps of a deep dict; TypeError: a value JSON has no form for
        # (a set, bytes, an object)
        except (ValueError, RecursionError, TypeError) as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        _check_schema_size(parsed)
        _check_schema_exact(parsed)
        return cls("json_schema", text)

    @classmethod
    def gbnf(cls, text: str) -> GrammarSpec:
        return cls("gbnf", text)

    @classmethod
    def lark(cls, text: str) -> GrammarSpec:
        return cls("lark", text)

    @classmethod
    def regex(cls, text: str) -> GrammarSpec:
        return cls("regex", text)

    @classmethod
    def from_response_format(cls, fmt: Mapping[str, Any] | None) -> GrammarSpec | None:
        """An OpenAI-style ``response_format``: ``{"type": "text"}`` (None),
        ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
        or the extensions ``{"type": "gbnf" | "lark" | "regex", "grammar": "..."}``."""
        if fmt is None:
            return None
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, Mapping) else None
            if schema is None:
                schema = fmt.get("schema")
            if schema is True:  # the JSON Schema that every JSON value satisfies
                schema = {}
            elif schema is False:
                raise GrammarError(
                    "response_format json_schema.schema is false: no JSON value satisfies it"
                )
            if not isinstance(schema, Mapping | str):
                raise GrammarError("response_format json_schema needs json_schema.schema")
            return cls.json_schema(schema)
        if kind in ("gbnf", "lark", "regex"):
            text = fmt.get("grammar")
            if not isinstance(text, str) or not text.strip():
                raise GrammarError(f"response_format {kind} needs a non-empty 'grammar' string")
            return cls(kind, text)
        raise GrammarError(
            f"unknown response_format type {kind!r}: use text, json_object, json_schema, gbnf, "
            "lark or regex"
        )

    def compile(self) -> str:
        """The llguidance grammar text (not yet checked against a tokenizer)."""
        import llguidance

        # Compact JSON (no optional whitespace): a model cannot wander off into endless blanks,
        # and a forced span such as '{"name":"' is one piece.
        compact: JsonCompileOptions = {"whitespace_flexible": False}
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=compact
                )
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=compact)
            if self.kind == "gbnf":
                return llguidance.grammar_from("gbnf", self.source)
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.source)
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        except ValueError as exc:
            raise GrammarError(
                f"the {self.kind} grammar does not compile: {_plain(str(exc))}"
            ) from exc


class TokenGrammar:
    """The model's tokenizer as llguidance sees it; makes one :class:`GrammarMatcher` per
    generation. Build once per engine (a large vocabulary takes a moment)."""

    def __init__(
        self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        import llguidance

        path = Path(tokenizer_json)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise GrammarError(f"{path}: cannot read the tokenizer ({exc})") from exc
        if not eos_token_ids:
            raise GrammarError("structured output needs an end-of-sequence token id")
        try:
            self._tok = llguidance.LLTokenizer(
                _plain_added_tokens(text),
                n_vocab=int(vocab_size),
                eos_token=[int(t) for t in eos_token_ids],
            )
        except Exception as exc:  # the Rust side raises plain exceptions
            raise GrammarError(f"{path}: llguidance cannot use this tokenizer ({exc})") from exc
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._lock = threading.Lock()
        # (kind, source) -> its compiled matcher at the start, least recently used first
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._failed: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> its error
        self.compilations = 0  # grammars compiled (not copied from one kept)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``; raises :class:`GrammarError` if invalid.

        The :data:`COMPILED_KEPT` grammars used last stay compiled (a matcher that never
        consumed a token): a grammar asked for again, as a service sends the same schema
        with every request and the server checks it before generating, is a copy of that
        one instead of a new compilation. Safe from several threads."""
        key = (spec.kind, spec.source)
        with self._lock:
            start = self._compiled.get(key)
            if start is not None:
                self._compiled.move_to_end(key)
            failed = self._failed.get(key)
        if failed is not None:
            raise GrammarError(failed)
        if start is None:
            try:
                start = self._compile(spec)
            except GrammarError as exc:
                # the same grammar fails the same way: asked for again (a client retrying),
                # it is refused at once instead of compiling for seconds again
                with self._lock:
                    self._failed[key] = str(exc)
                    while len(self._failed) > COMPILED_KEPT:
                        self._failed.popitem(last=False)
                raise
            with self._lock:
                self._compiled[key] = start
                while len(self._compiled) > COMPILED_KEPT:
                    self._compiled.popitem(last=False)
        return GrammarMatcher(start.deep_copy(), self.vocab_size, spec.kind)

    def _compile(self, spec: GrammarSpec) -> Any:
        import llguidance

        grammar = spec.compile()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tok)
        if is_error:
            why = "; ".join(_plain(m) for m in messages)
            raise GrammarError(f"the {spec.kind} grammar is invalid: {why}")
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the {spec.kind} grammar is invalid: {_reason(m.get_error())}")
        # The first token's mask, once: a grammar that compiles but admits no first token
        # (``root ::= root``) fails here, before a stream starts, not at its first token.
        # (Computing a mask does not advance the matcher; the copies start from this state.)
        import llguidance.numpy as lnp

        words = np.zeros((1, (self.vocab_size + 31) // 32), np.int32)
        lnp.fill_next_token_bitmask(m, words)
        if m.is_error():
            raise GrammarError(
                f"the {spec.kind} grammar admits no output: {_reason(m.get_error())}"
            )
        # ... and one step further, on a copy: a grammar past the parser's limits (an object
        # with hundreds of optional properties, a{1000000}) passes the first mask and fails at
        # the first token, which was an error inside a stream already answered 200
        first = _first_allowed(words, self.vocab_size, self.eos_token_ids)
        if first is not None:
            probe = m.deep_copy()
            if probe.consume_token(first):
                lnp.fill_next_token_bitmask(probe, words)
            if probe.is_error():
                error = probe.get_error()
                if _is_limit(error):  # a parser limit (items in a row, lexer states, ...)
                    raise GrammarError(_limit_message(spec.kind, error))
                raise GrammarError(f"the {spec.kind} grammar is invalid: {_reason(error)}")
        with self._lock:
            self.compilations += 1
        return m

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode_str([int(i) for i in ids]))


def _plain_added_tokens(text: str) -> str:
    """``tokenizer.json`` as llguidance should read it. llguidance takes every added token for
    a special one, never text; Qwen3's and GLM's ``<think>``, ``</think>``, ``<tool_call>``
    are added tokens marked ``special: false``, text the model writes. A grammar spelling
    them ("<think>x</think>") then rejected the very token that spells them (refused up
    front, or failed mid-stream). Non-special added tokens move into the model's vocabulary
    under their text (printable ASCII without spaces, the same in byte-level and
    sentencepiece spellings), so they are text to the grammar; others keep their place."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text  # (llguidance says what is wrong with it)
    added = doc.get("added_tokens") if isinstance(doc, dict) else None
    vocab = doc.get("model", {}).get("vocab") if isinstance(doc, dict) else None
    if not isinstance(added, list) or not isinstance(vocab, dict):
        return text
    keep = []
    for a in added:
        content = a.get("content") if isinstance(a, dict) else None
        if (
            isinstance(a, dict)
            and a.get("special") is False
            and isinstance(content, str)
            and isinstance(a.get("id"), int)
            and content.isascii()
            and content.isprintable()
            and " " not in content
        ):
            vocab.setdefault(content, a["id"])
            continue
        keep.append(a)
    if len(keep) == len(added):
        return text
    doc["added_tokens"] = keep
    return json.dumps(doc)


_BITS = np.arange(32, dtype=np.int32)  # [32]


def _unpack(words: npt.NDArray[np.int32], vocab: int) -> BoolArray:
    """llguidance's token bitmask [1, W] (32 token ids a word, low bit first) as [V] bools."""
    bits = (words[0][:, None] >> _BITS[None, :]) & 1  # [W, 32]
    ok: BoolArray = bits.reshape(-1)[:vocab].astype(bool)  # [V]
    return ok


def _first_allowed(words: npt.NDArray[np.int32], vocab: int, eos: Sequence[int]) -> int | None:
    """The lowest token id a bitmask [1, W] allows, end-of-sequence ids left out."""
    ok = np.flatnonzero(_unpack(words, vocab))
    ok = ok[~np.isin(ok, list(eos))]
    return int(ok[0]) if ok.size else None


def _plain(message: str) -> str:
    """llguidance's message, where it names an option of its own colibri does not expose,
    said as what the user can do instead."""
    if "coerce_one_of" in message:
        return (
            "oneOf alternatives that can match the same value are not supported; use anyOf, or "
            "make the alternatives exclusive (a const or enum that tells them apart)"
        )
    return message


def _is_limit(error: str) -> bool:
    """Whether an llguidance error is one of its parser's limits, not the grammar's own
    rule: 'Current row has 2500 items; max is 2000', 'too many expressions constructed'."""
    return " max is " in error or "too many" in error


def _limit_message(kind: str, error: str) -> str:
    return f"the {kind} grammar is too large for the constraint parser: {_reason(error)}"


def _reason(error: str) -> str:
    """llguidance's error text without the parser state it appends (``<state>`` and a JSON
    dump of its counters, meant for its developers): the first line that says what failed."""
    return error.split("\n<state>", 1)[0].strip().splitlines()[0] if error.strip() else error


class GrammarMatcher:
    """One generation's grammar state (wraps ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int, kind: str = "response") -> None:
        self._m = matcher
        self._v = vocab_size
        self._kind = kind
        self._undo: list[Any] = []  # the state before each pushed token (rollback)
        self._words = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)  # [1, W]

    def allowed(self) -> BoolArray:
        """Tokens the grammar admits next [V] (end-of-sequence ids only once it is complete)."""
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self._m, self._words)
        self._check()
        return _unpack(self._words, self._v)

    def mask(self, logits: F32Array) -> F32Array:
        """A copy of ``logits`` [V] with every disallowed token at ``-inf``."""
        out = np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32)  # [V]
        return out

    def consume(self, token: int) -> None:
        """Advance by one emitted token; a token outside the mask raises GrammarError."""
        self._undo.clear()  # an emitted token is not rolled back; nothing before it either
        self._advance(token)

    def _advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            error = self._m.get_error()
            if _is_limit(error):  # a parser limit (items in a row, ...), not the token
                raise GrammarError(_limit_message(self._kind, error))
            raise GrammarError(f"token {token} breaks the grammar: {_reason(error)}")

    def push(self, tokens: Sequence[int]) -> None:
        """Advance tentatively by draft tokens (undo with :meth:`rollback`).

        Each token keeps a copy of the state before it (a copy costs about a microsecond), and
        :meth:`rollback` restores it: llguidance's own rollback counts only the tokens its
        parser took, so an end-of-sequence token consumed once the grammar had stopped (a
        draft's, with ``ignore_eos``) was not counted and rolling back undid one more token
        than was pushed, leaving the matcher in an earlier state than the output's."""
        for t in tokens:
            before = self._m.deep_copy()
            try:
                self._advance(t)
            except GrammarError:
                self._m = before
                raise
            self._undo.append(before)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens :meth:`push` added."""
        if n > len(self._undo):
            raise GrammarError(f"cannot roll the grammar back by {n}: {len(self._undo)} pushed")
        if n:
            self._m = self._undo[-n]
            del self._undo[-n:]

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (empty when more than one continuation is allowed)."""
        if self._m.is_stopped():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts in order from the current state."""
        if not tokens:
            return 0
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (an end-of-sequence token may follow)."""
        return bool(self._m.is_accepting())

    @property
    def stopped(self) -> bool:
        """Nothing but an end-of-sequence token can follow."""
        return bool(self._m.is_stopped())

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"grammar state error: {_reason(self._m.get_error())}")
