"""`coli chat` driven through a pseudo-terminal (pexpect): streamed turns with a footer,
`:reset`, Ctrl-C stopping a reply (not the program), `:q`, and a session resumed after a
restart without prefilling the history again, bit-identical to a session that never stopped."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _demo import demo_model

import colibri
from colibri._chat import conversation_ids, kv_path, printable, session_path
from colibri._engine import Engine
from colibri.tokenizer import ChatTokenizer
from storage.container import Container

pexpect = pytest.importorskip("pexpect")

DEMO = demo_model()
FOOTER = re.compile(r"(\d+) tok · ([\d.]+) tok/s · hit (\d+) % · RSS (\d+) MiB · ([\d.]+) s\r\n")
VERBOSE = re.compile(r"prompt (\d+) tokens: (\d+) reused, (\d+) computed")
PROMPT = "you> "


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    home.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")} | {
        "COLI_MODEL": str(demo_model())
    }
    yield {**base, "HOME": str(home), "NO_COLOR": "1"}


def spawn(env: dict[str, str], state: Path, *args: str) -> Any:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "colibri.cli", "chat", "--state-dir", str(state), "-v", *args],
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 200),
    )
    child.expect_exact(PROMPT)
    return child


def say(child: Any, text: str) -> dict[str, Any]:
    """One turn: the reply's footer numbers and the reused / computed prompt tokens."""
    child.sendline(text)
    child.expect_exact(text + "\r\n")
    child.expect(FOOTER)
    reply = child.before
    tokens, rate, hit = int(child.match.group(1)), float(child.match.group(2)), child.match[3]
    child.expect(VERBOSE)
    out = {
        "reply": reply,
        "tokens": tokens,
        "rate": rate,
        "hit": int(hit),
        "prompt": int(child.match.group(1)),
        "reused": int(child.match.group(2)),
        "computed": int(child.match.group(3)),
    }
    child.expect_exact(PROMPT)
    return out


def quit_(child: Any, how: str = ":q") -> int:
    if how == "eof":
        child.sendeof()
    else:
        child.sendline(how)
    child.expect(pexpect.EOF)
    child.close()
    return int(child.exitstatus)


