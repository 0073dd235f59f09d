"""The load generator against the real embedded worker: two concurrency levels, numbers that hang together;
and against a stand-in for a server whose token chunks may carry no text (vLLM streams a chunk a step)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import httpx
import pytest

from squeezeserve.service.validate.latency import (
    LoadSettings,
    RequestRecord,
    level_metrics,
    percentile,
    stream_one,
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


def _sse_server(chunks: list[dict | str], pause_s: float) -> http.server.ThreadingHTTPServer:
    """A server whose POST /v1/completions streams ``chunks`` as server-sent events, ``pause_s`` apart."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks:
                time.sleep(pause_s)
                data = chunk if isinstance(chunk, str) else json.dumps(chunk)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _stream(httpd: http.server.ThreadingHTTPServer) -> RequestRecord:
    async def one() -> RequestRecord:
        base = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        async with httpx.AsyncClient(base_url=base, timeout=10.0) as client:
            return await stream_one(client, "m", [1000, 1001], 3)

    try:
        return asyncio.run(one())
    finally:
        httpd.shutdown()
        httpd.server_close()


def _usage(tokens: int) -> dict:  # (the last chunk of a stream with stream_options.include_usage)
    usage = {"prompt_tokens": 2, "completion_tokens": tokens}
    return {"object": "text_completion", "choices": [], "usage": usage}


def _step(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_a_token_whose_text_is_empty_still_ends_the_time_to_first_token():
    usage = _usage(3)
    # the first token ends inside a multi-byte character: its step's chunk carries no text yet
    httpd = _sse_server([_step(""), _step("\u00e9"), _step("!", "length"), usage, "[DONE]"], pause_s=0.05)

    record = _stream(httpd)

    assert record.ok and record.error is None
    # a chunk a step (the usage chunk is none): TTFT ends at the first, textless one, so two gaps follow it
    # and they span the rest of the stream (counting text only: 2 chunks, 1 gap)
    assert record.chunks == 3 and len(record.gaps) == 2
    assert record.ttft >= 0.05  # (the stand-in waits 0.05 s before each chunk)
    assert record.e2e - record.ttft == pytest.approx(sum(record.gaps))
    assert record.output_tokens == 3


def test_a_stream_of_steps_that_print_nothing_is_not_a_failure():
    usage = _usage(3)
    httpd = _sse_server([_step(""), _step(""), _step("", "length"), usage, "[DONE]"], pause_s=0.01)

    record = _stream(httpd)

    assert record.ok and record.chunks == 3 and record.output_tokens == 3


def test_a_stream_without_a_step_is_a_failure():
    usage = _usage(0)
    httpd = _sse_server([usage, "[DONE]"], pause_s=0.01)

    record = _stream(httpd)

    assert not record.ok and record.error == "the stream carried no output"
