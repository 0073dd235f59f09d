"""A real Docker engine for the container tests (``pytest -m docker``): the images built from the repository,
and the base images and package sources they are built from.

No daemon, no compose v2, or no way to get a base image or torch: every test here is skipped, and the
reason is printed (``-ra``). Where Docker Hub or the PyTorch CPU index is out of reach, the local stand-ins
are used when this machine has them: ``local/python:3.11-bookworm`` and ``local/prometheus:bookworm`` for
the public bases, and the folder of wheels in pip's own ``find-links`` setting for torch (served over HTTP
on loopback for the build). The Dockerfiles' public defaults are what a plain ``docker build`` uses.

Figures (image sizes, start times, time to the first completion) are collected in ``measurements``; with
``SQUEEZESERVE_DOCKER_RESULTS=FILE`` they are written there as JSON at the end of the session.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DOCKER_DIR = REPO / "docker"
COMPOSE_FILE = REPO / "deploy" / "compose" / "compose.yaml"
IMAGES = {"gateway": "gateway.Dockerfile", "worker-cpu": "worker-cpu.Dockerfile"}
# Stand-ins for the public bases, built by the development machines' Docker setup from Debian packages.
STAND_INS = {"python": "local/python:3.11-bookworm", "prometheus": "local/prometheus:bookworm"}
TORCH_WHEEL_PREFIX = "torch-2.13.0"
BUILD_TIMEOUT_S = 1500
RESULTS_ENV = "SQUEEZESERVE_DOCKER_RESULTS"
# Where the find-links wheel folder is served for the builds (the Dockerfile's example port).
WHEEL_PORT = 8765


def run(
    argv: list[str], timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a command, never raising on its exit code; a timeout fails the test naming the command."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s")


def checked(argv: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> str:
    """Run a command that must succeed; its stdout."""
    result = run(argv, timeout, env)
    assert result.returncode == 0, f"`{' '.join(argv)}` exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


def inspect(name: str) -> dict[str, Any]:
    """``docker inspect`` of one container or image."""
    return json.loads(checked(["docker", "inspect", name]))[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, probe, timeout: float, interval: float = 0.1) -> float:
    """Call ``probe()`` until it returns true; the seconds that took. Fails naming ``what`` at the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if probe():
            return time.monotonic() - start
        time.sleep(interval)
    pytest.fail(f"{what} did not happen within {timeout:.0f}s")


