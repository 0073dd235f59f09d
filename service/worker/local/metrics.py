"""Prometheus metrics of the embedded worker (one registry per app, so several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from squeezeserve.service.worker.local.engine import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class WorkerMetrics:
    def __init__(self, stats: EngineStats, model: str) -> None:
        self.registry = CollectorRegistry()
        ns = "squeezeserve_worker"
        self.requests = Counter(
            f"{ns}_requests",
            "Requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(f"{ns}_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter(
            f"{ns}_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.ttft = Histogram(
            f"{ns}_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            f"{ns}_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            f"{ns}_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        running = Gauge(
            f"{ns}_num_requests_running", "Sequences in the running batch", registry=self.registry
        )
        running.set_function(lambda: stats.running)
        waiting = Gauge(
            f"{ns}_num_requests_waiting", "Requests waiting for a batch slot", registry=self.registry
        )
        waiting.set_function(lambda: stats.waiting)
        steps = Gauge(f"{ns}_decode_steps", "Decode steps run so far", registry=self.registry)
        steps.set_function(lambda: stats.steps)
        mean_batch = Gauge(
            f"{ns}_mean_batch_size", "Mean rows per decode step so far", registry=self.registry
        )
        mean_batch.set_function(lambda: stats.batch_rows / stats.steps if stats.steps else 0.0)
        info = Gauge(f"{ns}_model_info", "The model this worker serves", ["model"], registry=self.registry)
        info.labels(model=model).set(1)
