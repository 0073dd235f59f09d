"""Device probe for issue #16 item 5: where fused linear cross-entropy's time goes at N=16k, V=128k, H=4096
(bf16), and which GEMM layouts cuBLAS runs fastest for each of a chunk's three products.

Per chunk size: the whole op's fwd+bwd time and its peak memory above the inputs (the target: <= 80 ms at
<= 1.3 GB); then, per chunk, each product in the layouts it can be written in:

- logits [c, V] = h @ W^T (what the op runs), or its transpose W @ h^T into a [V, c] buffer;
- grad_hidden [c, H] = dlogits @ W;
- grad_weight [V, H] += dlogits^T @ h (the op: addmm_ into the [V, H] gradient), or [H, V] += h^T @ dlogits
  into a transposed gradient. At c = 512 the [V, H] bf16 gradient (1.05 GB) is read and written per chunk,
  67 GB per batch: 22 ms at 3 TB/s on its own.

Each product's time is for the whole batch (per-chunk time x N / c) with its TFLOP/s.

    python3 tests/gpu/flce_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels.ops import fused_linear_ce as flce  # noqa: E402

N, H, V = 16384, 4096, 128256
DTYPE = torch.bfloat16


def op_row(hidden, weight, target, chunk: int) -> str:
    saved = flce.chunk_tokens
    flce.chunk_tokens = lambda *a: chunk
    try:

        def step():
            hidden.grad = weight.grad = None
            K.fused_linear_cross_entropy(hidden, weight, target).backward()

        ms = do_bench(step, warmup=200, rep=1000, return_mode="median")
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        hidden.grad = weight.grad = None
    finally:
        flce.chunk_tokens = saved
    return f"op chunk={chunk}: fwd+bwd {ms:.1f} ms, peak {peak:.0f} MiB ({peak * 2**20 / 1e9:.3f} GB)"


def gemm_rows(hidden, weight, chunk: int) -> list[str]:
    h = hidden[:chunk]
    dl = torch.randn(chunk, V, device="cuda", dtype=DTYPE) / 64
    dlT = dl.t().contiguous()
    out = torch.empty(chunk, V, device="cuda", dtype=DTYPE)
    outT = torch.empty(V, chunk, device="cuda", dtype=DTYPE)
    gh = torch.empty(chunk, H, device="cuda", dtype=DTYPE)
    gw = torch.zeros(V, H, device="cuda", dtype=DTYPE)
    gwT = torch.zeros(H, V, device="cuda", dtype=DTYPE)
    variants = {
        "logits h@W^T -> [c,V]": lambda: torch.matmul(h, weight.t(), out=out),
        "logits W@h^T -> [V,c]": lambda: torch.matmul(weight, h.t(), out=outT),
        "grad_hidden dl@W (dl [c,V])": lambda: torch.matmul(dl, weight, out=gh),
        "grad_hidden dl@W (dl [V,c] storage)": lambda: torch.matmul(dlT.t(), weight, out=gh),
        "grad_weight [V,H] += dl^T@h": lambda: gw.addmm_(dl.t(), h),
        "grad_weight [V,H] += dl^T@h (dl [V,c] storage)": lambda: gw.addmm_(dlT, h),
        "grad_weight [H,V] += h^T@dl": lambda: gwT.addmm_(h.t(), dl),
        "grad_weight [V,H] = dl^T@h (no accumulate)": lambda: torch.matmul(dl.t(), h, out=gw),
    }
    flop = 2 * chunk * H * V
    rows = []
    for name, fn in variants.items():
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median") * (N // chunk)
        rows.append(
            f"  c={chunk} {name}: {ms:.1f} ms per batch ({flop * (N // chunk) / ms / 1e9:.0f} TFLOP/s)"
        )
    return rows


def main() -> None:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    hidden = (torch.randn(N, H, device="cuda", dtype=DTYPE) / 8).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", dtype=DTYPE) / 64).requires_grad_()
    target = torch.randint(0, V, (N,), device="cuda")
    for chunk in (512, 768, 1024):
        print(op_row(hidden, weight, target, chunk), flush=True)
    with torch.no_grad():
        for chunk in (512, 768, 1024):
            for row in gemm_rows(hidden.detach(), weight.detach(), chunk):
                print(row, flush=True)


if __name__ == "__main__":
    main()
