"""``coli run --ray local``: the same text as one process, the flags in ``--help``, and bad
addresses refused with one clear line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from _cli import coli

from runtime.cluster.ray_backend import head_endpoint
from storage.errors import ColibriError

pytest.importorskip("ray", reason="the ray extra is not installed")


def test_run_on_two_expert_workers_prints_the_same_text(tmp_path: Path) -> None:
    args = ("run", "--raw", "-n", "16", "--draft", "off", "Once upon a time")
    alone = coli(*args, home=tmp_path)
    assert alone.returncode == 0, alone.stderr
    spread = coli(*args, "--ray", "local", "--expert-workers", "2", home=tmp_path)
    assert spread.returncode == 0, spread.stderr
    assert spread.stdout == alone.stdout and alone.stdout.strip()


def test_cluster_flags_are_documented_in_help() -> None:
    for cmd in ("run", "chat", "serve"):
        out = coli(cmd, "--help").stdout
        for flag in ("--ray", "--expert-workers", "--worker-ram", "--expert-timeout"):
            assert flag in out, (cmd, flag)


def test_a_bad_worker_count_is_one_clear_line(tmp_path: Path) -> None:
    r = coli("run", "--ray", "local", "--expert-workers", "0", "hi", home=tmp_path)
    assert r.returncode == 2 and "--expert-workers" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_worker_that_cannot_open_the_model_is_one_clear_error(tmp_path: Path) -> None:
    r = coli("run", "--ray", "local", "--worker-model", str(tmp_path / "nowhere"), "hi",
             home=tmp_path)  # fmt: skip
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not start" in errors[0] and "does not exist" in errors[0]
    assert "Traceback" not in r.stderr and "^^^" not in r.stderr, r.stderr


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_address_where_nothing_listens_is_one_clear_error_at_once(tmp_path: Path) -> None:
    """Ray's own join waits on a head node that is not there for minutes, deaf to SIGTERM: the
    address is tried first (one TCP connect) and the command says what is wrong."""
    port = _closed_port()
    r = coli("run", "--ray", f"127.0.0.1:{port}", "hi", home=tmp_path)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "cannot reach Ray" in errors[0] and str(port) in errors[0], errors[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("local", None),
        ("auto", None),
        ("10.0.0.5:6380", ("10.0.0.5", 6380)),
        ("head.lan", ("head.lan", 6379)),
        ("ray://head.lan", ("head.lan", 10001)),
        ("ray://head.lan:10002/", ("head.lan", 10002)),
        ("[::1]:7000", ("::1", 7000)),
        ("[fe80::1]", ("fe80::1", 6379)),
    ],
)
def test_ray_addresses_name_the_head_they_connect_to(
    address: str, endpoint: tuple[str, int] | None
) -> None:
    assert head_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["head:0", "head:70000", "head:http", "http://head", ":6379"])
def test_a_malformed_ray_address_is_refused(address: str) -> None:
    with pytest.raises(ColibriError, match="--ray"):
        head_endpoint(address)
