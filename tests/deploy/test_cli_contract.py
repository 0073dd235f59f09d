"""Every `squeezeserve ...` command line in the Dockerfiles, the compose file, the Helm renders and the
kustomize builds is parsed by the real CLI parser, and what it says (ports, model names, settings) matches
the rest of the manifest.

The validation Job and the model-prep step call `validate` and `compress`; their command lines are checked
in their own test (test_validate_and_compress_command_lines_parse) so that a missing command shows by name.
"""

from __future__ import annotations

import re
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

LATER_COMMANDS = {"validate", "compress"}
SERVING_COMMANDS = {"gateway", "worker"}


def test_every_manifest_family_contributes_command_lines(command_lines):
    sources = " ".join(line.source for line in command_lines)
    for family in ("helm[", "kustomize[", "compose service", ".Dockerfile CMD"):
        assert family in sources
    assert {line.subcommand for line in command_lines} == SERVING_COMMANDS | LATER_COMMANDS


def test_serving_command_lines_parse(command_lines, cli_args):
    checked = [cli_args(line) for line in command_lines if line.subcommand in SERVING_COMMANDS]
    assert len(checked) >= 20


def test_validate_and_compress_command_lines_parse(command_lines, cli_args):
    checked = [cli_args(line) for line in command_lines if line.subcommand in LATER_COMMANDS]
    assert len(checked) >= 6


def test_the_cli_help_runs_for_each_deployed_command(command_lines):
    for command in sorted({line.subcommand for line in command_lines} & SERVING_COMMANDS):
        result = subprocess.run(
            [sys.executable, "-m", "squeezeserve.service.cli", command, "--help"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0 and "--port" in result.stdout, result.stderr


def _http_port(container):
    return next(p["containerPort"] for p in container.get("ports", []) if p["name"] == "http")


def test_containers_listen_where_ports_and_probes_point(workloads, cli_args, deploy):
    for workload in workloads:
        for container in workload.containers(include_init=False):
            for line in deploy.command_lines_of_container(container, workload.source):
                if line.subcommand not in SERVING_COMMANDS:
                    continue
                args = cli_args(line)
                assert args.host == "0.0.0.0", line.source
                assert args.port == _http_port(container), f"{line.source}: listens on {args.port}"
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert container[probe]["httpGet"]["port"] in ("http", args.port), (
                        f"{line.source} {probe}"
                    )


def _probe_paths(workloads, container_name):
    paths = set()
    for workload in workloads:
        for container in workload.containers(include_init=False):
            if container["name"] == container_name:
                paths |= {
                    container[p]["httpGet"]["path"]
                    for p in ("startupProbe", "readinessProbe", "livenessProbe")
                }
    return paths


def test_gateway_probes_and_metrics_are_real_gateway_routes(workloads):
    """Asked over the real app: a probe path the gateway does not serve answers 404 and fails here."""
    from fastapi.testclient import TestClient

    from squeezeserve.service.gateway.app import create_app
    from squeezeserve.service.gateway.config import build_settings

    paths = _probe_paths(workloads, "gateway") | {"/metrics"}
    assert paths == {"/livez", "/readyz", "/metrics"}
    # Port 9 (discard) on loopback: nothing listens, so the upstream is simply unhealthy.
    with TestClient(create_app(build_settings(upstreams=["http://127.0.0.1:9"]))) as client:
        statuses = {path: client.get(path).status_code for path in sorted(paths)}
    assert statuses["/livez"] == 200 and statuses["/metrics"] == 200
    assert statuses["/readyz"] == 503, "no healthy upstream: the gateway must say it is not ready"


def _gateway_environments(helm_renders, kustomize_builds, compose):
    for origin, docs in [
        *(("helm", d) for d in helm_renders.values()),
        *(("kustomize", d) for d in kustomize_builds.values()),
    ]:
        for doc in docs:
            if doc["kind"] == "ConfigMap" and any(
                key.startswith("SQUEEZESERVE_GATEWAY_") for key in doc["data"]
            ):
                yield f"{origin} ConfigMap/{doc['metadata']['name']}", dict(doc["data"])
    # A path under /run/secrets/ is where compose mounts the secret's file: read the file compose would mount.
    secrets = {
        f"/run/secrets/{name}": re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", secret["file"])
        for name, secret in compose.get("secrets", {}).items()
    }
    environment = compose["services"]["gateway"]["environment"].items()
    yield "compose gateway", {k: secrets.get(str(v), str(v)) for k, v in environment}


def test_gateway_environment_is_accepted_by_the_real_settings(
    helm_renders, kustomize_builds, compose, monkeypatch
):
    from squeezeserve.service.gateway.config import GatewaySettings, SettingsError, build_settings

    for origin, environment in _gateway_environments(helm_renders, kustomize_builds, compose):
        for name in environment:
            field = name.removeprefix("SQUEEZESERVE_GATEWAY_").lower()
            # pydantic-settings ignores unknown prefixed variables: a typo would silently change nothing.
            assert field in GatewaySettings.model_fields, f"{origin}: {name} is not a gateway setting"
        with monkeypatch.context() as patched:
            for name, value in environment.items():
                patched.setenv(name, re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value))
            try:
                settings = build_settings()
            except SettingsError as error:
                pytest.fail(f"{origin}: the gateway refuses these settings: {error}")
        assert settings.upstreams, origin


def test_validation_jobs_target_the_gateway_and_the_served_model(workloads, deploy):
    for workload in workloads:
        if workload.kind != "Job":
            continue
        [line] = deploy.command_lines_of_container(workload.pod_spec["containers"][0], workload.source)
        candidate = line.argv[line.argv.index("--candidate") + 1]
        url, _, model = candidate.partition("#")
        assert model == "smollm2-135m-instruct", line.source
        assert urlsplit(url).path == "/v1" and urlsplit(url).port == 8000, line.source
        assert urlsplit(url).hostname.split(".")[0].endswith("-gateway"), line.source
        dataset = line.argv[line.argv.index("--dataset") + 1]
        mounts = {m["mountPath"] for m in workload.pod_spec["containers"][0]["volumeMounts"]}
        assert dataset.rsplit("/", 1)[0] in mounts, f"{line.source}: the dataset is not on a mounted volume"
