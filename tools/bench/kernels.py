"""Kernel benchmark: the numba matmul kernels against DRAM read bandwidth, in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python tools/bench/kernels.py [--rounds N]

Measures, interleaved round by round (so a noisy neighbour hits every case alike), reported as
medians per call. Single-threaded cases are timed with the thread's CPU clock (on a shared
machine the wall clock also counts the time slices other processes get; wall-clock medians are
in the JSON too); multi-threaded ones with the wall clock:

* DRAM read bandwidth: a sum over a 1 GiB array, one thread and all threads (numba ``prange``);
* int4-g64 GEMV (T = 1) on the GLM-5 expert shapes [2048, 6144] and [6144, 2048], with and
  without the software prefetch, as weight GB/s (packed bytes + scales) and GFLOP/s;
* int4-g64 small-T GEMM (T = 4, 8) on [2048, 6144], GFLOP/s and speed-up over T GEMVs;
* int8 GEMV on an lm_head-like [4096, 1024];
* the opt-in lossy ``--kernels fast-int8`` int4 GEMV / small-T GEMM on the same weights, and its
  greedy agreement with the exact kernels on the bundled demo model;
* one token through GLM-5's lm_head [154880, 6144] and an expert-sized [2048, 6144] with the
  output features split over every thread (``ExpertCompute.linear``, bit-identical) against
  one thread, wall clock.

Weights rotate over enough copies (twice the last-level cache sysfs reports, at least 48 MiB)
that every call reads them from DRAM, not L3. The copies sit where the engine keeps resident
weights (``storage.aligned.HugeArena``: transparent huge pages where the kernel allows them;
``weight_pages`` in the JSON); the [2048, 6144] GEMV also runs on ordinary 4 KiB pages
(``figure_4k_pages``).
The last line printed is one JSON object whose ``figure`` is the int4-g64 GEMV weight GB/s on
[2048, 6144] divided by the single-thread DRAM read GB/s (the kernels are single-threaded), both
medians on the thread CPU clock; ``figure_wall_clock`` is the same from wall-clock medians;
``figure_fast_int8`` the same ratio for the opt-in lossy kernel.
"""

# T tokens, I in features, O out features

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before numba starts (DESIGN.md section 4)

import argparse
import json
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numba  # noqa: E402
import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from numba import njit, prange  # noqa: E402

from runtime.compute import ExpertCompute  # noqa: E402
from runtime.kernels.isa import exact_lanes, kernel_info  # noqa: E402
from runtime.kernels.quant_matmul import matmul_int4, matmul_int4_q8, matmul_int8  # noqa: E402
from runtime.linear import Linear  # noqa: E402
from storage.aligned import HugeArena  # noqa: E402
from storage.quant import QTensor, quantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive  # noqa: E402
from _memory import read_sum  # noqa: E402

GIB = 1 << 30
MIN_ROTATE_BYTES = 48 << 20


def _last_level_cache_bytes(cpu0: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache of CPU 0 as sysfs reports it (0 when unknown)."""
    best = 0
    for size in cpu0.glob("index*/size"):
        text = size.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


#: Weights rotate over copies of at least twice the last-level cache (some guests report a
#: shared 480 MiB L3: a 48 MiB rotation ran from it at 15.9 GB/s where DRAM gave 11).
ROTATE_BYTES = max(MIN_ROTATE_BYTES, 2 * _last_level_cache_bytes())


@njit(parallel=True, cache=True)
def _read_all_threads(a):  # type: ignore[no-untyped-def]
    s = np.uint64(0)
    for i in prange(a.size):
        s += a[i]
    return s


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _copies(q: QTensor, arena: HugeArena | None = None) -> list[npt.NDArray[np.uint8]]:
    """Enough copies of ``q``'s bytes to rotate over; in ``arena`` (where the engine keeps its
    resident weights: on transparent huge pages when the kernel allows) or, without one, in
    ordinary numpy arrays (4 KiB pages)."""
    n = max(2, -(-ROTATE_BYTES // q.nbytes))
    src = np.asarray(q.data, dtype=np.uint8).reshape(-1)
    if arena is None:
        return [src.copy() for _ in range(n)]
    out = []
    for _ in range(n):
        c = arena.empty(src.nbytes)
        c[:] = src
        out.append(c)
    return out


class _Case:
    """One measured thing: ``call(k)`` runs the k-th call; ``per_round`` calls per round.

    Single-threaded cases (``cpu_clock``) are timed with the calling thread's CPU clock, so time
    slices that a shared machine gives to other processes do not count; wall-clock times are
    kept too. Multi-threaded cases use the wall clock only.
    """

    def __init__(
        self, name: str, call: Callable[[int], object], per_round: int, cpu_clock: bool = True
    ) -> None:
        self.name, self.call, self.per_round, self.cpu_clock = name, call, per_round, cpu_clock
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._k = 0

    def run_round(self) -> None:
        for _ in range(self.per_round):
            w0, c0 = time.perf_counter(), time.thread_time()
            self.call(self._k)
            c1, w1 = time.thread_time(), time.perf_counter()
            self.wall.append(w1 - w0)
            self.cpu.append(c1 - c0)
            self._k += 1

    @property
    def median(self) -> float:
        """Median seconds per call on this case's clock."""
        return float(np.median(self.cpu if self.cpu_clock else self.wall))

    @property
    def wall_median(self) -> float:
        return float(np.median(self.wall))

    @property
    def best(self) -> float:
        return float(np.min(self.cpu if self.cpu_clock else self.wall))


