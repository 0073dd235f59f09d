"""A bounded mixed load (streamed and non-streamed completions) against a gateway, and a verdict on every
answer, for the chaos tests and the soak script (``tests/benchmarks/soak.py`` loads this file by path).

Each answer is classified by what the client actually received, read off the wire (the official SDK ends a
truncated stream silently, so it cannot tell a cut stream from a finished one):

- ``complete``: 200 with a ``finish_reason`` (a stream: a chunk with one, then ``data: [DONE]``);
- ``error_event``: a stream whose last event is an OpenAI error object (nothing after it);
- ``http_error``: a non-200 answer (``code`` is its error code);
- ``truncated``: a stream that ended without ``[DONE]`` or an error event: never acceptable;
- ``transport_error``: the connection to the gateway broke or timed out: never acceptable.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

MODEL = "smollm2-135m-instruct"  # the name the tests serve the bundled baseline under
ACCEPTABLE_STREAM_ENDS = ("complete", "error_event")


@dataclass(frozen=True)
class Job:
    index: int
    stream: bool
    max_tokens: int
    chat: bool = False


@dataclass(frozen=True)
class Outcome:
    job: Job
    result: str
    status: int
    code: str | None
    started: float  # time.monotonic()
    seconds: float


def _body(job: Job, model: str) -> dict:
    body: dict = {"model": model, "max_tokens": job.max_tokens, "stream": job.stream, "ignore_eos": True}
    text = f"Request {job.index}: write a short list of fruits."
    if job.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _stream_verdict(events: list[bytes]) -> tuple[str, str | None]:
    """``complete``, ``error_event`` or ``truncated``, and the error code, from a stream's data payloads."""
    if events and events[-1] == b"[DONE]":
        finished = any(
            choice.get("finish_reason")
            for data in events[:-1]
            for choice in json.loads(data).get("choices") or ()
        )
        return ("complete" if finished else "truncated"), None
    if events:
        last = json.loads(events[-1])
        if isinstance(last, dict) and isinstance(last.get("error"), dict):
            return "error_event", last["error"].get("code")
    return "truncated", None


async def one_request(client: httpx.AsyncClient, gateway: str, job: Job, model: str = MODEL) -> Outcome:
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    started = time.monotonic()
    try:
        async with client.stream("POST", f"{gateway}{path}", json=_body(job, model)) as response:
            if response.status_code != 200:
                payload = json.loads(await response.aread())
                code = (payload.get("error") or {}).get("code")
                result, status = ("http_error", code), response.status_code
            elif job.stream:
                events = [
                    line[5:].strip().encode()
                    async for line in response.aiter_lines()
                    if line.startswith("data:")
                ]
                result, status = _stream_verdict(events), 200
            else:
                choices = json.loads(await response.aread()).get("choices") or []
                finished = bool(choices) and all(c.get("finish_reason") for c in choices)
                result, status = ("complete" if finished else "truncated", None), 200
    except httpx.HTTPError as exc:
        result, status = ("transport_error", type(exc).__name__), 0
    return Outcome(job, result[0], status, result[1], started, time.monotonic() - started)


async def run_load(
    gateway: str,
    jobs: Iterable[Job],
    concurrency: int,
    timeout: float = 120.0,
    model: str = MODEL,
    stop_at: float | None = None,
) -> list[Outcome]:
    """Send ``jobs`` with at most ``concurrency`` in flight, until they run out or ``time.monotonic()``
    passes ``stop_at`` (requests under way then finish); every outcome, in the order they ended."""
    pending = iter(jobs)  # shared by the client loops: the event loop runs one at a time
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def client_loop() -> None:
            for job in pending:
                outcomes.append(await one_request(client, gateway, job, model))
                if stop_at is not None and time.monotonic() >= stop_at:
                    return

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return outcomes


def mixed_job(index: int, stream_tokens: int, plain_tokens: int) -> Job:
    """Job ``index`` of the pattern stream, stream, plain, plain (so that round robin over two upstreams
    gives each both kinds), every fourth one a chat request."""
    stream = index % 4 < 2
    return Job(index, stream, stream_tokens if stream else plain_tokens, chat=index % 4 == 3)


def mixed_jobs(count: int, stream_tokens: int, plain_tokens: int) -> list[Job]:
    return [mixed_job(i, stream_tokens, plain_tokens) for i in range(count)]
