"""Clients that go away, with real processes: ``squeezeserve gateway`` in front of the real embedded worker.

Whether generation stopped is read from the worker's own ``decode_steps`` counter: once the only request
is gone it must stop growing within 1 s of the hang-up (the engine drops the sequence at its next step).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

pytestmark = pytest.mark.slow  # loads the model

MODEL = "smollm2-135m-instruct"  # as tests/conftest.py serves the baseline
BODY = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 4000, "ignore_eos": True}
STOP_WITHIN_S = 1.0


def _worker_sample(worker: str, name: str) -> float:
    for line in httpx.get(f"{worker}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from the worker's metrics")


def _steps(worker: str) -> float:
    return _worker_sample(worker, "squeezeserve_worker_decode_steps")


def _wait_until_generating(worker: str) -> None:
    """Until the worker runs a request and has taken a few decode steps for it."""
    deadline = time.monotonic() + 60
    start = _steps(worker)
    while (
        _worker_sample(worker, "squeezeserve_worker_num_requests_running") < 1 or _steps(worker) < start + 3
    ):
        assert time.monotonic() < deadline, "the worker never started generating"
        time.sleep(0.05)


def _assert_generation_stops(worker: str, hung_up_at: float) -> None:
    """From STOP_WITHIN_S after ``hung_up_at`` on, nothing runs and decode steps no longer grow."""
    time.sleep(max(0.0, hung_up_at + STOP_WITHIN_S - time.monotonic()))
    settled = _steps(worker)
    assert _worker_sample(worker, "squeezeserve_worker_num_requests_running") == 0, "still generating"
    time.sleep(0.5)
    assert _steps(worker) == settled, "decode steps still grow after the client left"


def _raw_request(gateway: str, body: dict) -> socket.socket:
    """Send a POST on a plain socket (so the test decides exactly when the connection closes)."""
    host, port = gateway.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _gateway_requests(gateway: str, status: str) -> float:
    for line in httpx.get(f"{gateway}/metrics").text.splitlines():
        if line.startswith("squeezeserve_gateway_requests_total{") and f'status="{status}"' in line:
            if f'model="{MODEL}"' in line and 'route="/v1/completions"' in line:
                return float(line.split()[-1])
    return 0.0


def test_a_non_streamed_client_hanging_up_stops_generation_and_counts_499(
    baseline_worker: str, cli_gateway: Callable[..., tuple[str, subprocess.Popen]]
) -> None:
    gateway, _ = cli_gateway("--upstream", baseline_worker)
    before = _gateway_requests(gateway, "499")
    sock = _raw_request(gateway, BODY)
    _wait_until_generating(baseline_worker)
    sock.close()
    _assert_generation_stops(baseline_worker, time.monotonic())
    deadline = time.monotonic() + 5
    while _gateway_requests(gateway, "499") < before + 1:
        assert time.monotonic() < deadline, "the gateway did not count the hang-up as 499"
        time.sleep(0.05)


def test_a_streamed_client_hanging_up_after_a_few_tokens_stops_generation(
    baseline_worker: str, cli_gateway: Callable[..., tuple[str, subprocess.Popen]]
) -> None:
    gateway, _ = cli_gateway("--upstream", baseline_worker)
    with httpx.stream(
        "POST", f"{gateway}/v1/completions", json={**BODY, "stream": True}, timeout=60
    ) as answer:
        assert answer.status_code == 200
        events = (line for line in answer.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(events)
    _assert_generation_stops(baseline_worker, time.monotonic())
