"""``coli chat``: an interactive conversation with streamed replies that survives restarts.

Each turn renders the whole conversation with the model's chat template and hands the token ids
to ``Engine.generate(cache=...)``, which reuses the longest common prefix with the cache and
prefills only the rest (normally the new user message). Assistant replies are spliced back in
as the exact token ids the model generated (not re-tokenized text), so the history always
matches the cache.

At the end of every turn the session is saved in the state directory: the KV cache as
``.coli_kv.chat.<name>`` (:mod:`storage.kvfile`: records appended, count written last) and the
messages as ``.coli_chat.<name>.json`` (temporary file, fsync, rename). Starting ``coli chat``
again with the same session loads both and continues without prefilling the history again;
the continuation is bit-identical to a session that never stopped (per-turn seeds are
``seed + turn``).

Commands: ``:q`` (or Ctrl-D) quits, ``:reset`` starts over, ``:help``. Ctrl-C during a reply
stops that reply and returns to the prompt; at the prompt it reminds of ``:q``, and a second
Ctrl-C there within two seconds quits (exit status 130, the conversation kept).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

import anyio.from_thread
import click
import structlog

from colibri._config import EngineOptions
from colibri._engine import (
    ENGINE_ID,
    DoneEvent,
    Engine,
    GenerationEvent,
    SyncModel,
    TokenEvent,
    open_model,
)
from colibri.tokenizer import ChatTokenizer, not_utf8
from runtime.kv import KVCache
from storage.atomic import atomic_write_bytes, set_aside_and_warn
from storage.container import Container
from storage.errors import ColibriError, KVFileError, ModelError
from storage.kvfile import KV_FILE, load_kv, model_identity, sync_kv

__all__ = [
    "SESSION_RE",
    "ChatSettings",
    "TurnResult",
    "conversation_ids",
    "format_footer",
    "kv_path",
    "printable",
    "rss_bytes",
    "run_chat",
    "session_path",
]

_log = structlog.get_logger("colibri.chat")

SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SESSION_FORMAT = "colibri-chat"
SESSION_VERSION = 1
PROMPT = "you> "
_MARK = "\ue000colibri-{}\ue001"  # private-use code points: never in real text
_MARK_RE = re.compile("\ue000colibri-(\\d+)\ue001")
_END = object()
HELP = ":q quits (or Ctrl-D, or Ctrl-C twice), :reset starts over, Ctrl-C stops a reply"
QUIT_WINDOW_S = 2.0  # a second Ctrl-C at the prompt within this quits


def session_path(state_dir: Path, name: str) -> Path:
    """The messages file of session ``name``."""
    return state_dir / f".coli_chat.{name}.json"


def kv_path(state_dir: Path, name: str) -> Path:
    """The ``.coli_kv`` file of session ``name``."""
    return state_dir / f"{KV_FILE}.chat.{name}"


def rss_bytes() -> int | None:
    """Resident set size of this process (``VmRSS`` in /proc/self/status), None if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


_CONTROL = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) shown as U+FFFD: a
    model's output must not drive the terminal (escape sequences, bells, backspaces)."""
    return text.translate(_CONTROL)


def _plain(m: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": m["role"], "content": m["content"]}


_ROLES = frozenset({"system", "user", "assistant"})  # what coli chat writes


def _check_messages(messages: object, vocab: int) -> None:
    """Raise ``ValueError`` unless ``messages`` is a saved conversation: a list of
    ``{"role": str, "content": str}``, an assistant's ``tokens`` (when given) a list of token
    ids below ``vocab``."""
    if not isinstance(messages, list):
        raise ValueError("messages are damaged: not a list")
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict) and m.get("role") in _ROLES
            and isinstance(m.get("content"), str)
        ):  # fmt: skip
            raise ValueError(
                f"message {i} is damaged (needs a role, one of {', '.join(sorted(_ROLES))}, "
                "and a content string)"
            )
        toks = m.get("tokens")
        if toks is not None and not (
            isinstance(toks, list)
            and all(type(t) is int and 0 <= t < vocab for t in toks)
        ):  # fmt: skip
            raise ValueError(f"message {i}: tokens must be token ids in 0..{vocab - 1}")


