"""SIGTERM drains, with real processes: readiness turns false and new requests get 503 + Retry-After at once,
running streams finish, the process exits when they have (or when the grace period is over); the gateway
sends a request that an upstream answers with 503 to another upstream."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

SERVED_NAME = "smollm2-135m-instruct"  # as tests/conftest.py serves the baseline


def _refused_while_draining(url: str, model: str) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "draining"


def _stream_lines(url: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """Open a stream; return (context manager, line iterator) once its first data event arrived."""
    context = httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120)
    response = context.__enter__()
    assert response.status_code == 200
    lines = (line for line in response.iter_lines() if line.startswith("data:"))
    next(lines)
    return context, lines


def _exit_code(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {timeout} s after the drain should have ended")


def test_sigterm_drains_the_gateway(
    cli_gateway: Callable[..., tuple[str, subprocess.Popen]],
    fake_process: Callable[..., tuple[str, subprocess.Popen]],
    eventually: Callable[..., None],
) -> None:
    upstream, _ = fake_process()
    url, gateway = cli_gateway("--upstream", upstream, "--grace-seconds", "30")
    context, lines = _stream_lines(
        url, {"model": "fake-model", "prompt": "x", "fake": {"chunks": 8, "chunk_delay": 0.3}}
    )
    gateway.send_signal(signal.SIGTERM)
    eventually(lambda: httpx.get(f"{url}/readyz").status_code == 503, timeout=5)
    _refused_while_draining(url, "fake-model")
    assert httpx.get(f"{url}/livez").status_code == 200  # alive: no restart wanted
    assert gateway.poll() is None  # the stream is still running
    rest = list(lines)
    context.__exit__(None, None, None)
    assert rest[-1] == "data: [DONE]"  # the running stream finished, whole
    assert sum('"w' in line for line in rest) == 7  # the 7 content chunks after the first
    _exit_code(gateway, timeout=10)


def test_the_grace_period_bounds_the_drain(
    cli_gateway: Callable[..., tuple[str, subprocess.Popen]],
    fake_process: Callable[..., tuple[str, subprocess.Popen]],
) -> None:
    upstream, _ = fake_process()
    url, gateway = cli_gateway("--upstream", upstream, "--grace-seconds", "1")
    context, lines = _stream_lines(url, {"model": "fake-model", "prompt": "x", "fake": {"hang_after": 1}})
    started = time.monotonic()
    gateway.send_signal(signal.SIGTERM)
    _exit_code(gateway, timeout=10)
    assert time.monotonic() - started < 8  # 1 s of grace, then uvicorn closes what is left
    with pytest.raises(httpx.HTTPError):
        list(lines)  # cut off, not completed
    context.__exit__(None, None, None)


def test_an_upstream_answering_503_is_ejected_and_the_request_goes_elsewhere(
    fake_upstream: Callable[..., Any], start_gateway: Callable[..., str], metric: Callable[..., float]
) -> None:
    draining, serving = fake_upstream("draining"), fake_upstream("serving")
    draining.app.state.status = 503
    url = start_gateway([draining.url, serving.url], routing="round_robin")
    for _ in range(4):
        answer = httpx.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": "hi"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["system_fingerprint"] == "serving"
    assert len(draining.app.state.received) == 1  # tried once, then ejected until its probes pass again
    assert metric(url, "squeezeserve_gateway_upstream_retries_total", upstream=draining.url) == 1


def test_a_lone_upstream_answering_503_passes_it_on(
    fake_upstream: Callable[..., Any], start_gateway: Callable[..., str]
) -> None:
    draining = fake_upstream("draining")
    draining.app.state.status = 503
    url = start_gateway([draining.url])
    answer = httpx.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": "hi"})
    assert answer.status_code == 503
    assert len(draining.app.state.received) == 1


@pytest.mark.slow
def test_sigterm_drains_a_worker(
    baseline_dir: Any, servers: SimpleNamespace, eventually: Callable[..., None]
) -> None:
    url, worker = servers.start_worker(baseline_dir, SERVED_NAME, "--threads", "1", "--grace-seconds", "120")
    try:
        body = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
        context, lines = _stream_lines(url, body)
        worker.send_signal(signal.SIGTERM)
        eventually(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=5)
        _refused_while_draining(url, SERVED_NAME)
        assert httpx.get(f"{url}/metrics").status_code == 200
        rest = list(lines)
        context.__exit__(None, None, None)
        assert rest[-1] == "data: [DONE]"
        assert len([line for line in rest if '"text"' in line]) >= 23  # every token after the first
        _exit_code(worker, timeout=15)
    finally:
        servers.stop_process(worker, signal.SIGKILL)


@pytest.mark.slow
def test_a_worker_whose_clients_hung_up_has_nothing_left_to_drain(
    baseline_dir: Any, servers: SimpleNamespace, eventually: Callable[..., None]
) -> None:
    """Collected (non-streamed) requests whose clients left, one decoding and one still waiting, end with
    them: SIGTERM then exits at once. Before, their handlers waited for an answer the engine never sends
    for cancelled sequences, and every drain after such a hang-up took the whole grace period."""
    flags = ("--threads", "1", "--max-batch-size", "1", "--grace-seconds", "120")
    url, worker = servers.start_worker(baseline_dir, SERVED_NAME, *flags)
    try:
        body = {"model": SERVED_NAME, "prompt": "Write a long essay.", "max_tokens": 2000, "ignore_eos": True}
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        clients = []
        for _ in range(2):  # the first decodes, the second waits for its row
            client = socket.create_connection((host, int(port)))
            client.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            clients.append(client)
        eventually(lambda: _worker_gauge(url, "squeezeserve_worker_num_requests_waiting") == 1, timeout=60)
        for client in clients:
            client.close()
        eventually(lambda: _worker_gauge(url, "squeezeserve_worker_num_requests_running") == 0, timeout=10)
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        _exit_code(worker, timeout=15)
        assert time.monotonic() - started < 10
    finally:
        servers.stop_process(worker, signal.SIGKILL)


def _worker_gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from the worker's metrics")
