"""Shared benchmark plumbing: device peaks, timing, and the one fixed-schema CSV every bench appends to."""

from __future__ import annotations

import csv
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

FIELDS = ["op", "provider", "mode", "shape", "dtype", "metric", "p20", "p50", "p80", "unit", "pct_of_peak",
          "device", "versions", "date"]  # fmt: skip
CSV_PATH = Path(os.environ.get("BENCH_CSV", Path(__file__).parent / "results" / "kernels.csv"))


def versions() -> str:
    parts = [f"torch={torch.__version__}", f"triton={triton.__version__}"]
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        parts.append(f"liger={version('liger-kernel')}")
    except ImportError:
        pass
    return " ".join(parts)


def device_name() -> str:
    return torch.cuda.get_device_name()


_PEAKS: dict[str, float] = {}


def peaks() -> dict[str, float]:
    """Measured copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on this device."""
    if not _PEAKS:
        src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
        dst = torch.empty_like(src)
        ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
        _PEAKS["copy_GBps"] = 2 * src.numel() * 2 / ms / 1e6
        del src, dst
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
        _PEAKS["bf16_TFLOPs"] = 2 * 8192**3 / ms / 1e9
        print(
            f"# peaks: copy {_PEAKS['copy_GBps']:.0f} GB/s, bf16 matmul {_PEAKS['bf16_TFLOPs']:.0f} TFLOP/s"
        )
    return _PEAKS


def time_ms(fn: Callable[[], object], graph: bool = False, rep: int = 100) -> list[float]:
    """[p20, p50, p80] in ms over about ``rep`` ms of repeats. graph=True replays a CUDA graph (small
    launches: no host gaps)."""
    q = [0.2, 0.5, 0.8]
    if graph:
        return list(do_bench_cudagraph(fn, rep=rep, quantiles=q))
    return list(do_bench(fn, warmup=25, rep=rep, quantiles=q))


def host_ms(fn: Callable[[], object], calls: int = 200, repeats: int = 7) -> list[float]:
    """[p20, p50, p80] in ms per call of ``calls`` back-to-back eager calls, synchronized once at the end:
    what a Python caller pays per call where the host, not the GPU, is the bound (small shapes)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    samples.sort()
    return [samples[round(q * (len(samples) - 1))] for q in (0.2, 0.5, 0.8)]


def vllm_op(name: str):
    """One of vLLM's own CUDA ops (``torch.ops._C.<name>``), or None without vLLM."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads and registers vLLM's _C library)
    except Exception as exc:
        print(f"# vllm unavailable: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
        return None
    return getattr(torch.ops._C, name, None)


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Peak allocated memory above what was allocated before the call, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


class Recorder:
    def __init__(self, op: str) -> None:
        self.op = op
        self.rows: list[dict] = []

    def add(self, provider, mode, shape, dtype, metric, values, unit, pct=None) -> None:
        p20, p50, p80 = values if len(values) == 3 else (values[0],) * 3
        self.rows.append({
            "op": self.op, "provider": provider, "mode": mode, "shape": "x".join(map(str, shape)),
            "dtype": str(dtype).replace("torch.", ""), "metric": metric, "p20": f"{p20:.5g}",
            "p50": f"{p50:.5g}", "p80": f"{p80:.5g}", "unit": unit,
            "pct_of_peak": "" if pct is None else f"{pct:.1f}",
            "device": device_name(), "versions": versions(),
            "date": datetime.date.today().isoformat(),
        })  # fmt: skip
        print(f"{self.op:>14} {provider:>14} {mode:>7} {self.rows[-1]['shape']:>18} {metric:>8} "
              f"{p50:10.4g} {unit}" + ("" if pct is None else f" ({pct:.0f}% of peak)"),
              flush=True)  # fmt: skip

    def time(
        self, provider, mode, shape, dtype, fn, nbytes=None, flops=None, graph=False, rep=100
    ) -> float | None:
        try:
            ms = time_ms(fn, graph=graph, rep=rep)
        except (
            Exception
        ) as exc:  # a provider that cannot run a shape (Liger's width limit) is recorded as such
            print(
                f"# {self.op} {provider} {mode} {shape}: {type(exc).__name__}: {str(exc)[:120]}",
                file=sys.stderr,
            )
            return None
        self.add(provider, mode, shape, dtype, "time", ms, "ms")
        if nbytes is not None:
            gbps = [nbytes / t / 1e6 for t in ms[::-1]]
            self.add(provider, mode, shape, dtype, "GB/s", gbps, "GB/s", 100 * gbps[1] / peaks()["copy_GBps"])
        if flops is not None:
            tf = [flops / t / 1e9 for t in ms[::-1]]
            self.add(
                provider, mode, shape, dtype, "TFLOP/s", tf, "TFLOP/s", 100 * tf[1] / peaks()["bf16_TFLOPs"]
            )
        return ms[1]

    def memory(self, provider, mode, shape, dtype, fn) -> float | None:
        try:
            mb = peak_memory_mb(fn)
        except Exception as exc:
            print(
                f"# {self.op} {provider} memory {shape}: {type(exc).__name__}: {str(exc)[:120]}",
                file=sys.stderr,
            )
            return None
        self.add(provider, mode, shape, dtype, "peak_mem", [mb], "MB")
        return mb

    def write(self) -> None:
        CSV_PATH.parent.mkdir(parents=True, exist_ok=True)
        new = not CSV_PATH.exists()
        with CSV_PATH.open("a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)


def liger(name: str):
    """A Liger-Kernel callable, or None when the wheel is not installed."""
    try:
        import liger_kernel.ops as ops  # noqa: F401
        from liger_kernel.transformers import functional as lf
    except ImportError:
        return None
    return getattr(lf, name, None)


def compiled(fn):
    return torch.compile(fn, dynamic=False)
