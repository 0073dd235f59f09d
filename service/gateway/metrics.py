"""Prometheus metrics, in a registry of the app's own (two apps in one process never share counters).

Label cardinality is bounded: ``model`` is a model some upstream serves (anything else is recorded as
``unknown``), ``route`` is one of the OpenAI routes, ``upstream`` one of the configured URLs.

Several gateway processes (``--workers N``) run in Prometheus multiprocess mode: the CLI sets
``PROMETHEUS_MULTIPROC_DIR`` before they start, each writes its samples there, and whichever process
answers ``/metrics`` sums them all. The upstream gauges then cannot be read at scrape time from one
process's memory: every process writes them there each second instead (in-flight summed over the live
processes, health the minimum: 0 as soon as one process has ejected the upstream).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from squeezeserve.service.gateway.upstreams import Upstream, UpstreamRegistry

UNKNOWN_MODEL = "unknown"

# Seconds. LLM requests run from tens of milliseconds (a cached short answer) to minutes (long generations
# on CPU), so the buckets span 10 ms .. 10 min.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
IN_FLIGHT = ("squeezeserve_gateway_upstream_in_flight", "Requests in flight per upstream")
HEALTHY = ("squeezeserve_gateway_upstream_healthy", "1 if the upstream is healthy, else 0")
MULTIPROCESS_SAMPLE_S = 1.0


def multiprocess_mode() -> bool:
    """Whether this process shares its metrics with others (prometheus_client's own switch)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class _UpstreamCollector(Collector):
    """Reads in-flight counts and health from the registry at scrape time, so they are never stale."""

    def __init__(self, upstreams: UpstreamRegistry) -> None:
        self._upstreams = upstreams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(*IN_FLIGHT, labels=["upstream"])
        healthy = GaugeMetricFamily(*HEALTHY, labels=["upstream"])
        for upstream in self._upstreams.upstreams:
            in_flight.add_metric([upstream.url], upstream.in_flight)
            healthy.add_metric([upstream.url], 1.0 if upstream.healthy else 0.0)
        yield in_flight
        yield healthy


class GatewayMetrics:
    def __init__(self) -> None:
        self.multiprocess = multiprocess_mode()
        self.registry = CollectorRegistry()
        self._upstreams: UpstreamRegistry | None = None
        self._sampler: asyncio.Task[None] | None = None
        r = self.registry
        self.requests = Counter(
            "squeezeserve_gateway_requests",
            "Requests by route, model and status",
            ["route", "model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "squeezeserve_gateway_request_duration_seconds",
            "Time from request to the last byte of the response",
            ["route", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "squeezeserve_gateway_time_to_first_token_seconds",
            "Streams only: time from request to the first chunk carrying generated content",
            ["route", "model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "squeezeserve_gateway_tokens",
            "Tokens by direction (prompt = in, completion = out), from the upstreams' usage",
            ["model", "direction"],
            registry=r,
        )
        self.retries = Counter(
            "squeezeserve_gateway_upstream_retries",
            "Requests retried after a connection error",
            ["upstream"],
            registry=r,
        )
        self.rejections = Counter(
            "squeezeserve_gateway_rejections",
            "Requests refused by the gateway itself, by reason",
            ["reason"],
            registry=r,
        )

    def watch_upstreams(self, upstreams: UpstreamRegistry) -> None:
        """Report ``upstreams``' in-flight counts and health: read at scrape time in one process. With
        several, each writes its in-flight counts as they change (``in_flight_changed``) and its health
        now and every second after: call this from the running event loop, after the first probes. The
        shared health gauge is the minimum over the processes: a process that wrote "unhealthy" before
        probing showed every scrape an outage for a second."""
        if not self.multiprocess:
            self.registry.register(_UpstreamCollector(upstreams))
            return
        self._upstreams = upstreams
        self._in_flight = Gauge(*IN_FLIGHT, ["upstream"], registry=None, multiprocess_mode="livesum")
        self._healthy = Gauge(*HEALTHY, ["upstream"], registry=None, multiprocess_mode="livemin")
        self._sample_upstreams()
        self._sampler = asyncio.get_running_loop().create_task(self._sample_forever(), name="metrics-sampler")

    def in_flight_changed(self, upstream: Upstream) -> None:
        """With several processes, publish ``upstream``'s in-flight count as it changes: a scrape answered
        by another process then adds up exact counts, not each process's count as of its last sample."""
        if self._upstreams is not None:
            self._in_flight.labels(upstream.url).set(upstream.in_flight)

    def _sample_upstreams(self) -> None:
        assert self._upstreams is not None
        for upstream in self._upstreams.upstreams:
            self._in_flight.labels(upstream.url).set(upstream.in_flight)
            self._healthy.labels(upstream.url).set(1.0 if upstream.healthy else 0.0)

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(MULTIPROCESS_SAMPLE_S)
            self._sample_upstreams()

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers: this registry, or every process's samples in multiprocess mode."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        if self._upstreams is not None:
            self._sample_upstreams()  # this process's own values as of now
        aggregated = CollectorRegistry()
        multiprocess.MultiProcessCollector(aggregated)
        return generate_latest(aggregated)

    def close(self) -> None:
        """Stop sampling; in multiprocess mode drop this process's live gauges from the shared totals."""
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None
        if self.multiprocess:
            with contextlib.suppress(OSError):
                multiprocess.mark_process_dead(os.getpid())

    def record_usage(self, model: str, usage: object) -> None:
        """Count tokens from an OpenAI ``usage`` object (ignored when absent or malformed)."""
        if not isinstance(usage, dict):
            return
        for field, direction in (("prompt_tokens", "prompt"), ("completion_tokens", "completion")):
            count = usage.get(field)
            if isinstance(count, int) and count >= 0:
                self.tokens.labels(model, direction).inc(count)
