"""Every rendered and plain manifest validates against the Kubernetes API schemas of a pinned version.

The schemas ship inside the kubernetes-validate package (no download). Strict mode: an unknown or misspelt
field fails instead of being silently dropped by the API server.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion >=1.29) is end-of-life upstream; 1.31 is
# the oldest still maintained by the major clouds, so the manifests must be valid there.
KUBERNETES_VERSION = "1.31.0"
# Custom resources: no schema in the Kubernetes API; test_helm_chart checks their structure.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _validate_all(docs, origin):
    failures, checked = [], 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(part) for part in error.path)
            failures.append(f"{origin} {doc['kind']}/{doc['metadata']['name']} at {path}: {error.message}")
    assert not failures, "\n".join(failures)
    return checked


def test_helm_renders_are_valid_kubernetes(helm_renders):
    for name, docs in helm_renders.items():
        assert _validate_all(docs, f"helm[{name}]") >= 6  # the smallest set (cpu) has six objects


def test_kustomize_builds_are_valid_kubernetes(kustomize_builds):
    for name, docs in kustomize_builds.items():
        assert _validate_all(docs, f"kustomize[{name}]") >= 10


def test_the_validator_rejects_a_misspelt_field(kustomize_builds):
    """The check above can fail: a field the API does not know is an error in strict mode."""
    deployment = next(doc for doc in kustomize_builds["base"] if doc["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_overlays_differ_only_where_meant(kustomize_builds):
    def worker(docs):
        deployment = next(
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "squeezeserve-worker"
        )
        return deployment["spec"]["template"]["spec"]

    cpu, gpu = worker(kustomize_builds["cpu"]), worker(kustomize_builds["gpu"])
    assert cpu["containers"][0]["image"].startswith("squeezeserve/worker-cpu:")
    assert gpu["containers"][0]["image"].startswith("squeezeserve/worker-vllm:")
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"].get("limits", {})
    assert [c["name"] for c in gpu.get("initContainers", [])] == ["model-prep"]
    for overlay in ("cpu", "gpu"):
        kinds = {doc["kind"] for doc in kustomize_builds[overlay]}
        assert {"Namespace", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job",
                "ConfigMap", "PersistentVolumeClaim"} <= kinds  # fmt: skip
        namespaced = [doc for doc in kustomize_builds[overlay] if doc["kind"] != "Namespace"]
        assert {doc["metadata"].get("namespace") for doc in namespaced} == {"squeezeserve"}
