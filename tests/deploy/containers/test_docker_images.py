"""The images on their own: what each adds over its base, how fast a container is up, and the user and
environment it runs with. Targets (issue 14): the gateway adds at most 80 MB and answers within 5 s of
start; the CPU worker answers within 60 s of start."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from .conftest import answers, checked, health, inspect, run, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

GATEWAY_MAX_ADDED_MB = 80
GATEWAY_READY_S = 5
WORKER_READY_S = 60
USER = "10001:10001"
SECRET_NAME = re.compile(r"(KEY|TOKEN|PASSWORD|SECRET)\w*=\S", re.IGNORECASE)


@pytest.fixture
def started() -> Iterator[list[str]]:
    """Containers a test starts (append their names); removed afterwards, whatever happened."""
    names: list[str] = []
    yield names
    for name in names:
        run(["docker", "rm", "--force", "--volumes", name], timeout=60)


def start(started: list[str], image: str, *options: str, port: int) -> tuple[str, int]:
    """``docker run -d`` with the container port published on a free loopback port; (name, host port)."""
    name = f"sqtest-{uuid.uuid4().hex[:8]}"
    started.append(name)
    checked(["docker", "run", "-d", "--name", name, "-p", f"127.0.0.1::{port}", *options, image], timeout=60)
    published = checked(["docker", "port", name, f"{port}/tcp"], timeout=30).split()[0]
    return name, int(published.rsplit(":", 1)[1])


def _seconds_since_start(name: str) -> float:
    """From the container's start (Docker's clock) to now."""
    from datetime import UTC, datetime

    started_at = inspect(name)["State"]["StartedAt"]
    started = datetime.fromisoformat(started_at[:26].rstrip("Z") + "+00:00")
    return (datetime.now(UTC) - started).total_seconds()


def test_gateway_image_adds_at_most_80_mb_over_its_base_and_has_no_torch(images, measurements):
    added = inspect(images.tags["gateway"])["Size"] - inspect(images.bases["gateway"])["Size"]
    measurements.setdefault("image_added_mb", {})["gateway"] = round(added / 1e6, 1)
    worker_added = inspect(images.tags["worker-cpu"])["Size"] - inspect(images.bases["worker-cpu"])["Size"]
    measurements["image_added_mb"]["worker-cpu"] = round(worker_added / 1e6, 1)

    no_torch = run(
        ["docker", "run", "--rm", "--entrypoint", "python", images.tags["gateway"], "-c",
         "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"],
        timeout=120,
    )  # fmt: skip

    assert added <= GATEWAY_MAX_ADDED_MB * 1e6, f"the gateway image adds {added / 1e6:.1f} MB over its base"
    assert no_torch.returncode == 0, "torch is importable in the gateway image"


def test_gateway_answers_within_5_s_of_start_and_turns_healthy(images, measurements, started):
    # Hardened as compose runs it; port 9 on loopback: nothing there, so no upstream is healthy (/livez
    # is about the process, not the upstreams).
    name, port = start(
        started,
        images.tags["gateway"],
        "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
        "-e", "SQUEEZESERVE_GATEWAY_UPSTREAMS=http://127.0.0.1:9",
        port=8000,
    )  # fmt: skip

    wait_for("the gateway's /livez answering", lambda: answers(f"http://127.0.0.1:{port}/livez"), 60, 0.05)
    ready_s = _seconds_since_start(name)
    # Docker's own check runs every `interval` (the image's HEALTHCHECK); healthy at its first probe.
    wait_for("Docker reporting the gateway healthy", lambda: health(name) == "healthy", 60, 0.2)
    healthy_s = _seconds_since_start(name)
    measurements["gateway_start_s"] = {
        "answers_livez": round(ready_s, 2),
        "docker_healthy": round(healthy_s, 2),
    }

    assert ready_s <= GATEWAY_READY_S, f"the gateway answered {ready_s:.1f}s after start"


def test_cpu_worker_answers_within_60_s_of_start_and_turns_healthy(images, measurements, started):
    name, port = start(
        started, images.tags["worker-cpu"], "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
        port=8001,
    )  # fmt: skip

    wait_for(
        "the CPU worker's /health answering", lambda: answers(f"http://127.0.0.1:{port}/health"), 300, 0.2
    )
    ready_s = _seconds_since_start(name)
    wait_for("Docker reporting the CPU worker healthy", lambda: health(name) == "healthy", 120, 0.5)
    healthy_s = _seconds_since_start(name)
    measurements["worker_cpu_start_s"] = {
        "answers_health": round(ready_s, 2),
        "docker_healthy": round(healthy_s, 2),
    }

    assert ready_s <= WORKER_READY_S, f"the CPU worker answered {ready_s:.1f}s after start"


@pytest.mark.parametrize("service", ["gateway", "worker-cpu"])
def test_image_runs_as_the_non_root_user_and_carries_no_secret(images, service):
    image = images.tags[service]
    config = inspect(image)["Config"]
    uid = checked(["docker", "run", "--rm", "--entrypoint", "id", image, "-u"], timeout=120).strip()
    history = checked(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image], timeout=60)

    assert config["User"] == USER and uid == USER.split(":")[0]
    secrets = [line for line in [*config["Env"], *history.splitlines()] if SECRET_NAME.search(line)]
    assert not secrets, f"{image} carries a secret-looking setting:\n" + "\n".join(secrets)
