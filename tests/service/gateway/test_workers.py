"""``--workers N``: several gateway processes on one port, whose metrics add up whichever one is scraped."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts servers and processes

MAX_REQUESTS = 200


def test_two_workers_serve_and_their_metrics_aggregate(fake_upstream, cli_gateway, metric):
    upstream = fake_upstream()
    url, _ = cli_gateway("--upstream", upstream.url, "--workers", "2")

    # A new connection per request, so the kernel hands them to both processes; each process keeps one
    # connection to the upstream alive, so two upstream peers = both processes have served.
    sent = 0
    while len({r["peer_port"] for r in upstream.app.state.received}) < 2 and sent < MAX_REQUESTS:
        response = httpx.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": "one two"})
        assert response.status_code == 200
        sent += 1

    assert len({r["peer_port"] for r in upstream.app.state.received}) == 2
    for _ in range(4):  # every scrape, whichever process answers it, shows the sum of both
        requests = metric(url, "squeezeserve_gateway_requests_total", route="/v1/completions", status="200")
        tokens = metric(url, "squeezeserve_gateway_tokens_total", model="fake-model", direction="prompt")
        assert (requests, tokens) == (sent, 2 * sent)
    assert metric(url, "squeezeserve_gateway_upstream_healthy", upstream=upstream.url) == 1
    assert metric(url, "squeezeserve_gateway_upstream_in_flight", upstream=upstream.url) == 0


def test_every_process_reports_the_upstreams_health_from_its_first_scrape(fake_upstream, cli_gateway, metric):
    """No process publishes "unhealthy" for an upstream it has not probed yet: the shared gauge is a
    minimum over the processes, so one such sample, even for the second until the next, read as an
    outage wherever the scrape landed (CI saw 0 right after start)."""
    upstream = fake_upstream()
    url, _ = cli_gateway("--upstream", upstream.url, "--workers", "2")
    for _ in range(40):  # a new connection each: the kernel hands them to both processes
        assert metric(url, "squeezeserve_gateway_upstream_healthy", upstream=upstream.url) == 1


def test_in_flight_counts_add_up_exactly_whichever_process_is_scraped(
    fake_upstream, cli_gateway, metric, eventually
):
    """Requests held open in both processes: every scrape shows all of them at once, not a process's count
    as of its last periodic sample."""
    upstream = fake_upstream()
    url, _ = cli_gateway("--upstream", upstream.url, "--workers", "2")
    held = 6
    body = {"model": "fake-model", "prompt": "one two", "fake": {"delay": 4}}
    with ThreadPoolExecutor(held) as pool:  # a connection each: the kernel spreads them over the processes
        post = lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=30)  # noqa: E731
        replies = [pool.submit(post) for _ in range(held)]
        eventually(lambda: len(upstream.app.state.received) == held)
        for _ in range(10):
            assert metric(url, "squeezeserve_gateway_upstream_in_flight", upstream=upstream.url) == held
        assert all(reply.result().status_code == 200 for reply in replies)
    assert metric(url, "squeezeserve_gateway_upstream_in_flight", upstream=upstream.url) == 0
