"""Serving benchmark: aggregate tokens/s and TTFT at 1, 2, 4 and 8 concurrent streams.

    .venv/bin/python tools/bench/serve.py [--model DIR] [--url URL] [--tokens 64]
                                          [--requests 16] [--levels 1,2,4,8] [--rounds 1]
                                          [--stagger 0]

Starts a real ``coli serve`` on a free loopback port (the bundled demo model by default) or
uses a running server (``--url``), then for each concurrency level runs that many streaming
clients that share ``--requests`` chat requests (each client sends its share back to back;
rotating prompts, greedy, ``ignore_eos`` so every request generates exactly ``--tokens``
tokens: every level does the same work; ``--stagger S`` starts client i of a level i * S
seconds after the first, so prompts arrive while the others decode). Per level:
generated tokens / wall seconds, and TTFT (request sent -> first content chunk, client side,
queue wait included) p50 / p99. With ``--rounds N`` every level runs N times, the levels'
order rotating each round, and each level's median round stands for it (every round's rate is
in ``tokens_per_s_rounds``, every round's ratio in ``figure_rounds``). The last line printed is
one JSON object whose ``figure`` is tokens/s at 8 streams divided by tokens/s at 1 stream (1.0 =
concurrency adds no throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _args import positive

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    """Percentile by nearest rank (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int
) -> tuple[float, int, float]:
    """(ttft seconds, generated tokens, total seconds) of one streamed request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    n = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = int(chunk["usage"]["completion_tokens"])
            for c in chunk.get("choices", []):
                if ttft is None and c.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), n, total


def _shares(requests: int, streams: int) -> list[int]:
    """``requests`` split over ``streams`` clients (the first ones one more where it does not
    divide): every level does the same work (``max(1, requests // n)`` each gave level 8 twice
    level 1's requests with --requests 4, and dropped the remainder elsewhere)."""
    return [requests // streams + (i < requests % streams) for i in range(streams)]


async def _level(
    base: str,
    model: str,
    streams: int,
    per_stream: int | list[int],
    tokens: int,
    stagger: float = 0.0,
) -> dict[str, Any]:
    url = base + "/v1/chat/completions"
    ttfts: list[float] = []
    produced = 0
    counts = per_stream if isinstance(per_stream, list) else [per_stream] * streams
    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def stream(i: int) -> None:
            nonlocal produced
            await asyncio.sleep(i * stagger)  # client i starts i * stagger s after the first
            for j in range(counts[i]):
                prompt = f"Request {i}.{j}: say something about the number {i * 31 + j}."
                ttft, n, _ = await _one(client, url, model, prompt, tokens)
                ttfts.append(ttft)
                produced += n

        t0 = time.perf_counter()
        await asyncio.gather(*(stream(i) for i in range(streams)))
        wall = time.perf_counter() - t0
    return {
        "streams": streams,
        "requests": sum(counts),
        "tokens": produced,
        "seconds": round(wall, 3),
        "tokens_per_s": round(produced / wall, 2),
        "ttft_p50_ms": round(_pct(ttfts, 50) * 1000, 1),
        "ttft_p99_ms": round(_pct(ttfts, 99) * 1000, 1),
    }


def _start(model: Path | None, queue: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "colibri.cli", "serve", "--port", str(port), "--kv-slots", "0"]
    cmd += ["--queue", str(queue)]
    if model is not None:
        cmd += ["--model", str(model)]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not become ready in 120 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: demo model)")
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--tokens", type=positive, default=64, help="tokens per request")
    ap.add_argument("--requests", type=positive, default=16, help="requests per level")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every level this many times, interleaved; each level's median round stands "
        "for it (default 1)",
    )
    ap.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="client i of a level starts i * SECONDS after the first (default 0: in lockstep); "
        "staggered, prompts arrive while the others decode, as a service's users' do",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not 0 <= args.stagger <= 60:
        ap.error("--stagger must be in 0..60 seconds")
    try:
        levels = sorted({int(x) for x in args.levels.split(",")})
    except ValueError:
        ap.error(f"--levels takes stream counts like 1,2,4,8, got {args.levels!r}")
    if levels[0] < 1:
        ap.error(f"--levels: stream counts are >= 1, got {args.levels!r}")
    if args.requests < levels[-1]:
        ap.error(
            f"--requests {args.requests} is fewer than the {levels[-1]} streams of the top "
            "level: each stream needs a request (every level does --requests of them)"
        )
    proc = None
    base = args.url
    if base is None:
        proc, base = _start(args.model, queue=max(levels) + 1)
    try:
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        # warm-up, every level once: the first batched steps of each width compile (or load)
        # their kernels, which must not land in a timed round
        for n in levels:
            asyncio.run(_level(base, model, n, 1, args.tokens))
        runs: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
        for r in range(args.rounds):
            # the levels rotate each round, so that none always runs first (or last)
            for n in levels[r % len(levels) :] + levels[: r % len(levels)]:
                res = asyncio.run(
                    _level(base, model, n, _shares(args.requests, n), args.tokens, args.stagger)
                )
                runs[n].append(res)
                print(
                    f"{n} stream(s): {res['tokens_per_s']} tok/s aggregate, TTFT p50 "
                    f"{res['ttft_p50_ms']} ms p99 {res['ttft_p99_ms']} ms "
                    f"({res['requests']} requests)",
                    flush=True,
                )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    results = []
    for n in levels:  # each level's median round (by tokens/s), with every round's rate
        ordered = sorted(runs[n], key=lambda x: x["tokens_per_s"])
        rates = [x["tokens_per_s"] for x in runs[n]]
        results.append({**ordered[(len(ordered) - 1) // 2], "tokens_per_s_rounds": rates})
    by = {r["streams"]: r for r in results}
    lo, hi = by.get(1), by.get(max(levels))
    # (level 1 alone: 1 / 1 said 1.0, a comparison with nothing)
    figure = hi["tokens_per_s"] / lo["tokens_per_s"] if lo and hi and hi is not lo else None
    top = max(levels)
    out = {
        "figure": None if figure is None else round(figure, 3),
        "figure_reason": None
        if figure is not None
        else "the figure needs level 1 and a higher level (--levels 1,...,N)",
        "figure_is": f"aggregate tokens/s at {top} streams / at 1 stream (median rounds)"
        if figure is not None
        else "aggregate tokens/s at the top level / at 1 stream (median rounds)",
        "figure_rounds": [
            round(a["tokens_per_s"] / b["tokens_per_s"], 3)
            for a, b in zip(runs[top], runs[1], strict=True)
        ]
        if 1 in runs and top > 1
        else [],
        "model": model,
        "tokens_per_request": args.tokens,
        "rounds": args.rounds,
        "stagger_s": args.stagger,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "levels": results,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
