"""Clients that go away, with real processes: ``squeezeserve gateway`` in front of the real embedded worker.

Whether generation stopped is read from the worker's own ``decode_steps`` counter: once the only request
is gone it must stop growing soon after the hang-up (the engine drops the sequence at its next step), long
before the request would have ended by itself (STOP_WITHIN_S).
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
# A hang-up stops generation within about a decode step on a warm worker (1 s in the runs this bound came
# from); under a loaded 2-core CI a step can take longer, so the tests wait up to STOP_WITHIN_S for the stop
# and check that it came long before the request would have ended by itself (4000 tokens take minutes).
STOP_WITHIN_S = 15.0


@pytest.fixture(scope="module", autouse=True)
def warm_worker(baseline_worker: str) -> None:
    """The first steps of a fresh worker take seconds each; the bounds are about a warm one."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    assert httpx.post(f"{baseline_worker}/v1/completions", json=body, timeout=300).status_code == 200


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
    """Within STOP_WITHIN_S of ``hung_up_at`` nothing runs, and decode steps no longer grow."""
    while _worker_sample(worker, "squeezeserve_worker_num_requests_running") != 0:
        assert time.monotonic() < hung_up_at + STOP_WITHIN_S, "still generating"
        time.sleep(0.05)
    settled = _steps(worker)
    time.sleep(0.5)
    assert _steps(worker) == settled, "decode steps still grow after the client left"


def _raw_request(gateway: str, body: dict) -> socket.socket:
    """Send a POST on a plain socket (so the test decides exactly when the connection closes, and whether
    anything is read); its receive buffer is small, so a client that does not read stalls the sender."""
    host, port = gateway.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
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


def test_a_stream_client_that_stops_reading_does_not_block_the_others(
    baseline_worker: str, cli_gateway: Callable[..., tuple[str, subprocess.Popen]]
) -> None:
    """A client keeps its stream open and reads nothing: its sends wait on full socket buffers, but the
    engine (which hands events to an unbounded per-request queue) goes on serving everyone else."""
    gateway, _ = cli_gateway("--upstream", baseline_worker)
    other = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    assert httpx.post(f"{gateway}/v1/completions", json=other, timeout=120).status_code == 200  # warm
    stalled = _raw_request(gateway, {**BODY, "max_tokens": 400, "stream": True})
    try:
        _wait_until_generating(baseline_worker)
        time.sleep(3)  # thousands of bytes of events: the client's 4 KiB receive buffer is full
        started = time.monotonic()
        answer = httpx.post(f"{gateway}/v1/completions", json=other, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - started < 20, "the other request waited on the stalled stream"
    finally:
        stalled.close()
    # Not asserted within 1 s here: once the relay is blocked on a full buffer, the hang-up can be seen
    # only when the blocked write fails. Bounded by max_tokens at worst; later tests need an idle worker.
    deadline = time.monotonic() + 120
    while _worker_sample(baseline_worker, "squeezeserve_worker_num_requests_running") > 0:
        assert time.monotonic() < deadline, "the stalled request never ended"
        time.sleep(0.1)
