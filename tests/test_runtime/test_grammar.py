"""Structured output (runtime/grammar.py): JSON Schema, json_object and GBNF outputs always
parse and validate, even from the random demo model; forced grammar spans are verified as free
drafts and do not change greedy output."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _demo import demo_model

import colibri
from colibri.tokenizer import ChatTokenizer
from runtime.grammar import COMPILED_KEPT, GrammarError, GrammarSpec, TokenGrammar
from storage.container import Container

jsonschema = pytest.importorskip("jsonschema")

DEMO = demo_model()
PROMPT = [1, 40, 41, 42, 43, 3]

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "tags": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 3,
            },
        },
        "required": ["color", "ok", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]
# long required keys: the grammar forces most of the output
FORCING = {
    "type": "object",
    "properties": {
        "the_answer_to_the_question": {"type": "integer", "minimum": 0, "maximum": 99},
        "how_sure_the_model_is": {"enum": ["very sure", "not sure"]},
    },
    "required": ["the_answer_to_the_question", "how_sure_the_model_is"],
    "additionalProperties": False,
}
SAMPLING = [{"temperature": 0.0}, *({"temperature": 1.0, "seed": s} for s in range(3))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[colibri.SyncModel]:
    with colibri.open_model(
        demo_model(), state_dir=tmp_path_factory.mktemp("state"), learn=False
    ) as m:
        yield m


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    cont = Container.open(DEMO)
    path = cont.tokenizer_path()
    assert path is not None
    return ChatTokenizer(path, cont.tokenizer_config())


def _text(tok: ChatTokenizer, ids: list[int]) -> str:
    return tok.decode([i for i in ids if i not in (0, 2)])


def _generate(
    model: colibri.SyncModel, spec: GrammarSpec, n: int = 200, **kw: Any
) -> tuple[list[int], str]:
    """(tokens, finish reason) of one constrained generation."""

    async def run() -> tuple[list[int], str]:
        from colibri._engine import DoneEvent

        async for ev in model.engine.generate(PROMPT, max_new_tokens=n, grammar=spec, **kw):
            if isinstance(ev, DoneEvent):
                return ev.tokens, ev.reason
        raise AssertionError("no DoneEvent")

    result: tuple[list[int], str] = model._portal.call(run)
    return result


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_json_schema_output_always_validates(
    schema_index: int, model: colibri.SyncModel, tok: ChatTokenizer
) -> None:
    schema = SCHEMAS[schema_index]
    spec = GrammarSpec.json_schema(schema)
    for kw in SAMPLING:
        ids, reason = _generate(model, spec, **kw)
        assert reason == "stop", (kw, _text(tok, ids))
        value = json.loads(_text(tok, ids))
        jsonschema.validate(value, schema)


def test_json_object_mode(model: colibri.SyncModel, tok: ChatTokenizer) -> None:
    """Any JSON object. A grammar cannot make a random model close its strings within the
    token budget, so a run that hits the budget must be a valid prefix; one that stops must
    parse."""
    spec = GrammarSpec.from_response_format({"type": "json_object"})
    assert spec == GrammarSpec.json_object()
    path = DEMO / "tokenizer.json"
    stopped = 0
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0}):
        ids, reason = _generate(model, spec, n=60, **kw)
        if reason == "stop":
            stopped += 1
            assert isinstance(json.loads(_text(tok, ids)), dict)
        else:
            checker = TokenGrammar(path, 1000, [0, 2]).matcher(spec)
            checker.push(ids)  # raises on any token outside the grammar
            assert _text(tok, ids).startswith("{")
    assert stopped >= 1


def test_gbnf_yes_no(model: colibri.SyncModel, tok: ChatTokenizer) -> None:
    spec = GrammarSpec.gbnf('root ::= "yes" | "no"')
    seen = set()
    for kw in [*SAMPLING, *({"temperature": 1.5, "seed": s} for s in range(3, 12))]:
        ids, reason = _generate(model, spec, n=10, **kw)
        assert reason == "stop"
        seen.add(_text(tok, ids))
    assert seen <= {"yes", "no"}


def test_forced_spans_are_free_drafts_and_keep_greedy_output(model: colibri.SyncModel) -> None:
    spec = GrammarSpec.json_schema(FORCING)
    engine = model.engine
    before = engine.stats()["speculative"]
    ref, _ = _generate(model, spec, draft="off")
    assert engine.stats()["speculative"]["proposed"]["grammar"] == before["proposed"]["grammar"]
    for draft in ("auto", "2", "lookup:4"):
        got, _ = _generate(model, spec, draft=draft)
        assert got == ref, draft
    after = engine.stats()["speculative"]
    accepted = after["accepted"]["grammar"] - before["accepted"]["grammar"]
    assert accepted >= 10  # the long keys came in verify steps, not one forward per token
    assert after["tokens_per_forward"] > 1.0


def test_mask_and_forced_tokens(tok: ChatTokenizer) -> None:
    cont = Container.open(DEMO)
    assert cont.tokenizer_path() is not None
    g = TokenGrammar(Path(str(cont.tokenizer_path())), 1000, cont.eos_token_ids)
    m = g.matcher(GrammarSpec.gbnf('root ::= "yes" | "no"'))
    allowed = np.flatnonzero(m.allowed())
    assert {g.decode([int(t)]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    logits = np.zeros(1000, np.float32)
    masked = m.mask(logits)
    assert np.isfinite(masked).sum() == allowed.size
    m.consume(tok.encode("n")[0])
    assert g.decode(m.forced()) == "o"
    m.consume(m.forced()[0])
    assert m.accepting
    assert set(np.flatnonzero(m.allowed())) <= set(cont.eos_token_ids)
    j = g.matcher(GrammarSpec.json_schema(FORCING))
    assert g.decode(j.forced()).startswith('{"the_answer')


def test_a_grammar_asked_for_again_is_copied_not_compiled(tok: ChatTokenizer) -> None:
    """The same spec twice compiles once (a service sends one schema with every request, and
    the server checks it before generating too); the copies are independent matchers at the
    grammar's start; an invalid grammar is refused every time (compiled once); the least
    recently used grammar is dropped past COMPILED_KEPT."""
    g = TokenGrammar(DEMO / "tokenizer.json", 1000, [0, 2])
    yes_no = GrammarSpec.gbnf('root ::= "yes" | "no"')
    a = g.matcher(yes_no)
    start = a.allowed()
    a.consume(tok.encode("n")[0])
    b = g.matcher(GrammarSpec.gbnf('root ::= "yes" | "no"'))  # an equal spec
    assert g.compilations == 1
    assert np.array_equal(b.allowed(), start) and not np.array_equal(a.allowed(), start)
    b.consume(tok.encode("y")[0])
    assert g.decode(a.forced()) == "o" and g.decode(b.forced()) == "es"
    compiled: list[GrammarSpec] = []
    real = g._compile

    def counting(spec: GrammarSpec) -> Any:
        compiled.append(spec)
        return real(spec)

    g._compile = counting  # type: ignore[method-assign]
    errors = []
    for _ in range(2):
        with pytest.raises(GrammarError) as err:
            g.matcher(GrammarSpec.gbnf("root ::= undefined_rule"))
        errors.append(str(err.value))
    # refused again at once with the same error, not compiled again (a bad schema took
    # seconds of CPU at every retry)
    assert len(compiled) == 1 and errors[0] == errors[1]
    for i in range(COMPILED_KEPT):
        g.matcher(GrammarSpec.regex(f"a{{{i + 1}}}"))
    assert g.compilations == 1 + COMPILED_KEPT
    g.matcher(GrammarSpec.regex("a{1}"))  # still kept
    g.matcher(yes_no)  # dropped by the 32 after it: compiled again, and still right
    assert g.compilations == 2 + COMPILED_KEPT
    assert np.array_equal(g.matcher(yes_no).allowed(), start)


def test_response_format_mapping_and_errors() -> None:
    assert GrammarSpec.from_response_format(None) is None
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    s = GrammarSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[0]}}
    )
    assert s is not None and s.kind == "json_schema" and json.loads(s.source) == SCHEMAS[0]
    g = GrammarSpec.from_response_format({"type": "gbnf", "grammar": 'root ::= "a"'})
    assert g == GrammarSpec.gbnf('root ::= "a"')
    for bad in (
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "gbnf", "grammar": ""},
    ):
        with pytest.raises(GrammarError):
            GrammarSpec.from_response_format(bad)
    with pytest.raises(GrammarError):
        GrammarSpec.json_schema("{not json")
    cont_tok = TokenGrammar(DEMO / "tokenizer.json", 1000, [0, 2])
    with pytest.raises(GrammarError):
        cont_tok.matcher(GrammarSpec.gbnf("root ::= undefined_rule"))
    assert isinstance(GrammarError("x"), colibri.ColibriError)


def test_json_schema_size_is_bounded() -> None:
    """The compiler recurses along nesting and $ref chains (a chain ~2000 long overflowed its
    stack and killed the process): past the bounds a schema is a GrammarError, as is JSON text
    nested past the parser's depth; a schema well inside them compiles."""
    from runtime.grammar import MAX_SCHEMA_DEPTH, MAX_SCHEMA_REFS

    def chain(n: int) -> dict[str, object]:
        defs: dict[str, object] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "string"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}

    with pytest.raises(GrammarError, match=f"more than {MAX_SCHEMA_REFS}"):
        GrammarSpec.json_schema(chain(3000))
    deep: dict[str, object] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nests deeper"):
        GrammarSpec.json_schema(deep)
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("[" * 5000 + "]" * 5000)  # text: the parser's own limit
    tok = TokenGrammar(DEMO / "tokenizer.json", 1000, [0, 2])
    tok.matcher(GrammarSpec.json_schema(chain(50)))  # a reasonable schema still compiles


