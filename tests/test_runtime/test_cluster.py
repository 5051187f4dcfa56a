"""Scale-out: expert ownership, one worker in-process, and a real local Ray cluster.

The Ray tests start Ray on this machine (``ray.init`` with worker processes here) through the
engine's ``ray="local"``: 2 expert workers, greedy tokens and logits identical to one process,
a worker killed (SIGKILL) or frozen (SIGSTOP, past the deadline) mid-generation with the output
unchanged, and the worker rejoining once Ray restarted it or it woke up.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from colibri import Engine, EngineOptions
from colibri._engine import TokenEvent
from runtime.cluster.placement import assign, shares, worker_weights
from runtime.cluster.worker import ExpertWorker
from runtime.experts import plan_layout
from runtime.layers import moe as moe_ops
from runtime.weights import ResidentExperts
from storage.container import Container
from storage.errors import ColibriError
from storage.multidisk.placement import rendezvous_order

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _demo() -> Path:
    from colibri._config import default_model_path

    return default_model_path()


# ----------------------------------------------------------------------------- ownership


def test_shares_follow_the_weights_and_are_the_same_in_every_process() -> None:
    owners = assign(range(16), 256, (1.0, 3.0))
    assert owners == assign(range(16), 256, (1.0, 3.0))  # pure function of the keys
    per = shares(owners, 2)
    assert sum(map(len, per)) == 16 * 256
    frac = len(per[0]) / (16 * 256)
    assert 0.21 < frac < 0.29, frac  # w0 / sum(w) = 0.25
    # every key is owned by the first of its ranking, and each ranking names every worker
    assert all(sorted(r) == [0, 1] for r in owners.values())


def test_adding_a_worker_moves_only_the_keys_it_takes() -> None:
    two = assign(range(8), 128, (1.0, 1.0))
    three = assign(range(8), 128, (1.0, 1.0, 1.0))
    moved = [k for k in two if two[k][0] != three[k][0]]
    assert moved and all(three[k][0] == 2 for k in moved)
    assert 0.25 < len(moved) / len(two) < 0.42  # about a third


def test_worker_ranking_is_independent_of_the_disk_ranking() -> None:
    """A worker's keys must not all prefer the same of its own disks (different salt)."""
    owners = assign([0], 4096, (1.0, 1.0))
    mine = [k for k, r in owners.items() if r[0] == 0]
    disk0 = sum(rendezvous_order(la, e, (1.0, 1.0), (0, 1))[0] == 0 for la, e in mine)
    assert 0.4 < disk0 / len(mine) < 0.6


def test_worker_weights() -> None:
    assert worker_weights([64, 32], [1.0, 1.0]) == (1.0, 0.5)
    # probe noise (same disk measured 0.85x) does not move keys; a disk half as fast does
    assert worker_weights([64, 64], [0.85, 1.0]) == (1.0, 1.0)
    assert worker_weights([64, 64], [0.5, 1.0]) == (0.5, 1.0)
    with pytest.raises(ColibriError):
        worker_weights([0, 0], [1.0, 1.0])
    with pytest.raises(ColibriError):
        worker_weights([1], [1.0, 2.0])


# ----------------------------------------------------------------------------- one worker


def _route_rows(c: Container, layer: int, n: int, seed: int) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(seed)
    a = c.arch
    x = rng.standard_normal((n, a.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(a.n_routed_experts, a.top_k, replace=False) for _ in range(n)])
    gates = rng.random((n, a.top_k)).astype(np.float32)
    return x, ids.astype(np.int64), gates