def answers(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        return httpx.get(url, headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def health(container: str) -> str | None:
    """Docker's health status of a container: starting, healthy, unhealthy (None: it has no check)."""
    state = inspect(container)["State"]
    return (state.get("Health") or {}).get("Status")


@pytest.fixture(scope="session")
def engine() -> str:
    """The Docker daemon's version; skips everything here when there is no daemon or no compose v2."""
    if shutil.which("docker") is None:
        pytest.skip("docker: no `docker` CLI on PATH, so no container test can run")
    info = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        pytest.skip(f"docker: no Docker daemon answers ({reason})")
    if run(["docker", "compose", "version"], timeout=30).returncode != 0:
        pytest.skip("docker: the Compose v2 plugin (`docker compose`) is not installed")
    return info.stdout.strip()


@dataclass
class Sources:
    """Where the images come from on this machine: the build arguments and compose variables to pass."""

    python_image: str
    prometheus_image: str
    torch_index_url: str
    pip_find_links: str = ""  # an http:// URL of a wheel folder, served on loopback for the build
    notes: list[str] = field(default_factory=list)

    @property
    def network_host(self) -> bool:
        """A loopback find-links server is reachable from a build only on the host's network."""
        return self.pip_find_links.startswith("http://127.0.0.1")

    def build_args(self, dockerfile: str) -> list[str]:
        args = ["--build-arg", f"PYTHON_IMAGE={self.python_image}"]
        if dockerfile == "worker-cpu.Dockerfile":
            args += ["--build-arg", f"TORCH_INDEX_URL={self.torch_index_url}"]
            args += ["--build-arg", f"PIP_FIND_LINKS={self.pip_find_links}"]
        return args

    def compose_env(self) -> dict[str, str]:
        return {
            "PYTHON_IMAGE": self.python_image,
            "PROMETHEUS_IMAGE": self.prometheus_image,
            "TORCH_INDEX_URL": self.torch_index_url,
            "PIP_FIND_LINKS": self.pip_find_links,
        }


def _public_default(dockerfile: str, arg: str) -> str:
    for line in (DOCKER_DIR / dockerfile).read_text().splitlines():
        if line.startswith(f"ARG {arg}="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(f"{dockerfile} has no `ARG {arg}=default`")


def _image_available(image: str) -> bool:
    """Present locally, or pulled now (a few minutes at most)."""
    if run(["docker", "image", "inspect", image], timeout=30).returncode == 0:
        return True
    return run(["docker", "pull", "--quiet", image], timeout=300).returncode == 0


def _pick_image(public: str, stand_in: str, notes: list[str]) -> str:
    if _image_available(public):
        return public
    if run(["docker", "image", "inspect", stand_in], timeout=30).returncode == 0:
        notes.append(f"{public} cannot be had here: the stand-in {stand_in} instead")
        return stand_in
    pytest.skip(f"docker: neither {public} (Docker Hub) nor the stand-in {stand_in} is available")


def _reachable(url: str) -> bool:
    try:
        return httpx.get(url.rstrip("/") + "/torch/", timeout=10, follow_redirects=True).status_code == 200
    except httpx.HTTPError:
        return False


def _local_wheel_folder() -> Path | None:
    """pip's own find-links (environment or pip config) when it names a folder holding torch 2.13.0."""
    settings = [os.environ.get("PIP_FIND_LINKS", "")]
    config = run(["pip", "config", "get", "global.find-links"], timeout=30)
    settings.append(config.stdout if config.returncode == 0 else "")
    for setting in settings:
        for entry in setting.split():
            folder = Path(entry.removeprefix("file://"))
            if folder.is_dir() and any(folder.glob(f"{TORCH_WHEEL_PREFIX}*.whl")):
                return folder
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def _wheel_server(folder: Path) -> http.server.ThreadingHTTPServer:
    """An HTTP server of ``folder`` on loopback, on ``WHEEL_PORT`` unless that is taken. The URL is the
    worker image's PIP_FIND_LINKS build argument, and a changed argument misses Docker's cache for every
    RUN after it (torch, the requirements): on a random port each run rebuilt them all (~3 min a CI run)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
    except OSError:  # another run serves there: a cold build, still correct
        return http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)


@pytest.fixture(scope="session")
def sources(engine) -> Iterator[Sources]:
    notes: list[str] = []
    python_image = _pick_image(
        _public_default("gateway.Dockerfile", "PYTHON_IMAGE"), STAND_INS["python"], notes
    )
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    public_prometheus = compose["services"]["prometheus"]["image"].split(":-", 1)[1].rstrip("}")
    prometheus_image = _pick_image(public_prometheus, STAND_INS["prometheus"], notes)
    torch_index = _public_default("worker-cpu.Dockerfile", "TORCH_INDEX_URL")
    if _reachable(torch_index):
        yield Sources(python_image, prometheus_image, torch_index, notes=notes)
        return
    folder = _local_wheel_folder()
    if folder is None:
        pytest.skip(
            f"docker: {torch_index} is out of reach and pip's find-links names no {TORCH_WHEEL_PREFIX} wheel"
        )
    server = _wheel_server(folder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    notes.append(
        f"{torch_index} is out of reach: torch from pip's find-links folder {folder}, served on loopback"
    )
    # PyPI for torch's own dependencies; the local +cpu build is the highest 2.13.0 pip sees, so it wins
    # over PyPI's CUDA build exactly as `pip install torch==2.13.0` does on this machine.
    find_links = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        yield Sources(python_image, prometheus_image, "https://pypi.org/simple", find_links, notes)
    finally:
        server.shutdown()


def docker_env() -> dict[str, str]:
    """The caller's environment, with the legacy builder where there is no buildx plugin."""
    env = dict(os.environ)
    if run(["docker", "buildx", "version"], timeout=30).returncode != 0:
        env.update(DOCKER_BUILDKIT="0", COMPOSE_BAKE="false")
    return env


@dataclass
class Images:
    tags: dict[str, str]  # compose service name -> image tag
    bases: dict[str, str]  # compose service name -> base image
    build_seconds: dict[str, float]


@pytest.fixture(scope="session")
def images(sources, measurements) -> Images:
    """Both images, built from the repository root as the README says, with this machine's sources."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    tags = {name: compose["services"][name]["image"] for name in IMAGES}
    seconds = {}
    env = docker_env()
    for name, dockerfile in IMAGES.items():
        argv = [
            "docker",
            "build",
            "-f",
            f"docker/{dockerfile}",
            "-t",
            tags[name],
            *sources.build_args(dockerfile),
        ]
        if sources.network_host:
            argv += ["--network", "host"]
        start = time.monotonic()
        result = subprocess.run(
            [*argv, "."],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            env=env,
            check=False,
        )
        seconds[name] = round(time.monotonic() - start, 1)
        assert result.returncode == 0, (
            f"building {tags[name]} failed:\n{(result.stdout + result.stderr)[-6000:]}"
        )
    measurements["build_seconds"] = seconds
    measurements["sources"] = {"python_image": sources.python_image, "notes": sources.notes}
    return Images(tags, dict.fromkeys(IMAGES, sources.python_image), seconds)


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    flags: list[str] = []
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx"))]
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "load_avg_1_5_15": list(os.getloadavg())}


@pytest.fixture(scope="session")
def measurements(engine) -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    before = _machine()
    yield found
    target = os.environ.get(RESULTS_ENV)
    if not target or not found:
        return
    after = _machine()
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "docker_engine": engine,
        "machine": {
            **before,
            "load_avg_at_start": before["load_avg_1_5_15"],
            "load_avg_at_end": after["load_avg_1_5_15"],
        },
        **found,
    }
    del record["machine"]["load_avg_1_5_15"]
    Path(target).write_text(json.dumps(record, indent=2) + "\n")
