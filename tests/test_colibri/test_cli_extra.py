"""`coli bench storage`, `coli plan`, `coli info`'s machine summary and the one-line errors of
`coli chat` / `coli plan`, run as real subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _demo import TINY, demo_model

ROOT = Path(__file__).resolve().parents[2]

DEMO = demo_model()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


def coli(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")} | {
        "COLI_MODEL": str(demo_model())
    }
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", *args],
        capture_output=True,
        text=True,
        env={**env, "HOME": str(home)},
        input=stdin,
        timeout=120,
    )


def one_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    for n in needles:
        assert n in errors[0], errors[0]
    assert any(line.startswith("hint: ") for line in r.stderr.splitlines()), r.stderr


def test_bench_storage_prints_json_with_a_figure(home: Path) -> None:
    r = coli(home, "bench", "storage", "--model", str(DEMO), "--reads", "8", "--backends",
             "threads", "--repeats", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "figure" in out  # null without fio
    assert out["backends"]["threads"]["gbps_median"] > 0
    assert out["reads"] == 8  # as asked: a minimum
    # a pass of 8 demo experts lasts ms, timed by fio in whole ms: every pass reads more
    assert out["reads_per_pass"] >= 8 and out["min_pass_s"] == 0.2
    assert out["reads_per_pass"] > 8 or out["pass_s"]["min"] >= 0.2, out
    assert "reads per pass" in r.stderr
    asked = coli(home, "bench", "storage", "--model", str(DEMO), "--reads", "8", "--backends",
                 "threads", "--repeats", "1", "--no-fio", "--min-pass", "0")  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    got = json.loads(asked.stdout.strip().splitlines()[-1])
    assert got["reads_per_pass"] == 8 and got["extended"] == [] and got["min_pass_s"] == 0
    # each round's extents read once, untimed, before its passes (--no-warm-up: not)
    assert out["warm_up"]["backend"] == "threads" and len(out["warm_up"]["gbps_runs"]) == 1
    assert "warm-up 1" in r.stderr, r.stderr
    cold = coli(home, "bench", "storage", "--model", str(DEMO), "--reads", "8", "--backends",
                "threads", "--repeats", "1", "--no-fio", "--no-warm-up")  # fmt: skip
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout.strip().splitlines()[-1])["warm_up"] is None
    assert "warm-up" not in cold.stderr
    neg = coli(home, "bench", "storage", "--min-pass", "-1")
    assert neg.returncode == 2 and "--min-pass" in neg.stderr, neg.stderr
    bad = coli(home, "bench", "storage", "--backends", "floppy")
    assert bad.returncode == 2 and "floppy" in bad.stderr
    # a block that is not whole 4 KiB pages: backends and fio would be credited unlike bytes
    odd = coli(home, "bench", "storage", "--model", str(DEMO), "--block", "1000")
    assert odd.returncode == 2 and "multiple of 4 KiB" in odd.stderr, odd.stderr
    # what it cannot read is one error line, not a traceback
    (home / "empty").mkdir()
    (home / "small.bin").write_bytes(b"x" * 8192)
    for args, words in (
        (["--block", "64MiB"], "holds one"),
        (["--model", str(home / "empty")], "no manifest experts"),
        (["--model", str(home / "small.bin")], "holds one"),
    ):
        r = coli(home, "bench", "storage", "--no-fio", "--reads", "2", "--repeats", "1",
                 "--model", str(DEMO), *args)  # fmt: skip
        assert r.returncode == 1 and words in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    # the reads' sizes as they are (the MTP layer's int8 experts are the largest)
    sizes = out["read_bytes"]
    assert sizes["min"] <= sizes["median"] <= sizes["max"] == out["block"]
    assert sizes["min"] < sizes["max"]


def test_plan_json_on_the_demo(home: Path) -> None:
    r = coli(home, "plan", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["mode"] == "resident" and p["projected_hit_rate"] == 1.0
    assert p["dense_bytes"] == p["dense_stored_bytes"] + p["dense_derived_bytes"] > 0
    for key in ("kv_reserve_bytes", "slot_bytes", "transient_slots", "bottleneck", "why",
                "suggested", "min_ram_bytes", "per_token"):  # fmt: skip
        assert key in p
    small = json.loads(coli(home, "plan", "--json", "--ram", "4500KiB").stdout)
    assert small["mode"] == "streaming" and small["ram_budget_bytes"] == 4500 * 2**10
    assert 0 < small["projected_hit_rate"] < 1 and small["bottleneck"] == "memory"
    text = coli(home, "plan", "--ram", "6MiB")
    assert text.returncode == 0 and "bottleneck" in text.stdout and "hit rate" in text.stdout


def test_too_small_budget_is_one_error_with_a_hint(home: Path) -> None:
    one_error(coli(home, "plan", "--ram", "1MiB"), "too small", "minimum")
    one_error(coli(home, "chat", "--ram", "1MiB", stdin=":q\n"), "too small")


def test_chat_on_a_missing_model_dir(home: Path, tmp_path: Path) -> None:
    one_error(coli(home, "chat", "--model", str(tmp_path / "nope"), stdin=""), "nope")
    r = coli(home, "chat", "--frobnicate")
    assert r.returncode == 2 and "frobnicate" in r.stderr
    r = coli(home, "chat", "--session", "../escape")
    assert r.returncode == 2 and "--session" in r.stderr


def test_chat_reads_piped_input(home: Path, tmp_path: Path) -> None:
    r = coli(home, "chat", "--state-dir", str(tmp_path), "-n", "4", "-t", "0", stdin="hi\n:q\n")
    assert r.returncode == 0, r.stderr
    assert " tok · " in r.stdout and "tok/s · hit 100 % · RSS" in r.stdout


def test_info_has_a_machine_summary(home: Path) -> None:
    r = coli(home, "info", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["cpu_count"] >= 1 and d["ram_total_bytes"] > 0
    assert d["ram_available_bytes"] > 0 and d["model_fs_free_bytes"] > 0
    assert isinstance(d["cpu_model"], str) and d["model_fs_type"]
    text = coli(home, "info").stdout
    for key in ("cpu_model", "ram_available_bytes", "model_fs_type", "model_fs_free_bytes"):
        assert key in text
    # the model in numbers people read: parameters, formats, context, binary units
    assert d["parameters"] > d["active_parameters"] > 0
    assert d["quantization"]["expert"].startswith("int4")
    assert d["context"] and d["experts_per_token"]
    lines = dict(ln.split(None, 1) for ln in text.splitlines() if ln.strip())
    assert lines["expert_bytes"].endswith("KiB") and lines["ram_total_bytes"].endswith("GiB")
    assert lines["parameters"].rstrip().endswith(f"({d['parameters']})")
    assert "expert=int4" in lines["quantization"]


def _as_nobody() -> list[str] | None:
    """A command prefix running Python as user nobody (permission bits apply to it), or None.
    Root ignores permission bits, so this needs root (to switch users) and a system Python of
    the same minor version that nobody may execute (the venv's interpreter may live under
    /root)."""
    import shutil as sh

    py = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if os.geteuid() != 0 or sh.which("setpriv") is None or not os.access(py, os.X_OK):
        return None
    site = next(p for p in sys.path if p.endswith("site-packages"))
    return [
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        "env", "HOME=/tmp", f"PYTHONPATH={ROOT}:{site}", "NUMBA_CACHE_DIR=/tmp/colibri-nb-nobody",
        py, "-m", "colibri.cli",
    ]  # fmt: skip


@pytest.mark.root
def test_unreadable_model_dir_is_one_error_line() -> None:
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("needs root, setpriv and a system Python of this version (to run as nobody)")
    import shutil as sh
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="colibri-perm-", dir="/tmp"))  # nobody can reach it
    top.chmod(0o755)
    m = top / "m"
    sh.copytree(TINY, m)
    for f in m.iterdir():
        f.chmod(0o644)
    try:
        ok = subprocess.run(
            [*prefix, "doctor", "--model", str(m)], capture_output=True, text=True, timeout=300
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr  # readable: nobody can use it
        for mode in (0o744, 0o711):  # listable but not searchable; searchable but not listable
            m.chmod(mode)
            for cmd in (["run", "hi"], ["doctor"], ["info"]):
                p = subprocess.run(
                    [*prefix, *cmd, "--model", str(m)], capture_output=True, text=True, timeout=300
                )
                out = p.stdout + p.stderr
                assert p.returncode in (1, 2), (mode, cmd, out)  # 2: click refused --model
                assert "Traceback" not in out, (mode, cmd, out)
                assert "Permission denied" in out or "not readable" in out, (mode, cmd, out)
    finally:
        m.chmod(0o755)
        sh.rmtree(top, ignore_errors=True)


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "colibri.cli", "run", "--model", str(TINY), "--raw", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_reads_the_prompt_from_stdin_or_a_file_and_reports_speed(tmp_path: Path) -> None:
    want = _run("w5 w6 w7", "-n", "6")
    assert want.returncode == 0, want.stderr
    summary = want.stderr.strip().splitlines()[-1]
    assert summary.startswith("6 tokens, ") and "tok/s" in summary and "first after" in summary
    piped = _run("-", "-n", "6", stdin="w5 w6 w7")
    assert piped.returncode == 0 and piped.stdout == want.stdout
    f = tmp_path / "prompt.txt"
    f.write_text("w5 w6 w7")
    from_file = _run("--file", str(f), "-n", "6", "--quiet")
    assert from_file.returncode == 0 and from_file.stdout == want.stdout
    assert "tok/s" not in from_file.stderr
    none = _run("-n", "2")
    assert none.returncode == 2 and "give a PROMPT" in none.stderr


@pytest.mark.parametrize(
    ("args", "env", "want"),
    [
        ([], None, "auto"),
        (["--prefetch", "on"], None, "on"),
        (["--no-prefetch"], None, "off"),
        (["--no-prefetch"], "on", "off"),
        ([], "0", "off"),
        ([], "on", "on"),
        (["--prefetch", "auto"], "off", "auto"),
    ],
)
def test_prefetch_flags_and_env_map_to_one_option(
    args: list[str], env: str | None, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prefetch MODE, --no-prefetch and COLI_PREFETCH reach EngineOptions.prefetch."""
    import click
    from click.testing import CliRunner

    import colibri.cli as cli

    if env is None:
        monkeypatch.delenv("COLI_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("COLI_PREFETCH", env)
    got: list[str] = []

    @click.command()
    @cli._engine_options
    def probe(model: Any, ram: Any, reader: str) -> None:
        got.append(cli._options(model, ram, reader).prefetch)

    res = CliRunner().invoke(probe, args)
    assert res.exit_code == 0, res.output
    assert got == [want]


def test_a_damaged_config_value_is_one_error_naming_the_key(home: Path, tmp_path: Path) -> None:
    """A bad value in an existing model's config.json: one error line naming the key, and a
    hint to run the doctor (not to pass another --model)."""
    import shutil

    d = Path(shutil.copytree(DEMO, tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": "abc"}))
    for cmd in (("run", "-n", "2", "hi"), ("info",)):
        r = coli(home, *cmd, "--model", str(d))
        one_error(r, "rms_norm_eps must be a number", str(d / "config.json"))
        assert "hint: run `coli doctor --model DIR`" in r.stderr, r.stderr


def test_serve_refuses_keys_no_client_could_send(home: Path) -> None:
    """A non-ASCII key would lock every client out (headers reach the server as latin-1,
    clients send UTF-8); an empty one would leave the server open. Both are refused before
    the model loads."""
    r = coli(home, "serve", "--port", "0", "--api-key", "cl\u00e9-\u043a\u043b\u044e\u0447")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "API key must be non-empty printable ASCII" in errors[0]
    r = coli(home, "serve", "--port", "0", "--api-key", "")
    assert r.returncode == 2 and "would leave the server open" in r.stderr, r.stderr


def test_info_counts_active_parameters_and_expert_bytes_as_a_token_and_a_read_use_them(
    home: Path,
) -> None:
    """active_parameters: every tensor but the routed experts and the MTP layer (its float32
    tensors included), plus top-k
    main-layer experts per MoE layer (the MTP layer's experts were counted in "per expert",
    which came out 1/(MoE layers + 1) low); expert_bytes: what a read of one main-layer expert
    transfers (blob and scales, as coli plan says), not the largest bare blob (the MTP's)."""
    import math

    from storage.container import Container

    d = json.loads(coli(home, "info", "--json").stdout)
    c = Container.open(Path(d["model"]))
    a = c.arch
    main = [x for x in c.expert_extents() if x.layer < a.num_hidden_layers]
    assert len(main) < len(c.expert_extents())  # the demo model has an MTP layer with experts
    one = main[0]
    expert_params = sum(
        math.prod(c.entry(f"model.layers.{one.layer}.mlp.experts.{one.expert}.{p}.weight").shape)
        for p in ("gate_proj", "up_proj", "down_proj")
    )

    def in_mtp(name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= a.num_hidden_layers

    dense = sum(
        math.prod(c.entry(n).shape)
        for n in c.names()
        if c.entry(n).role not in ("expert", "mtp") and not in_mtp(n)
    )
    # the MTP layer's float32 norms, router and bias are not the main model's either
    assert any(in_mtp(n) and c.entry(n).role == "f32" for n in c.names())
    moe_layers = len({x.layer for x in main})
    assert d["active_parameters"] == dense + a.num_experts_per_tok * expert_params * moe_layers
    plan = json.loads(coli(home, "plan", "--json").stdout)
    assert d["expert_bytes"] == plan["expert_bytes"]


def test_bench_stream_refuses_a_share_outside_0_1(home: Path) -> None:
    """--fraction nan was a traceback inside the benchmark's budget, -1 a reported figure for a
    negative share of experts in RAM."""
    for bad in ("nan", "-1", "0", "1.5"):
        r = coli(home, "bench", "stream", "--fraction", bad, "--tokens", "1")
        assert r.returncode == 2 and "--fraction" in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr
    script = Path(__file__).resolve().parents[2] / "tools" / "bench" / "stream.py"
    r = subprocess.run([sys.executable, str(script), "--fraction", "nan"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--fraction" in r.stderr and "Traceback" not in r.stderr
