"""Fixtures shared across the suite: the bundled baseline and a real embedded worker on loopback.

The text the tests read ships with the package (``squeezeserve.service.datasets``): nothing outside the
clone is read.
The baseline is exported once into ``$SQUEEZESERVE_HOME`` (default ``~/.cache/squeezeserve``) and reused by
later runs; ``$SQUEEZESERVE_TEST_MODEL`` points the suite at another checkpoint instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from squeezeserve.service.datasets import sample_path
from squeezeserve.service.processes import free_port, stop_process, wait_until_healthy

SERVED_NAME = "smollm2-135m-instruct"


def launch_worker(
    model: Path | str, name: str, *extra: str, port: int | None = None
) -> tuple[str, subprocess.Popen]:
    """Start ``squeezeserve worker --engine local`` in a subprocess (on ``port``, else a free one); it is
    not ready yet."""
    port = free_port() if port is None else port
    command = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "WARNING", "worker"]
    command += ["--engine", "local", "--model", str(model), "--port", str(port), "--served-model-name", name]
    return f"http://127.0.0.1:{port}", subprocess.Popen([*command, *extra])


def start_worker(
    model: Path | str, name: str, *extra: str, port: int | None = None
) -> tuple[str, subprocess.Popen]:
    """:func:`launch_worker`, then wait until it is healthy."""
    url, process = launch_worker(model, name, *extra, port=port)
    try:
        wait_until_healthy(url, timeout=300, process=process)  # model load on 2 busy CPU cores
    except BaseException:
        stop_process(process, signal.SIGKILL)
        raise
    return url, process


@pytest.fixture(autouse=True)
def _same_torch_seed_for_every_test() -> None:
    """Each test starts from one global torch RNG state, so that no verdict depends on which tests ran
    before it in the process (a subset, another order). torch only where a test module imported it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(scope="session")
def baseline_dir() -> Path:
    given = os.environ.get("SQUEEZESERVE_TEST_MODEL")
    if given:
        return Path(given)
    from squeezeserve.service.models.bundled import export_baseline

    return export_baseline().path


@pytest.fixture(scope="session")
def wikitext() -> Path:
    """The WikiText-2 samples that ship with the package (``test.txt``, ``calibration.txt``): the suite
    needs nothing beside the clone."""
    return sample_path("wikitext-2-test").parent


@pytest.fixture(scope="session")
def baseline_worker(baseline_dir: Path) -> Iterator[str]:
    """One real embedded worker serving the baseline as ``smollm2-135m-instruct`` for the whole session."""
    url, process = start_worker(baseline_dir, SERVED_NAME)
    try:
        yield url
    finally:
        stop_process(process)


@pytest.fixture(scope="session")
def float32_baseline_worker(baseline_dir: Path) -> Iterator[str]:
    """The baseline served in float32 (default decoder), where greedy text is compared exactly."""
    url, process = start_worker(baseline_dir, SERVED_NAME, "--dtype", "float32")
    try:
        yield url
    finally:
        stop_process(process)


@pytest.fixture(scope="session")
def servers() -> SimpleNamespace:
    """Process helpers for test modules (``--import-mode=importlib`` cannot import conftest)."""
    return SimpleNamespace(
        free_port=free_port,
        wait_until_healthy=wait_until_healthy,
        stop_process=stop_process,
        launch_worker=launch_worker,
        start_worker=start_worker,
    )
