"""quant_matmul under torch.compile on a GPU: what torch's view of the prefill GEMM's writes costs.

torch.compile decomposes the op into its Triton launches and reads which arguments each kernel writes off
its TTIR. Inline PTX not marked pure stops that analysis, and torch then takes every argument as written:
Inductor writes them in place, other backends (aot_eager) copy each, the weight included, before each
call. The prefill GEMM's wgmma wait is such PTX; launched by torch.compile's code it is marked pure
(``_after_mma``'s ``TRACED``). This times, per shape, in one process, with Inductor, Inductor's CUDA graphs
(``graphs``) and aot_eager:

- ``compiled``: ``torch.compile(quant_matmul)`` as it runs now;
- ``copies``: the same with the wait as eager launches have it (``quant_matmul.traced`` patched to say no
  launch is traced), so torch takes every argument as written, as before the forty-third session;
- ``eager``: the op called eagerly through torch's dispatcher (the Gluon GEMM on Hopper, which
  torch.compile does not trace);
- ``bf16``: ``torch.matmul`` on the dequantized weight.

    python tests/gpu/compile_probe.py [--shapes 512x4096x4096,2048x14336x4096] [--group 128] [--zeros]

Each result is checked against the eager call before it is timed; times are the mean of 100 calls queued
back to back (CUDA events), warm weights.
"""

from __future__ import annotations

import argparse
import logging

import torch

from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import quant_matmul as qm


def mean_us(fn, x, calls: int = 100) -> float:
    """GPU time a call, of ``calls`` calls queued back to back (the host's launches overlap the GPU's work
    where it is the longer)."""
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def compiled_op(args, group: int, **options):
    torch._dynamo.reset()
    return torch.compile(lambda x: torch.ops.squeezeserve.quant_matmul(x, *args, group, 4), fullgraph=True,
                         **options)  # fmt: skip


# torch.compile's settings: Inductor, Inductor with CUDA graphs, and no Inductor (no in-place rewrite)
SETTINGS = {"": {}, " graphs": {"mode": "reduce-overhead"}, " aot_eager": {"backend": "aot_eager"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="512x4096x4096,512x14336x4096,2048x4096x14336,2048x14336x4096")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--zeros", action="store_true")
    a = ap.parse_args()
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # (torch's warning, in 'copies')
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; g{a.group}"
          f"{' zero points' if a.zeros else ''}; us a call, 100 back to back")  # fmt: skip
    for shape in a.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        packed = quant_layout.pack_weight(torch.randn(n, k), 4, a.group, symmetric=not a.zeros)
        args = [packed["weight_packed"].cuda(), packed["weight_scale"].cuda().bfloat16()]
        args.append(packed["weight_zero_point"].cuda() if a.zeros else None)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = qm.quant_matmul(x, *args, a.group, 4)
        dense = qm.dequantize(args[0], args[1], args[2], k, a.group, 4, torch.bfloat16).t().contiguous()
        row = {}
        eager_traced = qm.traced
        for setting, options in SETTINGS.items():
            for name, copies in (("compiled", False), ("copies", True)):
                if copies:  # (the wait as eager launches have it: torch takes every argument as written)
                    qm.traced = lambda *tensors: False
                try:
                    op = compiled_op(args, a.group, **options)
                    torch.testing.assert_close(op(x), want, atol=2e-2, rtol=2e-2)
                    row[name + setting] = mean_us(op, x)
                finally:
                    qm.traced = eager_traced
        row["eager"] = mean_us(lambda x, args=args: qm.quant_matmul(x, *args, a.group, 4), x)
        row["bf16"] = mean_us(lambda x, dense=dense: x @ dense, x)
        print(
            f"{shape}: "
            + " | ".join(f"{name} {us:.1f}" for name, us in row.items())
            + " | copies / compiled "
            + ", ".join(f"{row['copies' + s] / row['compiled' + s]:.2f}x{s}" for s in SETTINGS),
            flush=True,
        )


if __name__ == "__main__":
    main()