def test_drafts_past_the_end_of_the_output_do_not_rewind_the_grammar(
    model: colibri.SyncModel, tok: ChatTokenizer
) -> None:
    """With end-of-sequence left out of the stop ids (ignore_eos), an MTP draft chained past
    the complete output pushed an end-of-sequence token the grammar did not count, and the
    rollback undid one more token than was pushed: the next tokens broke the schema
    ('{"a":02111122...'). The grammar's matcher restores its own copy now, every draft mode
    gives the undrafted output, and the end-of-sequence token after the output ends the
    generation (it was repeated up to max_tokens)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    spec = GrammarSpec.json_schema(schema)
    eos = set(Container.open(DEMO).eos_token_ids)
    ref, reason = _generate(model, spec, n=24, stop_token_ids=[], draft="off")
    assert reason == "stop" and ref[-1] in eos and not eos & set(ref[:-1]), ref
    jsonschema.validate(json.loads(_text(tok, ref)), schema)
    for draft in ("mtp:3", "lookup:4", "auto"):
        got, reason = _generate(model, spec, n=24, stop_token_ids=[], draft=draft)
        assert (got, reason) == (ref, "stop"), draft


def test_a_pushed_token_the_grammar_refuses_leaves_the_state_as_it_was(tok: ChatTokenizer) -> None:
    g = TokenGrammar(DEMO / "tokenizer.json", 1000, [0, 2])
    m = g.matcher(GrammarSpec.gbnf('root ::= "yes" | "no"'))
    before = m.allowed().copy()
    with pytest.raises(GrammarError):
        m.push([tok.encode("n")[0], tok.encode("n")[0]])
    m.rollback(1)  # the one token that was taken
    assert (m.allowed() == before).all()
    with pytest.raises(GrammarError, match="0 pushed"):
        m.rollback(1)


def test_a_schema_json_cannot_hold_is_a_grammar_error() -> None:
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema({"enum": {1, 2}})  # a set: it was a bare TypeError


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema(
            {
                "type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(600)},
                "additionalProperties": False,
            }
        ),
        GrammarSpec.regex("a{1000000}"),
    ],
    ids=["600-optional-properties", "regex-repeat"],
)
def test_a_grammar_past_the_parsers_limits_is_refused_before_any_token(spec: GrammarSpec) -> None:
    """These passed the compile check and failed at the first token ("token 94 breaks the
    grammar"), after the server had answered a stream with 200: they are refused up front."""
    g = TokenGrammar(DEMO / "tokenizer.json", 1000, [0, 2])
    with pytest.raises(GrammarError, match="too large for the constraint parser"):
        g.matcher(spec)


@pytest.mark.parametrize(
    ("schema", "say"),
    [
        (  # it forced 9007199254740992, below the minimum
            {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 1}
                },
                "required": ["id"],
            },
            "minimum 9007199254740993 is beyond 2",
        ),
        (  # {"a":8,"a":0} came back with finish_reason stop: one key, not two
            {
                "type": "object",
                "patternProperties": {"^a$": {"type": "integer"}},
                "additionalProperties": False,
                "minProperties": 2,
            },
            "minProperties 2 needs keys beyond the 0 required",
        ),
        ({"type": "object", "minProperties": 2}, "minProperties 2"),
        (  # llguidance's advice named an option nobody can set
            {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "use anyOf",
        ),
    ],
    ids=["int-bound-past-2^53", "min-properties-pattern", "min-properties-free", "oneOf-overlap"],
)
def test_schemas_the_parser_would_enforce_wrongly_are_refused(
    schema: dict[str, Any], say: str, tok: ChatTokenizer
) -> None:
    g = TokenGrammar(DEMO / "tokenizer.json", tok.vocab_size, [0, 2])
    with pytest.raises(GrammarError, match=say):
        g.matcher(GrammarSpec.json_schema(schema))


