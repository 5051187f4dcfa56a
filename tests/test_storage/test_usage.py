"""``.coli_usage``: round trip, crash safety under SIGKILL, damaged files set aside."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import structlog

from storage.errors import UsageFileError
from storage.usage import (
    USAGE_FILE,
    UsageCounts,
    _fast_body,
    _parse_lines,
    asave_usage,
    format_usage,
    load_usage,
    parse_usage,
    save_usage,
)

ROOT = Path(__file__).resolve().parents[2]
L, E, ENGINE = 6, 16, "glm_moe_dsa-abc123"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _sample(seed: int = 0) -> UsageCounts:
    rng = np.random.default_rng(seed)
    u = UsageCounts(L, E)
    for layer in range(L):
        u.add(layer, rng.integers(0, E, 40))
    return u


def test_counts_add_total_top_decay() -> None:
    u = UsageCounts(3, 4)
    u.add(0, [1, 1, 2])
    u.add(2, np.array([3]))
    u.add(1, [])
    assert u.total == 4
    assert u.counts[0].tolist() == [0, 2, 1, 0]
    assert u.top(2) == [(0, 1, 2), (0, 2, 1)]
    assert u.top(3)[2] == (2, 3, 1)  # ties broken by (layer, expert)
    assert len(u.top(100)) == 12
    u.add(0, [1] * 9)
    u.decay(0.5)
    assert u.counts[0, 1] == 5 and u.counts[0, 2] == 0 and u.total == 5
    with pytest.raises(ValueError):
        u.add(3, [0])
    with pytest.raises(ValueError):
        u.add(0, [4])
    with pytest.raises(ValueError):
        u.decay(1.5)


def test_round_trip(tmp_path: Path) -> None:
    u = _sample()
    p = tmp_path / USAGE_FILE
    save_usage(p, u, ENGINE)
    text = p.read_text()
    assert text.startswith(f"-1 {L} {E}\n-2 1 {ENGINE}\n")
    back = load_usage(p, L, E, ENGINE)
    assert back == u
    assert [x.name for x in tmp_path.iterdir()] == [USAGE_FILE]  # no temp file left
    # an empty history is a valid file too
    save_usage(p, UsageCounts(L, E), ENGINE)
    assert load_usage(p, L, E, ENGINE) == UsageCounts(L, E)


def test_c_engine_text_parses() -> None:
    text = "-1 2 3\n-2 1 eng\n0 2 7\n1 0 12345678901\n"
    u = parse_usage(text, 2, 3, "eng")
    assert u.counts.tolist() == [[0, 0, 7], [12345678901, 0, 0]]
    assert format_usage(u, "eng") == text


def _body(text: str) -> str:
    return text.split("\n", 2)[2]


def test_vectorized_parse_is_the_line_parser() -> None:
    """The numpy parse of a well-formed body gives the line-by-line parser's counts, on GLM-5's
    geometry with counts up to 18 digits; a 19-digit count, odd whitespace or a line with a
    field too many (in a body whose field count still divides by three) leave it to the line
    parser, which reads the same counts or names the wrong line."""
    n_l, n_e = 78, 256
    rng = np.random.default_rng(5)
    u = UsageCounts(n_l, n_e)
    u.counts[:] = rng.integers(0, 10**18, (n_l, n_e)) * (rng.random((n_l, n_e)) < 0.7)
    u.counts[3, 7] = 10**18 - 1  # 18 digits
    text = format_usage(u, ENGINE)
    rows = _fast_body(_body(text), n_l, n_e)
    assert rows is not None and rows.shape == (int(np.count_nonzero(u.counts)), 3)
    lines = text.split("\n")[2:-1]
    assert parse_usage(text, n_l, n_e, ENGINE) == u == _parse_lines(lines, n_l, n_e)
    # left to the line parser, which accepts these as the same counts
    big = u.copy()
    big.counts[0, 0] = np.iinfo(np.int64).max  # 19 digits
    spaced = text.replace(" ", "  ", 5).replace(" ", "\t", 3)
    for other, want in ((format_usage(big, ENGINE), big), (spaced, u)):
        assert _fast_body(_body(other), n_l, n_e) is None
        assert parse_usage(other, n_l, n_e, ENGINE) == want
    # ... and rejects these, naming the line
    head = f"-1 {n_l} {n_e}\n-2 1 {ENGINE}\n"
    bad = {
        "0 1 2 3\n4 5\n": "line 3 is not",
        "0 1 2\n0 1 3\n": "line 4 repeats layer 0 expert 1",
        f"0 {n_e} 2\n": "line 3 is out of range",
        "0 1 -2\n": "line 3 is out of range",
        "0 1 2\n\n": "line 4 is not",
    }
    for body, msg in bad.items():
        assert _fast_body(body, n_l, n_e) is None
        with pytest.raises(UsageFileError, match=msg):
            parse_usage(head + body, n_l, n_e, ENGINE)


@pytest.mark.anyio
async def test_async_save(tmp_path: Path) -> None:
    u = _sample(1)
    p = tmp_path / USAGE_FILE
    await asave_usage(p, u, ENGINE)
    assert load_usage(p, L, E, ENGINE) == u


def test_missing_file_is_none_and_nothing_is_created(tmp_path: Path) -> None:
    # A first run is normal: an info line (not a warning), no file, nothing set aside.
    assert load_usage(tmp_path / USAGE_FILE, L, E, ENGINE) is None
    assert list(tmp_path.iterdir()) == []


def _damaged(good: str) -> dict[str, str]:
    lines = good.split("\n")
    return {
        "truncated line": good[:-3],
        "truncated count": "\n".join([*lines[:3], lines[3].rsplit(" ", 1)[0], ""]),
        "wrong dims": good.replace(f"-1 {L} {E}", f"-1 {L} {E + 1}", 1),
        "wrong version": good.replace(f"-2 1 {ENGINE}", f"-2 2 {ENGINE}", 1),
        "other engine": good.replace(f"-2 1 {ENGINE}", "-2 1 other-model", 1),
        "garbage": "\x00\x01garbage\nnot a usage file\n",
        "binary": "\xff\xfe\xfd",
        "out of range": good + f"{L} 0 5\n",
        "negative": good + "0 0 -5\n",
        "count past int64": "\n".join(
            [*lines[:2], lines[2].rsplit(" ", 1)[0] + " 99999999999999999999", *lines[3:]]
        ),
        "duplicate": good + lines[2] + "\n",
        "empty": "",
        "header only half": f"-1 {L} {E}\n",
    }


@pytest.mark.parametrize("case", list(_damaged("x\ny\nz\nw\n")))
def test_damaged_files_are_set_aside(tmp_path: Path, case: str) -> None:
    good = format_usage(_sample(2), ENGINE)
    bad = _damaged(good)[case]
    p = tmp_path / USAGE_FILE
    p.write_bytes(bad.encode("latin-1"))
    with structlog.testing.capture_logs() as logs:
        assert load_usage(p, L, E, ENGINE) is None
    assert not p.exists()
    aside = [x for x in tmp_path.iterdir() if x.name.startswith(f"{USAGE_FILE}.bad-")]
    assert len(aside) == 1 and aside[0].read_bytes() == bad.encode("latin-1")
    warn = [e for e in logs if e["log_level"] == "warning"]
    assert warn and warn[0]["problem"] and warn[0]["moved_to"] == str(aside[0])
    # the engine then starts afresh and saves a good file
    save_usage(p, _sample(3), ENGINE)
    assert load_usage(p, L, E, ENGINE) == _sample(3)


def test_parse_errors_say_what_is_wrong() -> None:
    good = format_usage(_sample(2), ENGINE)
    with pytest.raises(UsageFileError, match="do not match this model"):
        parse_usage(good, L + 1, E, ENGINE)
    with pytest.raises(UsageFileError, match="engine id"):
        parse_usage(good, L, E, "another")
    with pytest.raises(UsageFileError, match="truncated"):
        parse_usage(good[:-1], L, E, ENGINE)


def test_save_failure_is_usage_file_error(tmp_path: Path) -> None:
    with pytest.raises(UsageFileError, match="cannot save"):
        save_usage(tmp_path / "no-such-dir" / USAGE_FILE, _sample(), ENGINE)
    with pytest.raises(ValueError):
        save_usage(tmp_path / USAGE_FILE, _sample(), "has space")


_WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, sys.argv[1])
    from storage.usage import UsageCounts, save_usage
    L, E = 75, 256
    base = np.arange(1, L * E + 1, dtype=np.int64).reshape(L, E)
    k = 1
    while True:
        u = UsageCounts(L, E)
        u.counts = base * k
        save_usage(sys.argv[2], u, "eng")
        if k <= 2:
            print("saved", flush=True)
        k += 1
    """
)


