"""Candidates for the validation tests: the baseline compressed by ``squeezeserve compress`` (int8 and int4
round-to-nearest, the fast settings), once per session; and a gateway in a thread in front of the
session's baseline worker."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from squeezeserve.service.gateway.app import create_app
from squeezeserve.service.gateway.config import GatewaySettings

HERE = Path(__file__).parent
GATEWAY_KEY = "validate-test-key"


def _server_thread_class() -> type:
    # The gateway tests' in-thread uvicorn runner (tests are not importable as packages here).
    spec = importlib.util.spec_from_file_location(
        "gateway_test_servers", HERE.parent / "gateway" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ServerThread


def _compress(baseline: Path, out: Path, *method: str) -> Path:
    command = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "WARNING", "compress"]
    subprocess.run([*command, "--model", str(baseline), "--out", str(out), *method], check=True, timeout=600)
    return out


@pytest.fixture(scope="session")
def int8_dir(baseline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compress(baseline_dir, tmp_path_factory.mktemp("validate") / "int8", "--method", "int8")


@pytest.fixture(scope="session")
def int4_dir(baseline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("validate") / "int4"
    return _compress(baseline_dir, out, "--method", "int4", "--algorithm", "rtn")


@pytest.fixture(scope="session")
def wikitext_file(wikitext: Path) -> Path:
    return wikitext / "test.txt"


@pytest.fixture(scope="module")
def keyed_gateway(float32_baseline_worker: str) -> Iterator[tuple[str, str]]:
    """(URL, key) of a gateway that requires that key, in front of the baseline worker in float32 (where the
    worker's decoder and transformers agree to rounding on every CPU; see test_http.py)."""
    server = _server_thread_class()(
        create_app(GatewaySettings(upstreams=[float32_baseline_worker], port=0, api_keys=[GATEWAY_KEY]))
    ).start()
    try:
        yield server.url, GATEWAY_KEY
    finally:
        server.stop()
