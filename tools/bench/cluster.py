"""Scale-out decode: 2 Ray expert workers holding the experts in RAM vs 1 streaming process.

On the synthetic GLM-5-geometry model (built on first use, ~16 GiB of experts), in one run:

* **1 process** streaming under a RAM budget that holds ``--fraction`` (default 25%) of the
  experts: what one box with that much RAM gets;
* **N Ray workers** (``--workers``, default 2) started on this machine (``--ray local``), each
  holding its share of the experts in RAM; the coordinator keeps the dense part.

Runs are interleaved (single, cluster, single, ... ``--rounds`` cluster runs, one more single:
the disk drifts minute to minute). The figure is the median cluster decode tokens/s over the
median 1-process tokens/s. The JSON also carries Ray's
call overhead (per call and per token: each call's round trip minus the worker's own compute),
the time the coordinator blocked on replies, and the per-worker counters.

    python tools/bench/cluster.py [--model /var/tmp/colibri-synth] [--tokens 24]
        [--fraction 0.25] [--workers 2] [--ray local]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import colibri  # noqa: E402
from storage.container import Container  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import add_tokens, positive, share  # noqa: E402
from _synth import budget_for, drop_caches, ensure_synthetic  # noqa: E402

PROMPT = [1, 2, 3, 4]


def decode(model: Path, tokens: int, **opts: Any) -> dict[str, Any]:
    """Open, warm up (prefill + 1 token), then time a sampled decode turn."""
    drop_caches()
    t_open = time.perf_counter()
    with colibri.open_model(model, learn=False, draft="off", **opts) as m:
        opened = time.perf_counter() - t_open
        m.generate(PROMPT, max_new_tokens=1)
        s0 = m.stats()
        t0 = time.perf_counter()
        # temperature 1 on a random model: varied tokens, so varied routing (greedy repeats)
        toks = m.generate(PROMPT, max_new_tokens=tokens + 1, temperature=1.0, seed=3)
        dt = time.perf_counter() - t0
        s1 = m.stats()
    out: dict[str, Any] = {
        "tokens": len(toks),
        "seconds": dt,
        "tokens_per_s": len(toks) / dt,
        "open_s": opened,
        "ids": toks,
    }
    if "cluster" in s1:
        c0, c1 = s0["cluster"], s1["cluster"]
        calls = sum(w["calls"] for w in c1["workers"]) - sum(w["calls"] for w in c0["workers"])
        per_w = []
        overhead = 0.0
        for w0, w1 in zip(c0["workers"], c1["workers"], strict=True):
            n = w1["calls"] - w0["calls"]
            over = (
                w1["overhead_ms_mean"] * w1["calls"] - w0["overhead_ms_mean"] * w0["calls"]
            ) / 1e3
            overhead += over
            per_w.append(
                {
                    "name": w1["name"],
                    "calls": n,
                    "experts_owned": w1["experts_owned"],
                    "mode": w1["mode"],
                    "call_ms_mean": round(
                        (w1["call_ms_mean"] * w1["calls"] - w0["call_ms_mean"] * w0["calls"])
                        / max(n, 1),
                        3,
                    ),
                    "overhead_ms_mean": round(1e3 * over / max(n, 1), 3),
                    "failures": w1["failures"],
                    "timeouts": w1["timeouts"],
                }
            )
        out["cluster"] = {
            "calls": calls,
            "calls_per_token": calls / len(toks),
            "overhead_ms_per_call": 1e3 * overhead / max(calls, 1),
            # the workers run in parallel: per token, the mean worker's overhead (the total
            # over the workers' calls / workers), not the slower of each step's calls
            "overhead_ms_per_token": 1e3 * overhead / len(workers_of(c1)) / len(toks),
            "wait_ms_per_token": 1e3 * (c1["wait_s"] - c0["wait_s"]) / len(toks),
            "fallback_experts": c1["fallback_experts"] - c0["fallback_experts"],
            "workers": per_w,
        }
    else:
        e0, e1 = s0["experts"], s1["experts"]
        out["hit_rate"] = e1.get("hit_rate")
        out["bytes_read_per_token"] = (e1.get("bytes_read", 0) - e0.get("bytes_read", 0)) / len(
            toks
        )
    return out


def round_trips(workers: int, request: int, reply: int, n: int = 200) -> dict[str, float]:
    """Ray's own cost, apart from ours: one call to each of ``workers`` echo actors with a
    ``request``-byte argument and a ``reply``-byte answer (the sizes of a decode step), as
    plain actor calls (what the engine uses, same inline setting) and through one compiled
    graph per actor (independent, so a frozen actor would block only its own), plus the CPU
    an idle compiled-graph actor burns (its channel reader spins)."""
    import logging

    import ray
    from ray.dag import InputNode

    from runtime.cluster.ray_backend import INLINE_BYTES

    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _system_config={"max_direct_call_object_size": INLINE_BYTES},
    )
    try:

        class Echo:
            def answer(self, b: bytes) -> bytes:
                return bytes(reply)

            def cpu(self) -> float:
                return time.process_time()  # every thread of the actor's process

        actor = ray.remote(num_cpus=0)(Echo)
        es = [actor.remote() for _ in range(workers)]
        blob = bytes(request)
        ray.get([e.answer.remote(blob) for e in es])
        t0 = time.perf_counter()
        for _ in range(n):
            ray.get([e.answer.remote(blob) for e in es])
        plain = (time.perf_counter() - t0) / n
        graphs = []
        for e in es:
            with InputNode() as inp:
                node = e.answer.bind(inp)
            graphs.append(node.experimental_compile())
        try:
            for _ in range(5):
                [ray.get(r) for r in [g.execute(blob) for g in graphs]]
            t0 = time.perf_counter()
            for _ in range(n):
                [ray.get(r) for r in [g.execute(blob) for g in graphs]]
            cg = (time.perf_counter() - t0) / n
            c0 = ray.get([e.cpu.remote() for e in es])
            time.sleep(2.0)
            c1 = ray.get([e.cpu.remote() for e in es])
            idle = sum(b - a for a, b in zip(c0, c1, strict=True)) / len(es) / 2.0
        finally:
            for g in graphs:
                g.teardown()
    finally:
        ray.shutdown()
    return {
        "plain_ms": 1e3 * plain,
        "compiled_graph_ms": 1e3 * cg,
        "compiled_graph_idle_cpu_per_actor": idle,  # CPU-seconds per second, waiting
    }


def workers_of(c: dict[str, Any]) -> list[Any]:
    return list(c["workers"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/var/tmp/colibri-synth"))
    add_tokens(ap, 24)
    ap.add_argument("--fraction", type=share, default=0.25, help="share of experts 1 process holds")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ray", default="local")
    ap.add_argument("--reader", default="auto")
    ap.add_argument("--rounds", type=positive, default=2, help="cluster runs (singles: one more)")
    a = ap.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # before minutes of single-process runs
        why = "Ray is not installed: pip install -e '.[ray]'"
        print(why, file=sys.stderr)
        print(json.dumps({"figure": None, "figure_reason": why}))
        return 1

    ensure_synthetic(a.model)
    c = Container.open(a.model)
    budget = budget_for(c, a.model, a.fraction)  # 1 process: dense + KV + `fraction` of experts

    # Interleaved: single, cluster, single, cluster, ..., single (the disk drifts minute to
    # minute; the cluster is compute-bound). Medians of each.
    singles = [decode(a.model, a.tokens, ram_budget=budget, reader=a.reader)]
    clusters = []
    for _ in range(a.rounds):
        clusters.append(
            decode(a.model, a.tokens, ray=a.ray, expert_workers=a.workers, reader=a.reader)
        )
        singles.append(decode(a.model, a.tokens, ram_budget=budget, reader=a.reader))
    one = statistics.median(r["tokens_per_s"] for r in singles)
    many = statistics.median(r["tokens_per_s"] for r in clusters)
    d = c.arch.hidden_size
    # a decode step's request (1 row, its routing) and reply (K / workers experts x D floats)
    trips = round_trips(a.workers, 4 * d + 64, 4 * d * c.arch.top_k // a.workers + 64)
    same = all(r["ids"] == singles[0]["ids"] for r in singles + clusters)
    for r in singles + clusters:
        r.pop("ids")
    clustered = clusters[-1]
    calls_per_token = clustered["cluster"]["calls_per_token"]
    ray_ms = trips["plain_ms"] * calls_per_token / a.workers  # one round trip per MoE layer
    result = {
        "figure": round(many / one, 3),
        "cluster_tokens_per_s": round(many, 3),
        "single_tokens_per_s": round(one, 3),
        "cluster_tokens_per_s_runs": [round(r["tokens_per_s"], 3) for r in clusters],
        "single_tokens_per_s_runs": [round(r["tokens_per_s"], 3) for r in singles],
        "same_tokens": same,
        "overhead_ms_per_token": round(clustered["cluster"]["overhead_ms_per_token"], 3),
        "overhead_ms_per_call": round(clustered["cluster"]["overhead_ms_per_call"], 3),
        # Ray alone, decode-sized messages: plain calls (used) vs a compiled graph (not used:
        # see docs/cluster.md, "Compiled graphs")
        "ray_round_trip_ms": {k: round(v, 3) for k, v in trips.items() if k.endswith("_ms")},
        "compiled_graph_idle_cpu_per_actor": round(trips["compiled_graph_idle_cpu_per_actor"], 3),
        "ray_overhead_ms_per_token": round(ray_ms, 3),
        "ray_overhead_share_of_token": round(ray_ms / (1e3 / many), 4),
        "single": singles[0],
        "cluster": clustered,
        "single_ram_budget_bytes": budget,
        "single_experts_share": a.fraction,
        "workers": a.workers,
        "tokens": a.tokens,
        "machine": f"{os.cpu_count()} cpu, {platform.machine()}, {platform.release()}",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
