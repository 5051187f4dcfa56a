"""Expert workers as Ray actors (the optional ``ray`` extra: ``pip install -e '.[ray]'``).

:func:`start_cluster` joins a Ray cluster (``address``) or starts one on this machine
(``"local"``), starts ``n`` :class:`runtime.cluster.worker.ExpertWorker` actors spread over its
nodes, weighs them by RAM and probed read bandwidth, hands each its share of the experts
(:mod:`runtime.cluster.placement`) and returns the links and ownership the coordinator's
:class:`runtime.cluster.source.ClusterExperts` needs. Actors restart when their process dies
(``max_restarts=-1``); calls are never retried by Ray (the coordinator falls back instead).

This is the one place Ray's exceptions are mapped (to :class:`WorkerFailed`).

Shape legend: N workers, key = (layer, expert).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import structlog

from runtime.cluster.placement import assign, shares, worker_weights
from runtime.cluster.source import WorkerFailed
from runtime.cluster.worker import AUTO_FRACTION, ExpertWorker
from storage.container import Container
from storage.errors import ColibriError
from storage.kvfile import model_identity

__all__ = ["RayCluster", "RayLink", "StartCancelled", "start_cluster"]

_log = structlog.get_logger(__name__)

NAMESPACE = "colibri"
INLINE_BYTES = 4 << 20  # replies up to this size travel inline (Ray's default: 100 KiB)
START_TIMEOUT_S = 600.0  # workers loading their share (reading GBs) may take minutes
REACH_TIMEOUT_S = 5.0  # a head node that does not answer a TCP connect in this long is down
GCS_PORT = 6379  # Ray's default head port (an address without one)
CLIENT_PORT = 10001  # Ray client's default port (ray://host)
START_POLL_S = 0.1  # a start waiting on its workers looks this often whether it was cancelled


class StartCancelled(ColibriError):
    """The caller of :func:`start_cluster` gave up (Ctrl-C, SIGTERM, a cancelled open): the
    workers started so far are stopped, and the Ray the start began with it."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ColibriError(
            "--ray needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.40')"
        ) from exc
    return ray


