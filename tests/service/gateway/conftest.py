"""Servers on loopback ports for the gateway tests: fake upstreams, gateways (in threads or as the CLI).

In-process servers run uvicorn in a thread of their own (their own event loop) on a socket bound to port
0, so tests never race for ports. Fakes that a test must kill run as separate processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from squeezeserve.service.gateway.app import create_app
from squeezeserve.service.gateway.config import GatewaySettings

HERE = Path(__file__).parent
FAKE_SCRIPT = HERE / "fake_upstream.py"


def _load_fake_module() -> Any:
    spec = importlib.util.spec_from_file_location("gateway_fake_upstream", FAKE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


create_fake: Callable[[str, list[str]], FastAPI] = _load_fake_module().create_fake


class ServerThread:
    """One uvicorn server in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[FastAPI], ServerThread]]:
    """Start apps in threads; all stopped when the test ends."""
    servers: list[ServerThread] = []

    def start(app: FastAPI) -> ServerThread:
        server = ServerThread(app).start()
        servers.append(server)
        return server

    yield start
    for server in reversed(servers):
        server.stop()


@pytest.fixture
def fake_upstream(serve: Callable[[FastAPI], ServerThread]) -> Callable[..., ServerThread]:
    """``fake_upstream(name, models=["fake-model"])``: a started fake; ``.app.state`` shows what it got."""

    def start(name: str = "fake", models: list[str] | None = None) -> ServerThread:
        return serve(create_fake(name, models or ["fake-model"]))

    return start


@pytest.fixture
def start_gateway(serve: Callable[[FastAPI], ServerThread]) -> Callable[..., str]:
    """``start_gateway([urls], **settings)``: a started gateway; returns its base URL.

    The health loop is slow by default (60 s) so that tests decide when upstreams change state."""

    def start(upstreams: list[str], **settings: Any) -> str:
        settings.setdefault("health_interval", 60.0)
        return serve(create_app(GatewaySettings(upstreams=upstreams, port=0, **settings))).url

    return start


def _openai_client(base_url: str, api_key: str = "unused", **kwargs: Any) -> OpenAI:
    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("timeout", 30.0)
    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key, **kwargs)


@pytest.fixture
def openai_client() -> Callable[..., OpenAI]:
    """``openai_client(base_url, api_key=...)``: the official client, its own retries off so each test
    sees the gateway's first answer."""
    return _openai_client


def _metric(base_url: str, name: str, **labels: str) -> float:
    """The value of one sample on ``base_url``'s /metrics (0.0 when the sample does not exist yet)."""
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.fixture
def metric() -> Callable[..., float]:
    """``metric(base_url, sample_name, **labels)``: one value scraped from /metrics."""
    return _metric


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def eventually() -> Callable[..., None]:
    """``eventually(condition, timeout=10)``: poll until true, fail after the timeout."""
    return wait_for


@pytest.fixture
def fake_process(servers: SimpleNamespace) -> Iterator[Callable[..., tuple[str, subprocess.Popen[bytes]]]]:
    """``fake_process(model)``: a fake upstream in its own process (so a test can kill it)."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(model: str = "fake-model") -> tuple[str, subprocess.Popen[bytes]]:
        port = servers.free_port()
        process = subprocess.Popen(
            [sys.executable, str(FAKE_SCRIPT), "--port", str(port), "--model", model, "--name", "process"]
        )
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        servers.wait_until_healthy(url, timeout=30, process=process)
        return url, process

    yield start
    for process in processes:
        servers.stop_process(process, signal.SIGKILL)


@pytest.fixture
def cli_gateway(servers: SimpleNamespace) -> Iterator[Callable[..., tuple[str, subprocess.Popen[bytes]]]]:
    """``cli_gateway(*flags)``: ``squeezeserve gateway FLAGS --port P`` as a process, once it is healthy."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = servers.free_port()
        command = [sys.executable, "-m", "squeezeserve.service.cli", "gateway", *flags, "--port", str(port)]
        # Its own process group: with --workers N the gateway's children go down with it at teardown.
        process = subprocess.Popen(command, start_new_session=True)
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        servers.wait_until_healthy(url, timeout=60, process=process)
        return url, process

    yield start
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def worker_gateway(baseline_worker: str) -> Iterator[str]:
    """A gateway in front of the real worker (``tests/conftest.py``'s session-wide one), per test module."""
    server = ServerThread(create_app(GatewaySettings(upstreams=[baseline_worker], port=0))).start()
    yield server.url
    server.stop()
