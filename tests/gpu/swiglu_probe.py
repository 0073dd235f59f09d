"""Device probe for issue #16 item 5's second half: SwiGLU forward + backward against Liger's at
16384 x {4096, 14336} (bf16), and which tiling of our two kernels gets there.

Rows 1-2 time what ``bench_memory_bound.py`` times ("fwd+bwd": an autograd step, ``.grad`` cleared each
time) for ``K.swiglu`` and Liger's ``LigerSiLUMulFunction``; the sweep times our forward and backward kernels
alone at each (rows a tile, columns a tile, warps) with CUDA events (GPU time; 134-470 MB a tensor, so
nothing stays in L2). Every figure is the minimum over 5 interleaved rounds of 20 calls, with GB/s counting
each input read once and each output written once (forward 3, backward 5 tensors).

    python3 tests/gpu/swiglu_probe.py [--shapes 16384x4096,16384x14336]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

import squeezeserve.kernels as K
from squeezeserve.kernels.ops import swiglu as sw
from squeezeserve.kernels.ops.launch import cdiv, next_power_of_2

ROUNDS, CALLS = 5, 20


def gpu_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def best(rows: dict) -> dict:
    for fn in rows.values():
        fn()
    torch.cuda.synchronize()
    out = dict.fromkeys(rows, float("inf"))
    for _ in range(ROUNDS):
        for name, fn in rows.items():
            out[name] = min(out[name], gpu_ms(fn))
    return out


def step(fn, a, b, g):
    def run():
        a.grad = b.grad = None
        fn(a, b).backward(g)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="16384x4096,16384x14336")
    args = parser.parse_args()
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError as e:
        LigerSiLUMulFunction = None
        print(f"# liger_kernel: {e}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        gb = m * n * 2 / 1e9
        a, b = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        rows = {"squeezeserve fwd+bwd (autograd)": step(K.swiglu, a, b, g)}
        if LigerSiLUMulFunction is not None:
            rows["liger fwd+bwd (autograd)"] = step(LigerSiLUMulFunction.apply, a, b, g)
        for name, ms in best(rows).items():
            print(f"{shape} {name:<34} {ms:8.4f} ms {8 * gb / ms * 1e3:7.0f} GB/s", flush=True)

        timed = best(kernel_sweep(a.detach(), b.detach(), g))
        for kind, nbytes in (("fwd", 3), ("bwd", 5)):
            ranked = sorted((ms, key) for key, ms in timed.items() if key[0] == kind)
            for ms, (_, r, c, w) in ranked[:8]:
                print(f"{shape} {kind} {r:2d} rows x {c:5d} cols, {w:2d} warps {ms:8.4f} ms "
                      f"{nbytes * gb / ms * 1e3:7.0f} GB/s")  # fmt: skip
            r, c, _, w = sw._tiles(m, n, backward=kind == "bwd")
            ms = timed[(kind, r, c, w)]
            print(f"{shape} {kind} shipped ({r} x {c}, {w} warps) {ms:8.4f} ms "
                  f"{nbytes * gb / ms * 1e3:7.0f} GB/s", flush=True)  # fmt: skip


def kernel_sweep(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> dict:
    """("fwd" | "bwd", rows a tile, columns a tile, warps) -> a call of that kernel at that tiling."""
    m, n = x.shape
    out, da, db = (torch.empty_like(x) for _ in range(3))
    sweep = {}
    for elements, rows, warps in itertools.product((2048, 4096, 8192, 16384), (1, 2, 4, 8), (4, 8, 16)):
        block = elements // rows
        if block > 16384 or block < 512 or block > next_power_of_2(n) or warps * 32 * 4 > elements:
            continue
        grid = (cdiv(m, rows), cdiv(n, block))
        meta = {"BLOCK_R": rows, "BLOCK": block, "OAI": False, "num_warps": warps}
        fwd = sw._swiglu_fwd[grid]
        bwd = sw._swiglu_bwd[grid]
        sweep[("fwd", rows, block, warps)] = functools.partial(
            fwd, x, y, out, n, n, n, n, 0.0, 0.0, m, **meta
        )
        sweep[("bwd", rows, block, warps)] = functools.partial(
            bwd, g, x, y, da, db, n, n, n, n, n, n, 0.0, 0.0, m, **meta
        )
    return sweep


if __name__ == "__main__":
    main()
