"""Streaming decode on the synthetic GLM-5-geometry model against its I/O bound.

With a RAM budget that holds < 25% of the experts, decode is bound by storage: each token must
read the experts it misses. In the same run this measures

* storage GB/s: cold random expert-shaped reads through the same reader backend, the better of
  one and two at a time (the decode has up to two demand reads in flight), before every decode
  run and after the last (the disk drifts minute to minute, on some virtual disks 2x);
* decode tokens/s and bytes read per decoded token (engine counters);
* each run's I/O bound: the mean of the storage GB/s measured right before and right after it
  / bytes per token, in tokens/s;
* after the last run, storage GB/s while another thread streams memory (as the expert
  compute does while reads are in flight), alternating with the memory idle:
  ``storage_memory_busy_ratio`` (busy / idle), and ``figure`` against a bound scaled by that
  ratio, ``figure_memory_busy_bound`` (on a virtual disk the host's copy into guest memory
  competes with the guest's own memory traffic), and the same with one such thread per CPU
  (the decode computes on all of them): ``figure_memory_busy_all_cpus_bound``.

One turn before the first round is not counted (a process's first decode loads kernels that
prefill does not use). A run's figure is achieved / its bound (1.0 = compute and every other
cost fully hidden behind reads); ``figure`` is the chosen mode's median run figure.
The same run also decodes with the other ``--prefetch`` modes, ``--rounds`` times each,
interleaved in an order that rotates each round (each mode's median run stands for it):
``figure_vs_no_prefetch`` is the chosen mode's tokens/s over ``off``'s,
``figure_vs_best_forced`` over the better of ``on`` and ``off``; ``time`` is where the
measured turn's wall time went (``stats()["time"]``).

The compute bound: the same turn decoded twice with every expert resident (before the first
round and after the last; skipped where the experts do not fit in free memory, or with
``--no-compute-bound``), ``compute_bound_tokens_per_s``; ``figure_vs_attainable`` is the
figure's run against the lower of its I/O bound and that compute bound (1.0: the decode is at
what this machine allows, whichever of disk and compute that is).

    python tools/bench/stream.py [--model /var/tmp/colibri-synth] [--tokens 24] [--fraction 0.2]
        [--prefetch auto|on|off] [--rounds 6] [--predictable]

``--model`` may be any converted model (the demo model under a small ``--fraction``: a trained
model's consecutive tokens share experts, but at that size it is compute-bound).
``--predictable`` uses the synthetic model whose layer L state predicts layer L+1's experts:
disk-bound, with predictable routing, the case where lookahead should pay.

The synthetic models are built on first use (3 MoE layers x 256 experts, ~16 GiB, about a minute
per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import numpy as np  # noqa: E402

import colibri  # noqa: E402
from storage.aligned import aligned_empty  # noqa: E402
from storage.container import Container  # noqa: E402
from storage.reader import ReadRequest, open_reader, required_size  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import add_tokens, positive, share  # noqa: E402
from _memory import read_sum  # noqa: E402
from _synth import budget_for, drop_caches, ensure_synthetic  # noqa: E402


async def storage_gbps(
    c: Container, reader_kind: str, n: int, seed: int, depth: int = 1
) -> tuple[float, str]:
    """Cold random whole-expert reads, ``depth`` at a time (the decode path reads a layer's
    misses a few at a time: its read depth is 2)."""
    rng = random.Random(seed)
    extents = c.expert_extents()
    picks = [extents[rng.randrange(len(extents))] for _ in range(n)]
    drop_caches()
    reader = await open_reader(reader_kind, probe_path=picks[0].path)  # type: ignore[arg-type]
    try:
        size = max(required_size(ReadRequest(x.path, x.start, x.nbytes)) for x in picks)
        bufs = [aligned_empty(size) for _ in range(depth)]
        total = 0
        t0 = time.perf_counter()
        for i in range(0, len(picks), depth):
            batch = picks[i : i + depth]
            async with anyio.create_task_group() as tg:
                for x, buf in zip(batch, bufs, strict=False):
                    tg.start_soon(reader.read_into, ReadRequest(x.path, x.start, x.nbytes), buf)
            total += sum(x.nbytes for x in batch)
        dt = time.perf_counter() - t0
        return total / dt / 1e9, reader.name
    finally:
        await reader.aclose()


def disk_gbps(c: Container, reader_kind: str, n: int, seed: int) -> tuple[float, str, list[float]]:
    """The disk's rate for expert reads: the better of one and two reads at a time (the decode
    reads up to two demand reads at once, so one at a time alone would understate the disk and
    the bound could be beaten)."""
    one, backend = anyio.run(storage_gbps, c, reader_kind, n, seed, 1)
    two, _ = anyio.run(storage_gbps, c, reader_kind, n, seed + 100, 2)
    return max(one, two), backend, [round(one, 3), round(two, 3)]


def disk_gbps_memory_busy(
    c: Container, reader_kind: str, n: int, seed: int, threads: int = 1
) -> float:
    """:func:`disk_gbps` while ``threads`` other threads stream memory, as a decode's expert
    compute does between and during reads. On a virtual disk the host copies what it reads
    into guest memory, so that copy and the guest's own memory traffic share one bandwidth:
    measured on a 2-vCPU guest, 2.05 GB/s against 2.3-2.5 with the memory idle (a thread
    computing in cache took nothing from it); on a 2-vCPU Firecracker guest 2.9-3.3 GB/s
    beside one such thread and 1.8-2.4 beside two, against 4.1-4.9 idle."""
    a = np.ones(32 << 20, dtype=np.uint64)  # 256 MiB: far beyond the caches
    read_sum(a[:8])  # (compiled before the clock matters)
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            read_sum(a)

    ts = [
        threading.Thread(target=traffic, name=f"memory-traffic-{i}", daemon=True)
        for i in range(threads)
    ]
    for t in ts:
        t.start()
    try:
        return disk_gbps(c, reader_kind, n, seed)[0]
    finally:
        stop.set()
        for t in ts:
            t.join()


def decode_run(a: argparse.Namespace, budget: int, prefetch: str) -> dict[str, Any]:
    """One cold decode turn under ``prefetch``: tier counters before and after, seconds,
    tokens and the time breakdown of the measured turn."""
    drop_caches()
    opts = {"reader": a.reader, "learn": False, "prefetch": prefetch}
    with colibri.open_model(a.model, ram_budget=budget, **opts) as m:
        m.generate([1, 2, 3, 4], max_new_tokens=1)  # prefill + warm-up
        s0 = m.stats()["experts"]
        t_0 = m.stats()["time"]
        t0 = time.perf_counter()
        # Sampling at temperature 1 from a random model gives varied tokens and so varied
        # routing (greedy decoding of random weights repeats itself and would hit the cache).
        toks = m.generate([1, 2, 3, 4], max_new_tokens=a.tokens + 1, temperature=1.0, seed=3)
        dt = time.perf_counter() - t0
        s1 = m.stats()["experts"]
        t_1 = m.stats()["time"]
    spent = {k: round(t_1[k] - t_0[k], 3) for k in t_1}
    return {"s0": s0, "s1": s1, "seconds": dt, "tokens": len(toks), "time": spent}


def resident_run(a: argparse.Namespace) -> tuple[float | None, str]:
    """The same turn with every expert in RAM (the automatic plan, no budget): what this
    machine decodes when reads cost nothing, the decode's compute bound. (tokens/s, "") or
    (None, why) when the experts do not fit in the memory this machine has now (the plan then
    streams them)."""
    drop_caches()
    opts = {"reader": a.reader, "learn": False, "prefetch": "off"}
    with colibri.open_model(a.model, **opts) as m:
        if m.engine._store is not None:
            return None, "the experts do not fit in this machine's memory (the plan streams them)"
        m.generate([1, 2, 3, 4], max_new_tokens=1)  # prefill + warm-up, as decode_run
        t0 = time.perf_counter()
        toks = m.generate([1, 2, 3, 4], max_new_tokens=a.tokens + 1, temperature=1.0, seed=3)
        return len(toks) / (time.perf_counter() - t0), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the synthetic model")
    ap.add_argument(
        "--predictable",
        action="store_true",
        help="the synthetic model with predictable routing (make_synthetic.py --predictable, "
        "built at /var/tmp/colibri-synth-predictable on first use): the disk-bound case where "
        "lookahead should pay",
    )
    add_tokens(ap, 24)
    ap.add_argument("--fraction", type=share, default=0.2, help="share of experts the budget holds")
    ap.add_argument("--reader", default="auto")
    ap.add_argument("--reads", type=positive, default=60)
    ap.add_argument("--prefetch", choices=("auto", "on", "off"), default="auto")
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="decode runs per mode, interleaved; tokens/s are the medians (the machine drifts)",
    )
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_const", const="off")
    ap.add_argument(
        "--no-compute-bound",
        dest="compute_bound",
        action="store_false",
        help="skip the two resident decodes (every expert in RAM) that measure the compute "
        "bound (they need the experts' size in free memory, ~14.5 GB for the synthetic model)",
    )
    a = ap.parse_args(argv)

    if a.model is None:
        a.model = Path("/var/tmp/colibri-synth" + "-predictable" * a.predictable)
    ensure_synthetic(a.model, a.predictable)  # (a converted model's directory is left as is)
    c = Container.open(a.model)
    n_experts = len(c.expert_extents())
    experts_bytes = sum(x.nbytes for x in c.expert_extents())
    budget = budget_for(c, a.model, a.fraction)  # dense + KV reserve + `fraction` of experts

    # A turn that is not counted: the first decode of a process loads (or, right after an
    # install or a change, compiles) the kernels that prefill does not use, which cost the
    # first measured run 4 s once (4.0 tok/s against 14-16 for every later run).
    print("warm-up turn (not counted)", file=sys.stderr, flush=True)
    decode_run(a, budget, a.prefetch)
    # The compute bound: the same turn with every expert resident, before the first round and
    # after the last (the machine drifts too). Where the decode reaches it, the disk is not
    # what holds it back, whatever ``figure`` says.
    resident: list[float] = []
    resident_why = "skipped (--no-compute-bound)"
    if a.compute_bound:
        print("resident turn (the compute bound)", file=sys.stderr, flush=True)
        tps0, resident_why = resident_run(a)
        if tps0 is not None:
            resident.append(tps0)

    # The disk is measured before every decode run and after the last: a run's bound is the
    # mean of the measurements on either side of it, so a disk that drifts (2x within minutes
    # on some virtual disks) moves the bound with the run it bounds.
    gb_first, backend, by_depth_first = disk_gbps(c, a.reader, a.reads, 1)
    disk = [gb_first]  # disk[i] is measured right before run i, disk[-1] after the last
    # The chosen mode, and in the same run the other modes to compare with (interleaved, so
    # the disk's drift touches them alike).
    modes = [a.prefetch] + [m for m in ("off", "on") if m != a.prefetch]
    all_runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    in_order: list[dict[str, Any]] = []
    for r in range(max(1, a.rounds)):
        # the order rotates round by round, so no mode always runs first (or right after
        # another particular one)
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
            if in_order:
                disk.append(disk_gbps(c, a.reader, a.reads, 1 + len(disk))[0])
            run = decode_run(a, budget, m)
            all_runs[m].append(run)
            in_order.append(run)
    gb_last, _, by_depth_last = disk_gbps(c, a.reader, a.reads, 1 + len(disk))
    disk.append(gb_last)
    if resident:
        print("resident turn (the compute bound)", file=sys.stderr, flush=True)
        tps1, resident_why = resident_run(a)
        if tps1 is not None:
            resident.append(tps1)
    compute_bound = sum(resident) / len(resident) if resident else None
    # memory busy against idle, in adjacent pairs (the disk drifts): idle (the last
    # measurement above), busy, idle, busy
    seed = 1 + len(disk)
    busy = [disk_gbps_memory_busy(c, a.reader, a.reads, seed)]
    idle = [gb_last, disk_gbps(c, a.reader, a.reads, seed + 1)[0]]
    busy.append(disk_gbps_memory_busy(c, a.reader, a.reads, seed + 2))
    busy_ratio = sum(busy) / sum(idle)
    # and while as many threads stream memory as the decode computes on (its pool's workers,
    # all of this machine's CPUs by default), against the disk idle right after
    cpus = len(os.sched_getaffinity(0))
    busy_all = disk_gbps_memory_busy(c, a.reader, a.reads, seed + 3, cpus)
    idle_all = disk_gbps(c, a.reader, a.reads, seed + 4)[0]
    for i, run in enumerate(in_order):
        run["gbps"] = (disk[i] + disk[i + 1]) / 2
    gbps = sum(disk) / len(disk)

    def per_token(run: dict[str, Any]) -> float:
        """Bytes the decode needed per token of the turn (prefill of 4 + decode): demand misses
        and the lookahead reads it used; lookahead reads it never used are counted apart
        (they cost bandwidth, not need; a piece stopped part-way counts what it read)."""
        s0, s1 = run["s0"], run["s1"]
        read = s1["bytes_read"] - s0["bytes_read"]
        return (
            float(read - (s1["prefetch_wasted_bytes"] - s0["prefetch_wasted_bytes"]))
            / run["tokens"]
        )

    def io_bound(run: dict[str, Any]) -> float:
        """The run's own I/O bound, tokens/s: its disk rate / the bytes it needed per token."""
        need = per_token(run)
        return float(run["gbps"] * 1e9 / need) if need else float("inf")

    def figure(run: dict[str, Any]) -> float:
        """The run's tokens/s over its own I/O bound."""
        return float(run["tokens"] / run["seconds"] / io_bound(run))

    # each mode's median run (by tokens/s) stands for it: a run of its own (its numbers then
    # recompute the figure), the lower of the middle two with an even count of rounds (the
    # upper one, taken before, leaned every mode's figure high)
    def mid(n: int) -> int:
        return (n - 1) // 2

    runs = {
        m: sorted(rs, key=lambda r: r["tokens"] / r["seconds"])[mid(len(rs))]
        for m, rs in all_runs.items()
    }
    # and its median run by figure for the figure
    figures = {m: sorted(figure(r) for r in rs)[mid(len(rs))] for m, rs in all_runs.items()}

    main_run = runs[a.prefetch]
    # the run whose figure is the median (another run than the median tokens/s one, often):
    # its own numbers, so that the figure can be recomputed from the JSON
    fig_run = sorted(all_runs[a.prefetch], key=figure)[mid(len(all_runs[a.prefetch]))]
    s0, s1, dt, steps = main_run["s0"], main_run["s1"], main_run["seconds"], main_run["tokens"]
    read = s1["bytes_read"] - s0["bytes_read"]
    wasted = s1["prefetch_wasted_bytes"] - s0["prefetch_wasted_bytes"]
    achieved = steps / dt
    resident_share = (s1["lru_slots_per_layer"] * len(c.expert_layers()) + s1["pinned"]) / n_experts
    tps = {m: r["tokens"] / r["seconds"] for m, r in runs.items()}
    result = {
        "figure": round(figures[a.prefetch], 3),
        "figure_vs_no_prefetch": round(tps[a.prefetch] / tps["off"], 3),
        "figure_vs_best_forced": round(tps[a.prefetch] / max(tps["on"], tps["off"]), 3),
        "figure_by_prefetch": {m: round(v, 3) for m, v in figures.items()},
        # figure = tokens_per_s / io_bound_tokens_per_s of this run (the median by figure)
        "figure_run": {
            "round": all_runs[a.prefetch].index(fig_run) + 1,
            "tokens_per_s": round(fig_run["tokens"] / fig_run["seconds"], 3),
            "io_bound_tokens_per_s": round(io_bound(fig_run), 3),
        },
        # the fields below, up to "tokens", describe the median tokens/s run of the chosen mode
        "details_run": all_runs[a.prefetch].index(main_run) + 1,
        "figure_rounds": {m: [round(figure(r), 3) for r in rs] for m, rs in all_runs.items()},
        "tokens_per_s": round(achieved, 3),
        "tokens_per_s_by_prefetch": {m: round(v, 3) for m, v in tps.items()},
        "tokens_per_s_rounds": {
            m: [round(r["tokens"] / r["seconds"], 3) for r in rs] for m, rs in all_runs.items()
        },
        # the median tokens/s run's own bound
        "io_bound_tokens_per_s": round(io_bound(main_run), 3),
        "storage_gbps": round(gbps, 3),
        # every measurement, in order: before the first run, between runs, after the last
        "storage_gbps_runs": [round(g, 3) for g in disk],
        "storage_gbps_before_after": [round(disk[0], 3), round(disk[-1], 3)],
        # [one read at a time, two at a time], first and last measurement
        "storage_gbps_by_depth": [by_depth_first, by_depth_last],
        # after the last run, while another thread streams memory (as expert compute does)
        # and not, alternately: [idle, busy, idle, busy]; the ratio of their means scales the
        # bound to what a decode could reach with reads and compute perfectly overlapped, on
        # a disk that shares memory bandwidth with the compute
        "storage_gbps_memory_busy_pairs": [
            round(g, 3) for g in (idle[0], busy[0], idle[1], busy[1])
        ],
        "storage_memory_busy_ratio": round(busy_ratio, 3),
        "figure_memory_busy_bound": round(figures[a.prefetch] / busy_ratio, 3),
        # the same with one memory-streaming thread per CPU, as the decode's expert compute
        # runs on every CPU: [busy, idle] and the figure against the bound scaled by busy/idle
        "storage_gbps_memory_busy_all_cpus": [round(busy_all, 3), round(idle_all, 3)],
        "figure_memory_busy_all_cpus_bound": round(figures[a.prefetch] / (busy_all / idle_all), 3),
        # the same turn with every expert resident (before the first round, after the last):
        # what the decode reaches when reads cost nothing; None where they do not fit in RAM
        "compute_bound_tokens_per_s": None if compute_bound is None else round(compute_bound, 3),
        "compute_bound_runs": [round(x, 3) for x in resident],
        "compute_bound_reason": resident_why or None,
        # the figure's run against the lower of its two bounds (1.0: at what this machine
        # allows, disk or compute); None without the compute bound
        "figure_vs_attainable": None
        if compute_bound is None
        else round(
            fig_run["tokens"] / fig_run["seconds"] / min(io_bound(fig_run), compute_bound), 3
        ),
        "bytes_missed_per_token": int(per_token(main_run)),
        "bytes_read_per_token": int(read / steps),
        "hit_rate": round(s1["hit_rate"], 3),
        "lookahead_recall": None
        if s1["lookahead_recall"] is None
        else round(s1["lookahead_recall"], 3),
        "prefetch_issued_used_wasted": [
            s1["prefetch_issued"] - s0["prefetch_issued"],
            s1["prefetch_used"] - s0["prefetch_used"],
            s1["prefetch_wasted"] - s0["prefetch_wasted"],
        ],
        "prefetch_aborted": s1["prefetch_aborted"] - s0["prefetch_aborted"],
        "bytes_wasted_per_token": int(wasted / steps),
        "lookahead_saved_cost_s": [
            round(s1["lookahead_saved_s"] - s0["lookahead_saved_s"], 3),
            round(s1["lookahead_cost_s"] - s0["lookahead_cost_s"], 3),
        ],
        "lookahead_layers_off": s1["lookahead_layers_off"],
        # where the decode's wall time went (stats()["time"] over the measured turn)
        "time": main_run["time"],
        # the share of the measured turn the compute waited on reads: near 0, the decode is
        # bound by compute and the figure says how much faster than the disk it could go
        "read_wait_share": round(
            (main_run["time"]["read_wait_demand_s"] + main_run["time"]["read_wait_lookahead_s"])
            / dt,
            3,
        ),
        "time_by_prefetch": {m: r["time"] for m, r in runs.items()},
        "read_wait_s": round(s1["read_wait_s"] - s0["read_wait_s"], 3),
        "compute_stall_s": round(s1["compute_stall_s"] - s0["compute_stall_s"], 3),
        "seconds": round(dt, 3),
        "tokens": steps,
        "ram_budget_bytes": budget,
        "experts_resident_share": round(resident_share, 3),
        "experts_total_bytes": experts_bytes,
        "reader": backend,
        "prefetch": a.prefetch,
        "machine": f"{os.cpu_count()} cpu, {platform.machine()}, {platform.release()}",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