def _sigterm_action() -> tuple[Any, Any] | None:
    """The process's SIGTERM disposition as the C library holds it (libc and an opaque
    ``struct sigaction``), for :func:`_ray_init_signals`; None where it cannot be read."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(1024)  # larger than any platform's struct
        if libc.sigaction(int(signal.SIGTERM), None, action) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return libc, action


@contextmanager
def _ray_init_signals() -> Iterator[None]:
    """Signals across ``ray.init``, which starts Ray's processes (GCS, raylet, agents, and the
    workers the raylet starts in turn) and its core worker in this process.

    - Ray's processes do not inherit this thread's blocked signals. A process starts with the
      mask of the thread that forked it, and an engine thread blocks SIGINT and SIGTERM (so
      that they reach the main thread): every Ray process, the expert workers included,
      blocked SIGTERM, and ``ray.shutdown`` waited a second on each before its SIGKILL (5 s
      to exit after a signal). This thread's mask is put back after init.
    - This process keeps its SIGTERM handler. The core worker installs its C++ failure
      handler for SIGTERM in the whole process, over Python's: a SIGTERM then printed
      "*** SIGTERM received" and aborted (status 134) with nothing closed, the Ray it
      started left running, where `coli` exits 143 after its clean-up. Ray's own switch
      (``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when init creates the core worker) keeps
      it out of this process only (Ray's processes keep theirs); for a Ray without it the
      disposition the process had is put back once init returns."""
    stop = {signal.SIGINT, signal.SIGTERM}
    mask = (
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
        if hasattr(signal, "pthread_sigmask")
        else None
    )
    consts: Any = None
    with suppress(ImportError):  # (another layout: only the restore below)
        consts = importlib.import_module("ray._private.ray_constants")
    had = getattr(consts, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    if had is not None:
        consts.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    saved = _sigterm_action()
    try:
        yield
    finally:
        if had is not None:
            consts.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = had
        if saved is not None:
            libc, action = saved
            libc.sigaction(int(signal.SIGTERM), action, None)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def head_endpoint(address: str) -> tuple[str, int] | None:
    """The (host, port) a Ray address connects to first: ``host:port``, ``host`` (Ray's head
    port), ``ray://host[:port]`` (the client port); None for ``local`` and ``auto``, which
    name no host. Raises :class:`ColibriError` on a port that is not a number in 1..65535."""
    if address in ("local", "auto"):
        return None
    rest, port = address, GCS_PORT
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        if scheme != "ray":
            raise ColibriError(f"--ray {address!r}: the address is host:port or ray://host:port")
        port = CLIENT_PORT
    rest = rest.rstrip("/")
    host = rest
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        if tail:
            port = _port(address, tail.removeprefix(":"))
    elif rest.count(":") == 1:
        host, _, p = rest.partition(":")
        port = _port(address, p)
    if not host:
        raise ColibriError(f"--ray {address!r}: no host in the address")
    return host, port


def _port(address: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ColibriError(f"--ray {address!r}: the port must be a number in 1..65535")
    return int(text)


#: An HTTP/2 client's connection preface and an empty SETTINGS frame: Ray's head (its GCS,
#: and the Ray client server behind ``ray://``) speaks gRPC, whose server answers with a
#: SETTINGS frame of its own (frame type 4 on stream 0) before anything else.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def check_reachable(address: str, timeout: float = REACH_TIMEOUT_S) -> None:
    """Fail at once when nothing that could be Ray answers at an address: ``ray.init`` would
    wait on the head node for minutes, with no way to stop it short of killing the process.
    One TCP connect; then the HTTP/2 preface, which a gRPC server (Ray's head) answers with
    a SETTINGS frame, so a port where another service listens (a web server, ssh, a closed
    tunnel that accepts and says nothing) is told apart. Raises :class:`ColibriError` naming
    the address and the reason."""
    where = head_endpoint(address)
    if where is None:
        return
    host, port = where
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:  # refused, unreachable, unknown host, timed out
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ColibriError(
            f"cannot reach Ray at {address!r} ({host} port {port}): {why}; start the head "
            "node with `ray start --head` there, or use --ray local"
        ) from exc
    with sock:
        try:
            sock.sendall(_H2_PREFACE)
            head = _read_some(sock, 9)
        except TimeoutError:
            said = f"accepted the connection, then said nothing for {timeout:g} s"
        except OSError as exc:  # reset by the peer
            said = f"dropped the connection ({exc.strerror or exc})"
        else:
            if len(head) >= 9 and head[3] == 4:
                return
            said = f"sent {head[:40]!r}" if head else "closed the connection"
    raise ColibriError(
        f"something answers at {address!r} ({host} port {port}) but it is not a Ray head "
        f"(it {said}, where Ray's gRPC sends its settings); check the address and port "
        "(`ray start --head` prints them)"
    )


def _read_some(sock: socket.socket, n: int) -> bytes:
    """At least ``n`` bytes (up to 64, to say what a stranger sent), fewer when the peer
    closes first."""
    got = b""
    while len(got) < n:
        part = sock.recv(64 - len(got))
        if not part:
            break
        got += part
    return got


def _cause(exc: BaseException) -> str:
    """The line of a Ray error that says what went wrong: Ray wraps a worker's exception in its
    traceback, whose last line is ``module.Error: message`` (the module path dropped here)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    last = lines[-1]
    head, sep, rest = last.partition(": ")
    if sep and "." in head and " " not in head:
        return f"{head.rsplit('.', 1)[-1]}: {rest}"
    return last


class RayLink:
    """One worker actor (a :class:`runtime.cluster.source.WorkerLink`)."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name

    def call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.actor, method).remote(*args)
        except Exception as exc:  # submitting to a dead actor can fail at once
            raise WorkerFailed(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def result(self, handle: Any, timeout: float) -> Any:
        ray = _ray()
        try:
            return ray.get(handle, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise WorkerFailed(
                f"{self.name}: no reply within the deadline", timed_out=True
            ) from exc
        except (ray.exceptions.RayError, ColibriError) as exc:
            raise WorkerFailed(f"{self.name}: {type(exc).__name__}: {_cause(exc)}") from exc

    def done(self, handle: Any) -> bool:
        ready, _ = _ray().wait([handle], timeout=0)
        return bool(ready)


#: the clusters of this process not closed yet: Ray's runtime is one per process, so the
#: engine that started it may not shut it down while another engine still uses it
_OPEN: weakref.WeakSet[RayCluster] = weakref.WeakSet()


@dataclass(eq=False)
class RayCluster:
    """The started workers: links, ownership ranking, each worker's load arguments."""

    links: list[RayLink]
    owners: dict[tuple[int, int], tuple[int, ...]]
    load_args: list[tuple[Any, ...]]
    infos: list[dict[str, Any]]
    address: str
    started_ray: bool
    weights: tuple[float, ...]
    actors: list[Any] = field(default_factory=list)

    def pids(self) -> list[int]:
        """Each worker's current process id (tests kill one)."""
        ray = _ray()
        return [int(i["pid"]) for i in ray.get([a.info.remote() for a in self.actors])]

    def close(self, timeout: float = 30.0) -> None:
        """Save each worker's usage, stop the actors and (when this process started it) Ray.
        ``timeout``: how long the workers get to save (the engine passes its expert timeout:
        a frozen worker held a server's shutdown for 30 s)."""
        ray = _ray()
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=timeout)
        except Exception as exc:  # a dead worker saves nothing; the rest already did
            _log.warning("an expert worker did not close cleanly", error=str(exc))
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        _OPEN.discard(self)
        if self.started_ray:
            others = [c for c in _OPEN if c.address == self.address]
            if others:
                # another engine of this process joined the Ray this one started: it stays up
                # for it, and the last one to close shuts it down (closing the first engine
                # of two hung the second for a minute, then crashed it)
                others[0].started_ray = True
            else:
                ray.shutdown()

    def describe(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "workers": len(self.links),
            "weights": list(self.weights),
            "hosts": [i.get("host", "") for i in self.infos],
            "kernels": [i.get("kernels", {}) for i in self.infos],
        }


def _check_copies(container: Container, infos: Sequence[dict[str, Any]]) -> None:
    """Every worker opened the coordinator's model: the same config, conversion and shards
    (:func:`storage.kvfile.model_identity`). A worker on another copy (another conversion,
    another model at ``--worker-model``) computed its experts from other weights: wrong
    tokens, no error."""
    own = model_identity(container.path, shards=[sh.path for sh in container.shards])
    wrong = [
        f"expert-worker-{k} on {i.get('host', '?')} ({i.get('model', '?')})"
        for k, i in enumerate(infos)
        if i.get("identity") != own
    ]
    if wrong:
        raise ColibriError(
            f"{', '.join(wrong)}: not the same model files as the coordinator's "
            f"({container.path}): another conversion, another model or a changed copy (config, "
            "manifest, shard sizes or headers differ); give the workers the same converted "
            "files (--worker-model DIR names where they are on the workers' hosts)"
        )


def _check_cancelled(cancelled: threading.Event | None) -> None:
    if cancelled is not None and cancelled.is_set():
        raise StartCancelled("the start of the expert workers was cancelled")


def _gather(ray: Any, refs: list[Any], cancelled: threading.Event | None) -> list[Any]:
    """``ray.get(refs)`` within ``START_TIMEOUT_S``, giving up (:class:`StartCancelled`) within
    ``START_POLL_S`` of ``cancelled`` being set: a start left waiting on its workers in a
    thread nobody waits for any more kept the Ray it started running past the process."""
    end = time.monotonic() + START_TIMEOUT_S
    pending = list(refs)
    while pending:
        _check_cancelled(cancelled)
        left = end - time.monotonic()
        if left <= 0:
            break  # (ray.get below raises its GetTimeoutError)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(START_POLL_S, left))
    return list(ray.get(refs, timeout=0 if pending else None))


def start_cluster(
    address: str,
    n_workers: int,
    container: Container,
    *,
    model: str,
    model_dirs: Sequence[str] = (),
    mirrors: Sequence[str] = (),
    reader: str = "auto",
    worker_ram: int | None = None,
    worker_threads: int | None = None,
    state_dir: str | None = None,
    kernels: str = "exact",
    verify_reads: bool = False,
    cancelled: threading.Event | None = None,
) -> RayCluster:
    """Start ``n_workers`` expert workers on Ray (``address``: ``"local"`` or a cluster address)
    and give each its share of ``container``'s experts. Blocking (run it off the event loop).

    ``cancelled``: set by a caller that gives up (its open cancelled, the program interrupted);
    the start then stops its workers and the Ray it started, and raises
    :class:`StartCancelled` (looked at every ``START_POLL_S`` while the workers load, and once
    ``ray.init``, which cannot be interrupted, returns)."""
    if n_workers < 1:
        raise ColibriError(f"--expert-workers must be >= 1, got {n_workers}")
    ray = _ray()
    started = False
    if not ray.is_initialized():
        kw: dict[str, Any] = dict(
            namespace=NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        if address == "local":
            # Replies of a decode step (~100 KB: K experts x D floats) go inline with the call
            # instead of through the object store: 3.5 -> 1.5 ms per round trip, measured.
            kw.update(
                address="local",
                num_cpus=os.cpu_count() or 1,
                _system_config={"max_direct_call_object_size": INLINE_BYTES},
            )
        else:
            check_reachable(address)
            kw.update(address=address)
        try:
            with _ray_init_signals():
                ray.init(**kw)
        except Exception as exc:
            raise ColibriError(f"could not start or join Ray at {address!r}: {exc}") from exc
        started = True
    actors: list[Any] = []
    try:
        _check_cancelled(cancelled)
        _log.info("expert workers starting", workers=n_workers, address=address)
        actor_cls = ray.remote(ExpertWorker).options(
            max_restarts=-1,
            max_task_retries=0,
            num_cpus=0,  # the workers' own threads do the work; Ray's CPU slots would only block
            scheduling_strategy="SPREAD",
        )
        for i in range(n_workers):
            worker_state = None if state_dir is None else os.path.join(state_dir, f"worker-{i}")
            actors.append(
                actor_cls.remote(
                    model,
                    model_dirs=list(model_dirs),
                    mirrors=list(mirrors),
                    reader=reader,
                    state_dir=worker_state,
                    kernels=kernels,
                    verify_reads=verify_reads,
                )
            )
        infos = _gather(ray, [a.info.remote() for a in actors], cancelled)
        _check_copies(container, infos)
        per_host = Counter(i["host"] for i in infos)
        budgets = [
            worker_ram
            if worker_ram is not None
            else int(AUTO_FRACTION * i["mem_available"] / per_host[i["host"]])
            for i in infos
        ]
        threads = [
            worker_threads
            if worker_threads is not None
            else max(1, int(i["cpus"]) // per_host[i["host"]])
            for i in infos
        ]
        # Workers of one host reading the same files share its disks: one figure for them
        # (the best of their probes, which ran at the same time and split the device).
        best: dict[tuple[str, str], float] = {}
        for i in infos:
            k = (i["host"], i["model"])
            best[k] = max(best.get(k, 0.0), float(i["read_bps"]))
        weights = worker_weights(budgets, [best[(i["host"], i["model"])] for i in infos])
        owners = assign(container.expert_layers(), container.arch.n_routed_experts, weights)
        share = shares(owners, n_workers)
        load_args = [(share[i], budgets[i], threads[i]) for i in range(n_workers)]
        infos = _gather(
            ray,
            [a.load.remote(*args) for a, args in zip(actors, load_args, strict=True)],
            cancelled,
        )
    except BaseException as exc:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if started:
            ray.shutdown()
        if isinstance(exc, ray.exceptions.RayError):
            raise ColibriError(f"an expert worker could not start: {_cause(exc)}") from exc
        raise
    links = [RayLink(a, f"expert-worker-{i}") for i, a in enumerate(actors)]
    _log.info(
        "expert workers ready",
        workers=n_workers,
        modes=[i["mode"] for i in infos],
        experts=[i["experts"] for i in infos],
    )
    cluster = RayCluster(
        links=links,
        owners=owners,
        load_args=load_args,
        infos=infos,
        address=address,
        started_ray=started,
        weights=weights,
        actors=actors,
    )
    _OPEN.add(cluster)
    return cluster
