"""The Helm chart: lint, schema, rendering with several value sets, names, labels and selectors."""

from __future__ import annotations

import re
import tomllib

import helm_python
import pytest
import yaml

KUBE_VERSION = "v1.31.0"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def test_chart_lints_clean_in_strict_mode(deploy):
    for name, path in deploy.VALUE_SETS.items():
        report = helm_python.lint(
            deploy.CHART, yaml.safe_load(path.read_text()) or {}, strict=True, kube_version=KUBE_VERSION
        )
        # Severity 1 is informational (e.g. "icon is recommended"); warnings (2) and errors (3) fail.
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], (
            f"helm lint with values {name}: {problems or report['errors']}"
        )


def test_chart_and_app_versions_follow_the_package(deploy):
    package_version = tomllib.loads((deploy.REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((deploy.CHART / "Chart.yaml").read_text())
    assert chart["version"] == package_version
    assert chart["appVersion"] == package_version


@pytest.mark.parametrize(
    "bad_values, where",
    [
        ({"gateway": {"image": {"tag": "latest"}}}, "/gateway/image/tag"),
        ({"worker": {"engine": "tensorrt"}}, "/worker/engine"),
        ({"worker": {"modelPrep": {"method": "int3"}}}, "/worker/modelPrep/method"),
        ({"gateway": {"settings": {"upstreams": "http://x:1"}}}, "upstreams"),  # the chart owns upstreams
        ({"gateway": {"port": 70000}}, "/gateway/port"),
        ({"gateway": {"replicas": 3}}, "replicas"),  # a typo for replicaCount must not pass silently
        ({"worker": {"persistence": {"size": "20GB"}}}, "/worker/persistence/size"),
    ],
)
def test_schema_rejects_bad_values(deploy, bad_values, where):
    with helm_python.Chart.load(deploy.CHART) as chart, pytest.raises(helm_python.HelmValuesError) as caught:
        chart.validate_schema(bad_values)
    assert where in str(caught.value)


def test_every_value_is_documented(deploy):
    """helm-docs convention: every leaf value, or a mapping above it, carries a `# --` comment."""
    lines = (deploy.CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    covered_below = None  # indentation of a documented key whose subtree is covered
    for index, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).split(" #")[0].strip()
        if covered_below is not None:
            if indent > covered_below:
                continue
            covered_below = None
        comments = []
        above = index - 1
        while above >= 0 and lines[above].strip().startswith("#"):
            comments.append(lines[above].strip())
            above -= 1
        if any(comment.startswith("# --") for comment in comments):
            covered_below = indent
        elif rest:  # a leaf without documentation
            undocumented.append(f"line {index + 1}: {key}")
    assert not undocumented, "values without a `# --` comment:\n" + "\n".join(undocumented)


def test_names_fit_in_a_dns_label(helm_renders):
    for value_set, docs in helm_renders.items():
        for doc in docs:
            name = doc["metadata"]["name"]
            assert DNS_LABEL.match(name), f"helm[{value_set}] {doc['kind']} name {name!r} is not a DNS label"


def test_long_release_names_are_cut_to_63_characters(helm_renders):
    names = [doc["metadata"]["name"] for doc in helm_renders["validation-job"]]
    assert max(map(len, names)) == 63  # the 53-character release name forces the cut


def _selector_labels(doc):
    spec = doc["spec"]
    return (
        spec["selector"]["matchLabels"]
        if "matchLabels" in spec.get("selector", {})
        else spec.get("selector", {})
    )


def test_selectors_are_separate_from_user_and_version_labels(helm_renders):
    for value_set, docs in helm_renders.items():
        for doc in docs:
            if doc["kind"] not in ("Deployment", "Service", "PodDisruptionBudget"):
                continue
            selector = _selector_labels(doc)
            assert set(selector) == {
                "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"
            }, f"helm[{value_set}] {doc['kind']}/{doc['metadata']['name']} selector {selector}"  # fmt: skip


def test_services_and_budgets_select_the_pods_they_mean(helm_renders):
    for value_set, docs in helm_renders.items():
        pods = {
            doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"]
            for doc in docs
            if doc["kind"] == "Deployment"
        }
        for doc in docs:
            if doc["kind"] in ("Service", "PodDisruptionBudget", "ServiceMonitor"):
                selector = _selector_labels(doc)
                matched = [name for name, labels in pods.items() if selector.items() <= labels.items()]
                meant = doc["metadata"]["name"].removesuffix("-pods")  # a headless Service: the same Pods
                assert matched == [meant], (
                    f"helm[{value_set}] {doc['kind']}/{doc['metadata']['name']} selects {matched}"
                )
            if doc["kind"] == "HorizontalPodAutoscaler":
                assert doc["spec"]["scaleTargetRef"]["name"] in pods


def test_service_monitors_scrape_a_named_service_port(helm_renders):
    docs = helm_renders["full"]
    services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
    monitors = [doc for doc in docs if doc["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for monitor in monitors:
        service = services[monitor["metadata"]["name"]]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        port_names = {port["name"] for port in service["spec"]["ports"]}
        assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= port_names
        assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_gateway_finds_workers_through_the_worker_service(helm_renders):
    for value_set, docs in helm_renders.items():
        services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
        config = next(
            d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-gateway")
        )
        first = config["data"]["SQUEEZESERVE_GATEWAY_UPSTREAMS"].split(",")[0]
        match = re.fullmatch(rf"(dns\+)?http://([a-z0-9-]+)\.{NAMESPACE_RE}\.svc:(\d+)", first)
        assert match, f"helm[{value_set}] upstream {first!r} is not a Service URL"
        service = services[match.group(2)]
        assert service["metadata"]["labels"]["app.kubernetes.io/component"] in ("worker", "worker-pods")
        assert int(match.group(3)) in {port["port"] for port in service["spec"]["ports"]}
        # One worker: its Service. Several: every Pod through a headless Service, so each is routed to.
        worker = next(
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker")
        )
        several = worker["spec"]["replicas"] > 1
        assert bool(match.group(1)) == several, f"helm[{value_set}]: {first!r}"
        assert (service["spec"].get("clusterIP") == "None") == several


NAMESPACE_RE = "llm"


def test_optional_parts_follow_their_switches(helm_renders):
    kinds = {name: sorted({doc["kind"] for doc in docs}) for name, docs in helm_renders.items()}
    assert "Job" not in kinds["gpu-default"] and "ServiceMonitor" not in kinds["gpu-default"]
    assert "Secret" not in kinds["gpu-default"]  # no keys given: no Secret, nothing to leak
    assert "HorizontalPodAutoscaler" not in kinds["cpu"] and "PodDisruptionBudget" not in kinds["cpu"]
    assert "PersistentVolumeClaim" not in kinds["cpu"]
    assert {"Job", "ServiceMonitor", "Secret"} <= set(kinds["full"])
    job = next(doc for doc in helm_renders["full"] if doc["kind"] == "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "test"
    plain_job = next(doc for doc in helm_renders["validation-job"] if doc["kind"] == "Job")
    assert "helm.sh/hook" not in plain_job["metadata"].get("annotations", {})


def test_gpu_worker_requests_a_gpu_and_cpu_worker_does_not(helm_renders):
    def worker(docs):
        deployment = next(
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker")
        )
        return deployment["spec"]["template"]["spec"]["containers"][0]

    gpu = worker(helm_renders["gpu-default"])["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 1 and gpu["requests"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in worker(helm_renders["cpu"])["resources"].get("limits", {})


def test_the_chart_ships_the_same_validation_sample_as_kustomize(deploy):
    chart_copy = (deploy.CHART / "files" / "validation-sample.txt").read_bytes()
    assert chart_copy == (deploy.REPO / "k8s" / "base" / "validation-sample.txt").read_bytes()


def test_rendering_with_an_unknown_engine_fails_at_the_schema(deploy):
    with pytest.raises(helm_python.HelmValuesError):
        deploy.render_chart({"worker": {"engine": "llamacpp"}})


def test_tensor_parallel_workers_request_one_gpu_per_rank(helm_renders):
    docs = helm_renders["scale"]
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker"))
    container = worker["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    tail = args[args.index("--") + 1 :]
    assert tail == ["--tensor-parallel-size", "2", "--max-model-len", "4096"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["spec"]["replicas"] == 2
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-gateway"))
    assert config["data"]["SQUEEZESERVE_GATEWAY_ROUTING"] == "prefix_affinity"
    # the default values are untouched: one GPU, no "--" tail
    default = next(
        d
        for d in helm_renders["gpu-default"]
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker")
    )
    assert "--" not in default["spec"]["template"]["spec"]["containers"][0]["args"]
