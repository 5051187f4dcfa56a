"""Text <-> token ids with the model directory's own tokenizer and chat template.

Uses the ``tokenizers`` library (``tokenizer.json``) and renders the chat template with jinja2
in a sandbox, as Hugging Face ``transformers`` does (:mod:`storage.chat_template` finds and
compiles it: ``chat_template.jinja`` beside ``tokenizer.json`` wins over ``chat_template`` in
``tokenizer_config.json``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer

from storage.chat_template import (
    CHAT_TEMPLATE_NAME,
    chat_template_source,
    compile_chat_template,
    tool_use_template_source,
)
from storage.errors import ColibriError, ConfigError

__all__ = [
    "CHAT_TEMPLATE_NAME",
    "TOOL_CALL_MARKERS",
    "ChatTokenizer",
    "PromptTooLongError",
    "TextStream",
]

#: The markers of the tool-call formats the server reads (colibri/server/textproc.py): kept in
#: decoded text even where the tokenizer marks them special (Mistral's, Kimi-K2's).
TOOL_CALL_MARKERS = frozenset(
    {
        "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<minimax:tool_call>", "</minimax:tool_call>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
    }
)  # fmt: skip
_LONG_TEXT = 1 << 16  # characters; shorter texts take the cheaper single-text call


def _token_text(v: object) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def not_utf8(text: str) -> str | None:
    """Why ``text`` is not text the tokenizer can take, or None: a string decoded with
    ``surrogateescape`` (argv, or a stream in the C locale) keeps undecodable bytes as lone
    surrogates, which no UTF-8 encoder (nor the tokenizer) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raw = bad.encode("utf-8", "surrogateescape") if bad else b""
        return f"it is not valid UTF-8 (bytes {raw!r} at character {exc.start})"
    return None


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE table, character -> byte: printable bytes map to themselves, the
    rest to the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class PromptTooLongError(ColibriError):
    """A text has more tokens than allowed (:meth:`ChatTokenizer.encode` with ``limit``)."""

    def __init__(self, n_tokens: int, limit: int, *, at_least: bool = False) -> None:
        more = "at least " if at_least else ""
        super().__init__(f"the text has {more}{n_tokens} tokens, more than {limit}")
        self.n_tokens = n_tokens
        self.limit = limit
        self.at_least = at_least  # n_tokens is a floor (the text was never tokenized)


