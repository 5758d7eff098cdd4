"""Prometheus metrics of one HTTP server, in a registry of its own (never the global one).

Two sources:
- the scheduler's counters and gauges (`SchedulerStats`), fetched at scrape time: queue
  lengths, KV pages, token counters. Token counters, not hit-rate gauges: the reader computes
  ratios (``rate(cached_prompt_tokens_total) / rate(prompt_tokens_total)``).
- latency histograms observed in the front as requests finish: time to first token, time per
  output token after the first, end-to-end latency.

Every sample carries a `model_name` label (the served model's name, as the OpenAI API reports
it), so one Prometheus can scrape several servers and a dashboard can pick a model
(deploy/grafana/radixserve.json).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from radixserve.protocol import GRAMMAR_COMPILE_BUCKETS, SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "radixserve_"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# name, help, SchedulerStats field
_GAUGES = (
    ("num_running_requests", "Sequences being decoded or prefilled.", "num_running"),
    ("num_waiting_requests", "Sequences in the waiting queue.", "num_waiting"),
    ("kv_pages_total", "KV pages in the pool.", "total_pages"),
    ("kv_pages_free", "KV pages on the free list.", "free_pages"),
    ("kv_pages_cached", "KV pages held by the prefix cache (radix tree), evictable or locked.", "cached_pages"),
    ("kv_pages_evictable", "KV pages held by the prefix cache and by no running request.", "evictable_pages"),
    ("kv_pages_running", "KV pages held by running requests, theirs and the cached ones they lock.", "running_pages"),
    ("kv_disk_pages", "KV pages in the disk tier (--kv-disk-dir).", "kv_disk_pages"),
    ("kv_disk_bytes", "Bytes the disk tier's page files take.", "kv_disk_bytes"),
    ("kv_disk_capacity_bytes", "The disk tier's budget in bytes (--kv-disk-gb).", "kv_disk_capacity_bytes"),
    ("worker_threads", "Threads the worker's last forward ran on: a CPU worker gives up a thread while "
     "other processes keep its threads waiting for a core (0: no forward yet).", "worker_threads"),
)
_COUNTERS = (
    ("prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("generation_tokens", "Tokens generated.", "generation_tokens_total"),
    ("num_retractions", "Requests retracted (pages freed, resumed later) when the pool ran out.", "num_retractions_total"),
    ("grammar_compiles", "Grammars compiled (constrained decoding; cache misses).", "grammar_compiles_total"),
    ("grammar_cache_hits", "Constrained requests whose grammar came from the compiled-grammar cache.", "grammar_cache_hits_total"),
    ("spec_draft_tokens", "Draft tokens proposed for verification (speculative decoding).", "spec_draft_tokens_total"),
    ("spec_accepted_tokens", "Draft tokens accepted (speculative decoding).", "spec_accepted_tokens_total"),
    ("kv_disk_stored_bytes", "KV bytes written to the disk tier (pages evicted from memory, pins).", "kv_disk_stored_bytes_total"),
    ("kv_disk_loaded_bytes", "KV bytes loaded from the disk tier into the pool.", "kv_disk_loaded_bytes_total"),
    ("kv_disk_store_seconds", "Time the disk tier's writer spent writing (bytes / seconds: store throughput).", "kv_disk_store_seconds_total"),
    ("kv_disk_load_seconds", "Time the worker spent copying pages loaded from disk into the pool.", "kv_disk_load_seconds_total"),
    ("kv_disk_corrupt_pages", "Disk tier files dropped for a bad size, header or checksum (never served).", "kv_disk_corrupt_pages_total"),
    ("segment_reused_tokens", "Prompt tokens whose KV came from the segment cache (requests' `segments`; "
     "counted in radixserve_cached_prompt_tokens too).", "segment_reused_tokens_total"),
    ("segment_recomputed_tokens", "Of the segment tokens reused, those recomputed in context.", "segment_recomputed_tokens_total"),
)


class _SchedulerCollector(Collector):
    """Reports the last `SchedulerStats` the server fetched (fetched right before each scrape)."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        for name, doc, attr in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))
        usage = stats.running_pages / stats.total_pages if stats.total_pages else 0.0
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_usage_ratio",
            "Fraction of KV pages held by running requests (pages held only by the prefix cache "
            "are reusable and counted in radixserve_kv_pages_evictable).",
            value=usage,
        )
        for name, doc, attr in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))
        cached = CounterMetricFamily(
            PREFIX + "cached_prompt_tokens", "Prompt tokens found cached at admission, by the tier they came from "
            "(memory: the KV pool; disk: loaded from --kv-disk-dir).", labels=["tier"],
        )
        cached.add_metric(["memory"], stats.cached_prompt_tokens_total - stats.cached_prompt_tokens_disk_total)
        cached.add_metric(["disk"], stats.cached_prompt_tokens_disk_total)
        yield cached
        pinned = GaugeMetricFamily(PREFIX + "pinned_tokens", "Tokens of the pages pins hold (/cache/pin), by tier.",
                                   labels=["tier"])
        pinned.add_metric(["memory"], stats.pinned_tokens_memory)
        pinned.add_metric(["disk"], stats.pinned_tokens_disk)
        yield pinned
        counts = stats.grammar_compile_buckets or [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
        bounds = [str(b) for b in GRAMMAR_COMPILE_BUCKETS] + ["+Inf"]
        yield HistogramMetricFamily(
            PREFIX + "grammar_compile_seconds", "Time to compile one grammar (in the scheduler's compile process).",
            buckets=list(zip(bounds, counts, strict=True)), sum_value=stats.grammar_compile_seconds_sum,
        )


class _RecoveryCollector(Collector):
    """The front's own counts of engine restarts and the requests it resumed (front/recovery.py):
    they outlive the engines, whose counters start again from 0 after a restart."""

    def __init__(self) -> None:
        self.restarts = 0
        self.recovered = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(PREFIX + "engine_restarts", "Scheduler and worker restarts after a crash.",
                                  value=self.restarts)
        yield CounterMetricFamily(PREFIX + "requests_recovered",
                                  "Requests in flight at a crash, resumed on the restarted engine.",
                                  value=self.recovered)


class _ModelNameLabel(Collector):
    """Every sample of `inner` with a `model_name` label added: added here, in one place, a
    metric registered in `inner` cannot be left without it."""

    def __init__(self, inner: CollectorRegistry, model_name: str) -> None:
        self._inner = inner
        self._label = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        for metric in self._inner.collect():  # fresh objects at every collect: ours to change
            metric.samples = [s._replace(labels={**self._label, **s.labels}) for s in metric.samples]
            yield metric


class _OneTenant:
    """The `radixserve_tenant_*` series of one tenant, out of everything `inner` collects."""

    def __init__(self, inner: CollectorRegistry, tenant: str) -> None:
        self._inner = inner
        self._tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for metric in self._inner.collect():
            if not metric.name.startswith(PREFIX + "tenant_"):
                continue
            metric.samples = [s for s in metric.samples if s.labels.get("tenant") == self._tenant]
            yield metric


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)  # every metric, without model_name
        self._exposed = CollectorRegistry()
        self._exposed.register(_ModelNameLabel(self.registry, model_name))
        self._scheduler = _SchedulerCollector()
        self.registry.register(self._scheduler)
        self._recovery = _RecoveryCollector()
        self.registry.register(self._recovery)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request: (e2e - ttft) / (tokens - 1).",
            buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last output token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.finished = Counter(
            PREFIX + "requests_finished", "Sequences finished, by finish reason (stop, length, abort).",
            ["finish_reason"], registry=self.registry,
        )
        self.http_responses = Counter(
            PREFIX + "http_responses", "HTTP answers by route (the path the route is declared with; "
            "`other` where none matched) and status code.", ["route", "status"], registry=self.registry,
        )
        self.kv_pool_tokens = Gauge(
            PREFIX + "kv_pool_tokens", "Tokens the KV pool holds (pages x page size), labelled with what it "
            "stores (--kv-cache-dtype: the 8-bit kinds hold twice the tokens of bfloat16 in the same memory).",
            ["kv_cache_dtype"], registry=self.registry,
        )
        # per tenant (--api-key-file only): the label's values are the file's names, a bounded set
        self._tenant_counters: tuple[Counter, Counter, Counter] | None = None

    def describe_pool(self, kv_cache_dtype: str, tokens: int) -> None:
        """The KV pool as the worker built it (fixed for the server's life)."""
        self.kv_pool_tokens.clear()
        self.kv_pool_tokens.labels(kv_cache_dtype=kv_cache_dtype).set(tokens)

    def add_tenants(self, names: frozenset[str]) -> None:
        """Per-tenant counters, every tenant's series present (at 0) from the start."""
        self._tenant_counters = (
            Counter(PREFIX + "tenant_requests_finished", "Sequences finished, by tenant (API key file).",
                    ["tenant"], registry=self.registry),
            Counter(PREFIX + "tenant_prompt_tokens", "Prompt tokens of finished sequences, by tenant.",
                    ["tenant"], registry=self.registry),
            Counter(PREFIX + "tenant_cached_prompt_tokens",
                    "Prompt tokens of finished sequences found in the tenant's own prefix cache, by tenant.",
                    ["tenant"], registry=self.registry),
        )
        for counter in self._tenant_counters:
            for name in sorted(names):
                counter.labels(tenant=name)

    def observe_response(self, route: str, status: int) -> None:
        self.http_responses.labels(route=route, status=str(status)).inc()

    def observe_finished(self, meta: dict[str, Any], tenant: str | None = None) -> None:
        """Record one finished sequence from its `meta_info` (and its tenant's, if it has one)."""
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        self.finished.labels(finish_reason=reason).inc()
        if tenant is not None and self._tenant_counters is not None:
            finished, prompt, cached = self._tenant_counters
            finished.labels(tenant=tenant).inc()
            prompt.labels(tenant=tenant).inc(meta.get("prompt_tokens", 0))
            cached.labels(tenant=tenant).inc(meta.get("cached_tokens", 0))
        if reason == "abort":
            return
        e2e = meta["e2e_latency"]
        self.e2e.observe(e2e)
        tokens = meta["completion_tokens"]
        if tokens >= 1 and "ttft" in meta:
            self.ttft.observe(meta["ttft"])
            if tokens >= 2:
                self.tpot.observe(max(0.0, e2e - meta["ttft"]) / (tokens - 1))

    def render_tenant(self, tenant: str) -> bytes:
        """What a tenant's key sees (--api-key-file, not an admin key): its own tenant's series
        only. Every other number (queues, pages, pins, token counters, latencies, HTTP answers)
        moves with other tenants' traffic."""
        return generate_latest(_OneTenant(self._exposed, tenant))  # type: ignore[arg-type]

    def render(self, stats: SchedulerStats | None, restarts: int = 0, recovered: int = 0) -> bytes:
        """The Prometheus text exposition, with `stats` as the scheduler's current numbers (None
        while it cannot answer) and the front's counts of engine restarts and resumed requests."""
        self._scheduler.stats = stats
        self._recovery.restarts, self._recovery.recovered = restarts, recovered
        return generate_latest(self._exposed)
