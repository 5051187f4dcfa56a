"""Prometheus metrics for one app (its own registry: two apps in one process never mix).

Names follow vLLM's (``vllm:`` -> ``colibri:``) so existing dashboards adapt by a prefix:
request counters, time to first token, inter-token latency, queue time, end-to-end latency,
prompt / cached-prompt / generation token counters, running / waiting gauges; plus, read from
``engine.snapshot()`` at scrape time, the engine's counters and the expert tiers (hits per tier,
misses, bytes read, read wait, prefetch issued / used / wasted, evictions, hit rate) and, when
the experts stream, one series per copy of the model (``colibri:expert_device_*{index, role,
root}``: bytes, reads, weight, failovers, demoted, ...; see docs/api.md "Metrics").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from colibri._stats import EngineStats
from storage.multidisk.placement import CopyStats

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _EngineCollector(Collector):
    """Engine counters and expert-tier series, read from ``snapshot()`` on each scrape."""

    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        sc = s.scheduler
        yield _counter("colibri:engine_forward_calls", "Model forward calls", sc.forward_calls)
        yield _counter(
            "colibri:engine_compute_seconds",
            "Seconds spent in model forward calls",
            sc.compute_seconds,
        )
        yield _counter(
            "colibri:engine_prefill_tokens", "Prompt tokens prefilled", sc.prefill_tokens
        )
        yield _counter(
            "colibri:engine_prefill_chunks", "Prompt chunks prefilled", sc.prefill_chunks
        )
        yield _counter(
            "colibri:engine_prefill_steps",
            "Forwards that prefilled (the chunks of prompts queued together share one)",
            sc.prefill_steps,
        )
        yield _counter(
            "colibri:engine_prefill_seconds", "Seconds spent prefilling", sc.prefill_seconds
        )
        yield _counter(
            "colibri:engine_prefill_read_bytes",
            "Expert bytes read while prefilling",
            sc.prefill_bytes_read,
        )
        parts = CounterMetricFamily(
            "colibri:engine_time_seconds",
            "Where the forwards' wall time went: read waits (demand, lookahead), expert compute, "
            "dense compute, thread hand-off",
            labels=["part"],
        )
        for f in dataclasses.fields(sc.time):
            parts.add_metric([f.name.removesuffix("_s")], float(getattr(sc.time, f.name)))
        yield parts
        ex = s.experts
        resident = GaugeMetricFamily(
            "colibri:experts_streaming", "1 when routed experts stream from storage, 0 in RAM"
        )
        resident.add_metric([], 1.0 if ex.mode == "streaming" else 0.0)
        yield resident
        if s.cluster is not None:
            yield from _cluster_metrics(s.cluster)
        t = ex.tiers
        if t is None:
            return
        hits = CounterMetricFamily(
            "colibri:expert_hits", "Expert lookups served from memory, by tier", labels=["tier"]
        )
        hits.add_metric(["pinned"], float(t.hits_pinned))
        hits.add_metric(["lru"], float(t.hits_lru))
        yield hits
        yield _counter("colibri:expert_misses", "Expert lookups read from storage", t.misses)
        yield _counter("colibri:expert_reads", "Expert reads issued", t.reads)
        yield _counter("colibri:expert_read_bytes", "Bytes of experts read", t.bytes_read)
        yield _counter(
            "colibri:expert_read_wait_seconds",
            "Seconds compute waited for expert reads",
            t.compute_stall_s,
        )
        yield _counter(
            "colibri:expert_read_seconds",
            "Seconds expert reads took, summed over reads (they overlap one another and compute)",
            t.read_wait_s,
        )
        pre = CounterMetricFamily(
            "colibri:expert_prefetch", "Lookahead prefetches by outcome", labels=["outcome"]
        )
        pre.add_metric(["issued"], float(t.prefetch_issued))
        pre.add_metric(["used"], float(t.prefetch_used))
        pre.add_metric(["wasted"], float(t.prefetch_wasted))
        pre.add_metric(["aborted"], float(t.prefetch_aborted))
        yield pre
        yield _counter("colibri:expert_evictions", "Experts evicted from the LRU", t.evictions)
        yield _counter("colibri:expert_read_errors", "Expert reads that failed", t.read_errors)
        rate = GaugeMetricFamily("colibri:expert_hit_rate", "Expert lookups served from memory")
        if t.hits_pinned + t.hits_lru + t.misses:  # no sample before the first lookup
            rate.add_metric([], t.hit_rate)
        yield rate
        size = GaugeMetricFamily("colibri:expert_cache_bytes", "Bytes of expert slots in RAM")
        size.add_metric([], float(ex.slots_bytes))
        yield size
        if ex.devices:
            yield from _device_metrics(ex.devices)


# Per-copy series (storage/multidisk/): (name, help, type, CopyStats attribute).
_DEVICE_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("colibri:expert_device_read_bytes", "Bytes of experts read from this copy", "c", "bytes"),
    ("colibri:expert_device_reads", "Expert reads served by this copy", "c", "reads"),
    ("colibri:expert_device_read_seconds", "Seconds of reads on this copy", "c", "seconds"),
    (
        "colibri:expert_device_busy_seconds",
        "Wall seconds this copy had at least one read in flight",
        "c",
        "busy_seconds",
    ),
    ("colibri:expert_device_errors", "Failed reads on this copy", "c", "errors"),
    (
        "colibri:expert_device_failovers",
        "Reads that failed on this copy and were retried on another",
        "c",
        "failovers",
    ),
    (
        "colibri:expert_device_served_failovers",
        "Retried reads this copy served for a failed one",
        "c",
        "served_failovers",
    ),
    ("colibri:expert_device_weight", "Read weight in use for this copy", "g", "weight"),
    (
        "colibri:expert_device_base_weight",
        "Declared or probed read weight of this copy",
        "g",
        "base_weight",
    ),
    (
        "colibri:expert_device_throughput_bytes_per_second",
        "Throughput estimate of this copy (EWMA over busy time; absent before one)",
        "g",
        "throughput_bytes_per_s",
    ),
    ("colibri:expert_device_demoted", "1 when a read error demoted this copy", "g", "demoted"),
)
_DEVICE_LABELS = ["index", "role", "root"]


def _device_metrics(devices: Sequence[CopyStats]) -> Iterator[Metric]:
    """One series per copy of the model (0: the primary, then each ``--mirror``) and metric."""
    rows = [([str(d.index), d.role, d.root], dataclasses.asdict(d)) for d in devices]
    yield from _labelled(_DEVICE_SERIES, _DEVICE_LABELS, rows)


def _labelled(
    series: Sequence[tuple[str, str, str, str]],
    labels: list[str],
    rows: Sequence[tuple[list[str], Mapping[str, Any]]],
) -> Iterator[Metric]:
    """One family per ``(name, help, "c"ounter | "g"auge, key)`` of ``series``, one series per
    row ``(label values, stats)`` (a missing or None value is left out)."""
    for name, doc, kind, key in series:
        fam: CounterMetricFamily | GaugeMetricFamily
        if kind == "c":
            fam = CounterMetricFamily(name, doc, labels=labels)
        else:
            fam = GaugeMetricFamily(name, doc, labels=labels)
        for values, stats in rows:
            v = stats.get(key)
            if v is not None:
                fam.add_metric(values, float(v))
        yield fam


# Per-worker series under --ray (runtime/cluster/): (name, help, type, stats key).
_WORKER_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("colibri:cluster_worker_calls", "Expert requests this worker answered", "c", "calls"),
    ("colibri:cluster_worker_failures", "Requests that failed on this worker", "c", "failures"),
    ("colibri:cluster_worker_timeouts", "Requests past the deadline", "c", "timeouts"),
    ("colibri:cluster_worker_rejoins", "Times this worker came back", "c", "rejoins"),
    ("colibri:cluster_worker_hits", "Expert lookups its store served from RAM", "c", "hits"),
    ("colibri:cluster_worker_reads", "Experts its store read from its disks", "c", "reads"),
    ("colibri:cluster_worker_read_bytes", "Bytes its store read", "c", "bytes_read"),
    (
        "colibri:cluster_worker_fallback_experts",
        "Its experts the coordinator computed instead (it was down or late)",
        "c",
        "fallback_experts",
    ),
    ("colibri:cluster_worker_call_ms", "Mean request round trip", "g", "call_ms_mean"),
    (
        "colibri:cluster_worker_overhead_ms",
        "Mean round trip minus the worker's own compute",
        "g",
        "overhead_ms_mean",
    ),
    ("colibri:cluster_worker_up", "1 while the worker answers", "g", "alive"),
    ("colibri:cluster_worker_experts", "Experts this worker owns", "g", "experts_owned"),
)


def _cluster_metrics(cluster: dict[str, Any]) -> Iterator[Metric]:
    """One series per expert worker and metric."""
    rows = [([str(w["name"])], w) for w in cluster["workers"]]
    yield from _labelled(_WORKER_SERIES, ["worker"], rows)
    yield _counter(
        "colibri:cluster_fallback_experts",
        "Expert computations the coordinator did because a worker was down or late",
        cluster["fallback_experts"],
    )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


class Metrics:
    """Every metric of one server; ``render()`` gives the Prometheus text."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        """``engine_stats``: the engine's :meth:`~colibri.Engine.snapshot`."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "colibri:http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.request_success = Counter(
            "colibri:request_success",
            "Generations finished, by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "colibri:requests_rejected", "Requests refused, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "colibri:prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.prompt_tokens_cached = Counter(
            "colibri:prompt_tokens_cached",
            "Prompt tokens taken from a KV slot instead of computed",
            registry=r,
        )
        self.generation_tokens = Counter(
            "colibri:generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "colibri:time_to_first_token_seconds",
            "Request arrival to first token (queue wait included)",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "colibri:inter_token_latency_seconds",
            "Time between consecutive tokens of one request",
            buckets=_ITL,
            registry=r,
        )
        self.queue_time = Histogram(
            "colibri:request_queue_time_seconds",
            "Time waiting for admission (and for its KV slot)",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "colibri:e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=_LATENCY,
            registry=r,
        )
        self.running = Gauge("colibri:num_requests_running", "Generations running", registry=r)
        self.waiting = Gauge(
            "colibri:num_requests_waiting", "Generations waiting for admission", registry=r
        )
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
