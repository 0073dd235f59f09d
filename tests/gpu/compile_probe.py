"""quant_matmul under torch.compile on a Hopper GPU: the opaque op against the traced body.

Traced on Hopper, ``torch.ops.squeezeserve.quant_matmul`` is its opaque op (``quant_matmul.COMPILED``
"opaque"), whose eager dispatch runs per call, the Gluon kernels included; with "kernels" torch.compile
traces the op's body into its Triton launches. There torch reads which arguments each kernel writes off its
TTIR; inline PTX not marked pure stops that analysis and torch takes every argument as written (Inductor
writes them in place, aot_eager copies each, the weight included, each call). The prefill GEMM's wgmma wait
is such PTX; launched by torch.compile's code it is marked pure (``_after_mma``'s ``TRACED``). Columns, per
backend (Inductor, aot_eager):

- ``opaque``: ``torch.compile(quant_matmul)`` as it runs by default;
- ``kernels``: the traced body (COMPILED "kernels");
- ``impure``: the traced body with the wait as eager launches have it (``quant_matmul.traced`` patched to
  say no launch is traced), so torch takes every argument as written, as before the forty-third session.

    python tests/gpu/compile_probe.py [--shapes 16x14336x14336,512x14336x4096] [--group 128] [--zeros]

Each result is checked against the eager call (relative norm of the difference) before it is timed. GPU
time a call: 20 calls captured in a CUDA graph, 10 replays (the weight, past the L2 at 14336 wide, cold-ish);
host time a call: 200 calls enqueued back to back.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch._inductor.config as inductor_config

from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import quant_matmul as qm


def gpu_us(fn, x, calls: int = 20, replays: int = 10) -> float:
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def host_us(fn, x, calls: int = 200) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    host = (time.perf_counter() - start) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def compiled(args, group: int, compiled_as: str, pure_wait: bool, backend: str):
    """quant_matmul compiled with COMPILED ``compiled_as`` (and the traced wait pure or not); the settings
    hold while torch.compile traces, at the first call."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.ops.squeezeserve.quant_matmul(x, *args, group, 4), fullgraph=True,
                       backend=backend)  # fmt: skip

    def first(x):
        saved = qm.COMPILED, qm.traced
        qm.COMPILED = compiled_as
        if not pure_wait:
            qm.traced = lambda *tensors: False
        try:
            return fn(x)
        finally:
            qm.COMPILED, qm.traced = saved

    return fn, first


VARIANTS = {"opaque": ("opaque", True), "kernels": ("kernels", True), "impure": ("kernels", False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x14336x14336,16x14336x14336,64x14336x4096,200x4096x4096,"
                                        "512x14336x4096,2048x14336x4096")  # fmt: skip
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--zeros", action="store_true")
    ap.add_argument("--backends", default="inductor,aot_eager")
    a = ap.parse_args()
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # (torch's warning, for 'impure')
    inductor_config.force_disable_caches = True  # (a cached graph would be another variant's)
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; g{a.group}"
          f"{' zero points' if a.zeros else ''}; us a call, GPU (in a CUDA graph) / host")  # fmt: skip
    for shape in a.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        packed = quant_layout.pack_weight(torch.randn(n, k), 4, a.group, symmetric=not a.zeros)
        args = [packed["weight_packed"].cuda(), packed["weight_scale"].cuda().bfloat16()]
        args.append(packed["weight_zero_point"].cuda() if a.zeros else None)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = qm.quant_matmul(x, *args, a.group, 4).float()
        for backend in a.backends.split(","):
            row = {}
            for name, (compiled_as, pure_wait) in VARIANTS.items():
                fn, first = compiled(args, a.group, compiled_as, pure_wait, backend)
                err = ((first(x).float() - want).norm() / want.norm()).item()
                assert err < 1e-2, (shape, backend, name, err)
                row[name] = (gpu_us(fn, x), host_us(fn, x))
            cells = " | ".join(f"{name} {g:.1f} / {h:.1f}" for name, (g, h) in row.items())
            ratios = (row["kernels"][0] / row["opaque"][0], row["impure"][0] / row["kernels"][0])
            print(f"{shape} {backend}: {cells} | GPU kernels / opaque {ratios[0]:.2f}x, impure / kernels "
                  f"{ratios[1]:.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
