"""Device probe for issue #16 items 2-3: int4 products of 64-8192 rows without a dense weight in memory.

vLLM's chunked prefill puts 65-600 rows into most steps at c = 64, where ours then took dequantize + cuBLAS
(the dense weight written and read again every step) or ``_prefill_kernel`` (0.37-0.55x bf16 on
2026-11-24; since that night's seventh session it builds the weight tile in the operand layout and runs at
0.62-1.12x, tests/benchmarks/NOTES.md). Two candidates of that day, each timed beside bf16 cuBLAS and the
path of the time on cold weights (CUDA graphs, copies past L2):

- ``skinny``: the decode tensor-core kernel (``_skinny_kernel``, 64-row tiles, scales after the dot, split-K)
  taken past its 64-row limit.
- ``v2``: a GEMM whose weight tile is computed elementwise from gathered words (``w[n, k]`` from the word
  holding ``k``, shifted by ``k % 8``), so Triton can load the words straight into the wgmma A-operand
  layout (no [N, W, 8] -> [N, K] reshape through shared memory, which ``_prefill_kernel`` then paid each
  tile);
  ``BF16`` does the dequantize in bf16 ((128 + q) - 136 exact, one rounding of the product, as in fp32).

    python3 tests/gpu/prefill_probe.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_quant_matmul import _copies, _cycle, _packed  # noqa: E402
from common import time_ms  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402
from squeezeserve.kernels.ops.launch import cdiv  # noqa: E402

DTYPE = torch.bfloat16


@triton.jit
def _prefill_v2(
    x_ptr,  # [M, K] bf16
    qw_ptr,  # [N, K / 8] int32, symmetric int4 (zero point 8)
    scale_ptr,  # [N, K / GROUP] bf16
    y_ptr,  # [M, N] bf16
    M,
    N,
    K,
    x_row_stride,
    qw_row_stride,
    scale_row_stride,
    y_row_stride,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIZZLE: tl.constexpr,
    BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    band = pid // (SWIZZLE * tiles_m)
    first_n = band * SWIZZLE
    band_n = tl.minimum(tiles_n - first_n, SWIZZLE)
    pid_n = first_n + (pid % (SWIZZLE * tiles_m)) % band_n
    pid_m = (pid % (SWIZZLE * tiles_m)) // band_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    rows = offs_n[:, None].to(tl.int64)
    qw_ptrs = qw_ptr + rows * qw_row_stride + (offs_k // 8)[None, :]
    shifts = ((offs_k % 8) * 4)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h = tl.load(qw_ptrs)
        s = tl.load(scale_ptr + rows * scale_row_stride + ((k0 + offs_k) // GROUP)[None, :])
        xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        q = (h >> shifts) & 0xF
        if BF16:
            w = ((q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0) * s
        else:
            w = (((q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s.to(tl.float32)).to(
                tl.bfloat16
            )
        acc = tl.dot(w.to(tl.bfloat16), tl.trans(xt), acc)
        qw_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    y = y_ptr + offs_m[None, :].to(tl.int64) * y_row_stride + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[None, :])


def v2(x, qw, sc, group, cfg):
    m, k = x.shape
    n = qw.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"]),)
    _prefill_v2[grid](
        x, qw, sc, y, m, n, k, x.stride(0), qw.stride(0), sc.stride(0), y.stride(0), GROUP=group,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SWIZZLE=8, BF16=cfg["BF16"],
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    return y


def skinny(x, qw, sc, group):
    saved = qm.SKINNY_MAX_M
    qm.SKINNY_MAX_M = 1 << 20
    try:
        return K.quant_matmul(x, qw, sc, None, group, 4)
    finally:
        qm.SKINNY_MAX_M = saved


V2_CONFIGS = [
    {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 64, "warps": 4, "stages": 3, "BF16": False},
    {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 64, "warps": 4, "stages": 3, "BF16": True},
    {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 64, "warps": 8, "stages": 3, "BF16": True},
    {"BLOCK_N": 128, "BLOCK_M": 256, "BLOCK_K": 64, "warps": 8, "stages": 3, "BF16": True},
    {"BLOCK_N": 64, "BLOCK_M": 128, "BLOCK_K": 64, "warps": 4, "stages": 4, "BF16": True},
    {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "warps": 4, "stages": 3, "BF16": True},
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    group = args.group
    ms = (64, 128, 256, 512, 2048, 8192) if not args.quick else (128, 512, 2048)
    kn = [(4096, 4096), (4096, 14336), (14336, 4096)] if not args.quick else [(4096, 14336)]
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, int4 g{group} symmetric, bf16; "
          "us (speedup vs bf16 cuBLAS)", flush=True)  # fmt: skip
    for k, n in kn:
        qw, sc, _ = _packed(n, k, 4, group)
        w_bytes = qw.numel() * 4 + sc.numel() * 2
        packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(_copies(w_bytes) - 1)]
        dense = quant_layout.dequantize(qw, sc, None, (n, k), group, 4).to(DTYPE)
        denses = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            ref = (x @ dense.t()).float()
            t_bf16 = time_ms(_cycle([lambda d=d, x=x: x @ d.t() for d in denses]), graph=True)[1]
            cells = [f"bf16 {t_bf16 * 1e3:.1f}"]
            cands = {"today": lambda p, x=x: K.quant_matmul(x, p[0], p[1], None, group, 4)}
            if m <= 1024:
                cands["skinny"] = lambda p, x=x: skinny(x, p[0], p[1], group)
            for i, cfg in enumerate(V2_CONFIGS):
                cands[f"v2.{i}"] = lambda p, cfg=cfg, x=x: v2(x, p[0], p[1], group, cfg)
            for name, fn in cands.items():
                try:
                    err = ((fn((qw, sc)).float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        cells.append(f"{name} WRONG({err:.2g})")
                        continue
                    t = time_ms(_cycle([lambda p=p, fn=fn: fn(p) for p in packs]), graph=True)[1]
                    cells.append(f"{name} {t * 1e3:.1f} ({t_bf16 / t:.2f}x)")
                except Exception as exc:  # noqa: BLE001  (a config that does not compile or fit)
                    cells.append(f"{name} {type(exc).__name__}")
            print(f"{m}x{n}x{k}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
