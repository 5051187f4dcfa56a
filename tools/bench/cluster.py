"""Scale-out decode: 2 Ray expert workers holding the experts in RAM vs 1 streaming process.

On the synthetic GLM-5-geometry model (built on first use, ~16 GiB of experts), in one run:

* **1 process** streaming under a RAM budget that holds ``--fraction`` (default 25%) of the
  experts: what one box with that much RAM gets (measured before and after the cluster run,
  averaged: the disk drifts);
* **N Ray workers** (``--workers``, default 2) started on this machine (``--ray local``), each
  holding its share of the experts in RAM; the coordinator keeps the dense part.

The figure is cluster decode tokens/s over the 1-process tokens/s. The JSON also carries Ray's
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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

import colibri  # noqa: E402
from storage.container import Container  # noqa: E402

PROMPT = [1, 2, 3, 4]


def drop_caches() -> bool:
    if os.geteuid() != 0:
        return False
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")
    return True


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
            # the workers run in parallel: per token, the slower of the concurrent calls
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
    plain actor calls (what the engine uses, same inline setting) and as a compiled graph."""
    import logging

    import ray
    from ray.dag import InputNode, MultiOutputNode

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

        actor = ray.remote(num_cpus=0)(Echo)
        es = [actor.remote() for _ in range(workers)]
        blob = bytes(request)
        ray.get([e.answer.remote(blob) for e in es])
        t0 = time.perf_counter()
        for _ in range(n):
            ray.get([e.answer.remote(blob) for e in es])
        plain = (time.perf_counter() - t0) / n
        with InputNode() as inp:
            dag = MultiOutputNode([e.answer.bind(inp[i]) for i, e in enumerate(es)])
        compiled = dag.experimental_compile()
        try:
            for _ in range(5):
                ray.get(compiled.execute(*[blob] * workers))
            t0 = time.perf_counter()
            for _ in range(n):
                ray.get(compiled.execute(*[blob] * workers))
            cg = (time.perf_counter() - t0) / n
        finally:
            compiled.teardown()
    finally:
        ray.shutdown()
    return {"plain_ms": 1e3 * plain, "compiled_graph_ms": 1e3 * cg}


def workers_of(c: dict[str, Any]) -> list[Any]:
    return list(c["workers"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/var/tmp/colibri-synth"))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--fraction", type=float, default=0.25, help="share of experts 1 process holds")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ray", default="local")
    ap.add_argument("--reader", default="auto")
    a = ap.parse_args(argv)

    if not (a.model / "config.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "make_synthetic.py"), "--out", str(a.model)],
            check=True,
        )
    c = Container.open(a.model)
    n_experts = len(c.expert_extents())

    from colibri._config import EngineOptions
    from colibri._engine import _plan
    from runtime.budget import kv_bytes_per_token, resident_nbytes

    probe_opts = EngineOptions(model=a.model, ram_budget=1 << 50, learn=False)
    model, layout, _ = anyio.run(_plan, c, probe_opts)
    dense = resident_nbytes(model.weights)
    kv = kv_bytes_per_token(c.arch) * 4096
    del model
    budget = int(dense + kv + a.fraction * n_experts * layout.slot_bytes)

    single_before = decode(a.model, a.tokens, ram_budget=budget, reader=a.reader)
    clustered = decode(a.model, a.tokens, ray=a.ray, expert_workers=a.workers, reader=a.reader)
    single_after = decode(a.model, a.tokens, ram_budget=budget, reader=a.reader)
    one = (single_before["tokens_per_s"] + single_after["tokens_per_s"]) / 2
    d = c.arch.hidden_size
    # a decode step's request (1 row, its routing) and reply (K / workers experts x D floats)
    trips = round_trips(a.workers, 4 * d + 64, 4 * d * c.arch.top_k // a.workers + 64)
    same = clustered["ids"] == single_before["ids"] == single_after["ids"]
    for r in (single_before, clustered, single_after):
        r.pop("ids")
    result = {
        "figure": round(clustered["tokens_per_s"] / one, 3),
        "cluster_tokens_per_s": round(clustered["tokens_per_s"], 3),
        "single_tokens_per_s": round(one, 3),
        "single_tokens_per_s_before_after": [
            round(single_before["tokens_per_s"], 3),
            round(single_after["tokens_per_s"], 3),
        ],
        "same_tokens": same,
        "overhead_ms_per_token": round(clustered["cluster"]["overhead_ms_per_token"], 3),
        "overhead_ms_per_call": round(clustered["cluster"]["overhead_ms_per_call"], 3),
        # Ray alone, decode-sized messages: plain calls (used) vs a compiled graph (not used:
        # see docs/cluster.md, "Compiled graphs")
        "ray_round_trip_ms": {k: round(v, 3) for k, v in trips.items()},
        # one round trip per MoE layer and token: Ray's share of a token's time
        "ray_overhead_ms_per_token": round(
            trips["plain_ms"] * clustered["cluster"]["calls_per_token"] / a.workers, 3
        ),
        "ray_overhead_share_of_token": round(
            trips["plain_ms"]
            * clustered["cluster"]["calls_per_token"]
            / a.workers
            / (1e3 / clustered["tokens_per_s"]),
            4,
        ),
        "single": single_before,
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
