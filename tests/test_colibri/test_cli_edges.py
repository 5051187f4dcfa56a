"""`coli` where a demanding user leaves the happy path: a reader that goes away, the context
running out in `run` and `chat`, JSON logs, damaged copies of the model that `run` must refuse
as `doctor` does, RAM budgets at the edge. Real subprocesses on copies of the test model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _demo import demo_model

from colibri._config import default_model_path

pytestmark = pytest.mark.reliability

BUNDLED = default_model_path()  # the trained demo model `coli` uses by default


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    return env | {"COLI_MODEL": str(demo_model()), "HOME": str(home)}


def coli(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", *args],
        capture_output=True,
        text=True,
        env=_env(home),
        input=stdin,
        timeout=300,
    )


def _copy(tmp_path: Path, name: str = "model") -> Path:
    dst = tmp_path / name
    shutil.copytree(demo_model(), dst)
    return dst


def test_a_reader_that_goes_away_ends_the_command_quietly(home: Path) -> None:
    """`coli run ... | head -c 10`: the status of a Unix tool killed by SIGPIPE, no error
    line (it used to print "error: Broken pipe" and exit 1)."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colibri.cli",
            "run",
            "--raw",
            "-n",
            "400",
            "--model",
            str(BUNDLED),
            "Once upon a time",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(home),
    )
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "error" not in err and "Traceback" not in err, err


def test_run_says_when_the_context_ended_the_output(home: Path) -> None:
    """The bundled demo model (greedy, this prompt) writes on past its 1024-token context:
    the summary says the context, not -n, ended it (it used to say nothing)."""
    r = coli(home, "run", "--model", str(BUNDLED), "--raw", "-n", "5000", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert "stopped at the end of the model's context (1024 tokens)" in r.stderr, r.stderr
    r = coli(home, "run", "--model", str(BUNDLED), "--raw", "-n", "5", "Once upon a time")
    assert r.returncode == 0 and "context" not in r.stderr, r.stderr


def test_json_logs_keep_every_stderr_line_json(home: Path) -> None:
    """The closing summary was a plain text line in the middle of the JSON log stream."""
    r = coli(home, "--log-format", "json", "-v", "run", "-n", "4", "Hi")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]
    summary = [x for x in lines if x.get("event") == "generated"]
    assert len(summary) == 1 and summary[0]["tokens"] == 4, lines