def test_schemas_the_parser_enforces_stay_accepted(tok: ChatTokenizer) -> None:
    g = TokenGrammar(DEMO / "tokenizer.json", tok.vocab_size, [0, 2])
    for schema in (
        {"type": "integer", "minimum": -(2**53), "maximum": 2**53},
        {"type": "object", "required": ["a", "b"], "minProperties": 2},
        {"type": "object", "properties": {"minimum": {"type": "integer"}}},  # a key, not a bound
    ):
        g.matcher(GrammarSpec.json_schema(schema))


def test_grammar_spec_checks_its_kind_and_takes_a_schema_dict(
    model: colibri.SyncModel, tok: ChatTokenizer
) -> None:
    """GrammarSpec('xml', ...) and 'JSON_SCHEMA' were compiled as regular expressions of their
    text; a schema dict (as documented) was a TypeError from the compiled-grammar cache."""
    for kind in ("xml", "JSON_SCHEMA"):
        with pytest.raises(GrammarError, match=f"unknown grammar kind '{kind}'"):
            GrammarSpec(kind, "hello")  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="source is text"):
        GrammarSpec("regex", {"a": 1})  # type: ignore[arg-type]
    spec = GrammarSpec("json_schema", {"type": "integer", "minimum": 0, "maximum": 9})  # type: ignore[arg-type]
    assert spec == GrammarSpec.json_schema({"type": "integer", "minimum": 0, "maximum": 9})
    out = model.generate(PROMPT, max_new_tokens=4, grammar=spec)
    text = _text(tok, out)
    assert 0 <= int(text) <= 9, text
    assert colibri.GrammarSpec is GrammarSpec


