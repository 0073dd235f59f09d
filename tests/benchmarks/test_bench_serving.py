"""bench_serving.py's server line: vLLM's Prometheus histograms read around a level (the text below is the
form vLLM 0.26's /metrics serves them in, one engine and one model)."""

from __future__ import annotations

import http.server
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_serving", Path(__file__).with_name("bench_serving.py"))
bench_serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serving)


def vllm_metrics(
    requests: int, ttft_s: float, queue_s: float, prefill_s: float, steps: int, tokens: int
) -> str:
    lines = []
    for name, total, count in (
        ("vllm:time_to_first_token_seconds", ttft_s, requests),
        ("vllm:request_queue_time_seconds", queue_s, requests),
        ("vllm:request_prefill_time_seconds", prefill_s, requests),
        ("vllm:iteration_tokens_total", tokens, steps),
    ):
        labels = 'engine="0",model_name="m"'
        lines += [
            f"# HELP {name} A histogram.",
            f"# TYPE {name} histogram",
            f'{name}_bucket{{{labels},le="1.0"}} {count}',
            f'{name}_bucket{{{labels},le="+Inf"}} {count}',
            f"{name}_count{{{labels}}} {count}",
            f"{name}_sum{{{labels}}} {total}",
        ]
    lines += ["# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge",
              'vllm:num_requests_running{engine="0",model_name="m"} 3.0']  # fmt: skip
    return "\n".join(lines) + "\n"


@pytest.fixture
def server() -> Iterator[tuple[str, dict]]:
    """An HTTP server whose /metrics serves ``state["text"]`` (404 while it is None)."""
    state: dict = {"text": None}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics" or state["text"] is None:
                self.send_error(404)
                return
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_server_line_is_the_level_s_difference_of_two_scrapes(server) -> None:
    root, state = server
    state["text"] = vllm_metrics(requests=4, ttft_s=0.4, queue_s=0.1, prefill_s=0.2, steps=10, tokens=1000)
    before = bench_serving.scrape(root)
    assert before == {
        "ttft_sum": 0.4, "ttft_count": 4, "queue_sum": 0.1, "queue_count": 4, "prefill_sum": 0.2,
        "prefill_count": 4, "step_tokens_sum": 1000, "step_tokens_count": 10,
    }  # fmt: skip
    # The level: 8 more requests (TTFT 1.6 s in all, 0.4 s queued, 0.8 s in prefill) over 30 more steps.
    state["text"] = vllm_metrics(requests=12, ttft_s=2.0, queue_s=0.5, prefill_s=1.0, steps=40, tokens=7000)
    line = bench_serving.server_line(before, bench_serving.scrape(root))
    assert line == "vLLM TTFT mean 200.0 ms (queue 50.0 + prefill 100.0), 200 tokens a step"


def test_no_server_line_without_vllm_metrics(server) -> None:
    root, state = server
    assert bench_serving.scrape(root) is None  # no /metrics
    state["text"] = "# HELP up Up.\n# TYPE up gauge\nup 1.0\n"
    assert bench_serving.scrape(root) is None  # metrics, none of vLLM's
    state["text"] = vllm_metrics(requests=4, ttft_s=0.4, queue_s=0.1, prefill_s=0.2, steps=10, tokens=1000)
    same = bench_serving.scrape(root)
    assert bench_serving.server_line(same, same) is None  # no request in between
    assert bench_serving.server_line(None, same) is None
    assert bench_serving.scrape("http://127.0.0.1:9") is None  # nothing listening


def test_failed_requests_are_told_by_message_most_frequent_first() -> None:
    record = bench_serving.latency.RequestRecord
    ok = record(ok=True, ttft=0.1, e2e=0.5, output_tokens=8)
    level = bench_serving.latency.Level(concurrency=4, records=[ok, ok], wall_s=1.0)
    assert bench_serving.error_summary(level) is None
    empty = record(ok=False, error="the stream carried no output")
    failed = [empty, empty, record(ok=False, error="HTTP 400")]
    level = bench_serving.latency.Level(concurrency=4, records=[ok, *failed, record(ok=False)], wall_s=1.0)
    assert bench_serving.error_summary(level) == (
        "2 x the stream carried no output; 1 x HTTP 400; 1 x no message"
    )
    assert bench_serving.error_summary(level, most=1) == "2 x the stream carried no output; 2 other kinds"
    assert bench_serving.level_row(level)["errors"] == 4
