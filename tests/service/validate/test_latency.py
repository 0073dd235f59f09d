"""The load generator against the real embedded worker: two concurrency levels, numbers that hang together."""

from __future__ import annotations

import asyncio

import pytest

from squeezeserve.service.validate.latency import (
    LoadSettings,
    RequestRecord,
    level_metrics,
    percentile,
    sweep,
)

SERVED = "smollm2-135m-instruct"  # the name tests/conftest.py serves the baseline under
OUTPUT_TOKENS = 4


def test_percentiles_interpolate_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]

    assert [percentile(values, q) for q in (0, 50, 90, 100)] == pytest.approx([1.0, 2.5, 3.7, 4.0])
    assert percentile([], 50) is None


def test_level_metrics_count_errors_and_goodput():
    settings = LoadSettings([2], 3, None, 4, 0, slo_ttft_ms=150, slo_tpot_ms=None)
    fast = RequestRecord(ok=True, ttft=0.1, e2e=0.4, gaps=[0.1, 0.1, 0.1], chunks=4, output_tokens=4)
    slow = RequestRecord(ok=True, ttft=0.2, e2e=0.5, gaps=[0.1, 0.1, 0.1], chunks=4, output_tokens=4)
    failed = RequestRecord(ok=False, error="HTTP 500")

    row = level_metrics(2, [fast, slow, failed], wall=1.0, settings=settings)

    assert (row["completed"], row["errors"], row["output_tokens"]) == (2, 1, 8)
    assert row["goodput"] == 1.0  # only `fast` meets TTFT <= 150 ms
    assert row["ttft_mean_ms"] == pytest.approx(150.0)
    assert row["tpot_p50_ms"] == pytest.approx(100.0)  # (E2E - TTFT) / (4 - 1) = 100 ms for both


@pytest.mark.slow  # the model worker
def test_sweep_against_the_worker_gives_consistent_numbers(baseline_worker):
    settings = LoadSettings([1, 2], 3, None, OUTPUT_TOKENS, 1, slo_ttft_ms=None, slo_tpot_ms=None)
    prompt = list(range(1000, 1016))  # 16 ordinary token ids

    rows = asyncio.run(sweep(f"{baseline_worker}/v1", SERVED, None, lambda i: prompt, settings))

    assert [row["concurrency"] for row in rows] == [1, 2]
    for row in rows:
        assert (row["completed"], row["errors"]) == (3, 0)
        assert row["prompt_tokens_mean"] == len(prompt)
        # our worker streams one chunk per token: the chunks counted equal the usage it reports
        assert row["streamed_chunks"] == row["output_tokens"] <= 3 * OUTPUT_TOKENS
        assert 0 < row["ttft_p50_ms"] < row["e2e_p50_ms"]
        assert row["ttft_mean_ms"] < row["e2e_mean_ms"]
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert row["output_throughput"] == pytest.approx(row["output_tokens"] / row["wall_s"])
        assert row["goodput"] is None
