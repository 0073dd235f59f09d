"""Prometheus metrics, in a registry of the app's own (two apps in one process never share counters).

Label cardinality is bounded: ``model`` is a model some upstream serves (anything else is recorded as
``unknown``), ``route`` is one of the OpenAI routes, ``upstream`` one of the configured URLs.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from squeezeserve.service.gateway.upstreams import UpstreamRegistry

UNKNOWN_MODEL = "unknown"

# Seconds. LLM requests run from tens of milliseconds (a cached short answer) to minutes (long generations
# on CPU), so the buckets span 10 ms .. 10 min.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _UpstreamCollector(Collector):
    """Reads in-flight counts and health from the registry at scrape time, so they are never stale."""

    def __init__(self, upstreams: UpstreamRegistry) -> None:
        self._upstreams = upstreams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "squeezeserve_gateway_upstream_in_flight", "Requests in flight per upstream", labels=["upstream"]
        )
        healthy = GaugeMetricFamily(
            "squeezeserve_gateway_upstream_healthy",
            "1 if the upstream is healthy, else 0",
            labels=["upstream"],
        )
        for upstream in self._upstreams.upstreams:
            in_flight.add_metric([upstream.url], upstream.in_flight)
            healthy.add_metric([upstream.url], 1.0 if upstream.healthy else 0.0)
        yield in_flight
        yield healthy


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.registry.register(_UpstreamCollector(upstreams))

    def record_usage(self, model: str, usage: object) -> None:
        """Count tokens from an OpenAI ``usage`` object (ignored when absent or malformed)."""
        if not isinstance(usage, dict):
            return
        for field, direction in (("prompt_tokens", "prompt"), ("completion_tokens", "completion")):
            count = usage.get(field)
            if isinstance(count, int) and count >= 0:
                self.tokens.labels(model, direction).inc(count)