class ChatTokenizer:
    """The model's tokenizer plus its chat template."""

    def __init__(self, tokenizer_file: Path, tokenizer_config: Mapping[str, Any]) -> None:
        tokenizer_file = Path(tokenizer_file)
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ConfigError(f"{tokenizer_file}: cannot load tokenizer ({exc})") from exc
        self.config = dict(tokenizer_config)
        self._longest: int | None = None  # bytes a token may cover (at_least_tokens)
        # <0xHH> tokens (is_byte_fallback): 256 lookups, not a scan of the vocabulary
        self._byte_ids = frozenset(
            int(i) for b in range(256) if (i := self._tok.token_to_id(f"<0x{b:02X}>")) is not None
        )
        decoder = self._tok.decoder
        self._byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        added = self._tok.get_added_tokens_decoder()
        self._added_ids = frozenset(int(i) for i in added)
        # special tokens: decode() leaves them out of the text, so their bytes are none; but for
        # the markers of a tool call (Mistral's [TOOL_CALLS] is a special token: without it
        # the server could not see the call, as transformers' skip_special_tokens would hide it)
        self._special_ids = frozenset(
            int(i) for i, t in added.items() if t.special and t.content not in TOOL_CALL_MARKERS
        )
        self._kept_ids = frozenset(
            int(i) for i, t in added.items() if t.special and t.content in TOOL_CALL_MARKERS
        )
        self._template_src, where = chat_template_source(tokenizer_file.parent, self.config)
        self._template = (
            compile_chat_template(self._template_src, where) if self._template_src else None
        )
        tool_src = tool_use_template_source(tokenizer_file.parent, self.config)
        self._tool_template = (
            compile_chat_template(tool_src, f"{where} (tool_use)") if tool_src else None
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, limit: int | None = None, raw: bool = False) -> list[int]:
        """Token ids of ``text``. ``limit``: raise :class:`PromptTooLongError` instead of
        returning more ids than that (counted before the ids become a Python list, which for
        a huge text holds the GIL for a noticeable time).

        ``raw``: ``text`` is a whole prompt the model sees as is (no chat template, whose text
        carries its own special tokens): the ids are what transformers' ``tokenizer(text)``
        gives, with the special tokens tokenizer.json's post-processor adds (a BOS, for
        tokenizers that start every text with one)."""
        if limit is not None and len(text) > limit:
            floor = self.at_least_tokens(text)
            if floor > limit:
                # refused without tokenizing: a 4 MB prompt to a model of a 1,024-token context
                # took seconds of a text thread (and GBs of memory) only to be refused
                raise PromptTooLongError(floor, limit, at_least=True)
        if len(text) > _LONG_TEXT:
            # encode_batch releases the GIL while it works (encode holds it for the whole call:
            # seconds for a 4 MB prompt, during which no other thread, the event loop included,
            # runs). Same pipeline, same ids.
            enc = self._tok.encode_batch([text], add_special_tokens=raw)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=raw)
        if limit is not None and len(enc) > limit:
            raise PromptTooLongError(len(enc), limit)
        return list(enc.ids)

    def spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text, raw=True)``'s ids and each token's (start, end) characters in
        ``text`` (an added BOS spans nothing)."""
        enc = self._tok.encode(text, add_special_tokens=True)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def at_least_tokens(self, text: str) -> int:
        """A lower bound of ``text``'s token count, found without tokenizing it (0 where the
        tokenizer gives none), to refuse a text far past a limit at once: with a byte-level
        BPE, no token covers more bytes of the normalized text than the longest vocabulary
        entry."""
        if self._longest is None:
            # only where it holds: a byte-level BPE covers every byte of the (normalized) text
            # by tokens of its vocabulary (an [UNK] of a fused-unknown BPE or a unigram model
            # stands for any run of text)
            longest = max((len(k.encode("utf-8")) for k in self._tok.get_vocab()), default=1)
            self._longest = max(longest, 1) if self._byte_level else 0
        if not self._longest:
            return 0
        norm = self._tok.normalizer  # NFC (Qwen's) can shrink a text: count what it gives
        seen = norm.normalize_str(text) if norm is not None else text
        return len(seen.encode("utf-8")) // self._longest

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``: special tokens left out, but tool-call markers."""
        if self._kept_ids and not self._kept_ids.isdisjoint(ids):
            kept = [int(i) for i in ids if int(i) not in self._special_ids]
            return str(self._tok.decode(kept, skip_special_tokens=False))
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (left out of decoded text)."""
        return int(token_id) in self._special_ids

    def token_bytes(self, token_id: int, *, spelled: bool = False) -> bytes:
        """The bytes token ``token_id`` stands for in the output text, also for a token that
        holds only part of a UTF-8 character (whose own decode is U+FFFD): byte-level BPE
        tokens through GPT-2's byte-to-character table, ``<0xHH>`` byte-fallback tokens as
        that byte, sentencepiece pieces with ``▁`` as a space; added tokens as their text,
        special ones (which the output text leaves out) as no bytes unless ``spelled`` (text
        that holds them as written: an echoed prompt)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._special_ids and not spelled:
            return b""  # not in the output text (it was "<|assistant|>", so offsets ran past it)
        if int(token_id) in self._added_ids:
            return str(piece).encode("utf-8")
        if self._byte_level:
            table = _byte_decoder()
            try:
                return bytes(table[ch] for ch in piece)
            except KeyError:  # not a byte-level piece after all
                return str(piece).encode("utf-8")
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return str(piece).replace("\u2581", " ").encode("utf-8")

    def is_byte_fallback(self, token_id: int) -> bool:
        """Whether ``token_id`` is a ``<0xHH>`` byte-fallback token (sentencepiece-style
        vocabularies: Llama, Mistral, Mixtral), whose text depends on the run of byte tokens
        it is part of (a run that is no valid UTF-8 decodes as one U+FFFD per token)."""
        return int(token_id) in self._byte_ids

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def stream(self) -> TextStream:
        """An incremental decoder for one generation (see :class:`TextStream`)."""
        return TextStream(self)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render messages with the model's template (plain ``role: content`` lines if none).

        ``continue_final_message`` (transformers' option of that name): the last message (an
        assistant's prefill) is left open, so the model continues its text: rendered without
        a generation prompt and cut right after that message's content. A template that does
        not reproduce the content is a :class:`ConfigError`."""
        if continue_final_message:
            add_generation_prompt = False
        if self._template is None:
            lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
            if add_generation_prompt:
                lines.append("assistant:")
            return "\n".join(lines)
        special = {
            k: t
            for k, v in self.config.items()
            if k.endswith("_token") and (t := _token_text(v)) is not None
        }
        template = self._template
        if extra.get("tools") and self._tool_template is not None:
            template = self._tool_template  # (as transformers picks it: tools were given)
        try:
            text = str(
                template.render(
                    messages=list(messages),
                    add_generation_prompt=add_generation_prompt,
                    # as transformers renders: ``tools`` and ``documents`` are None, not
                    # undefined, when not given (``tools is not none`` was true)
                    **{"tools": None, "documents": None, **special, **extra},
                )
            )
        except TemplateError as exc:
            raise ConfigError(f"chat template failed to render: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # Jinja lets a Python error of an expression escape unwrapped (a message field of
            # an unexpected type: ``'a' + none``, iterating over an integer): the same failure
            # to render, not an internal error
            raise ConfigError(
                f"chat template failed to render: {type(exc).__name__}: {exc}"
            ) from exc
        if continue_final_message and messages:
            final = str(messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if final and at < 0:
                raise ConfigError(
                    "the chat template does not reproduce the final message's text, so it "
                    "cannot be continued"
                )
            if final:
                text = text[: at + len(final)]
        return text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **extra))


class TextStream:
    """Token ids in, text out, one token at a time, for printing a generation as it streams.

    A character split over several byte-level tokens decodes as U+FFFD until its last byte
    arrives: :meth:`push` holds such text back, so what it returns, concatenated, is exactly
    ``decode(all ids)``. Decoding restarts from a recent token each time (not from the first),
    which keeps the cost per token constant and spacing rules (a leading-space marker) right.
    A run of ``<0xHH>`` byte-fallback tokens is held back until a token of another kind ends
    it: the decoder renders the whole run at once (an invalid run as one U+FFFD per token, a
    newline among them included), so text released from its first tokens could be rewritten by
    its later ones (every later piece was then lost).
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # decoding window starts here (context for spacing rules)
        self._read = 0  # text of ids[_prefix:_read] has been returned already
        # where, in the text the last push returned, that token's own text begins (after the
        # text of the tokens held back before it)
        self.last_start = 0

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is partial)."""
        self._ids.append(int(token_id))
        self.last_start = 0
        if self._tok.is_byte_fallback(token_id) or self._tok.is_special(token_id):
            # the run of byte tokens may go on (see the class docstring); a special token
            # leaves no text and does not end a run either (the decoder skips it)
            return ""
        ready = self._ready()
        if ready is None:
            return ""
        done, text = ready
        if len(self._ids) - self._read > 1:  # it releases tokens held before it too
            before = self._tok.decode(self._ids[self._prefix : -1])
            if before.startswith(done):
                self.last_start = min(len(before), len(text)) - len(done)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def pending(self) -> str:
        """The text held back now, as it reads if the generation ended here ("" while it ends
        in a partial character): what a stop string may already be found in (a newline is a
        byte token in Llama-style vocabularies, held until its run ends)."""
        ready = self._ready()
        return "" if ready is None else ready[1][len(ready[0]) :]

    def _ready(self) -> tuple[str, str] | None:
        """(text returned already, text of the window) when the window's new text can be
        released: more of it, no partial character at its end, the text returned unchanged."""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd") and text.startswith(done):
            return done, text
        return None

    def flush(self) -> str:
        """Whatever is still held back (a trailing partial character decodes as U+FFFD)."""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :] if text.startswith(done) else ""
