"""The compose file: the compose-spec schema, profiles, GPU reservation, and that every name, port and
path it refers to exists."""

from __future__ import annotations

import importlib.resources
import json
import re
from urllib.parse import urlsplit

import jsonschema
import yaml

OUR_SERVICES = {"gateway", "model-prep", "worker-vllm", "worker-cpu", "validate"}


def test_compose_file_matches_the_compose_spec(deploy):
    schema_text = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath(
        "compose-spec.json"
    )
    schema = json.loads(schema_text.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    document = yaml.safe_load(deploy.interpolate_defaults(deploy.COMPOSE_FILE.read_text()))
    errors = sorted(validator_class(schema).iter_errors(document), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # The check can fail: a misspelt service key is not in the spec.
    broken = {
        **document,
        "services": {**document["services"], "gateway": {**document["services"]["gateway"], "port": [1]}},
    }
    assert list(validator_class(schema).iter_errors(broken))


def test_profiles_pick_one_worker(compose):
    services = compose["services"]
    assert "profiles" not in services["gateway"]
    assert services["worker-vllm"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    # Both workers serve the INT8 checkpoint model-prep writes.
    assert services["model-prep"]["profiles"] == ["gpu", "cpu"]
    assert services["validate"]["profiles"] == ["validate"]
    # Optional: the stack runs where no Grafana image can be had.
    assert services["grafana"]["profiles"] == ["grafana"]
    for worker in ("worker-vllm", "worker-cpu"):
        assert services[worker]["networks"]["default"]["aliases"] == ["worker"]


def test_gpu_worker_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["worker-vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert (
        compose["services"]["worker-vllm"]["depends_on"]["model-prep"]["condition"]
        == "service_completed_successfully"
    )


def _listening_port(service, cli_args, deploy, name):
    lines = deploy.command_lines_of_compose_service(name, service)
    return cli_args(lines[0]).port


def test_ports_and_addresses_agree(deploy, compose, cli_args):
    services = compose["services"]
    hosts = {name: name for name in services}
    for name in ("worker-vllm", "worker-cpu"):
        hosts["worker"] = name  # both answer to the alias; their ports must then agree
    ports = {
        name: _listening_port(services[name], cli_args, deploy, name)
        for name in ("gateway", "worker-vllm", "worker-cpu")
    }
    assert ports["worker-vllm"] == ports["worker-cpu"], (
        "the two workers behind one alias must listen on one port"
    )
    ports["worker"] = ports["worker-cpu"]
    ports["prometheus"], ports["grafana"] = 9090, 3000

    upstream = urlsplit(services["gateway"]["environment"]["SQUEEZESERVE_GATEWAY_UPSTREAMS"])
    assert ports[upstream.hostname] == upstream.port
    published = services["gateway"]["ports"][0].split(":")
    assert int(published[-1]) == ports["gateway"]
    for name in ("gateway", "worker-vllm", "worker-cpu"):
        url = re.search(r"http://[^'\"]+", " ".join(services[name]["healthcheck"]["test"])).group(0)
        assert urlsplit(url).port == ports[name], f"{name} healthcheck probes {url}"

    prometheus = yaml.safe_load((deploy.COMPOSE_FILE.parent / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert len(targets) == 2
    for target in targets:
        host, port = target.split(":")
        assert host in hosts and ports[host] == int(port), f"prometheus target {target}"

    datasource = yaml.safe_load(
        (
            deploy.COMPOSE_FILE.parent / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
        ).read_text()
    )["datasources"][0]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and url.port == ports["prometheus"]


def test_validate_targets_the_gateway_and_the_served_model(deploy, compose, cli_args):
    services = compose["services"]
    [line] = deploy.command_lines_of_compose_service("validate", services["validate"])
    candidate = line.argv[line.argv.index("--candidate") + 1]
    url, model = candidate.split("#")
    assert urlsplit(url).hostname == "gateway" and urlsplit(url).port == 8000
    for worker in ("worker-vllm", "worker-cpu"):
        [worker_line] = deploy.command_lines_of_compose_service(worker, services[worker])
        assert cli_args(worker_line).served_model_name == model
    assert services["validate"]["depends_on"]["gateway"]["condition"] == "service_healthy"
    # It authenticates with the gateway's own key file (a secret, not an environment value).
    assert services["validate"]["secrets"] == services["gateway"]["secrets"] == ["api-keys"]
    assert services["validate"]["environment"]["SQUEEZESERVE_API_KEY_FILE"] == "/run/secrets/api-keys"
    assert "reports:/reports" in services["validate"]["volumes"]


def test_referenced_files_images_and_volumes_exist(deploy, compose):
    base = deploy.COMPOSE_FILE.parent
    declared_volumes = set(compose["volumes"])
    for name, service in compose["services"].items():
        if "build" in service:
            context = (base / service["build"]["context"]).resolve()
            dockerfile = context / service["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
            assert service["image"].split(":")[0] == "squeezeserve/" + dockerfile.name.removesuffix(
                ".Dockerfile"
            )
        if name in OUR_SERVICES:
            app_version = yaml.safe_load((deploy.CHART / "Chart.yaml").read_text())["appVersion"]
            assert service["image"].endswith(f":{app_version}"), f"{name}: image tag must be the app version"
        for volume in service.get("volumes", []):
            source = deploy.interpolate_defaults(volume).split(":")[0]
            if source.startswith("."):
                assert (base / source).exists(), f"{name}: bind mount {source} does not exist"
            else:
                assert source in declared_volumes, f"{name}: volume {source} is not declared"
    provider = yaml.safe_load(
        (base / "grafana" / "provisioning" / "dashboards" / "squeezeserve.yaml").read_text()
    )
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    dashboards = base / mounts[provider["providers"][0]["options"]["path"]]
    assert (dashboards / "squeezeserve.json").is_file()