def test_turns_footer_reset_and_quit(env: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = spawn(env, state, "--max-tokens", "8", "--temperature", "0")
    first = say(c, "hello there")
    assert 1 <= first["tokens"] <= 8 and first["hit"] == 100  # resident demo: no misses
    assert first["reused"] == 0 and first["computed"] == first["prompt"]
    second = say(c, "and again")
    # The second turn prefills only what the cache does not hold (the new message).
    assert second["reused"] >= first["prompt"] and second["computed"] < second["prompt"]
    saved = json.loads(session_path(state, "default").read_text())
    assert saved["turns"] == 2 and [m["role"] for m in saved["messages"]] == [
        "user", "assistant", "user", "assistant"
    ]  # fmt: skip
    c.sendline(":reset")
    c.expect_exact("conversation cleared")
    c.expect_exact(PROMPT)
    assert not session_path(state, "default").exists() and not kv_path(state, "default").exists()
    third = say(c, "hello there")
    assert third["reused"] == 0 and third["prompt"] == first["prompt"]
    assert third["reply"] == first["reply"]  # greedy, fresh context: the same reply
    assert quit_(c) == 0


def test_ctrl_c_stops_the_reply_not_the_program(env: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = spawn(env, state, "--max-tokens", "4000", "--ignore-eos", "--temperature", "0")
    for text in ("tell me a long story", "go on"):
        c.sendline(text)
        c.expect_exact(text + "\r\n")
        c.expect(r"[^\r\n]")  # the reply has started
        c.sendintr()
        c.expect_exact("[stopped]")
        c.expect(FOOTER)
        assert int(c.match.group(1)) < 4000
        c.expect(VERBOSE)
        c.expect_exact(PROMPT)
    saved = json.loads(session_path(state, "default").read_text())
    assert saved["turns"] == 2  # stopped replies are kept (and the cache holds them)
    assert quit_(c, "eof") == 0


def test_a_reply_stopped_before_its_first_token_leaves_no_empty_turn(tmp_path: Path) -> None:
    """Ctrl-C during a long message's prefill kept the message and an empty assistant turn
    (the next prompt held a turn where the model said nothing). Nothing came of it: the
    message is dropped, as after an error; a stopped reply with tokens is kept."""
    from colibri._chat import ChatSettings, TurnResult, _Chat

    c = Container.open(DEMO)
    tok_path = c.tokenizer_path()
    assert tok_path is not None
    tok = ChatTokenizer(tok_path, c.tokenizer_config())
    with colibri.open_model(DEMO, learn=False) as m:
        chat = _Chat(
            m._portal, m.engine, tok, ChatSettings(), tmp_path, lambda *a, **k: None, False
        )
        for tokens, kept in (([], False), ([5, 6], True)):
            stopped = TurnResult(tokens, "interrupted", 0.1, 0.0, 10, 0, 1.0)
            chat._generate = lambda ids, reused, stop, r=stopped: r  # type: ignore[method-assign]
            chat.turn("a long message")
            roles = [msg["role"] for msg in chat.state.messages]
            assert roles == (["user", "assistant"] if kept else []), chat.state.messages


def _reference(turns: list[str], max_tokens: int, temperature: float, seed: int) -> list[Any]:
    """The same conversation through the Python API in one uninterrupted session."""
    c = Container.open(DEMO)
    tok_path = c.tokenizer_path()
    assert tok_path is not None
    tok = ChatTokenizer(tok_path, c.tokenizer_config())
    eos = set(c.eos_token_ids)
    messages: list[dict[str, Any]] = []
    out = []
    with colibri.open_model(DEMO, learn=False) as m:
        cache = m.engine.new_cache()
        for k, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            ids = conversation_ids(tok, messages)
            reused = Engine.reusable_prefix(cache, ids)
            toks = m.generate(
                ids, max_new_tokens=max_tokens, temperature=temperature, seed=seed + k, cache=cache
            )
            if toks and toks[-1] in eos:
                toks = toks[:-1]
            messages.append({"role": "assistant", "content": tok.decode(toks), "tokens": toks})
            out.append({"tokens": toks, "reused": reused, "computed": len(ids) - reused,
                        "text": tok.decode(toks)})  # fmt: skip
    return out


def test_restart_resumes_without_prefill_and_matches_uninterrupted(
    env: dict[str, str], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    args = ("--session", "story", "--max-tokens", "12", "--temperature", "0.9", "--seed", "7")
    turns = ["hello, who are you?", "tell me more", "and then?"]
    c = spawn(env, state, *args)
    say(c, turns[0])
    say(c, turns[1])
    assert quit_(c) == 0

    c = spawn(env, state, *args)
    assert "resumed a conversation of 2 turns; :reset to start over" in c.before
    resumed = say(c, turns[2])
    assert quit_(c) == 0

    ref = _reference(turns, 12, 0.9, 7)
    # No re-prefill: the restarted process computed exactly what the uninterrupted session
    # computed for its third turn (the new message), and reused the whole history.
    assert (resumed["reused"], resumed["computed"]) == (ref[2]["reused"], ref[2]["computed"])
    assert resumed["reused"] > resumed["computed"]
    saved = json.loads(session_path(state, "story").read_text())
    assert saved["turns"] == 3
    got = [m["tokens"] for m in saved["messages"] if m["role"] == "assistant"]
    assert got == [r["tokens"] for r in ref]  # bit-identical continuation
    shown = printable(ref[2]["text"]).replace("\n", "\r\n")
    assert resumed["reply"].rstrip("\r\n") == shown.rstrip("\r\n")


def test_ctrl_c_stops_a_reply_and_twice_at_the_prompt_quits_with_130(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Ctrl-C mid-answer stops that answer (back to the prompt, the partial reply kept); at the
    prompt one Ctrl-C reminds, a second quits with 130 and no traceback; the next start resumes
    the conversation."""
    state = tmp_path / "state"
    child = spawn(env, state, "-n", "400", "--ignore-eos")
    first = say(child, "Tell me about birds.")
    assert first["tokens"] > 0
    child.sendline("And about fish?")
    child.expect_exact("And about fish?\r\n")
    child.expect(r"\w{2}")  # the answer is streaming
    child.sendintr()
    child.expect(FOOTER, timeout=10)  # the reply ended early and was accounted for
    assert int(child.match.group(1)) < 400
    child.expect_exact(PROMPT)
    child.sendintr()
    child.expect_exact("Ctrl-C again to quit")
    t0 = time.monotonic()
    child.sendintr()
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    assert child.exitstatus == 130, (child.exitstatus, child.signalstatus, child.before)
    assert "Traceback" not in (child.before or "")
    assert time.monotonic() - t0 < 5.0
    again = spawn(env, state, "-n", "4")
    turn = say(again, "Go on.")
    assert turn["reused"] > 0  # both earlier turns' KV came back from the session file
    assert quit_(again) == 0


@pytest.mark.parametrize(
    "damage",
    [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x", "tokens": "x"},
            ]
        },
        {"messages": [{"role": "assistant", "content": "x", "tokens": [1, 99999]}]},
        {"messages": [{"role": "assistant", "content": "x", "tokens": [1, True]}]},
        {"messages": [{"content": "no role"}]},
        {"turns": float("inf")},
        {"turns": -1},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"turns": 10**30},
    ],
    ids=["tokens-not-a-list", "token-past-vocab", "token-bool", "no-role", "turns-inf", "turns<0",
         "role-unknown", "turns-past-messages"],
)  # fmt: skip
def test_a_damaged_session_file_is_set_aside(
    env: dict[str, str], tmp_path: Path, damage: dict[str, Any]
) -> None:
    """A session file whose messages or counts are damaged never resumes (nor crashes the
    REPL): it is renamed aside with a warning and a new conversation starts."""
    import subprocess

    state = tmp_path / "state"
    state.mkdir()
    doc: dict[str, Any] = {
        "format": "colibri-chat", "version": 1, "identity": 0, "turns": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }  # fmt: skip
    doc.update(damage)
    path = session_path(state, "s1")
    path.write_text(json.dumps(doc), encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "chat", "--state-dir", str(state), "--session",
         "s1"],
        input=":q\n", env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "chat session file ignored" in r.stderr + r.stdout
    assert not path.exists()
    assert [p.name.split(".bad-")[0] for p in state.glob("*.bad-*")] == [path.name]


@pytest.mark.parametrize("how", ["post-processor", "add_bos_token", "both", "neither"])
def test_a_raw_prompt_gets_the_special_tokens_transformers_adds(tmp_path: Path, how: str) -> None:
    """`coli run --raw` and plain completions encoded without special tokens: a tokenizer
    whose post-processor adds a BOS gave the model another sequence than transformers'
    tokenizer(text). Raw prompts now get what tokenizer(text) gives (transformers 5 takes the
    post-processor as stored: add_bos_token alone adds nothing to a tokenizer.json like this
    one); chat-template text (which carries its own) is unchanged."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, processors

    src = demo_model()
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    bos = "<|endoftext|>"
    if how in ("post-processor", "both"):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )  # fmt: skip
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    if how in ("add_bos_token", "both"):
        cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ChatTokenizer(tmp_path / "tokenizer.json", cfg)
    for text in ("The quick brown fox", "Once upon a time, there was"):
        want = hf(text).input_ids
        assert ours.encode(text, raw=True) == want, (how, text)
        assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids
    with_bos = how in ("post-processor", "both")
    assert (ours.encode("x", raw=True)[0] == tok.token_to_id(bos)) == with_bos


def test_a_first_run_on_a_terminal_says_the_kernels_are_compiling(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A fresh install spent up to a minute compiling kernels before its first token with no
    word about it: on a terminal, a run with no compiled kernels cached says so first (and one
    with them cached does not; pipes and files never get the line)."""
    from runtime.kernels.cache import kernels_cached

    assert kernels_cached()  # this checkout's kernels (the suite compiled them)
    words = "compiling the kernels"
    for cache, shown in ((tmp_path / "numba", True), (None, False)):
        e = dict(env) if cache is None else {**env, "NUMBA_CACHE_DIR": str(cache)}
        child = pexpect.spawn(
            sys.executable,
            ["-m", "colibri.cli", "run", "-n", "1", "--state-dir", str(tmp_path / "s"), "Hi"],
            env=e,
            encoding="utf-8",
            timeout=120,
        )
        try:
            got = child.expect_exact([words, "first after"])
            assert got == (0 if shown else 1), child.before
        finally:
            child.terminate(force=True)


def test_an_error_mid_reply_ends_it_as_an_error(tmp_path: Path) -> None:
    """An engine error after some tokens (a damaged expert read) left the reply's reason at
    "length": the footer said the reply reached the end of the context and advised :reset."""
    from colibri._chat import ChatSettings, _Chat
    from colibri._engine import TokenEvent
    from storage.errors import ReadError

    c = Container.open(DEMO)
    tok_path = c.tokenizer_path()
    assert tok_path is not None
    tok = ChatTokenizer(tok_path, c.tokenizer_config())

    async def failing(ids: Any, **kw: Any) -> Any:
        yield TokenEvent(40, 0, -1.0)
        raise ReadError("checksum mismatch")

    with colibri.open_model(DEMO, learn=False) as m:
        said: list[str] = []
        chat = _Chat(
            m._portal, m.engine, tok, ChatSettings(), tmp_path, lambda *a, **k: said.append(
                str(a[0]) if a else ""), False
        )  # fmt: skip
        m.engine.generate = failing  # type: ignore[method-assign]
        result = chat.turn("hi")
    assert result.reason == "error" and result.tokens == [40], result
    assert not any("end of the model's context" in s for s in said), said


def test_kernels_cached_counts_only_this_packages_kernels(tmp_path: Path) -> None:
    """A NUMBA_CACHE_DIR shared with another numba user counted its index files as ours (and
    one of ours, from a first run stopped early, was enough): the first-run notice was lost."""
    import subprocess
    import sys

    probe = "from runtime.kernels.cache import kernels_cached; print(kernels_cached())"

    def cached(root: Path) -> str:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(root)}
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           env=env, timeout=120, check=True)  # fmt: skip
        return r.stdout.strip()

    other = tmp_path / "other" / "somepkg_0123"
    other.mkdir(parents=True)
    for i in range(20):
        (other / f"other_fn-{i}.py311.nbi").touch()
    assert cached(tmp_path / "other") == "False"
    ours = tmp_path / "ours" / "kernels_0123"
    ours.mkdir(parents=True)
    (ours / "_matmul_kernels.f0-1.py311.nbi").touch()
    assert cached(tmp_path / "ours") == "False"  # one is a first run stopped early
    for i in range(1, 20):
        (ours / f"_matmul_kernels.f{i}-1.py311.nbi").touch()
    assert cached(tmp_path / "ours") == "True"


@pytest.mark.parametrize("opens", [False, True], ids=["reply-opens-think", "prompt-opens-think"])
def test_a_thinking_template_renders_earlier_replies_as_it_would(opens: bool) -> None:
    """coli chat spliced a reply's generated ids where the template renders the reply: a
    thinking template (Qwen3's drops earlier reasoning, GLM-4.5's re-wraps it) never saw the
    text, so turn 2's prompt kept the reasoning (Qwen3), held two think blocks (GLM-4.5) or a
    '</think>' without its '<think>' (MiniMax-M2, whose generation prompt opens it). The
    prompt is now what the template renders for the conversation."""
    c = Container.open(DEMO)
    tok_path = c.tokenizer_path()
    assert tok_path is not None
    template = (
        "{% for m in messages %}<|{{ m.role }}|>"
        "{% if m.role == 'assistant' %}{{ m.content }}"  # reasoning of earlier turns dropped
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>" + ("<think>" if opens else "") + "{% endif %}"
    )
    tok = ChatTokenizer(tok_path, {**c.tokenizer_config(), "chat_template": template})
    reply = ("" if opens else "<think>") + "I think.</think>\nHello there."
    gen = tok.encode(reply)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": tok.decode(gen), "tokens": gen},
        {"role": "user", "content": "And now?"},
    ]
    want = tok.encode(
        "<|user|>Hi<|assistant|>Hello there.<|user|>And now?<|assistant|>"
        + ("<think>" if opens else "")
    )
    assert conversation_ids(tok, messages) == want
    # a reply the template renders as written is still spliced as its ids (the cache reuses
    # the whole turn)
    plain = tok.encode("Hello there.")
    messages[1] = {"role": "assistant", "content": tok.decode(plain), "tokens": plain}
    assert conversation_ids(tok, messages) == want
