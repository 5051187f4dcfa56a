"""``--kernels fast-int8``, the opt-in lossy kernels, as a user meets them: the flag and its
label in ``--help``, the warning at open, ``coli info``, ``stats()`` and the server's ``/health``
(a real ``coli serve`` on loopback). The kernel math is tested in
tests/test_runtime/test_fast_int8.py."""

from __future__ import annotations

from pathlib import Path

import httpx
from _cli import coli
from _serve import Server

import colibri
from colibri._config import default_model_path


def test_help_labels_the_mode_lossy_and_bad_values_are_refused() -> None:
    out = coli("run", "--help").stdout
    assert "--kernels" in out and "fast-int8" in out and "LOSSY" in out
    bad = coli("run", "--kernels", "int3", "-n", "2", "Hi")
    assert bad.returncode == 2 and "Invalid value for '--kernels'" in bad.stderr
    env_bad = coli("run", "-n", "2", "Hi", env={"COLI_KERNELS": "int3"})
    assert env_bad.returncode == 2 and "--kernels" in env_bad.stderr


def test_run_with_fast_int8_warns_and_matches_exact_text_on_the_demo(tmp_path: Path) -> None:
    model = str(default_model_path())
    args = ("run", "--model", model, "-n", "12", "--state-dir", str(tmp_path), "Hello")
    exact = coli(*args)
    fast = coli(*args, "--kernels", "fast-int8")
    assert exact.returncode == 0 and fast.returncode == 0, fast.stderr
    assert "lossy kernels" in fast.stderr and "lossy kernels" not in exact.stderr
    # the trained demo model's greedy text is the same (tests/test_runtime: agreement 1.0)
    assert fast.stdout == exact.stdout
    env = coli(*args, env={"COLI_KERNELS": "fast-int8"})
    assert "lossy kernels" in env.stderr


def test_info_names_the_int8_path() -> None:
    out = coli("info").stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("fast_int8_kernels"))
    assert "lossy" in line and "--kernels fast-int8" in line


def test_stats_report_the_mode() -> None:
    with colibri.open_model(None, learn=False, kernels="fast-int8") as m:
        k = m.stats()["compute"]["kernels"]
        assert (k["mode"], k["lossy"]) == ("fast-int8", True)
        assert m.generate([1, 2, 3], max_new_tokens=4)
    with colibri.open_model(None, learn=False) as m:
        k = m.stats()["compute"]["kernels"]
        assert (k["mode"], k["lossy"]) == ("exact", False)


def test_health_says_lossy(tmp_path: Path) -> None:
    srv = Server(tmp_path, "--kernels", "fast-int8")
    try:
        srv.wait_ready()
        health = httpx.get(srv.url + "/health", timeout=10).json()
        assert health["kernels"] == {"mode": "fast-int8", "lossy": True}
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": health["model"], "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        srv.stop()