@pytest.mark.parametrize("mode", ["resident", "streaming"])
def test_worker_outputs_are_bit_identical_to_local_experts(mode: str, tmp_path: Path) -> None:
    c = Container.open(_demo())
    layer = c.expert_layers()[0]
    keys = [(la, e) for la in c.expert_layers() for e in range(0, c.arch.n_routed_experts, 2)]
    full = plan_layout(c, None, top_k=c.arch.top_k)
    budget = None if mode == "resident" else (full.transient_slots + 3) * full.slot_bytes
    w = ExpertWorker(_demo(), state_dir=tmp_path / "w", probe_s=0.05)
    try:
        info = w.load(keys, budget if budget is not None else 1 << 40)
        assert info["mode"] == mode and info["experts"] == len(keys)
        x, ids, gates = _route_rows(c, layer, 9, seed=1)
        mine = sorted({int(e) for e in ids.ravel() if (layer, int(e)) in set(keys)})
        reply, stats = w.compute(layer, mine, x, ids, gates)
        local = ResidentExperts(c, keys=keys)
        for e, rows, y in reply:
            want_rows, want = moe_ops.expert_output(x, ids, gates, e, local.get(layer, [e])[e])
            assert np.array_equal(rows, want_rows) and np.array_equal(y, want)
        assert stats["counters"]["requests"] == 1
        if mode == "streaming":
            assert stats["store"]["reads"] > 0
        with pytest.raises(ColibriError, match="not in this worker's share"):
            w.compute(layer, [1], x, ids, gates)
    finally:
        w.close()
    assert (tmp_path / "w" / ".coli_usage").exists()  # its own usage history