def test_chat_says_the_conversation_filled_the_context(home: Path, tmp_path: Path) -> None:
    """Once the context is full every message failed with "the prompt has N tokens; shorten
    it", which no message the user types could fix; :reset does."""
    state = str(tmp_path / "state")
    r = coli(home, "chat", "--state-dir", state, "--ignore-eos", "-n", "5000",
             stdin="hi\nmore please\n:reset\nhi\n:q\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "the reply reached the end of the model's context (512 tokens)" in r.stdout
    assert "the conversation has filled the model's context" in r.stderr, r.stderr
    assert ":reset starts a new one" in r.stderr and "shorten it" not in r.stderr
    assert "conversation cleared" in r.stdout
    assert r.stdout.count(" tok · ") == 2, r.stdout  # the full turn and the one after :reset


def test_run_refuses_what_doctor_fails(home: Path, tmp_path: Path) -> None:
    """A manifest of the wrong structure was ignored at open (so were the shards it lists);
    `--draft mtp` on a copy without its MTP weights decoded without drafts, silently."""
    junk = _copy(tmp_path, "junk")
    (junk / "colibri-manifest.json").write_text(json.dumps({"shards": 5}))
    r = coli(home, "run", "--model", str(junk), "-n", "2", "Hello")
    assert r.returncode == 1 and "colibri-manifest.json" in r.stderr, r.stderr
    assert "coli doctor" in r.stderr
    no_mtp = _copy(tmp_path, "no_mtp")
    (no_mtp / "colibri-manifest.json").unlink()
    next(no_mtp.glob("out-mtp-*.safetensors")).unlink()
    r = coli(home, "run", "--model", str(no_mtp), "--draft", "mtp", "-n", "4", "Hello")
    assert r.returncode == 1, r.stderr
    assert "needs the model's MTP head" in r.stderr and "no MTP weights" in r.stderr, r.stderr
    r = coli(home, "run", "--model", str(no_mtp), "-n", "2", "Hello")  # usable without the head
    assert r.returncode == 0, r.stderr
    # a shard the manifest lists is gone: the hint points at the doctor, not at --model
    gone = _copy(tmp_path, "gone")
    next(gone.glob("out-mtp-*.safetensors")).unlink()
    r = coli(home, "run", "--model", str(gone), "-n", "2", "Hello")
    assert r.returncode == 1 and "listed in colibri-manifest.json but missing" in r.stderr
    assert "hint: run `coli doctor" in r.stderr, r.stderr


def test_doctor_fails_the_experts_check_when_experts_are_missing(
    home: Path, tmp_path: Path
) -> None:
    """It used to report "PASS experts: 32 of 192 experts" for a truncated shard."""
    cut = _copy(tmp_path, "cut")
    shard = cut / "out-00000.safetensors"
    os.truncate(shard, shard.stat().st_size // 3)
    r = coli(home, "doctor", "--model", str(cut), "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["experts"]["status"] == "fail", checks["experts"]
    r = coli(home, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["experts"]["status"] == "pass", checks["experts"]


def test_a_budget_just_under_the_minimum_prints_figures_that_differ(home: Path) -> None:
    """Both used to be rounded alike: "11.6 MiB is too small ... the minimum is 11.6 MiB"."""
    plan = json.loads(coli(home, "plan", "--json", "--ram", "1GiB").stdout)
    floor = int(plan["min_ram_bytes"])
    r = coli(home, "plan", "--ram", str(floor - 1000))
    assert r.returncode == 1, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("error: "))
    assert f"{floor - 1000:,} bytes is too small" in line and f"minimum is {floor:,} bytes" in line


def test_a_chat_session_open_in_another_process_is_refused(home: Path, tmp_path: Path) -> None:
    """Two processes on one session: the last to save used to overwrite the other's turns."""
    state = str(tmp_path / "state")
    first = subprocess.Popen(
        [sys.executable, "-m", "colibri.cli", "chat", "--state-dir", state, "-n", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(home),
    )
    assert first.stdin is not None and first.stdout is not None
    try:
        assert "colibri chat" in first.stdout.readline()  # open, the session held
        second = coli(home, "chat", "--state-dir", state, "-n", "2", stdin="hi\n:q\n")
        assert second.returncode == 1, second.stderr
        assert "is open in another coli chat" in second.stderr, second.stderr
        other = coli(home, "chat", "--state-dir", state, "--session", "b", stdin="hi\n:q\n")
        assert other.returncode == 0, other.stderr  # another session is free
    finally:
        first.stdin.write(":q\n")
        first.stdin.close()
        assert first.wait(timeout=120) == 0
    again = coli(home, "chat", "--state-dir", state, "-n", "2", stdin="hi\n:q\n")
    assert again.returncode == 0, again.stderr  # released when its process ended


@pytest.mark.parametrize(
    ("var", "value"),
    [("COLI_THREADS", "abc"), ("COLI_READER", "floppy"), ("COLI_VERIFY_READS", "maybe"),
     ("COLI_PREFETCH", "sometimes"), ("COLI_LOG_FORMAT", "xml"), ("COLI_RAM", "banana"),
     ("COLI_DRAFT", "zz"), ("COLI_DISK_WEIGHTS", "a,b"), ("COLI_RAM", "0"),
     ("COLI_STATE_DIR", "/etc/hostname")],
)  # fmt: skip
def test_a_bad_environment_value_names_its_variable(home: Path, var: str, value: str) -> None:
    """A bad COLI_* value was reported as a bad --flag the user never typed (and
    COLI_VERIFY_READS=maybe silently meant off; COLI_RAM, COLI_DRAFT and COLI_DISK_WEIGHTS were
    errors without the variable's name, exit 1, once the model had started to load; COLI_RAM=0
    too; a COLI_STATE_DIR naming a file was taken, with a warning per save): the usage error
    names the variable; the flag given on the command line wins over it."""
    env = _env(home) | {var: value}
    r = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "-n", "1", "Hi"],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 2 and f"{var}={value!r}" in r.stderr, r.stderr
    flag = {"COLI_THREADS": ["--threads", "1"], "COLI_READER": ["--reader", "auto"],
            "COLI_VERIFY_READS": ["--no-verify-reads"], "COLI_PREFETCH": ["--prefetch", "auto"],
            "COLI_LOG_FORMAT": [], "COLI_RAM": ["--ram", "auto"], "COLI_DRAFT": ["--draft", "off"],
            "COLI_DISK_WEIGHTS": ["--disk-weights", "1"],
            "COLI_STATE_DIR": ["--state-dir", str(home / "state")]}[var]  # fmt: skip
    pre = ["--log-format", "console"] if var == "COLI_LOG_FORMAT" else []
    ok = subprocess.run([sys.executable, "-m", "colibri.cli", *pre, "run", *flag, "-n", "1", "Hi"],
                        capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert ok.returncode == 0, ok.stderr


def test_help_shows_the_real_default_of_verify_reads(home: Path) -> None:
    """--help said "[default: verify-reads]" (the default was the string "0") while reads were
    not checked unless COLI_VERIFY_READS said so."""
    r = coli(home, "run", "--help")
    assert r.returncode == 0
    assert "[default: no-verify-reads]" in " ".join(r.stdout.split()).replace("- ", "-"), r.stdout


def test_a_kv_file_that_cannot_be_written_loses_no_messages(home: Path, tmp_path: Path) -> None:
    """The KV file only saves a prefill: when it cannot be written (a full disk; here a
    directory in its place) the messages were not written either, and every turn was lost
    on quit. They are saved; the next run resumes the conversation."""
    state = tmp_path / "state"
    state.mkdir()
    (state / ".coli_kv.chat.default").mkdir()  # no file can be written there
    first = coli(home, "chat", "--state-dir", str(state), "-n", "2", stdin="hi\nand then\n:q\n")
    assert first.returncode == 0, first.stderr
    assert "KV file not saved" in first.stderr and "session not saved" not in first.stderr
    saved = json.loads((state / ".coli_chat.default.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["hi", "and then"]
    again = coli(home, "chat", "--state-dir", str(state), "-n", "2", stdin=":q\n")
    assert (
        again.returncode == 0 and "resumed a conversation of 2 turns" in again.stdout + again.stderr
    )


def test_chat_says_when_the_message_itself_is_too_long(home: Path, tmp_path: Path) -> None:
    """A message longer than the context alone was told the conversation filled the context
    and ":reset starts a new one", even on an empty conversation where only shortening the
    message helps; a huge paste was tokenized whole first (15 s and 3 GB for 20 MB)."""
    state = str(tmp_path / "state")
    long = " ".join(["word"] * 2000)  # well past the test model's 512 tokens, alone
    huge = "x" * 2_000_000
    r = coli(home, "chat", "--state-dir", state, "-n", "2", stdin=f"{long}\n{huge}\nhi\n:q\n")
    assert r.returncode == 0, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2, r.stderr
    assert "with the chat template" in errors[0] and "shorten it" in errors[0], errors
    assert "this message is at least" in errors[1] and "shorten it" in errors[1], errors
    assert ":reset" not in r.stderr
    assert r.stdout.count(" tok · ") == 1, r.stdout  # "hi" is answered: nothing was kept


@pytest.mark.parametrize(
    ("args", "redirect"), [(["chat"], "<&-"), (["run", "-n", "1", "Hi"], ">&-")]
)
def test_a_closed_standard_stream_is_no_traceback(
    home: Path, tmp_path: Path, args: list[str], redirect: str
) -> None:
    """`coli chat <&-` and `coli run >&-` (a stream the shell closed: None to Python) ended in
    a traceback; a closed input reads as empty, a closed output discards what is written."""
    cmd = f'exec "$0" -m colibri.cli "$@" {redirect}'
    r = subprocess.run(
        ["sh", "-c", cmd, sys.executable, *args, "--state-dir", str(tmp_path / "s")],
        capture_output=redirect != ">&-", text=True, env=_env(home), timeout=300,
        stderr=subprocess.PIPE if redirect == ">&-" else None,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in (r.stderr or ""), r.stderr


def test_a_piped_chat_transcript_shows_each_message_on_its_prompt(
    home: Path, tmp_path: Path
) -> None:
    """Piped input is not echoed by a terminal: the reply was printed on the "you> " line, so
    a transcript read as if the user had typed the model's words."""
    r = coli(home, "chat", "--state-dir", str(tmp_path / "s"), "-n", "3", stdin="hello there\n:q\n")
    assert r.returncode == 0, r.stderr
    assert "you> hello there\n" in r.stdout, r.stdout


def test_a_missing_model_from_coli_model_is_named_in_the_hint(home: Path) -> None:
    """A COLI_MODEL pointing nowhere said to pass --model DIR, which the user never did."""
    env = _env(home) | {"COLI_MODEL": str(home / "nowhere")}
    r = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "-n", "1", "Hi"],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 1 and "does not exist" in r.stderr
    assert "COLI_MODEL=" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_a_full_disk_keeps_the_messages_not_the_kv_file(home: Path, tmp_path: Path) -> None:
    """On a full disk the KV file (written first) took the last free space and the
    conversation lost its turns: 1 of 3 saved. The messages go first now, and the KV file,
    only a saved prefill, makes room for them when they do not fit."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        said = "hello there\nand again\nthird one\n"
        chat = coli(home, "chat", "--model", str(default_model_path()), "--state-dir", str(mnt),
                    "-n", "8", "-t", "0", stdin=said + ":q\n")  # fmt: skip
        assert chat.returncode == 0, chat.stderr
        doc = json.loads((mnt / ".coli_chat.default.json").read_text())
        assert doc["turns"] == 3 and len(doc["messages"]) == 6, (doc, chat.stderr)
        assert [m["content"] for m in doc["messages"][::2]] == said.split("\n")[:3]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_size_options_are_usage_errors_naming_the_option(home: Path, tmp_path: Path) -> None:
    """--shard-size -1, --stripe-min abc and --worker-ram abc failed later as "cannot read
    '-1' as a size" naming no option (exit 1); a SRC that does not exist was "not a
    directory"."""
    for args, flag in (
        (["convert", str(tmp_path), str(tmp_path / "out"), "--shard-size", "-1"], "--shard-size"),
        (["convert", str(tmp_path), str(tmp_path / "out"), "--shard-size", "0"], "--shard-size"),
        (["run", "--stripe-min", "abc", "-n", "1", "Hi"], "--stripe-min"),
        (["run", "--worker-ram", "abc", "-n", "1", "Hi"], "--worker-ram"),
    ):
        r = coli(home, *args)
        assert r.returncode == 2 and flag in r.stderr, (args, r.stderr)
    r = coli(home, "convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr


def test_with_json_logs_an_error_is_a_json_line(home: Path, tmp_path: Path) -> None:
    """With --log-format json every stderr line parses, errors too (they were plain text)."""
    r = coli(home, "--log-format", "json", "run", "--model", str(tmp_path / "nope"), "Hi")
    assert r.returncode == 1
    docs = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]
    [err] = [d for d in docs if d.get("event") == "error"]
    assert "does not exist" in err["error"] and err["hint"]
    # a usage error too (click printed it as text)
    r = coli(home, "--log-format", "json", "run", "--ram", "0", "Hi")
    assert r.returncode == 2
    [usage] = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]
    assert usage["event"] == "usage_error" and "--ram" in usage["error"]
    # a group run without its subcommand shows its help, as text (not a JSON "error")
    r = coli(home, "--log-format", "json", "bench")
    assert "Commands:" in r.stderr + r.stdout and "usage_error" not in r.stderr
