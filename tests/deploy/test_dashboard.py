"""The Grafana dashboard: every metric it queries exists under that name (and with those labels) in the
real gateway and embedded-worker registries, and it covers what the issue asks for."""

from __future__ import annotations

import json
import re

import httpx

# vLLM 0.26's own names (its metrics documentation); vLLM is not installable on this machine, so these are
# the one part of the dashboard checked against a list rather than the running code.
VLLM_METRICS = {
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
}
SAMPLE_SUFFIXES = ("_bucket", "_total", "_count", "_sum", "_created")


def _dashboard(deploy):
    return json.loads(
        (deploy.COMPOSE_FILE.parent / "grafana" / "dashboards" / "squeezeserve.json").read_text()
    )


def _expressions(dashboard):
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def _real_families():
    """Metric family name -> label names, from the real registries."""
    from squeezeserve.service.gateway.metrics import GatewayMetrics
    from squeezeserve.service.gateway.upstreams import UpstreamRegistry
    from squeezeserve.service.worker.local.engine import EngineStats
    from squeezeserve.service.worker.local.metrics import WorkerMetrics

    gateway = GatewayMetrics()
    gateway.watch_upstreams(
        UpstreamRegistry(
            ["http://127.0.0.1:9"],
            httpx.AsyncClient(),
            health_interval=5,
            health_timeout=1,
            unhealthy_threshold=3,
        )  # fmt: skip
    )
    worker = WorkerMetrics(EngineStats(), "smollm2-135m-instruct")
    families: dict[str, set[str]] = {}
    for registry in (gateway.registry, worker.registry):
        for family in registry.collect():
            labels = {label for sample in family.samples for label in sample.labels} - {"le"}
            names = {family.name} | {family.name + suffix for suffix in SAMPLE_SUFFIXES}
            for name in names:
                families.setdefault(name, set()).update(labels)
    # Labelled counters and histograms have no samples until first used: take their declared label names.
    for metric in (gateway.requests, gateway.latency, gateway.ttft, gateway.tokens, gateway.rejections):
        for suffix in ("",) + SAMPLE_SUFFIXES:
            families.setdefault(metric._name + suffix, set()).update(metric._labelnames)
    return families


def test_every_queried_metric_exists_with_its_labels(deploy):
    families = _real_families()
    missing = []
    for expression in _expressions(_dashboard(deploy)):
        for metric, selector in re.findall(r"((?:squeezeserve_\w+)|(?:vllm:\w+))(\{[^}]*\})?", expression):
            if metric.startswith("vllm:"):
                base = metric
                for suffix in SAMPLE_SUFFIXES:
                    base = base.removesuffix(suffix)
                if base not in VLLM_METRICS:
                    missing.append(metric)
                continue
            if metric not in families:
                missing.append(metric)
                continue
            used = set(re.findall(r"(\w+)\s*=~?", selector or ""))
            grouped = set()
            for group in re.findall(r"by \(([^)]*)\)[^()]*\(?[^()]*" + re.escape(metric), expression):
                grouped |= {label.strip() for label in group.split(",")} - {"le"}
            unknown = (used | grouped) - families[metric]
            if unknown:
                missing.append(f"{metric} has no label {sorted(unknown)}")
    assert not missing, "dashboard queries names the services do not expose:\n" + "\n".join(missing)


def test_dashboard_covers_the_issue_and_uses_the_provisioned_datasource(deploy):
    dashboard = _dashboard(deploy)
    text = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    topics = ("requests", "error", "time to first token", "time per output token", "tokens / s", "in flight")
    for topic in (*topics, "upstream health"):
        assert topic in text, f"no panel about {topic}"
    expressions = " ".join(_expressions(dashboard))
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}," in expressions
    datasource = (
        deploy.COMPOSE_FILE.parent / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
    ).read_text()
    uid = re.search(r"uid: (\S+)", datasource).group(1)
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {uid}
    cells = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        here = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert grid["x"] + grid["w"] <= 24 and not (cells & here), f"panel {panel['title']} overlaps another"
        cells |= here