def _demo_agreement(tokens: int = 24) -> dict[str, float]:
    """fast-int8 against exact on the bundled demo model: the share of positions whose argmax
    agrees (teacher-forced on the exact greedy continuation of 4 prompts) and the share of
    greedy tokens generated before the first divergence."""
    from colibri._config import default_model_path
    from runtime.context import StepContext
    from runtime.models import load_model
    from storage.container import Container

    m = load_model(Container.open(default_model_path()))
    exact, fast = StepContext(), StepContext(compute=ExpertCompute(kernels="fast-int8"))

    def greedy(prompt: npt.NDArray[np.int64], ctx: StepContext) -> list[int]:
        cache = m.new_cache()
        logits = m.forward(prompt, cache, ctx=ctx).logits
        out = [int(np.argmax(logits[-1]))]
        while len(out) < tokens:
            logits = m.forward(np.array(out[-1:], np.int64), cache, ctx=ctx).logits
            out.append(int(np.argmax(logits[-1])))
        return out

    rng = np.random.default_rng(1)
    same = prefix = total = 0
    for _ in range(4):
        prompt = rng.integers(3, m.config.vocab_size, 12).astype(np.int64)
        want = greedy(prompt, exact)
        seq = np.concatenate([prompt, np.array(want[:-1], np.int64)])
        a = m.forward(seq, m.new_cache(), ctx=exact).logits[len(prompt) - 1 :]
        b = m.forward(seq, m.new_cache(), ctx=fast).logits[len(prompt) - 1 :]
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        got = greedy(prompt, fast)
        prefix += next(
            (j for j, (u, v) in enumerate(zip(want, got, strict=True)) if u != v), tokens
        )
        total += tokens
    return {
        "teacher_forced": round(same / total, 3),
        "before_first_divergence": round(prefix / total, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive, default=15, help="interleaved rounds (default 15)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    threads = numba.get_num_threads()
    lanes = exact_lanes()  # the int4 width this machine's Linear uses
    started = time.perf_counter()
    arena = HugeArena()  # resident weights live on huge pages in the engine (Container)

    big = np.ones(GIB // 8, dtype=np.uint64)  # 1 GiB, pages touched
    read_sum(big)
    _read_all_threads(big)

    cases: list[_Case] = [
        _Case("dram_read_1t", lambda k: read_sum(big), 1),
        _Case("dram_read_all", lambda k: _read_all_threads(big), 1, cpu_clock=False),
    ]
    shapes = {"2048x6144": (2048, 6144), "6144x2048": (6144, 2048)}
    weights: dict[str, QTensor] = {}
    for label, (o, i) in shapes.items():
        q = quantize(rng.standard_normal((o, i), dtype=np.float32), "int4-g64")
        weights[label] = q
        data = _copies(q, arena)
        s = np.asarray(q.scales, dtype=np.float32)
        x1 = rng.standard_normal((1, i), dtype=np.float32)

        def gemv(k: int, data=data, s=s, x1=x1, o=o, i=i, w=lanes) -> object:  # type: ignore[no-untyped-def]
            return matmul_int4(x1, data[k % len(data)], s, o, i, 64, lanes=w)

        def gemv_nopf(k: int, data=data, s=s, x1=x1, o=o, i=i) -> object:  # type: ignore[no-untyped-def]
            return matmul_int4(
                x1, data[k % len(data)], s, o, i, 64, prefetch_distance=0, lanes=lanes
            )

        def gemv8(k: int, data=data, s=s, x1=x1, o=o, i=i) -> object:  # type: ignore[no-untyped-def]
            return matmul_int4(x1, data[k % len(data)], s, o, i, 64, lanes=8)

        def gemv_q8(k: int, data=data, s=s, x1=x1, o=o, i=i) -> object:  # type: ignore[no-untyped-def]
            return matmul_int4_q8(x1, data[k % len(data)], s, o, i, 64)

        cases.append(_Case(f"int4_gemv_{label}", gemv, len(data)))
        if label == "2048x6144":  # the same on ordinary 4 KiB pages, for comparison
            data4k = _copies(q)

            def gemv4k(k: int, data=data4k, s=s, x1=x1, o=o, i=i, w=lanes) -> object:  # type: ignore[no-untyped-def]
                return matmul_int4(x1, data[k % len(data)], s, o, i, 64, lanes=w)

            cases.append(_Case(f"int4_gemv_{label}_4k_pages", gemv4k, len(data4k)))
        cases.append(_Case(f"q8_gemv_{label}", gemv_q8, len(data)))
        cases.append(_Case(f"int4_gemv_{label}_noprefetch", gemv_nopf, len(data)))
        cases.append(_Case(f"int4_gemv_{label}_8lanes", gemv8, len(data)))
        if label == "2048x6144":
            for t in (4, 8):
                xt = rng.standard_normal((t, i), dtype=np.float32)
                for w in sorted({8, lanes}):

                    def gemm(k: int, data=data, s=s, xt=xt, o=o, i=i, w=w) -> object:  # type: ignore[no-untyped-def]
                        return matmul_int4(xt, data[k % len(data)], s, o, i, 64, lanes=w)

                    cases.append(_Case(f"int4_gemm_T{t}_{label}_{w}", gemm, len(data) // 2))

                def gemm_q8(k: int, data=data, s=s, xt=xt, o=o, i=i) -> object:  # type: ignore[no-untyped-def]
                    return matmul_int4_q8(xt, data[k % len(data)], s, o, i, 64)

                cases.append(_Case(f"q8_gemm_T{t}_{label}", gemm_q8, len(data) // 2))
    q8 = quantize(rng.standard_normal((4096, 1024), dtype=np.float32), "int8")
    data8 = _copies(q8, arena)
    s8 = np.asarray(q8.scales, dtype=np.float32)
    x8 = rng.standard_normal((1, 1024), dtype=np.float32)
    cases.append(
        _Case(
            "int8_gemv_4096x1024",
            lambda k: matmul_int8(x8, data8[k % len(data8)], s8, 4096, 1024),
            len(data8),
        )
    )
    # the int8 width the engine's Linear takes (lm_head), one token and a batched step of 8
    x8t = rng.standard_normal((8, 1024), dtype=np.float32)
    cases.append(
        _Case(
            "int8_gemv_4096x1024_engine",
            lambda k: matmul_int8(x8, data8[k % len(data8)], s8, 4096, 1024, lanes=lanes),
            len(data8),
        )
    )
    cases.append(
        _Case(
            "int8_gemm_T8_4096x1024",
            lambda k: matmul_int8(x8t, data8[k % len(data8)], s8, 4096, 1024, lanes=lanes),
            len(data8) // 2,
        )
    )

    gemv_case = next(c for c in cases if c.name == "int4_gemv_2048x6144")

    def two_threads(k: int) -> object:
        # The same 2 x 8 GEMVs as two threads: nogil kernels should overlap (DESIGN.md 4).
        def work(first: int) -> None:
            for j in range(8):
                gemv_case.call(first + 2 * j)

        ts = [threading.Thread(target=work, args=(first,)) for first in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return None

    def one_thread(k: int) -> object:
        for j in range(16):
            gemv_case.call(j)
        return None

    cases.append(_Case("gemv16_two_threads", two_threads, 1, cpu_clock=False))
    cases.append(_Case("gemv16_one_thread", one_thread, 1, cpu_clock=False))

    # One token through a big weight on every thread: ExpertCompute.linear splits the output
    # features (bit-identical to one call); GLM-5's lm_head [154880, 6144] and an expert-sized
    # [2048, 6144], wall clock against the same Linear on one thread.
    split_comp = ExpertCompute(max(2, len(os.sched_getaffinity(0))))
    split_shapes = {"154880x6144": (154880, 6144), "2048x6144": (2048, 6144)}
    for label, (o, i) in split_shapes.items():
        q = weights.get(label) or quantize(
            rng.standard_normal((o, i), dtype=np.float32), "int4-g64"
        )
        weights[label] = q
        lins = [
            Linear(QTensor(q.fmt, q.shape, d, q.scales))
            for d in (_copies(q) if o < 10**5 else [q.data])
        ]
        x1 = rng.standard_normal((1, i), dtype=np.float32)
        assert np.array_equal(split_comp.linear(lins[0], x1), lins[0](x1))  # bit-identical
        cases.append(
            _Case(
                f"split_{label}_1t",
                lambda k, L=lins, x=x1: L[k % len(L)](x),
                len(lins),
                cpu_clock=False,
            )
        )
        cases.append(
            _Case(
                f"split_{label}_all",
                lambda k, L=lins, x=x1: split_comp.linear(L[k % len(L)], x),
                len(lins),
                cpu_clock=False,
            )
        )

    for case in cases:  # JIT (or load the cache) and warm every path once
        case.call(0)
    for _ in range(args.rounds):
        for case in cases:
            case.run_round()
    by = {c.name: c for c in cases}

    def gbs(nbytes: int, sec: float) -> float:
        return nbytes / sec / 1e9

    dram_1t = gbs(big.nbytes, by["dram_read_1t"].median)
    dram_all = gbs(big.nbytes, by["dram_read_all"].median)
    report: dict[str, Any] = {
        "machine": {
            "rotate_bytes": ROTATE_BYTES,
            "nproc": os.cpu_count(),
            "cpu": _cpu_model(),
            "numba_threads": threads,
        },
        "kernels": kernel_info().as_dict(),
        "rounds": args.rounds,
        "dram_read_gbs": {"1_thread": round(dram_1t, 2), f"{threads}_threads": round(dram_all, 2)},
        "int4_g64_gemv": {},
        "int4_g64_small_t": {},
    }
    print(f"machine: {_cpu_model()}, nproc {os.cpu_count()}, numba threads {threads}")
    print(f"DRAM read (1 GiB sum): 1 thread {dram_1t:.2f} GB/s, {threads} threads {dram_all:.2f}")
    for label, (o, i) in shapes.items():
        q = weights[label]
        c, cn = by[f"int4_gemv_{label}"], by[f"int4_gemv_{label}_noprefetch"]
        row = {
            "ms": round(c.median * 1e3, 3),
            "weight_gbs": round(gbs(q.nbytes, c.median), 2),
            "gflops": round(2 * o * i / c.median / 1e9, 1),
            "weight_gbs_best": round(gbs(q.nbytes, c.best), 2),
            "weight_gbs_no_prefetch": round(gbs(q.nbytes, cn.median), 2),
            "of_dram_1t": round(gbs(q.nbytes, c.median) / dram_1t, 3),
            "weight_gbs_8_lanes": round(gbs(q.nbytes, by[f"int4_gemv_{label}_8lanes"].median), 2),
        }
        report["int4_g64_gemv"][label] = row
        print(
            f"int4-g64 GEMV [{o}, {i}]: {row['ms']} ms, {row['weight_gbs']} GB/s weights "
            f"({row['of_dram_1t']} of 1-thread DRAM read), {row['gflops']} GFLOP/s; "
            f"no prefetch {row['weight_gbs_no_prefetch']} GB/s; "
            f"best {row['weight_gbs_best']} GB/s; 8-lane kernel {row['weight_gbs_8_lanes']} GB/s"
        )
    gemv_2048 = by["int4_gemv_2048x6144"].median
    for t in (4, 8):
        c = by[f"int4_gemm_T{t}_2048x6144_{lanes}"]
        c8 = by[f"int4_gemm_T{t}_2048x6144_8"]
        row = {
            "ms": round(c.median * 1e3, 3),
            "gflops": round(2 * t * 2048 * 6144 / c.median / 1e9, 1),
            "speedup_vs_t_gemvs": round(t * gemv_2048 / c.median, 2),
            "ms_8_lanes": round(c8.median * 1e3, 3),
        }
        report["int4_g64_small_t"][f"T{t}_2048x6144"] = row
        print(
            f"int4-g64 GEMM T={t} [2048, 6144]: {row['ms']} ms, {row['gflops']} GFLOP/s, "
            f"{row['speedup_vs_t_gemvs']}x the throughput of {t} GEMVs"
        )
    report["fast_int8"] = {"int8_dot": kernel_info().int8_dot, "gemv": {}, "small_t": {}}
    for label, (o, i) in shapes.items():
        c, ce = by[f"q8_gemv_{label}"], by[f"int4_gemv_{label}"]
        row = {
            "ms": round(c.median * 1e3, 3),
            "weight_gbs": round(gbs(weights[label].nbytes, c.median), 2),
            "of_dram_1t": round(gbs(weights[label].nbytes, c.median) / dram_1t, 3),
            "speedup_vs_exact": round(ce.median / c.median, 2),
        }
        report["fast_int8"]["gemv"][label] = row
        print(
            f"fast-int8 GEMV [{o}, {i}]: {row['ms']} ms, {row['weight_gbs']} GB/s weights "
            f"({row['of_dram_1t']} of 1-thread DRAM read), {row['speedup_vs_exact']}x exact"
        )
    for t in (4, 8):
        c, ce = by[f"q8_gemm_T{t}_2048x6144"], by[f"int4_gemm_T{t}_2048x6144_{lanes}"]
        report["fast_int8"]["small_t"][f"T{t}_2048x6144"] = {
            "ms": round(c.median * 1e3, 3),
            "speedup_vs_exact": round(ce.median / c.median, 2),
        }
        print(f"fast-int8 GEMM T={t} [2048, 6144]: {ce.median / c.median:.2f}x exact")
    report["fast_int8"]["demo_agreement"] = _demo_agreement()
    print(f"fast-int8 greedy agreement on the demo model: {report['fast_int8']['demo_agreement']}")
    c8 = by["int8_gemv_4096x1024"]
    report["int8_gemv_4096x1024"] = {
        "ms": round(c8.median * 1e3, 3),
        "weight_gbs": round(gbs(q8.nbytes, c8.median), 2),
        "gflops": round(2 * 4096 * 1024 / c8.median / 1e9, 1),
    }
    print(
        f"int8 GEMV [4096, 1024]: {report['int8_gemv_4096x1024']['ms']} ms, "
        f"{report['int8_gemv_4096x1024']['weight_gbs']} GB/s weights"
    )
    c1, c8t = by["int8_gemv_4096x1024_engine"], by["int8_gemm_T8_4096x1024"]
    report["int8_small_t"] = {
        "lanes": lanes,
        "T8_4096x1024": {
            "ms": round(c8t.median * 1e3, 3),
            "gflops": round(2 * 8 * 4096 * 1024 / c8t.median / 1e9, 1),
            "speedup_vs_t_gemvs": round(8 * c1.median / c8t.median, 2),
        },
    }
    print(
        f"int8 GEMM T=8 [4096, 1024] ({lanes} lanes): "
        f"{report['int8_small_t']['T8_4096x1024']['speedup_vs_t_gemvs']}x the throughput of "
        "8 GEMVs"
    )
    report["split_gemv"] = {}
    for label in split_shapes:
        one, split = by[f"split_{label}_1t"].median, by[f"split_{label}_all"].median
        report["split_gemv"][label] = {
            "threads": split_comp.threads,
            "ms_1_thread": round(one * 1e3, 3),
            "ms_split": round(split * 1e3, 3),
            "speedup": round(one / split, 2),
            "weight_gbs_split": round(gbs(weights[label].nbytes, split), 2),
        }
        print(f"one token through [{label}] on {split_comp.threads} threads: {one / split:.2f}x")
    split_comp.close()
    overlap = by["gemv16_one_thread"].median / by["gemv16_two_threads"].median
    report["two_thread_gemv_speedup"] = round(overlap, 2)
    print(f"16 int4 GEMVs [2048, 6144] on 2 Python threads: {overlap:.2f}x one thread (nogil)")
    hot, read = by["int4_gemv_2048x6144"], by["dram_read_1t"]
    nbytes = weights["2048x6144"].nbytes
    figure = gbs(nbytes, hot.median) / dram_1t
    # The same ratio from wall-clock medians and from the best calls, for comparison.
    figure_wall = gbs(nbytes, hot.wall_median) / gbs(big.nbytes, read.wall_median)
    figure_best = gbs(nbytes, hot.best) / gbs(big.nbytes, read.best)
    report["seconds"] = round(time.perf_counter() - started, 1)
    out = {
        "figure": round(figure, 3),
        "figure_is": f"int4-g64 GEMV ({lanes}-lane kernel) weight GB/s [2048,6144] / 1-thread "
        "DRAM read GB/s (medians, thread CPU clock)",
        "figure_8_lanes": round(gbs(nbytes, by["int4_gemv_2048x6144_8lanes"].median) / dram_1t, 3),
        "figure_fast_int8": report["fast_int8"]["gemv"]["2048x6144"]["of_dram_1t"],
        "figure_wall_clock": round(figure_wall, 3),
        "figure_best": round(figure_best, 3),
        "figure_4k_pages": round(
            gbs(nbytes, by["int4_gemv_2048x6144_4k_pages"].median) / dram_1t, 3
        ),
        "weight_pages": "transparent huge pages (the engine's resident weights)"
        if arena.huge
        else f"4 KiB ({arena.support.reason})",
        **report,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