@pytest.mark.reliability
def test_sigkill_during_save_never_leaves_a_broken_file(tmp_path: Path) -> None:
    """A writer saving in a loop is SIGKILLed at random points: always an old or new file."""
    p = tmp_path / USAGE_FILE
    base = np.arange(1, 75 * 256 + 1, dtype=np.int64).reshape(75, 256)
    rng = random.Random(42)
    seen: set[int] = set()
    for _ in range(10):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(ROOT), str(p)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saved"
        t0 = time.perf_counter()
        assert proc.stdout.readline().strip() == "saved"
        # one save as long as this disk makes it (its fsync: about 1 ms on some disks, 50 on
        # others), so the kill lands somewhere in the next few
        one_save = time.perf_counter() - t0
        try:
            signal_at = rng.uniform(0.0, 3 * one_save)
            proc.wait(timeout=signal_at)
        except subprocess.TimeoutExpired:
            pass
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        with structlog.testing.capture_logs() as logs:
            u = load_usage(p, 75, 256, "eng")
        assert u is not None, logs
        k = int(u.counts[0, 0])
        assert k >= 1 and np.array_equal(u.counts, base * k)
        seen.add(k)
    assert not [x for x in tmp_path.iterdir() if ".bad-" in x.name]
    assert len(seen) > 1  # the kills really landed at different points


def test_counting_and_a_merged_save_never_lose_counts() -> None:
    """The compute thread counts (add) while the event loop folds a merged save back (shift):
    both read-modify-write the array, which numpy does without the GIL (counts were lost)."""
    import threading

    from storage.usage import UsageCounts

    c = UsageCounts(4, 256)
    ids = np.arange(256).repeat(4)
    n = 400

    def count() -> None:
        for _ in range(n):
            c.add(1, ids)

    def fold() -> None:
        one = np.ones((4, 256), np.int64)
        for _ in range(n):
            c.shift(one)

    threads = [threading.Thread(target=count), threading.Thread(target=fold)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.total == n * ids.size + n * 4 * 256


def test_usage_counts_pickle_and_copy_with_a_lock_of_their_own() -> None:
    """The lock added for merged saves made UsageCounts unpicklable (TypeError)."""
    import copy
    import pickle

    from storage.usage import UsageCounts

    c = UsageCounts(2, 8)
    c.add(1, [3, 3, 5])
    for twin in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert twin == c and twin._lock is not c._lock
        twin.add(0, [1])  # its lock works
        assert twin.total == c.total + 1