def test_a_grammar_may_spell_text_tokens_the_tokenizer_adds(tmp_path: Path) -> None:
    """Qwen3's and GLM's <think>, </think> are added tokens marked special: false (text the
    model writes); llguidance took them for special tokens, so a grammar spelling them
    rejected the very token that spells them ('<think>x</think>' refused as 'too large', 'ab
    </think>x' failing mid-stream)."""
    doc = json.loads((DEMO / "tokenizer.json").read_text())
    n = len(doc["model"]["vocab"])
    ids = {"<think>": n, "</think>": n + 1}  # past the BPE vocabulary, as in Qwen3's
    for text, tid in ids.items():
        doc["added_tokens"].append(
            {"id": tid, "content": text, "special": False, "single_word": False,
             "lstrip": False, "rstrip": False, "normalized": False}
        )  # fmt: skip
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc))
    g = TokenGrammar(path, n + 2, [0])
    for text in ("<think>x</think>", "ab </think>x"):
        m = g.matcher(GrammarSpec.regex(text))
        out: list[int] = []
        while not m.accepting:  # the lowest allowed token each step: a whole path
            tok = int(np.flatnonzero(m.allowed())[0])
            m.consume(tok)
            out.append(tok)
        assert g.decode(out) == text
    # the token that spells it is text to the grammar: accepted where the text goes
    m = g.matcher(GrammarSpec.regex("(<think>)?x"))
    m.consume(ids["<think>"])
    assert g.decode([ids["<think>"]]) == "<think>"
