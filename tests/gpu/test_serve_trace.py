"""serve_trace.py, which reads a vLLM server's torch profiler trace back into engine steps: on a trace laid
out as torch's profiler writes one (chrome trace events: vLLM's step ranges, runtime and driver launches on
the step's thread, kernels tied to them by correlation id, a CUDA graph's kernels sharing its launch's)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("serve_trace", Path(__file__).with_name("serve_trace.py"))
serve_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_trace)


def _events() -> list[dict]:
    def step(name, ts, dur):
        return {"cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": 1}

    def launch(cat, ts, corr, tid=1):
        return {"cat": cat, "name": "launch", "ts": ts, "dur": 2, "tid": tid, "args": {"correlation": corr}}

    def kernel(name, ts, dur, corr):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    return [
        # a prompt step of 3000 rows (2 prompts, 8 decodes): two kernels that overlap, one launched by the
        # driver API (Triton's launches), and a kernel launched from another thread inside its range
        step("execute_context_2(2992)_generation_8(8)", 1000, 500),
        launch("cuda_runtime", 1010, 7),
        launch("cuda_driver", 1020, 8),
        launch("cuda_runtime", 1030, 99, tid=2),
        kernel("gemm", 1100, 300, 7),
        kernel("norm", 1300, 200, 8),  # overlaps gemm by 100 us: GPU busy 400
        kernel("elsewhere", 1200, 50, 99),
        # a decode step replaying a CUDA graph: both kernels carry the graph launch's correlation id
        step("execute_context_0(0)_generation_8(8)", 2000, 40),
        launch("cuda_runtime", 2005, 9),
        kernel("graph_a", 2050, 10, 9),
        kernel("graph_b", 2070, 10, 9),
        # an annotation that is not a step
        {"cat": "user_annotation", "name": "gpu_model_runner: sample", "ts": 2100, "dur": 5, "tid": 1},
    ]


def test_steps_take_the_kernels_their_thread_launched_within_them():
    steps = serve_trace.steps_of(_events())
    assert [(s["rows"], s["prompt"], s["host"]) for s in steps] == [(3000, 2992, 500), (8, 0, 40)]
    assert sorted(k[2] for k in steps[0]["kernels"]) == ["gemm", "norm"]
    assert sorted(k[2] for k in steps[1]["kernels"]) == ["graph_a", "graph_b"]
    assert serve_trace.busy(steps[0]["kernels"]) == 400
    assert serve_trace.extent(steps[0]["kernels"]) == 400
    assert serve_trace.busy(steps[1]["kernels"]) == 20 and serve_trace.extent(steps[1]["kernels"]) == 30


def test_report_groups_steps_by_rows_and_ranks_the_prompt_and_decode_steps_kernels(tmp_path):
    with gzip.open(tmp_path / "rank0.1.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _events()}, f)
    lines = serve_trace.report(serve_trace.steps_of(serve_trace.load(tmp_path)), "ours", top=5)
    assert lines[0] == "ours: 2 engine steps profiled"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:4]}
    # rows -> steps, prompt rows, GPU busy ms (sum), busy / step, host / step, span / step
    assert rows["1-64"] == ["1", "0", "0.02", "0.020", "0.040", "0.030"]
    assert rows["2049-4096"] == ["1", "2992", "0.40", "0.400", "0.500", "0.400"]
    assert "steps with prompt tokens: 1, 3000 rows, kernels 0.50 ms" in lines[4]
    assert [line.split()[-1] for line in lines[5:7]] == ["gemm", "norm"]
    # the decode-only steps: rows and GPU busy a step, then each kernel's time and calls a step
    assert "decode-only steps: 1, 8.0 rows, GPU busy 20.0 us a step" in lines[7]
    assert [line.split() for line in lines[8:]] == [["10.00", "1.0", "graph_a"], ["10.00", "1.0", "graph_b"]]
    # --by-size: each size's prompt steps, their row counts and kernels (the one of 2049-4096 rows, top 1)
    sized = serve_trace.report(serve_trace.steps_of(serve_trace.load(tmp_path)), "ours", top=5, by_size=1)
    assert sized[7] == "  prompt steps of 2049-4096 rows: 1 (3000); by kernel (ms, calls, name):"
    assert sized[8] == lines[5]
    assert sized[9:] == lines[7:]


def test_a_folder_without_a_trace_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no torch profiler trace"):
        serve_trace.load(tmp_path)