def conversation_ids(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the generation prompt.

    Assistant messages that carry ``tokens`` (the ids the model generated, stop token
    excluded) are spliced in as those ids: the template is rendered with a placeholder in
    their place and the text around it is encoded. When a template drops or alters the
    placeholders, the whole rendering is encoded instead (the cache then reuses less)."""
    spliced = {
        i: [int(t) for t in m["tokens"]]
        for i, m in enumerate(messages)
        if m.get("role") == "assistant" and m.get("tokens") is not None
    }
    plain = _as_template(tok, messages)
    if spliced:
        marked = [
            {"role": m["role"], "content": _MARK.format(i)} if i in spliced else plain[i]
            for i, m in enumerate(messages)
        ]
        parts = _MARK_RE.split(tok.apply_chat_template(marked, add_generation_prompt=True))
        found = [int(x) for x in parts[1::2]]
        # ... only where the template renders a reply as the text the model wrote: a thinking
        # template drops earlier reasoning or re-wraps it (GLM-4.5 rendered two think blocks,
        # MiniMax-M2 a '</think>' without its '<think>'), and then the whole rendering is
        # encoded (the cache reuses the common prefix only)
        texts = {i: tok.decode(t) for i, t in spliced.items()}
        rebuilt = "".join(p if k % 2 == 0 else texts.get(int(p), "") for k, p in enumerate(parts))
        if found == sorted(spliced) and rebuilt == tok.apply_chat_template(
            plain, add_generation_prompt=True
        ):
            ids: list[int] = []
            for k, text in enumerate(parts[0::2]):
                if text:
                    ids += tok.encode(text)
                if k < len(found):
                    ids += spliced[found[k]]
            return ids
    return tok.encode_chat(plain)


def _as_template(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template expects them, as the server gets them from a client:
    a reply's think section (``<think>...</think>`` at its start, or all up to ``</think>``
    when the generation prompt opened it) as ``reasoning_content``, the rest as content."""
    # (imported here: colibri.server loads the web stack, which coli chat does not need)
    from colibri.server.textproc import THINK_END, THINK_START, ThinkSplitter

    out: list[dict[str, Any]] = []
    for m in messages:
        msg = _plain(m)
        if m.get("role") == "assistant" and THINK_END in msg["content"]:
            prompt = tok.apply_chat_template(out, add_generation_prompt=True) if out else ""
            split = ThinkSplitter(enabled=True, inside=prompt.rstrip().endswith(THINK_START))
            parts = split.feed(msg["content"]) + split.flush()
            reasoning = "".join(t for kind, t in parts if kind == "reasoning")
            msg["content"] = "".join(t for kind, t in parts if kind == "content")
            if reasoning:
                msg["reasoning_content"] = reasoning.strip()
        out.append(msg)
    return out


def format_footer(
    tokens: int, tok_per_s: float, hit: float, rss: int | None, seconds: float
) -> str:
    """``N tok · X tok/s · hit Y % · RSS Z MiB · S s``."""
    rss_text = "?" if rss is None else f"{rss / 2**20:.0f}"
    return (
        f"{tokens} tok · {tok_per_s:.1f} tok/s · hit {100 * hit:.0f} % · "
        f"RSS {rss_text} MiB · {seconds:.1f} s"
    )


@dataclass(frozen=True)
class ChatSettings:
    """What ``coli chat`` was started with."""

    session: str = "default"
    system: str | None = None
    max_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    verbose: bool = False


@dataclass
class TurnResult:
    """One reply: its tokens (stop token excluded), why it ended, and its counters."""

    tokens: list[int]
    reason: str
    seconds: float
    decode_seconds: float
    prompt_tokens: int
    reused: int
    hit_rate: float
    error: BaseException | None = None

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.reused

    @property
    def tok_per_s(self) -> float:
        n = len(self.tokens)
        if n >= 2 and self.decode_seconds > 0:
            return (n - 1) / self.decode_seconds  # decode speed: the first token pays prefill
        return n / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _State:
    """The conversation: messages, completed turns, and KV rows known to be on disk."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    persisted: int = 0


def _hits(engine: Engine) -> tuple[int, int]:
    """(expert lookups served from memory, lookups read from storage) since open."""
    t = engine.snapshot().experts.tiers
    return (0, 0) if t is None else (t.hits_pinned + t.hits_lru, t.misses)


class _Chat:
    """The REPL around one open engine (main thread; the engine runs on the portal's loop)."""

    def __init__(
        self,
        portal: anyio.from_thread.BlockingPortal,
        engine: Engine,
        tok: ChatTokenizer,
        settings: ChatSettings,
        state_dir: Path,
        echo: Callable[..., None],
        color: bool,
    ) -> None:
        self.portal = portal
        self.engine = engine
        self.tok = tok
        self.s = settings
        self.state_dir = state_dir
        self.echo = echo
        self.color = color
        c = engine.container
        self.vocab = int(c.arch.vocab_size)
        self.identity = model_identity(c.path)
        self.json_path = session_path(state_dir, settings.session)
        self.kv_path = kv_path(state_dir, settings.session)
        self.cache: KVCache = engine.new_cache()
        self.state = self._fresh()

    # ------------------------------------------------------------------ session files
    def _fresh(self) -> _State:
        msgs = [{"role": "system", "content": self.s.system}] if self.s.system else []
        return _State(messages=msgs)

    def _set_aside(self, path: Path, problem: str) -> None:
        set_aside_and_warn(
            _log, path, "chat session file ignored; starting a new conversation", problem
        )

    def load(self) -> bool:
        """Resume the saved session, if any; True when a conversation was resumed."""
        if not self.json_path.exists():
            return False
        try:
            data = json.loads(self.json_path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != SESSION_FORMAT:
                raise ValueError("not a colibri chat session file")
            if data.get("version") != SESSION_VERSION:
                raise ValueError(f"version {data.get('version')} (this colibri reads 1)")
            if data.get("identity") not in (0, self.identity):
                raise ValueError("written for other model weights")
            messages = data["messages"]
            _check_messages(messages, self.vocab)
            turns = data["turns"]
            if type(turns) is not int or not 0 <= turns <= len(messages):
                raise ValueError(f"turns is {turns!r}, not a count of its {len(messages)} messages")
        except (
            OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError
        ) as exc:  # fmt: skip
            self._set_aside(self.json_path, str(exc))
            return False
        cache = load_kv(self.kv_path, self.engine.new_cache, self.vocab, self.identity)
        self.cache = cache if cache is not None else self.engine.new_cache()
        self.state = _State(messages, turns, self.cache.length)
        return True

    def save(self, valid: int) -> None:
        """Write the messages, then the KV rows that changed (rows [0, valid) are already on
        disk). Errors are reported; the conversation goes on in memory. The messages go first:
        they are the conversation, the KV file only saves a prefill (a disk with room for one
        of the two kept the KV file and lost the turns); a crash between the two leaves the
        new messages over the old KV rows, whose prefix the next run reuses."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.state.persisted = 0
            self.echo(f"warning: session not saved ({exc})", err=True)
            return
        try:
            doc = {
                "format": SESSION_FORMAT,
                "version": SESSION_VERSION,
                "engine": ENGINE_ID,
                "model": str(self.engine.container.path),
                "identity": self.identity,
                "turns": self.state.turns,
                "kv_tokens": self.cache.length,
                "messages": self.state.messages,
            }
            data = (json.dumps(doc, ensure_ascii=False, indent=1) + "\n").encode()
            try:  # a conversation: readable by its owner only
                atomic_write_bytes(self.json_path, data, mode=0o600)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.kv_path.exists():
                    raise
                # a full disk: the KV file (a saved prefill, rebuilt by the next run) makes
                # room for the messages (the conversation itself)
                self.kv_path.unlink()
                self.state.persisted = 0
                atomic_write_bytes(self.json_path, data, mode=0o600)
                self.echo(
                    "warning: the disk is full: the session's KV file was dropped to save the "
                    "messages (the next run prefills the conversation again)",
                    err=True,
                )
                return
        except OSError as exc:
            self.echo(f"warning: session not saved ({exc})", err=True)
            if not self.kv_path.exists():  # dropped for room: no KV file in the messages' place
                return
        try:
            self.state.persisted = sync_kv(
                self.kv_path,
                self.cache,
                valid=min(valid, self.state.persisted),
                vocab=self.vocab,
                identity=self.identity,
            )
        except (OSError, KVFileError) as exc:
            # the messages were written all the same (a full disk lost every turn, messages
            # included, when the KV file went first)
            self.state.persisted = 0
            self.echo(f"warning: the session's KV file not saved ({exc})", err=True)

    def reset(self) -> None:
        """Forget the conversation, in memory and on disk."""
        self.cache = self.engine.new_cache()
        self.state = self._fresh()
        for p in (self.kv_path, self.json_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.echo(f"warning: cannot remove {p} ({exc})", err=True)

    # ------------------------------------------------------------------ one turn
    def turn(self, text: str) -> TurnResult:
        """Add the user message, stream the reply, record it and save the session."""
        ctx_len = self.engine.context_length
        floor = self.tok.at_least_tokens(text)
        if floor >= ctx_len:  # refused untokenized (a 20 MB paste took 15 s and 3 GB)
            return self._too_long(
                f"this message is at least {floor} tokens, the context holds {ctx_len}; shorten it",
                floor,
            )
        self.state.messages.append({"role": "user", "content": text})
        ids = conversation_ids(self.tok, self.state.messages)
        if len(ids) >= ctx_len:
            self.state.messages.pop()
            system = [m for m in self.state.messages[:1] if m["role"] == "system"]
            alone = conversation_ids(self.tok, [*system, {"role": "user", "content": text}])
            if len(alone) >= ctx_len:  # the message itself: starting over would not help
                return self._too_long(
                    f"this message is {len(alone)} tokens with the chat template, the context "
                    f"holds {ctx_len}; shorten it",
                    len(ids),
                )
            # the conversation is what is too long: starting over helps
            return self._too_long(
                f"the conversation has filled the model's context ({len(ids)} tokens with this "
                f"message, the context holds {ctx_len}); :reset starts a new one",
                len(ids),
            )
        reused = (
            self.engine.prompt_reuse(
                self.cache, ids, temperature=self.s.temperature, seed=self._seed()
            )
            if ids
            else 0
        )
        stop = threading.Event()

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            stop.set()

        # Ctrl-C stops the reply (and never cuts the save that follows it short).
        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            result = self._generate(ids, reused, stop)
            if not result.tokens and (result.error is not None or result.reason == "interrupted"):
                # nothing came of it (an error, or Ctrl-C before the first token): as if it was
                # never sent (an empty assistant turn went into the conversation)
                self.state.messages.pop()
                return result
            content = self.tok.decode(result.tokens)
            self.state.messages.append(
                {"role": "assistant", "content": content, "tokens": result.tokens}
            )
            self.state.turns += 1
            self.save(valid=reused)
        finally:
            signal.signal(signal.SIGINT, previous)
        return result

    def _too_long(self, message: str, n_prompt: int) -> TurnResult:
        error = ModelError(message)
        self.echo(f"error: {error}", err=True)
        return TurnResult([], "context full", 0.0, 0.0, n_prompt, 0, 1.0, error)

    def _seed(self) -> int | None:
        """This turn's seed: the session's, moved on by the turns so far (None: unseeded)."""
        return None if self.s.seed is None else self.s.seed + self.state.turns

    def _generate(self, ids: list[int], reused: int, stop: threading.Event) -> TurnResult:
        s = self.s
        seed = self._seed()
        events: queue.SimpleQueue[object] = queue.SimpleQueue()
        engine, cache = self.engine, self.cache

        async def produce() -> None:
            try:
                gen = engine.generate(
                    ids,
                    max_new_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    seed=seed,
                    stop_token_ids=[] if s.ignore_eos else None,
                    cache=cache,
                )
                # generate() is an async generator: close it when the loop stops early.
                agen = cast(AsyncGenerator[GenerationEvent, None], gen)
                async with aclosing(agen) as stream:
                    async for ev in stream:
                        events.put(ev)
                        if stop.is_set():
                            break
            except Exception as exc:  # handed to the REPL thread, which reports it
                events.put(exc)
            finally:
                events.put(_END)

        stops = set() if s.ignore_eos else set(self.engine.container.eos_token_ids)
        tokens: list[int] = []
        reason = "length"
        error: BaseException | None = None
        text = self.tok.stream()
        h0, m0 = _hits(self.engine)
        t0 = time.perf_counter()
        t_first: float | None = None
        t_last = t0
        future = self.portal.start_task_soon(produce)
        cancelled = False
        while True:
            try:
                item = events.get(timeout=0.1)
            except queue.Empty:
                if stop.is_set() and not cancelled:
                    future.cancel()  # no token for a while (a long prefill): cancel it
                    cancelled = True
                continue
            if item is _END:
                break
            if isinstance(item, TokenEvent):
                t_last = time.perf_counter()
                t_first = t_first if t_first is not None else t_last
                if item.token_id in stops:
                    reason = "stop"
                    continue
                tokens.append(item.token_id)
                piece = text.push(item.token_id)
                if piece:
                    self.echo(printable(piece), nl=False)
            elif isinstance(item, DoneEvent):
                reason = item.reason if reason != "stop" else reason
            elif isinstance(item, BaseException):
                error = item
        self.echo(printable(text.flush()), nl=False)
        self.echo("")
        if stop.is_set():
            reason = "interrupted"
        elif error is not None:
            reason = "error"  # no DoneEvent came: "length" made the footer say the context was full
        h1, m1 = _hits(self.engine)
        looked = (h1 - h0) + (m1 - m0)
        dt = time.perf_counter() - t0
        result = TurnResult(
            tokens=tokens,
            reason=reason,
            seconds=dt,
            decode_seconds=(t_last - t_first) if t_first is not None else 0.0,
            prompt_tokens=len(ids),
            reused=reused,
            hit_rate=(h1 - h0) / looked if looked else 1.0,
            error=error,
        )
        if error is not None:
            # The reply so far is kept (the cache holds it); the user sees one line.
            self.echo(f"error: {error}", err=True)
        return result

    # ------------------------------------------------------------------ the loop
    def footer(self, r: TurnResult) -> None:
        if r.error is not None and not r.tokens:
            return  # nothing was generated: the error line says what happened
        if r.reason == "interrupted":
            self._dim("[stopped]")
        self._dim(format_footer(len(r.tokens), r.tok_per_s, r.hit_rate, rss_bytes(), r.seconds))
        if self.s.verbose:
            self._dim(
                f"prompt {r.prompt_tokens} tokens: {r.reused} reused, {r.computed} computed; "
                f"context {self.cache.length} tokens; ended: {r.reason}"
            )
        if r.reason == "length" and len(r.tokens) < self.s.max_tokens:
            # the context ended the reply, not --max-tokens: the next message cannot fit
            self._dim(
                f"the reply reached the end of the model's context "
                f"({self.engine.context_length} tokens); :reset starts a new conversation"
            )

    def _dim(self, line: str) -> None:
        self.echo(click.style(line, dim=True) if self.color else line)

    def repl(self, read: Callable[[str], str]) -> None:
        last_interrupt = -QUIT_WINDOW_S
        while True:
            try:
                line = read(PROMPT)
            except EOFError:
                self.echo("")
                return
            except UnicodeDecodeError as exc:  # a terminal or pipe in a UTF-8 locale
                self._dim(f"that line is not valid UTF-8 ({exc.reason}); type it again")
                continue
            except KeyboardInterrupt:
                self.echo("")
                now = time.monotonic()
                if now - last_interrupt < QUIT_WINDOW_S:
                    raise  # the second Ctrl-C: quit (exit 130); every finished turn is saved
                last_interrupt = now
                self._dim(f"(Ctrl-C again to quit; {HELP})")
                continue
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in (":q", ":quit", ":exit"):
                return
            if cmd == ":reset":
                self.reset()
                self._dim("conversation cleared")
                continue
            if cmd in (":help", ":h", ":?"):
                self._dim(HELP)
                continue
            if cmd.startswith(":") and " " not in cmd:
                self._dim(f"unknown command {cmd} ({HELP})")
                continue
            bad = not_utf8(line)  # the C locale keeps undecodable bytes as surrogates
            if bad is not None:
                self._dim(f"that line cannot be sent: {bad}; type it again")
                continue
            self.footer(self.turn(line))


@contextmanager
def _session_lock(state_dir: Path, name: str) -> Iterator[None]:
    """Hold session ``name`` for this process: a second ``coli chat`` on it is refused (the
    last to save would overwrite the other's turns). An advisory lock (``flock``) on a file
    beside the session's, released by the kernel however the process ends; a state dir that
    cannot hold it (read-only) is not locked (nothing is saved there either)."""
    path = session_path(state_dir, name).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise ColibriError(
                f"the chat session {name!r} is open in another coli chat"
                + (f" (pid {other})" if other.isdigit() else "")
                + "; quit that one, or pass --session with another name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def run_chat(
    opts: EngineOptions,
    settings: ChatSettings,
    open_model_cm: Callable[[EngineOptions], AbstractContextManager[SyncModel]] | None = None,
) -> None:
    """Open the model and run the REPL on stdin/stdout until ``:q`` or end of input.
    ``open_model_cm(opts)``: how to open it (the CLI shows the load's progress)."""
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    state_dir = opts.resolved_state_dir()
    # checked before the load: the model directory and its tokenizer
    c = Container.open(opts.resolved_model(), shard_dirs=opts.model_dirs)
    tok_path = c.tokenizer_path()
    if tok_path is None:
        raise ColibriError(f"{c.path}: no tokenizer.json, cannot turn text into tokens")
    tok = ChatTokenizer(tok_path, c.tokenizer_config())
    opener = open_model_cm or (lambda o: open_model(**o.model_dump()))
    with _session_lock(state_dir, settings.session), opener(opts) as m:
        portal, engine = m._portal, m.engine
        chat = _Chat(portal, engine, tok, settings, state_dir, click.echo, color)
        mode = engine.snapshot().experts.mode
        chat._dim(
            f"colibri chat · {c.path.name} · experts {mode} · session {settings.session} · {HELP}"
        )
        if chat.load():
            n = chat.state.turns
            chat._dim(
                f"resumed a conversation of {n} turn{'' if n == 1 else 's'}; :reset to start over"
            )
            if settings.system and chat.state.messages[:1] != [
                {"role": "system", "content": settings.system}
            ]:
                chat._dim("note: --system differs from the resumed conversation's")
        if sys.stdin.isatty():
            chat.repl(input)
        else:
            # piped input is not echoed by a terminal: the prompt line shows it, so that a
            # transcript reads "you> question", then the reply (it read "you> <reply>")
            def read_piped(prompt: str) -> str:
                line = input(prompt)
                click.echo(line)
                return line

            chat.repl(read_piped)
