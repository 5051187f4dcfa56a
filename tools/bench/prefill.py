"""Expert-major chunked prefill on the synthetic GLM-5-geometry model, RAM budget < 25% experts.

For 1k and 4k-token prompts it measures TTFT, bytes read per prompt token, and the figure:
bytes read during prefill / bytes of the distinct experts each chunk routes to (summed over
chunks; <= 1.0 means each needed expert was read at most once per chunk, less when some were
already resident). In the same run it measures plain token-by-token prefill (each token its own
forward: every token re-reads its experts) on a sample of the prompt and extrapolates its TTFT
linearly (stated as such: running it to 4k tokens would take many minutes).

    python tools/bench/prefill.py [--model /var/tmp/colibri-synth] [--lengths 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
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
from colibri._engine import TokenEvent  # noqa: E402
from storage.container import Container  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import share  # noqa: E402
from _synth import budget_for, ensure_synthetic  # noqa: E402


async def run_prefill(
    path: Path,
    prompt: list[int],
    chunk: int | None,
    budget: int,
    fast: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    opts = colibri.EngineOptions(
        model=path,
        ram_budget=budget,
        learn=False,
        prefill_chunk=chunk,
        prefetch=False,
        fast_prefill=fast,
        threads=threads,
    )
    async with colibri.Engine.open(options=opts) as eng:
        store = eng._store
        per_chunk: list[set[tuple[int, int]]] = []
        rows = [0]

        def observe(event: str, layer: int, arr: Any) -> None:
            if event != "route":
                return
            if layer == min(store._lru):  # first MoE layer opens a new forward (chunk)
                per_chunk.append(set())
                rows[0] = int(np.asarray(arr).shape[0])
            per_chunk[-1].update((layer, int(e)) for e in np.unique(arr))

        s0 = dict(store.stats.as_dict())
        t0 = time.perf_counter()
        with eng._scheduler.observing(observe):
            async for ev in eng.generate(prompt, max_new_tokens=1):
                if isinstance(ev, TokenEvent):
                    ttft = time.perf_counter() - t0
        s1 = store.stats.as_dict()
        per_expert = (s1["bytes_read"] - s0["bytes_read"]) / max(
            1, s1["experts_read"] - s0["experts_read"]
        )
        st = eng.stats()
    distinct = sum(len(x) for x in per_chunk)
    read = st["prefill_bytes_read"]
    return {
        "ttft_s": round(ttft, 3),
        "prefill_tokens_per_s": round(len(prompt) / st["prefill_seconds"], 3),
        "bytes_read": int(read),
        "bytes_per_prompt_token": int(read / len(prompt)),
        "distinct_expert_bytes": int(distinct * per_expert),
        "ratio_read_to_distinct": round(read / (distinct * per_expert), 3) if distinct else None,
        "chunks": st["prefill_chunks"],
        "chunk": eng._scheduler.prefill_chunk,
        "fast_prefill": fast,
        "threads": eng._scheduler.ctx.compute.threads,
        "hit_rate": round(s1["hit_rate"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/var/tmp/colibri-synth"))
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--chunk", type=int, default=None, help="default: the planned chunk")
    ap.add_argument(
        "--modes",
        default="exact,fast",
        help="exact (bit-identical kernels) and/or fast (fast_prefill: dequantize + BLAS)",
    )
    ap.add_argument("--threads", type=int, default=None, help="default: one per CPU")
    ap.add_argument("--fraction", type=share, default=0.2)
    ap.add_argument("--baseline-sample", type=int, default=64)
    a = ap.parse_args(argv)
    ensure_synthetic(a.model)
    c = Container.open(a.model)
    budget = budget_for(c, a.model, a.fraction)
    vocab = c.arch.vocab_size
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in a.lengths.split(",")]
    prompt = [int(x) for x in rng.integers(2, vocab, size=max(lengths))]

    # Baseline: token-by-token prefill on a sample, extrapolated per token.
    sample = prompt[: a.baseline_sample]  # (no longer than the longest --lengths prompt)
    base = anyio.run(run_prefill, a.model, sample, 1, budget, False, a.threads)
    # per token it ran: divided by --baseline-sample when the prompt was shorter, the
    # token-by-token rate came out too fast and every speedup too low (2.3 for 4.6)
    per_token_s = base["ttft_s"] / len(sample)
    print(f"token by token: {base}", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    for mode in a.modes.split(","):
        for n in lengths:
            r = anyio.run(
                run_prefill, a.model, prompt[:n], a.chunk, budget, mode == "fast", a.threads
            )
            r["token_by_token_ttft_s_extrapolated"] = round(per_token_s * n, 1)
            r["speedup_vs_token_by_token"] = round(per_token_s * n / r["ttft_s"], 2)
            results[f"{mode}-{n}"] = r
            print(f"{mode} {n} tokens: {r}", file=sys.stderr, flush=True)
    worst = max(r["ratio_read_to_distinct"] or 0 for r in results.values())
    longest = max(lengths)
    out = {
        "figure": worst,
        "speedup_at_longest": {
            k: v["speedup_vs_token_by_token"]
            for k, v in results.items()
            if k.endswith(f"-{longest}")
        },
        "results": results,
        "token_by_token_sample": {"tokens": len(sample), **base},
        "ram_budget_bytes": budget,
        "experts_total_bytes": sum(x.nbytes for x in c.expert_extents()),
        "machine": f"{os.cpu_count()} cpu, {platform.machine()}, {platform.release()}",
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
