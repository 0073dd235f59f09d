"""Chaos: two real embedded workers (bundled model, one thread each) behind one gateway, a bounded mixed
load, and one worker killed (SIGKILL) or frozen (SIGSTOP) in the middle of it.

What must hold: no non-streamed request is lost (it is retried on the other worker), a stream that was cut
ends with an OpenAI error event (never silently), the dead worker is ejected within one health interval
and re-admitted within one interval after it is back; a frozen worker's requests end at the configured
deadline, or fail over as soon as its health check times out.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

pytestmark = pytest.mark.slow  # two workers with the real model

_spec = importlib.util.spec_from_file_location("gateway_mixed_load", Path(__file__).parent / "mixed_load.py")
assert _spec is not None and _spec.loader is not None
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load  # dataclasses look their module up there
_spec.loader.exec_module(load)

HEALTH_INTERVAL = 1.0
# Scheduling slack for the assertions on timing: the gateway, the load and two workers share 2 busy cores.
SLACK = 1.5


class Worker:
    """A real embedded worker on a fixed port, so that it can come back where the gateway expects it."""

    def __init__(self, servers: SimpleNamespace, model_dir: Path) -> None:
        self._servers = servers
        self._model_dir = model_dir
        self.port = servers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def launch(self) -> None:
        # float32: the same speed on every CPU (bfloat16 is emulated on AVX2-only ones, where a batch of 4
        # streams could outlast the 4 s deadline of the frozen-worker test on the healthy worker)
        args = ("--threads", "1", "--dtype", "float32")
        _, self.process = self._servers.launch_worker(self._model_dir, load.MODEL, *args, port=self.port)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure_running(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.launch()
        self.process.send_signal(signal.SIGCONT)  # a test that failed while it was frozen
        self._servers.wait_until_healthy(self.url, timeout=300, process=self.process)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self._servers.stop_process(self.process, signal.SIGKILL)


@pytest.fixture(scope="module")
def workers(servers: SimpleNamespace, baseline_dir: Path) -> Iterator[list[Worker]]:
    pair = [Worker(servers, baseline_dir), Worker(servers, baseline_dir)]
    try:
        for worker in pair:
            worker.launch()  # both load the model at once
        yield pair
    finally:
        for worker in pair:
            worker.stop()


@pytest.fixture
def running(workers: list[Worker]) -> list[Worker]:
    for worker in workers:
        worker.ensure_running()
    return workers


def _healthy_upstreams(gateway: str) -> int:
    return httpx.get(f"{gateway}/readyz").json().get("healthy_upstreams", 0)


def _until(condition: Callable[[], bool], timeout: float) -> float:
    """Poll ``condition`` every 20 ms; the monotonic time it first held (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic()


def _signal_mid_load(
    gateway: str, victim: Worker, sig: signal.Signals, jobs: list, metric: Callable[..., float]
) -> tuple[list, float, float]:
    """Run ``jobs`` (8 at a time); once ``victim`` has 4 requests in flight send it ``sig``. Returns the
    outcomes, when the signal was sent and when the gateway had ejected the victim."""
    with ThreadPoolExecutor(1) as pool:
        outcomes = pool.submit(asyncio.run, load.run_load(gateway, jobs, concurrency=8))
        in_flight = "squeezeserve_gateway_upstream_in_flight"
        _until(lambda: metric(gateway, in_flight, upstream=victim.url) >= 4, timeout=60)
        victim.process.send_signal(sig)
        signalled = time.monotonic()
        ejected = _until(lambda: _healthy_upstreams(gateway) == 1, timeout=15)
        return outcomes.result(timeout=180), signalled, ejected


def _summary(outcomes: list) -> Counter:
    return Counter((o.job.stream, o.result, o.code) for o in outcomes)


def _report(test: str, outcomes: list, retried: float | None = None, **seconds: float) -> None:
    """One line per test with what happened (``pytest -s`` shows it; a failure shows it anyway)."""
    kinds = ", ".join(
        f"{'stream' if stream else 'plain'} {result}{'/' + code if code else ''}: {count}"
        for (stream, result, code), count in sorted(_summary(outcomes).items(), key=str)
    )
    timings = ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items())
    retries = "" if retried is None else f"; {retried:g} retried on the other worker"
    print(f"\n{test}: {len(outcomes)} requests ({kinds}){retries}; {timings}")


def _assert_none_lost(outcomes: list, gateway: str, victim: Worker, metric: Callable[..., float]) -> None:
    """Every non-streamed request completed; every stream completed or ended with an error event; and the
    victim had work in flight that was cut or retried (else the test proved nothing)."""
    streams = [o for o in outcomes if o.job.stream]
    assert all(o.result == "complete" for o in outcomes if not o.job.stream), _summary(outcomes)
    assert all(o.result in load.ACCEPTABLE_STREAM_ENDS for o in streams), _summary(outcomes)
    assert all(o.code == "bad_gateway" for o in streams if o.result == "error_event"), _summary(outcomes)
    cut = sum(o.result == "error_event" for o in streams)
    retried = metric(gateway, "squeezeserve_gateway_upstream_retries_total", upstream=victim.url)
    assert cut + retried >= 1, "the victim had requests in flight: some must have been cut or retried"


