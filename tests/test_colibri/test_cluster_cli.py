"""``coli run --ray local``: the same text as one process, the flags in ``--help``, and bad
addresses refused with one clear line."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _cli import coli

from runtime.cluster.ray_backend import check_reachable, head_endpoint
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
    # an infinite timeout passed the check and crashed the first step inside Ray
    r = coli("run", "--ray", "local", "--expert-timeout", "inf", "hi", home=tmp_path)
    assert r.returncode == 2 and "--expert-timeout" in r.stderr, r.stderr


def test_a_worker_that_cannot_open_the_model_is_one_clear_error(tmp_path: Path) -> None:
    r = coli("run", "--ray", "local", "--worker-model", str(tmp_path / "nowhere"), "hi",
             home=tmp_path)  # fmt: skip
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not start" in errors[0] and "does not exist" in errors[0]
    assert "Traceback" not in r.stderr and "^^^" not in r.stderr, r.stderr


def test_workers_on_another_model_are_one_clear_error(tmp_path: Path) -> None:
    """--worker-model naming another model of the same shape (here the bundled demo with
    another norm epsilon) ran and printed other text, no error."""
    import json
    import shutil

    from colibri._config import default_model_path

    other = Path(shutil.copytree(default_model_path(), tmp_path / "other"))
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    r = coli("run", "--ray", "local", "--worker-model", str(other), "-n", "4", "hi",
             home=tmp_path)  # fmt: skip
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not the same model files" in errors[0], r.stderr
    assert "expert-worker-0" in errors[0] and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- signals

# From the signal to the exit: the clean-up stops the workers and the Ray the command started
# (Ray's shutdown gives each of its processes up to a second); loaded CI machines are slower.
EXIT_WITHIN_S = 10.0


def _coli_in_own_session(home: Path, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``coli ARGS`` in a session of its own (Ray's processes, started by it, join it) with
    its stderr lines collected as they come."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    env["HOME"] = str(home)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    p = subprocess.Popen([sys.executable, "-m", "colibri.cli", *args], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert p.stderr is not None
        lines.extend(iter(p.stderr.readline, ""))

    threading.Thread(target=read, daemon=True).start()
    return p, lines


def _session(sid: int) -> list[str]:
    """The live processes of session ``sid`` ("pid name")."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        state, _ppid, _pgrp, session = rest.split()[:4]
        if int(session) == sid and state not in "ZX":
            out.append(f"{d.name} {name}")
    return out


def _signal_and_wait(p: subprocess.Popen[str], sig: int) -> tuple[int, float]:
    """Send ``sig``; the exit status and how long the command took to end."""
    assert len(_session(p.pid)) >= 3, _session(p.pid)  # the command, Ray's GCS and raylet, ...
    p.send_signal(sig)
    t0 = time.monotonic()
    try:
        code = p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = -999
    return code, time.monotonic() - t0


def _left_after(sid: int, seconds: float) -> list[str]:
    """The processes of session ``sid`` still there after ``seconds`` (then killed)."""
    end = time.monotonic() + seconds
    while (left := _session(sid)) and time.monotonic() < end:
        time.sleep(0.2)
    for line in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return left


@pytest.mark.reliability
def test_sigterm_ends_a_ray_run_cleanly_and_stops_its_ray(tmp_path: Path) -> None:
    """SIGTERM to `coli run --ray local` mid-generation: Ray's init had put its own SIGTERM
    handler in the process, which aborted it (status 134, "*** SIGTERM received", nothing
    closed, Ray's processes left behind). It exits 143 after its clean-up, as without --ray,
    with the Ray it started stopped."""
    p, lines = _coli_in_own_session(
        tmp_path, "run", "--ray", "local", "--expert-workers", "2",
        "-n", "400", "-t", "1", "--seed", "1", "a story about a bird",
    )  # fmt: skip
    try:
        assert p.stdout is not None
        assert p.stdout.read(1), "".join(lines)  # decoding has begun
        code, took = _signal_and_wait(p, signal.SIGTERM)
    finally:
        left = _left_after(p.pid, 5.0)
    err = "".join(lines)
    assert code == 143, (code, err[-3000:])
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert took < EXIT_WITHIN_S, (took, err[-2000:])
    assert not left, left


@pytest.mark.reliability
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_ray_serve_interrupted_while_its_workers_load_stops_its_ray(
    tmp_path: Path, sig: int
) -> None:
    """Ctrl-C / SIGTERM to `coli serve --ray local` while the expert workers load: the start
    went on in its thread while the command exited, and Ray's agents ran on for a minute (a
    SIGTERM aborted the process, 134). Now the start is stopped, its workers and the Ray it
    began too, before the command exits 130 / 143."""
    p, lines = _coli_in_own_session(
        tmp_path, "serve", "--ray", "local", "--expert-workers", "2", "--port",
        str(_closed_port()),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # an expert worker's process is up (Ray names it after the actor): loading its share
        while not any(" ray::ExpertWor" in q for q in _session(p.pid)):
            assert p.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        code, took = _signal_and_wait(p, sig)
    finally:
        left = _left_after(p.pid, 5.0)
    err = "".join(lines)
    assert not any("expert workers ready" in line for line in lines), "loaded before the signal"
    assert code == 128 + sig, (code, err[-3000:])
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert took < EXIT_WITHIN_S, (took, err[-2000:])
    assert not left, left


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


@contextmanager
def _service(answer: Callable[[socket.socket], None]) -> Iterator[int]:
    """A loopback TCP service that runs ``answer`` on each connection; yields its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                answer(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join(5)
        srv.close()


def _http1(conn: socket.socket) -> None:
    conn.recv(1024)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def _silent(conn: socket.socket) -> None:
    time.sleep(1.0)


def _hang_up(conn: socket.socket) -> None:
    pass


@pytest.mark.parametrize(
    ("answer", "said"),
    [(_http1, "sent b'HTTP/1.1 400"), (_silent, "said nothing"), (_hang_up, "connection")],
)
def test_a_service_that_is_not_ray_is_one_clear_error_at_once(
    answer: Callable[[socket.socket], None], said: str
) -> None:
    """A port where something else listens (a web server, a tunnel that accepts and stays
    silent, one that hangs up) made ``ray.init`` wait for minutes: the check speaks the
    HTTP/2 preface that Ray's gRPC head answers with its settings, and says what it got."""
    with _service(answer) as port:
        t0 = time.monotonic()
        with pytest.raises(ColibriError, match="not a Ray head") as err:
            check_reachable(f"127.0.0.1:{port}", timeout=0.5)
        assert said in str(err.value) and str(port) in str(err.value)
        assert time.monotonic() - t0 < 3


def test_a_ray_head_passes_the_check() -> None:
    """The GCS of a Ray started here answers the HTTP/2 preface as a head node does."""
    import ray

    if ray.is_initialized():  # (started by another test in this process: its head will do)
        check_reachable(ray.get_runtime_context().gcs_address)
        return
    ctx = ray.init(num_cpus=1, include_dashboard=False, namespace="colibri-test-check")
    try:
        check_reachable(ctx.address_info["gcs_address"])
    finally:
        ray.shutdown()