def _flip_expert_byte(d: Path, layer: int, expert: int) -> None:
    x = Container.open(d).expert(layer, expert)
    with open(x.path, "r+b") as fh:
        fh.seek(x.start + (x.end - x.start) // 3)
        b = fh.read(1)[0]
        fh.seek(x.start + (x.end - x.start) // 3)
        fh.write(bytes([b ^ 0x40]))


@pytest.mark.parametrize("mode", ["resident", "streaming"])
def test_a_worker_checks_its_reads_under_verify_reads(mode: str, tmp_path: Path) -> None:
    """--verify-reads was the coordinator's only: a worker on a damaged copy computed its
    experts from the damaged bytes (wrong tokens, no error). Its loads and reads are checked
    now: an error naming the expert, as in one process."""
    import shutil

    d = Path(shutil.copytree(_demo(), tmp_path / "m"))
    c = Container.open(d)
    layer = c.expert_layers()[0]
    _flip_expert_byte(d, layer, 0)
    keys = [(layer, e) for e in range(c.arch.n_routed_experts)]
    full = plan_layout(c, None, top_k=c.arch.top_k)
    budget = 1 << 40 if mode == "resident" else (full.transient_slots + 3) * full.slot_bytes
    plain = ExpertWorker(d, probe_s=0)  # (without the check: loads, computes what is there)
    try:
        plain.load(keys, budget)
    finally:
        plain.close()
    w = ExpertWorker(d, probe_s=0, verify_reads=True)
    try:
        assert w.info()["verify_reads"]
        x = np.zeros((1, c.arch.hidden_size), np.float32)
        ids, gates = np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32)
        with pytest.raises(ColibriError, match=rf"(?i)layer {layer}.*expert 0|crc"):
            w.load(keys, budget)
            w.compute(layer, [0], x, ids, gates)
    finally:
        w.close()


def test_workers_on_other_model_files_are_refused(tmp_path: Path) -> None:
    """A worker whose --worker-model holds another conversion or another model gave its
    experts from other weights: wrong tokens, no error. Each worker reports its copy's
    fingerprint and the coordinator refuses any that differs from its own."""
    import shutil

    from runtime.cluster.ray_backend import _check_copies

    c = Container.open(_demo())
    same = Path(shutil.copytree(_demo(), tmp_path / "same"))
    other = Path(shutil.copytree(_demo(), tmp_path / "other"))
    # another model's weights: what it hashes (config, manifest, each shard's size, header and
    # tail) differs; here the config (a fine-tune of the same shape gets another manifest)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    infos = []
    for k, d in enumerate((same, other)):
        w = ExpertWorker(d, probe_s=0)
        infos.append({**w.info(), "host": f"h{k}"})
        w.close()
    _check_copies(c, infos[:1])  # the same files elsewhere: fine
    with pytest.raises(ColibriError, match=r"expert-worker-1 on h1 .*other.*not the same model"):
        _check_copies(c, infos)


def test_a_worker_with_every_shard_needs_no_model_dir_of_the_coordinator(tmp_path: Path) -> None:
    """The coordinator splits its shards over --model-dir directories; a worker's host holds
    the whole model in one directory and none of those: it was refused ("model directory
    ... does not exist"), though its files are the same (the identity check says so)."""
    import shutil

    from runtime.cluster.ray_backend import _check_copies

    full = Path(shutil.copytree(_demo(), tmp_path / "full"))
    main, extra = tmp_path / "main", tmp_path / "extra"
    shutil.copytree(_demo(), main)
    extra.mkdir()
    shutil.move(main / "out-mtp-00000.safetensors", extra / "out-mtp-00000.safetensors")
    coordinator = Container.open(main, shard_dirs=[extra])
    gone = tmp_path / "only-on-the-coordinator"
    w = ExpertWorker(full, model_dirs=[gone], probe_s=0)
    try:
        _check_copies(coordinator, [w.info()])
    finally:
        w.close()


def test_a_streaming_worker_spreads_its_reads_over_its_mirror(tmp_path: Path) -> None:
    """A worker's own disks: its model dir plus a ``--mirror`` copy, both serving reads."""
    import shutil

    mirror = tmp_path / "mirror"
    shutil.copytree(_demo(), mirror)
    c = Container.open(_demo())
    keys = [(la, e) for la in c.expert_layers() for e in range(c.arch.n_routed_experts)]
    full = plan_layout(c, None, top_k=c.arch.top_k)
    w = ExpertWorker(_demo(), mirrors=[mirror], reader="threads", state_dir=tmp_path / "w")
    try:
        w.load(keys, (full.transient_slots + 2) * full.slot_bytes)
        for layer in c.expert_layers():
            x, ids, gates = _route_rows(c, layer, 16, seed=layer)
            w.compute(layer, sorted({int(e) for e in ids.ravel()}), x, ids, gates)
        devices = w.info()["store"]["devices"]
        assert len(devices) == 2 and all(d["reads"] > 0 for d in devices), devices
    finally:
        w.close()


# ----------------------------------------------------------------------------- starting


def test_ray_init_keeps_the_sigterm_handler_and_starts_ray_unblocked() -> None:
    """Across ``ray.init``: Ray's core worker put its C++ failure handler on SIGTERM in the
    whole process (a SIGTERM then aborted it, 134, where `coli` exits 143 after its
    clean-up), and Ray's processes, started from an engine thread that blocks SIGTERM,
    blocked it too (each then waited a second for SIGKILL at shutdown, agents outlived it).
    Ray is not started here: what its init does to the process is (an OS-level handler)."""
    import ctypes
    import subprocess

    from runtime.cluster.ray_backend import _ray_init_signals

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as an engine thread
    try:
        try:
            with _ray_init_signals():
                libc.signal(signal.SIGTERM, 1)  # SIG_IGN behind Python's back, as Ray's does
                child = subprocess.run(["cat", "/proc/self/status"], capture_output=True,
                                       text=True, check=True).stdout  # fmt: skip
            assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        blocked = int(next(x for x in child.splitlines() if x.startswith("SigBlk:")).split()[1], 16)
        assert not blocked >> (signal.SIGTERM - 1) & 1, hex(blocked)  # Ray's children take it
        os.kill(os.getpid(), signal.SIGTERM)  # Python's handler again, not the one put there
        end = time.monotonic() + 5
        while not got and time.monotonic() < end:
            time.sleep(0.01)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_start_waiting_on_its_workers_gives_up_when_cancelled() -> None:
    """A start whose caller gave up (Ctrl-C while the workers load) stops waiting within
    ``START_POLL_S`` (then stops its workers and Ray): it waited on in its thread while the
    process exited, and the Ray it started outlived it."""
    import threading

    from runtime.cluster.ray_backend import START_POLL_S, StartCancelled, _gather

    class NeverReady:  # Ray's wait / get on workers that are still loading
        def wait(self, refs: list[Any], num_returns: int, timeout: float) -> Any:
            time.sleep(timeout)
            return [], refs

        def get(self, refs: list[Any], timeout: float | None = None) -> Any:
            raise AssertionError("not ready")

    cancelled = threading.Event()
    threading.Timer(0.2, cancelled.set).start()
    t0 = time.monotonic()
    with pytest.raises(StartCancelled, match="cancelled"):
        _gather(NeverReady(), ["w0", "w1"], cancelled)
    assert time.monotonic() - t0 < 0.2 + 5 * START_POLL_S


# ----------------------------------------------------------------------------- on Ray


def _opts(**kw: Any) -> EngineOptions:
    return EngineOptions(draft="off", **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process: logits of PROMPT and a greedy continuation."""
    state = tmp_path_factory.mktemp("ref-state")

    async def main() -> dict[str, Any]:
        async with Engine.open(options=_opts(state_dir=state, learn=False)) as eng:
            logits = await eng.forward(PROMPT)
            toks = [
                ev.token_id
                async for ev in eng.generate(PROMPT, max_new_tokens=40)
                if isinstance(ev, TokenEvent)
            ]
        return {"logits": logits, "tokens": toks}

    return anyio.run(main)


async def _generate(eng: Engine, n: int, on_token: Any = None) -> list[int]:
    toks: list[int] = []
    async for ev in eng.generate(PROMPT, max_new_tokens=n):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
            if on_token is not None:
                await on_token(len(toks))
    return toks


def _cluster(eng: Engine) -> dict[str, Any]:
    st = eng.stats()["cluster"]
    assert isinstance(st, dict)
    return st


@pytest.fixture
def no_leftover_ray() -> Iterator[None]:
    yield
    assert not ray.is_initialized(), "the engine must shut down the Ray it started"


def test_two_workers_give_identical_logits_and_greedy_tokens(
    reference: dict[str, Any], tmp_path: Path, no_leftover_ray: None
) -> None:
    async def main() -> None:
        opts = _opts(ray="local", expert_workers=2, state_dir=tmp_path, learn=False)
        async with Engine.open(options=opts) as eng:
            logits = await eng.forward(PROMPT)
            assert np.array_equal(logits, reference["logits"])
            assert await _generate(eng, 40) == reference["tokens"]
            st = _cluster(eng)
            assert [w["alive"] for w in st["workers"]] == [True, True]
            assert all(w["calls"] > 0 and w["experts_computed"] > 0 for w in st["workers"])
            assert st["fallback_experts"] == 0
            assert (
                sum(w["experts_owned"] for w in st["workers"])
                == len(eng.container.expert_layers()) * eng.container.arch.n_routed_experts
            )
            assert {w["mode"] for w in st["workers"]} == {"resident"}
            # several sequences in one batched step: each worker gets one request per layer
            # with the union of their rows, and every row is still the solo row
            async with anyio.create_task_group() as tg:
                outs: list[list[int]] = [[], [], []]

                async def one(i: int) -> None:
                    outs[i] = await _generate(eng, 40)

                for i in range(3):
                    tg.start_soon(one, i)
            assert outs == [reference["tokens"]] * 3
            assert eng.stats()["decode_batches"] > 0

    anyio.run(main)


def test_streaming_workers_give_identical_tokens(
    reference: dict[str, Any], tmp_path: Path, no_leftover_ray: None
) -> None:
    c = Container.open(_demo())
    full = plan_layout(c, None, top_k=c.arch.top_k)
    budget = (full.transient_slots + 2 * len(c.expert_layers())) * full.slot_bytes

    async def main() -> None:
        opts = _opts(
            ray="local", expert_workers=2, worker_ram=budget, state_dir=tmp_path, learn=False
        )
        async with Engine.open(options=opts) as eng:
            assert await _generate(eng, 40) == reference["tokens"]
            st = _cluster(eng)
            assert {w["mode"] for w in st["workers"]} == {"streaming"}
            assert all(w["reads"] > 0 and w["bytes_read"] > 0 for w in st["workers"])

    anyio.run(main)


async def _until_rejoined(eng: Engine, w: int, seconds: float) -> None:
    """Decode until worker ``w`` is alive again (Ray restarts it, it reloads its share)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await _generate(eng, 4)
        if _cluster(eng)["workers"][w]["alive"]:
            return
        await anyio.sleep(0.5)
    raise AssertionError(f"worker {w} did not rejoin: {_cluster(eng)['workers'][w]}")


def test_a_killed_worker_changes_no_token_and_rejoins(
    reference: dict[str, Any], tmp_path: Path, no_leftover_ray: None
) -> None:
    async def main() -> None:
        opts = _opts(ray="local", expert_workers=2, state_dir=tmp_path, learn=False)
        async with Engine.open(options=opts) as eng:
            assert eng._cluster is not None
            pid = (await anyio.to_thread.run_sync(eng._cluster.pids))[0]

            async def kill_at(n: int) -> None:
                if n == 10:
                    os.kill(pid, signal.SIGKILL)

            assert await _generate(eng, 40, kill_at) == reference["tokens"]
            st = _cluster(eng)
            w0 = st["workers"][0]
            assert w0["failures"] >= 1 and w0["fallback_experts"] > 0, w0
            # every expert computed here instead is counted against its worker (the series
            # counted only the step the worker failed in, far below the total)
            assert sum(w["fallback_experts"] for w in st["workers"]) == st["fallback_experts"], st
            await _until_rejoined(eng, 0, 90)
            before = _cluster(eng)["workers"][0]["calls"]
            assert await _generate(eng, 40) == reference["tokens"]
            w0 = _cluster(eng)["workers"][0]
            assert w0["rejoins"] >= 1 and w0["calls"] > before
            new_pid = (await anyio.to_thread.run_sync(eng._cluster.pids))[0]
            assert new_pid != pid  # Ray restarted the process

    anyio.run(main)


def test_a_frozen_worker_misses_its_deadline_without_changing_a_token(
    reference: dict[str, Any], tmp_path: Path, no_leftover_ray: None
) -> None:
    async def main() -> None:
        opts = _opts(
            ray="local", expert_workers=2, expert_timeout=0.5, state_dir=tmp_path, learn=False
        )
        async with Engine.open(options=opts) as eng:
            assert eng._cluster is not None
            pid = (await anyio.to_thread.run_sync(eng._cluster.pids))[1]
            try:

                async def freeze_at(n: int) -> None:
                    if n == 5:
                        os.kill(pid, signal.SIGSTOP)

                assert await _generate(eng, 40, freeze_at) == reference["tokens"]
                w1 = _cluster(eng)["workers"][1]
                assert w1["timeouts"] >= 1 and not w1["alive"], w1
            finally:
                os.kill(pid, signal.SIGCONT)
            await _until_rejoined(eng, 1, 30)
            assert await _generate(eng, 40) == reference["tokens"]
            assert _cluster(eng)["workers"][1]["rejoins"] >= 1

    anyio.run(main)


def test_workers_run_the_coordinators_kernel_mode(tmp_path: Path, no_leftover_ray: None) -> None:
    """With --kernels fast-int8 (lossy, opt-in) the workers computed their experts exact: the
    logits matched neither the one-process fast-int8 run nor the exact one. The workers run
    the coordinator's mode, and report it."""

    async def logits(**kw: Any) -> tuple[Any, Any]:
        opts = _opts(state_dir=tmp_path, learn=False, kernels="fast-int8", **kw)
        async with Engine.open(options=opts) as eng:
            out = await eng.forward(PROMPT)
            return out, (_cluster(eng) if kw else None)

    one, _ = anyio.run(logits)
    got, st = anyio.run(lambda: logits(ray="local", expert_workers=1))
    assert np.array_equal(got, one)
    assert {w["kernels"]["mode"] for w in st["workers"]} == {"fast-int8"}, st["workers"]


def test_closing_one_of_two_engines_on_one_ray_leaves_the_other_working(
    reference: dict[str, Any], tmp_path: Path, no_leftover_ray: None
) -> None:
    """Two models with ray="local" in one process share Ray's runtime; closing the one that
    started it shut Ray down under the other, whose next step hung for a minute and crashed
    the process (the open-the-new-model-then-close-the-old-one pattern)."""
    import colibri

    kw = dict(ray="local", expert_workers=1, state_dir=tmp_path, learn=False, draft="off")
    first_cm, second_cm = colibri.open_model(**kw), colibri.open_model(**kw)
    first_cm.__enter__()  # starts Ray
    try:
        second = second_cm.__enter__()  # joins it
    finally:
        first_cm.__exit__(None, None, None)  # the one that started Ray closes first
    try:
        assert ray.is_initialized()
        assert second.generate(PROMPT, max_new_tokens=40) == reference["tokens"]
    finally:
        second_cm.__exit__(None, None, None)