def test_worker_killed_mid_load_loses_no_request(running, start_gateway, metric):
    survivor, victim = running
    gateway = start_gateway(
        [survivor.url, victim.url],
        routing="round_robin",  # both workers get both kinds of request (see load.mixed_jobs)
        health_interval=HEALTH_INTERVAL,
        health_timeout=1.0,
        unhealthy_threshold=1,
    )
    jobs = load.mixed_jobs(24, stream_tokens=48, plain_tokens=24)

    outcomes, killed, ejected = _signal_mid_load(gateway, victim, signal.SIGKILL, jobs, metric)

    victim.launch()  # back on the same port
    back = _until(victim.healthy, timeout=300)
    readmitted = _until(lambda: _healthy_upstreams(gateway) == 2, timeout=30)
    retried = metric(gateway, "squeezeserve_gateway_upstream_retries_total", upstream=victim.url)
    _report(
        "SIGKILL",
        outcomes,
        retried=retried,
        ejected_after=ejected - killed,
        readmitted_after=readmitted - back,
    )

    assert len(outcomes) == len(jobs)
    _assert_none_lost(outcomes, gateway, victim, metric)
    assert ejected - killed <= HEALTH_INTERVAL + SLACK, f"ejected {ejected - killed:.2f} s after the kill"
    assert readmitted - back <= HEALTH_INTERVAL + SLACK, f"re-admitted {readmitted - back:.2f} s after"


def test_frozen_worker_requests_end_at_the_deadline(running, start_gateway):
    """Health checks slower than the deadline: requests stuck on the frozen worker get 504 (streams an
    error event) at the deadline, not later; once it is ejected everything is served by the other."""
    healthy, frozen = running
    deadline = 4.0
    gateway = start_gateway(
        [healthy.url, frozen.url],
        routing="round_robin",
        request_timeout=deadline,
        health_interval=HEALTH_INTERVAL,
        health_timeout=1.0,
        unhealthy_threshold=3,  # ejected after ~3 x (interval + timeout) = 6 s, past the deadline
    )
    jobs = load.mixed_jobs(16, stream_tokens=16, plain_tokens=8)
    try:
        frozen.process.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            outcomes_future = pool.submit(asyncio.run, load.run_load(gateway, jobs, concurrency=4))
            ejected = _until(lambda: _healthy_upstreams(gateway) == 1, timeout=15)
            outcomes = outcomes_future.result(timeout=120)
        # (light enough that the healthy worker alone ends it well inside the 4 s deadline on a CI machine at
        # half speed beside other tests: four 16-token streams at once there ran past it)
        after = asyncio.run(load.run_load(gateway, load.mixed_jobs(6, 8, 8), concurrency=2))
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    continued = time.monotonic()
    readmitted = _until(lambda: _healthy_upstreams(gateway) == 2, timeout=30)

    timed_out = [o for o in outcomes if o.result != "complete"]
    _report(
        "SIGSTOP, deadline 4 s",
        outcomes + after,
        slowest_timed_out=max((o.seconds for o in timed_out), default=0.0),
        ejected_after=ejected - frozen_at,
        readmitted_after=readmitted - continued,
    )
    assert timed_out, "round robin sent requests to the frozen worker: they cannot have completed"
    assert all(o.code == "upstream_timeout" for o in timed_out), _summary(outcomes)
    assert all(o.result in ("http_error", "error_event") for o in timed_out), _summary(outcomes)
    assert all(deadline - 0.1 <= o.seconds <= deadline + SLACK for o in timed_out), [
        round(o.seconds, 2) for o in timed_out
    ]
    # three failed checks of interval + timeout each (6 s at the most), their loop sharing the cores with the
    # load and two workers: on a CI machine running at half its usual speed the third landed at 8.03 s
    assert ejected - frozen_at <= 3 * (HEALTH_INTERVAL + 1.0) + 2 * SLACK, (
        f"ejected after {ejected - frozen_at:.2f} s"
    )
    assert all(o.result == "complete" for o in after), _summary(after)
    assert readmitted - continued <= HEALTH_INTERVAL + SLACK, (
        f"re-admitted {readmitted - continued:.2f} s after"
    )


def test_frozen_worker_requests_fail_over_when_its_health_check_times_out(running, start_gateway, metric):
    """A long deadline: the frozen worker's requests are cut as soon as a health check times out (not at
    the deadline); the non-streamed ones are retried on the other worker, the streams end with an error."""
    healthy, frozen = running
    gateway = start_gateway(
        [healthy.url, frozen.url],
        routing="round_robin",
        request_timeout=120.0,
        health_interval=HEALTH_INTERVAL,
        health_timeout=1.0,
        unhealthy_threshold=1,
    )
    jobs = load.mixed_jobs(16, stream_tokens=32, plain_tokens=16)
    try:
        outcomes, frozen_at, ejected = _signal_mid_load(gateway, frozen, signal.SIGSTOP, jobs, metric)
    finally:
        frozen.process.send_signal(signal.SIGCONT)

    slowest_after_ejection = max(o.started + o.seconds for o in outcomes) - ejected
    retried = metric(gateway, "squeezeserve_gateway_upstream_retries_total", upstream=frozen.url)
    _report(
        "SIGSTOP, deadline 120 s",
        outcomes,
        retried=retried,
        ejected_after=ejected - frozen_at,
        last_answer_after_ejection=slowest_after_ejection,
    )
    _assert_none_lost(outcomes, gateway, frozen, metric)
    # One interval and one probe timeout.
    assert ejected - frozen_at <= HEALTH_INTERVAL + 1.0 + SLACK, f"ejected after {ejected - frozen_at:.2f} s"
    # Nothing waited for the 120 s deadline: the slowest request ended a few seconds after the ejection.
    assert slowest_after_ejection < 30
