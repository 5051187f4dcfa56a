"""Incremental detokenization (colibri.tokenizer.TextStream) against the tokenizer's own
decode: the pieces a generation streams, joined, are exactly ``decode(all ids)``. The byte-level
BPE of the demo model and a sentencepiece-style byte-fallback tokenizer (Llama, Mistral,
Mixtral), built here with the tokenizers library."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from colibri._config import default_model_path
from colibri.tokenizer import ChatTokenizer


def _byte_fallback(tmp: Path) -> ChatTokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in ["\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "\u2581ab", "日", "本", "é"]:
        vocab.setdefault(p, len(vocab))
    merges = [("\u2581", "a"), ("\u2581", "b"), ("a", "b"), ("\u2581a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))  # fmt: skip
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp / "tokenizer.json"))
    return ChatTokenizer(tmp / "tokenizer.json", {"bos_token": "<s>", "eos_token": "</s>"})


def _streamed(tok: ChatTokenizer, ids: list[int]) -> str:
    s = tok.stream()
    return "".join(s.push(i) for i in ids) + s.flush()


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_streamed_pieces_join_to_the_decoded_text(tmp_path: Path, kind: str) -> None:
    """With byte-fallback tokens a run that is no valid UTF-8 decodes as one U+FFFD per token,
    a newline among them included: text released from its first tokens was rewritten by the
    later ones, and every piece after that was lost (half of random sequences differed)."""
    if kind == "byte-level":
        d = default_model_path()
        tok = ChatTokenizer(
            d / "tokenizer.json", json.loads((d / "tokenizer_config.json").read_text())
        )
    else:
        tok = _byte_fallback(tmp_path)
    rng = random.Random(0)
    for _ in range(1500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        assert _streamed(tok, ids) == tok.decode(ids), ids
    if kind == "byte-fallback":
        ids = [tok.token_to_id(t) for t in ("\u2581a", "<0x0A>", "<0xE6>", "\u2581b", "\u2581ab")]
        assert all(i is not None for i in ids)
        assert _streamed(tok, ids) == tok.decode(ids) == "a\ufffd\ufffd b ab"  # type: ignore[arg-type]


def test_the_template_sees_tools_and_documents_as_none_when_not_given(tmp_path: Path) -> None:
    """transformers renders a chat template with ``tools=None`` and ``documents=None``; they
    were undefined here, so a template testing ``tools is not none`` rendered its tools
    section for every request without tools (a prompt the model never saw in training)."""
    d = default_model_path()
    (tmp_path / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes())
    template = (
        "{%- if tools is not none %}TOOLS:{{ tools | length }}|{% endif -%}"
        "{%- for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor -%}"
        "{{ documents is none }}"
    )
    tok = ChatTokenizer(tmp_path / "tokenizer.json", {"chat_template": template})
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "user:hi|True"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.apply_chat_template(msgs, tools=tools) == "TOOLS:1|user:hi|True"


def test_held_text_is_visible_to_stop_strings_and_offsets_are_the_tokens_own(
    tmp_path: Path,
) -> None:
    """Held byte runs (a newline is <0x0A> in Llama-style vocabularies) hid a stop string
    until the run ended, a step or many later (a model looping on newlines ran to max_tokens);
    and the token that released a held run had its logprob placed at the run's start."""
    from colibri.server.textproc import StopMatcher

    tok = _byte_fallback(tmp_path)

    def tid(t: str) -> int:
        i = tok.token_to_id(t)
        assert i is not None
        return i

    s = tok.stream()
    stop = StopMatcher(["\n"])
    assert s.push(tid("\u2581a")) == "a"
    assert s.push(tid("<0x0A>")) == ""  # held: its run may go on
    assert s.pending() == "\n" and stop.would_hit(s.pending())
    assert not StopMatcher(["x"]).would_hit(s.pending())
    assert s.push(tid("<0x0A>")) == "" and s.pending() == "\n\n"
    assert s.push(tid("\u2581b")) == "\n\n b"
    assert s.last_start == 2  # its own text (" b") begins after the released newlines
    assert s.push(tid("\u2581ab")) == " ab" and s.last_start == 0


def test_the_tool_use_template_renders_when_tools_are_given(tmp_path: Path) -> None:
    """tokenizer_config.json may name templates (Mixtral-8x22B-Instruct ships "default" and
    "tool_use"); with tools the default one rendered, and the tools never reached the model."""
    from colibri.tokenizer import ChatTokenizer

    cfg = {
        "chat_template": [
            {"name": "default", "template": "D:{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}:{{ messages[0].content }}"},
        ]
    }
    from _demo import demo_model

    (tmp_path / "tokenizer.json").symlink_to(demo_model() / "tokenizer.json")
    tok = ChatTokenizer(tmp_path / "tokenizer.json", cfg)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "D:hi"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.apply_chat_template(msgs, tools=tools) == "T1:hi"


def test_tool_call_markers_stay_in_the_text_where_the_tokenizer_marks_them_special(
    tmp_path: Path,
) -> None:
    """Mistral's ``[TOOL_CALLS]`` / ``[ARGS]`` are special tokens: left out of the decoded text
    like ``</s>``, the server never saw a Mistral model's tool call. They stay (decoded and
    streamed alike), other special tokens still go, and the call parses."""
    from colibri.server import textproc
    from colibri.tokenizer import TOOL_CALL_MARKERS

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in ["\u2581", "a", "b", "\u2581a", "ab"]:
        vocab.setdefault(p, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a"), ("a", "b")],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))  # fmt: skip
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True)
                            for t in ("<s>", "</s>", "[TOOL_CALLS]", "[ARGS]")])  # fmt: skip
    tok.save(str(tmp_path / "tokenizer.json"))
    ct = ChatTokenizer(tmp_path / "tokenizer.json", {"bos_token": "<s>", "eos_token": "</s>"})
    calls, args, eos = (ct.token_to_id(t) for t in ("[TOOL_CALLS]", "[ARGS]", "</s>"))
    assert calls is not None and args is not None and eos is not None
    assert not ct.is_special(calls) and not ct.is_special(args) and ct.is_special(eos)
    listed = [*ct.encode("ab"), calls, *ct.encode('[{"name": "f", "arguments": {"x": 1}}]'), eos]
    named = [*ct.encode("ab"), calls, *ct.encode("f"), args, *ct.encode('{"x": 2}'), eos]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for ids, want in ((listed, {"x": 1}), (named, {"x": 2})):
        text = ct.decode(ids)
        assert text.startswith("ab[TOOL_CALLS]") and "</s>" not in text, text
        assert _streamed(ct, ids) == text
        rest, got = textproc.parse_tool_calls(text, tools)
        assert rest == "ab" and [(c.name, json.loads(c.arguments)) for c in got] == [("f", want)]
    # every marker the server reads is kept
    markers = {*textproc._CALL_STARTS, *textproc._ENDS.values()}
    assert markers <= TOOL_CALL_MARKERS, markers - TOOL_CALL_MARKERS
