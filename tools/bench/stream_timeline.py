"""Where the disk idles during a streaming decode: a timeline of reads, expert computations
and MoE steps (``ExpertStore.trace``), summed into what the compute side was doing while no
read was on the device.

    python tools/bench/stream_timeline.py [--model /var/tmp/colibri-synth] [--tokens 21]
        [--fraction 0.2] [--prefetch off|on|auto] [--reader auto]

One cold decode turn (the page cache dropped first, when root), sampling at temperature 1 with
a fixed seed as ``stream.py`` does. Every instant of the measured turn is in exactly one bucket:

* ``disk_busy``: some read (a demand read, or a piece of a lookahead read) is on the device;
* ``idle_in_step_computing``: no read, inside a MoE step, an expert computing (typically the
  step's last arrival, after its reads all landed);
* ``idle_in_step_other``: no read, inside a MoE step, nothing computing (routing to the first
  read of the step, hand-offs);
* ``idle_between_steps``: no read, outside every MoE step (the next layer's attention and
  router, dense layers, ``lm_head``, sampling).

Printed per token and as shares of the turn, with two medians over the steps that read: how
long after a step began its first read reached the device, and how long the step ran on after
its last read landed. The last line is a JSON object whose ``figure`` is ``disk_busy`` / wall
time (1.0: the disk never idles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _args import add_tokens, share  # noqa: E402
from _synth import ROOT, budget_for, drop_caches, ensure_synthetic  # noqa: E402

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import colibri  # noqa: E402
from runtime.experts import TraceEvent  # noqa: E402
from storage.container import Container  # noqa: E402

Interval = tuple[float, float]


def union(iv: list[Interval]) -> list[Interval]:
    """Sorted, merged intervals."""
    out: list[Interval] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clip(iv: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def length(iv: list[Interval]) -> float:
    return sum(b - a for a, b in iv)


def minus(iv: list[Interval], cut: list[Interval]) -> list[Interval]:
    """``iv`` without ``cut`` (both merged)."""
    out: list[Interval] = []
    j = 0
    for a, b in iv:
        cur = a
        while j < len(cut) and cut[j][1] <= cur:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > cur:
                out.append((cur, cut[k][0]))
            cur = max(cur, cut[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def breakdown(events: list[TraceEvent], t0: float, t1: float) -> dict[str, float]:
    """Seconds of ``[t0, t1]`` in each bucket (see the module docstring)."""
    wall = [(t0, t1)]
    reads = union(clip([(e.t0, e.t1) for e in events if e.kind in ("read", "piece")], t0, t1))
    steps = union(clip([(e.t0, e.t1) for e in events if e.kind == "step"], t0, t1))
    comp = union(clip([(e.t0, e.t1) for e in events if e.kind == "compute"], t0, t1))
    idle = minus(wall, reads)
    in_step = minus(idle, minus(idle, steps))  # idle ∩ steps
    computing = minus(in_step, minus(in_step, comp))  # idle ∩ steps ∩ compute
    return {
        "disk_busy": length(reads),
        "idle_in_step_computing": length(computing),
        "idle_in_step_other": length(in_step) - length(computing),
        "idle_between_steps": length(idle) - length(in_step),
    }


def step_edges(events: list[TraceEvent]) -> dict[str, float | None]:
    """Medians over the steps that read: from the step's start to its first read on the
    device, and from its last read's completion to the step's end (the tail), in ms."""
    first: list[float] = []
    tail: list[float] = []
    reads = [e for e in events if e.kind == "read"]
    for s in (e for e in events if e.kind == "step"):
        mine = [r for r in reads if r.layer == s.layer and s.t0 <= r.t0 <= s.t1]
        if mine:
            first.append(min(r.t0 for r in mine) - s.t0)
            tail.append(s.t1 - max(r.t1 for r in mine))

    def median_ms(xs: list[float]) -> float | None:
        # None (JSON null) when no step read: a bare NaN is not JSON
        return round(1e3 * sorted(xs)[len(xs) // 2], 3) if xs else None

    return {"first_read_ms_p50": median_ms(first), "tail_ms_p50": median_ms(tail)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the synthetic model")
    add_tokens(ap, 21)
    ap.add_argument("--fraction", type=share, default=0.2, help="share of experts the budget holds")
    ap.add_argument("--prefetch", choices=("auto", "on", "off"), default="off")
    ap.add_argument("--reader", default="auto")
    a = ap.parse_args(argv)
    if a.model is None:
        a.model = Path("/var/tmp/colibri-synth")
        ensure_synthetic(a.model)
    c = Container.open(a.model)
    budget = budget_for(c, a.model, a.fraction)
    dropped = drop_caches()
    opts = {"reader": a.reader, "learn": False, "prefetch": a.prefetch}
    with colibri.open_model(a.model, ram_budget=budget, **opts) as m:
        store = m.engine._store
        if store is None:
            raise SystemExit("every expert fits in this budget: nothing streams (lower --fraction)")
        m.generate([1, 2, 3, 4], max_new_tokens=1)  # prefill + warm-up
        trace: list[TraceEvent] = []
        store.trace = trace
        t0 = time.perf_counter()
        toks = m.generate([1, 2, 3, 4], max_new_tokens=a.tokens + 1, temperature=1.0, seed=3)
        t1 = time.perf_counter()
        store.trace = None
    parts = breakdown(trace, t0, t1)
    wall = t1 - t0
    n = len(toks)
    counts = {k: sum(1 for e in trace if e.kind == k) for k in ("read", "piece", "compute", "step")}
    print(f"{n} tokens in {wall:.3f} s ({n / wall:.2f} tok/s); page cache dropped: {dropped}")
    print(f"events: {counts}")
    print(f"{'bucket':26} {'ms/token':>9} {'share':>7}")
    for k, v in parts.items():
        print(f"{k:26} {1e3 * v / n:9.2f} {v / wall:7.3f}")
    edges = step_edges(trace)
    print(
        f"per step that reads (medians): first read {edges['first_read_ms_p50']} ms after the "
        f"step began; the step ended {edges['tail_ms_p50']} ms after its last read landed"
    )
    result: dict[str, Any] = {
        "figure": round(parts["disk_busy"] / wall, 4),
        "figure_is": "share of the decode turn's wall time a read is on the device",
        "tokens": n,
        "seconds": round(wall, 4),
        "ms_per_token": {k: round(1e3 * v / n, 3) for k, v in parts.items()},
        "share": {k: round(v / wall, 4) for k, v in parts.items()},
        "events": counts,
        **edges,
        "prefetch": a.prefetch,
        "model": str(a.model),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
