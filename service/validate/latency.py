"""Latency and throughput: an async load generator over the OpenAI streaming completions API.

Each request sends a fixed-length prompt (token ids) with ``max_tokens`` = the output length,
``ignore_eos`` (honoured by vLLM; the embedded worker may stop early at an end-of-text token, so output
tokens are always taken from the ``usage`` the server reports) and ``stream_options.include_usage``.
Per request, with t0 the send time and t_i the arrival of the i-th chunk carrying a choice (a step's
tokens; their text may be empty, as for a token that ends inside a multi-byte character or one the server
does not print: vLLM's own benchmark counts those chunks too, and a request whose tokens all print as
nothing still produced them):

    TTFT = t_1 - t0        E2E = t_last - t0        ITL = t_{i+1} - t_i  (every gap, pooled)
    TPOT = (E2E - TTFT) / (output tokens - 1)        (requests with 2+ output tokens)

Per concurrency level c, c workers keep one request in flight each until ``requests`` have been sent or
``duration`` has passed (after a warm-up at the same level that is not counted). Over the level's wall
time W (first send to last finish): request throughput = completed / W, output-token throughput =
sum(output tokens) / W, goodput = completed requests meeting every SLO given / W.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

STATS = ("mean", "p50", "p90", "p99")
TIMINGS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0  # streamed chunks that carried a choice (a step's tokens)
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # from usage

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadSettings:
    concurrency: list[int]
    requests_per_level: int | None  # None: 4 x concurrency, at least 8
    duration_s: float | None
    output_tokens: int
    warmup_requests: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    timeout_s: float = 600.0

    def requests_for(self, concurrency: int) -> int:
        return self.requests_per_level or max(8, 4 * concurrency)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds."""
    ms = [v * 1000 for v in values]
    return {
        "mean": sum(ms) / len(ms) if ms else None,
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


async def stream_one(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_tokens: int
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(ok=False)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message", chunk["error"]))
                    return record
                now = time.perf_counter()
                if chunk.get("choices"):  # (the usage chunk's list is empty)
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.gaps.append(now - last)
                    last = now
                    record.chunks += 1
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    record.output_tokens = chunk["usage"].get("completion_tokens")
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e = (last if last is not None else time.perf_counter()) - start
    record.ok = record.ttft is not None
    if not record.ok:
        record.error = "the stream carried no output"
    return record


async def run_level(
    client: httpx.AsyncClient,
    model: str,
    prompts: Callable[[int], list[int]],
    concurrency: int,
    settings: LoadSettings,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send the level's requests from ``concurrency`` workers; returns the records and the wall time."""
    total = settings.requests_for(concurrency)
    next_index = 0
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + settings.duration_s if settings.duration_s else math.inf

    async def worker() -> None:
        nonlocal next_index
        while next_index < total and time.perf_counter() < deadline:
            index = next_index
            next_index += 1
            records.append(await stream_one(client, model, prompts(index), settings.output_tokens))
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def level_metrics(
    concurrency: int, records: list[RequestRecord], wall: float, settings: LoadSettings
) -> dict:
    """One row of the latency table: every timing's stats in ms, throughputs, goodput and errors."""
    done = [r for r in records if r.ok]
    row: dict = {"concurrency": concurrency, "requests": len(records), "completed": len(done)}
    row["errors"] = len(records) - len(done)
    row["error_rate"] = row["errors"] / len(records) if records else None
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [g for r in done for g in r.gaps],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }
    for name in TIMINGS:
        for stat, value in summarize(samples[name]).items():
            row[f"{name}_{stat}_ms"] = value
    output = sum(r.output_tokens or 0 for r in done)
    row["output_tokens"] = output
    row["streamed_chunks"] = sum(r.chunks for r in done)
    row["prompt_tokens_mean"] = sum(r.prompt_tokens or 0 for r in done) / len(done) if done else None
    row["wall_s"] = wall
    row["request_throughput"] = len(done) / wall if wall > 0 else None
    row["output_throughput"] = output / wall if wall > 0 else None
    row["goodput"] = None
    if settings.slo_ttft_ms is not None or settings.slo_tpot_ms is not None:
        good = sum(1 for r in done if _meets_slo(r, settings))
        row["goodput"] = good / wall if wall > 0 else None
    return row


def _meets_slo(record: RequestRecord, settings: LoadSettings) -> bool:
    if settings.slo_ttft_ms is not None and (
        record.ttft is None or record.ttft * 1000 > settings.slo_ttft_ms
    ):
        return False
    if settings.slo_tpot_ms is not None:
        tpot = record.tpot
        if tpot is not None and tpot * 1000 > settings.slo_tpot_ms:
            return False
    return True


@dataclass
class Level:
    """One concurrency level's raw results: every request's record and the level's wall time."""

    concurrency: int
    records: list[RequestRecord]
    wall_s: float


async def sweep_levels(
    base_url: str,
    model: str,
    api_key: str | None,
    prompts: Callable[[int], list[int]],
    settings: LoadSettings,
    on_level: Callable[[int, int], None] | None = None,
    on_done: Callable[[], None] | None = None,
) -> list[Level]:
    """Every concurrency level in turn, each after its own uncounted warm-up. ``base_url`` ends in /v1;
    ``prompts(i)`` is request i's token ids (negative i: warm-up requests)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(settings.concurrency) + 4)
    timeout = httpx.Timeout(settings.timeout_s, connect=10.0)
    levels = []
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        for concurrency in settings.concurrency:
            warmup = [
                stream_one(client, model, prompts(-1 - i), settings.output_tokens)
                for i in range(settings.warmup_requests)
            ]
            await asyncio.gather(*warmup)
            if on_level is not None:
                on_level(concurrency, settings.requests_for(concurrency))
            records, wall = await run_level(client, model, prompts, concurrency, settings, on_done)
            levels.append(Level(concurrency, records, wall))
    return levels


async def sweep(
    base_url: str,
    model: str,
    api_key: str | None,
    prompts: Callable[[int], list[int]],
    settings: LoadSettings,
    on_level: Callable[[int, int], None] | None = None,
    on_done: Callable[[], None] | None = None,
) -> list[dict]:
    """:func:`sweep_levels`, one :func:`level_metrics` row per level."""
    levels = await sweep_levels(base_url, model, api_key, prompts, settings, on_level, on_done)
    return [level_metrics(level.concurrency, level.records, level.wall_s, settings) for level in levels]
