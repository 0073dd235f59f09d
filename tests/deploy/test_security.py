"""Security basics across every workload (Helm renders with each value set, kustomize builds), compose
file and Dockerfile: non-root, no privilege escalation, resource requests, pinned images, probes, no
plaintext secrets."""

from __future__ import annotations

import re

SECRET_NAME = re.compile(r"(KEY|TOKEN|PASSWORD|SECRET)", re.IGNORECASE)
# Long-running containers (Deployments) need all three probes; the startup probe carries the model load.
MIN_WORKER_STARTUP_SECONDS = {"worker-cpu": 120, "worker-vllm": 600}


def pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in {"", "latest"}


def test_pods_run_as_non_root(workloads):
    for workload in workloads:
        context = workload.pod_spec.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, workload.source
        assert context.get("runAsUser", 0) != 0, workload.source
        assert context.get("seccompProfile", {}).get("type") == "RuntimeDefault", workload.source
        assert workload.pod_spec.get("automountServiceAccountToken") is False, workload.source
        for container in workload.containers():
            own = container.get("securityContext", {})
            where = f"{workload.source} container {container['name']}"
            assert own.get("runAsUser", 1) != 0 and own.get("privileged") is not True, where
            assert own.get("allowPrivilegeEscalation") is False, where
            assert own.get("capabilities", {}).get("drop") == ["ALL"], where


def test_every_container_requests_cpu_and_memory_and_caps_memory(workloads):
    for workload in workloads:
        for container in workload.containers():
            resources = container.get("resources", {})
            where = f"{workload.source} container {container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert "memory" in resources.get("limits", {}), where


def test_images_are_pinned(deploy, workloads, compose, dockerfiles):
    images = [(w.source, c["image"]) for w in workloads for c in w.containers()]
    services = compose["services"].items()
    images += [(f"compose {name}", deploy.interpolate_defaults(s["image"])) for name, s in services]
    images += [(f"{name} FROM", image) for name, d in dockerfiles.items() for image in d.base_images()]
    unpinned = [f"{where}: {image}" for where, image in images if not pinned(image)]
    assert not unpinned, "\n".join(unpinned)


def test_long_running_containers_have_three_probes_and_drain(workloads):
    for workload in workloads:
        if workload.kind != "Deployment":
            continue
        grace = workload.pod_spec["terminationGracePeriodSeconds"]
        for container in workload.containers(include_init=False):
            where = f"{workload.source} container {container['name']}"
            probes = [container.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
            assert all(probes), f"{where}: startup, readiness and liveness probes are all required"
            pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
            assert pre_stop[0] == "sleep" and int(pre_stop[1]) < grace, where
            image = container["image"].split("/")[-1].split(":")[0]
            if image in MIN_WORKER_STARTUP_SECONDS:
                startup = container["startupProbe"]
                budget = startup["periodSeconds"] * startup["failureThreshold"]
                assert budget >= MIN_WORKER_STARTUP_SECONDS[image], f"{where}: startup budget {budget}s"
                assert grace >= 60, f"{where}: {grace}s is too short to finish running generations"


def test_no_secret_is_written_in_plain_text(workloads, compose, dockerfiles, helm_renders, kustomize_builds):
    for workload in workloads:
        for container in workload.containers():
            for variable in container.get("env", []):
                if SECRET_NAME.search(variable["name"]):
                    assert "value" not in variable, f"{workload.source}: {variable['name']} set in plain text"
    for name, service in compose["services"].items():
        for variable, value in (service.get("environment") or {}).items():
            if SECRET_NAME.search(variable):
                # A file holding it (a mounted secret), or interpolated from the operator's environment;
                # never a literal.
                assert re.fullmatch(r"/run/secrets/[\w.-]+|\$\{[A-Z_]+(:-)?\}", str(value)), (
                    f"compose {name}: {variable}={value}"
                )
    for name, dockerfile in dockerfiles.items():
        for instruction in dockerfile.all("ENV") + dockerfile.all("ARG"):
            assert not SECRET_NAME.search(instruction.value.split("=")[0]), f"{name}:{instruction.line}"
    assert not [d for d in helm_renders["gpu-default"] if d["kind"] == "Secret"]
    for docs in kustomize_builds.values():
        assert not [d for d in docs if d["kind"] == "Secret"], (
            "kustomize must not carry keys; users create them"
        )


def test_images_run_as_a_numeric_non_root_user(dockerfiles):
    for name, dockerfile in dockerfiles.items():
        user = dockerfile.last("USER")
        assert user is not None, f"{name}: final stage has no USER"
        uid = user.value.split(":")[0]
        assert uid.isdigit() and int(uid) != 0, (
            f"{name}: USER {user.value} (numeric, so runAsNonRoot can verify it)"
        )
        assert dockerfile.last("HEALTHCHECK") is not None, f"{name}: final stage has no HEALTHCHECK"


def test_compose_services_of_ours_are_hardened(compose):
    for name, service in compose["services"].items():
        if not service["image"].startswith("squeezeserve/"):
            continue
        assert service.get("user", "0").split(":")[0] not in {"0", "root"}, name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("cap_drop") == ["ALL"], name
