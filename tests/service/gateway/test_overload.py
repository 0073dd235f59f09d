"""A real worker whose waiting queue is full: the excess is answered 429 + Retry-After at once, through the
gateway, instead of queueing (and waiting) without bound."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import httpx
import pytest

pytestmark = pytest.mark.slow  # a worker with the real model

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def small_queue_worker(servers: SimpleNamespace, baseline_dir: Path) -> Iterator[str]:
    """One sequence decoded at a time, one more allowed to wait: a third concurrent request is overload."""
    flags = ("--threads", "1", "--max-batch-size", "1", "--max-waiting", "1")
    url, process = servers.start_worker(baseline_dir, MODEL, *flags)
    yield url
    servers.stop_process(process)


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float
    streamed: bool


async def _burst(gateway: str, count: int) -> list[Answer]:
    """One streamed request that is decoding (its first event has come back), then ``count - 1`` more at
    once, every other one streamed. Without waiting for the first, all could arrive before the worker has
    taken any of them off its waiting queue; on a loaded 2-core machine, one was served and five turned
    away."""

    def request(i: int, max_tokens: int = 24) -> dict:
        return {
            "model": MODEL,
            "prompt": f"Story {i}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": i % 2 == 1,
        }

    async def one(client: httpx.AsyncClient, i: int) -> Answer:
        started = time.monotonic()
        async with client.stream("POST", f"{gateway}/v1/completions", json=request(i)) as response:
            content = await response.aread()
        return Answer(
            response.status_code, dict(response.headers), content, time.monotonic() - started, i % 2 == 1
        )

    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        started = time.monotonic()
        # Long enough to still be decoding while the others are turned away or wait behind it.
        async with client.stream("POST", f"{gateway}/v1/completions", json=request(1, 64)) as first:
            events = first.aiter_bytes()
            head = await anext(events)
            assert first.status_code == 200 and head.startswith(b"data:"), (first.status_code, head)
            others = await asyncio.gather(*(one(client, i) for i in range(2, count + 1)))
            content = head + b"".join([chunk async for chunk in events])
        holder = Answer(200, dict(first.headers), content, time.monotonic() - started, True)
    return [holder, *others]


def test_full_waiting_queue_answers_429_with_retry_after_at_once(small_queue_worker, start_gateway):
    gateway = start_gateway([small_queue_worker])

    answers = asyncio.run(_burst(gateway, 6))

    served = [a for a in answers if a.status == 200]
    rejected = [a for a in answers if a.status == 429]
    print(  # pytest -s shows it
        f"\noverload: {len(answers)} at once, {len(served)} served (slowest "
        f"{max((a.seconds for a in served), default=0):.2f} s), {len(rejected)} got 429 (slowest "
        f"{max((a.seconds for a in rejected), default=0):.3f} s, Retry-After "
        f"{sorted({a.headers.get('retry-after') for a in rejected})})"
    )
    assert len(served) + len(rejected) == len(answers), [a.status for a in answers]
    assert 2 <= len(served) < len(answers)  # the one decoding and one waiting at least; the rest turned away
    for answer in rejected:  # streamed or not: an OpenAI error before any event, and when to come back
        assert int(answer.headers["retry-after"]) >= 1
        assert json.loads(answer.body)["error"]["code"] == "overloaded"
    # Turned away at once, not after waiting behind the others: the 429s came back well before the
    # slowest served request, which waited for the one ahead of it.
    slowest_served = max(a.seconds for a in served)
    assert max(a.seconds for a in rejected) < slowest_served / 2, [
        (a.status, round(a.seconds, 2)) for a in answers
    ]
