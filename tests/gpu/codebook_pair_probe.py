"""Device probe for issue #20: does halving the loads a weight pays make the one-row codebook kernel faster?

``_codebook_lut_kernel`` loads one 2-byte codebook value per weight from L1. Here each load fetches two:
a per-row table of the 256 index pairs of a 4-bit codebook (``pair_table``: entry ``a + 16 b`` holds the
bf16 values ``C[a]`` and ``C[b]`` in one int32, 1 KB a row), indexed by a byte of the index word, so one
4-byte load serves two consecutive columns; the bf16 halves become fp32 by shifts. The table would be built
once at load time from the stored codebook (4 MB for a 4096-row layer, read once per call: ~1.3 us at
3 TB/s). Prints the pair kernel's time beside ``codebook_matmul`` (the LUT kernel at one row) and our int4
g128 kernel, at the benchmark's decode shapes, after checking the result against the dense product.

    python3 tests/gpu/codebook_pair_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_codebook_matmul import _cycle, _rel, decode_weights  # noqa: E402
from common import time_ms  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels.ops.launch import cdiv  # noqa: E402

DTYPE = torch.bfloat16


def pair_table(codebook: torch.Tensor) -> torch.Tensor:
    """[N, 16] codebook -> [N, 256] int32: entry a + 16 b = bf16 bits of C[a] (low half) and C[b] (high)."""
    bits = codebook.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    low = bits.repeat(1, 16)  # entry e: C[e % 16]
    high = bits.repeat_interleave(16, dim=1)  # entry e: C[e // 16]
    return low | (high << 16)


@triton.jit
def _pair_kernel(x_ptr, idx_ptr, table_ptr, y_ptr, N, K, idx_row_stride, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.minimum(offs_n, N - 1)[:, None]
    idx_rows = idx_ptr + rows.to(tl.int64) * idx_row_stride
    table_offs = rows * 256
    n_words = tl.cdiv(K, 8)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for tile in range(0, tl.cdiv(n_words, BLOCK_W)):
        offs_w = tile * BLOCK_W + tl.arange(0, BLOCK_W)
        words = tl.load(idx_rows + offs_w[None, :], mask=(offs_w < n_words)[None, :], other=0).to(
            tl.uint32, bitcast=True
        )
        for j in tl.static_range(4):
            pair = ((words >> (8 * j)) & 255).to(tl.int32)
            entry = tl.load(table_ptr + (table_offs + pair)).to(tl.uint32, bitcast=True)
            w0 = (entry << 16).to(tl.float32, bitcast=True)
            w1 = (entry & 0xFFFF0000).to(tl.float32, bitcast=True)
            ks = offs_w * 8 + 2 * j
            x0 = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + ks + 1, mask=ks + 1 < K, other=0.0).to(tl.float32)
            acc += w0 * x0[None, :] + w1 * x1[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=mask_n)


def pair_matmul(x: torch.Tensor, indices: torch.Tensor, table: torch.Tensor, block_n=4, block_w=64):
    n = indices.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _pair_kernel[(cdiv(n, block_n),)](x, indices, table, y, n, x.shape[-1], indices.stride(0),
                                      BLOCK_N=block_n, BLOCK_W=block_w)  # fmt: skip
    return y


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}")
    for k, n, bits, (int4s, _), (books, _), dense in decode_weights():
        if bits != 4:
            continue
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        y_ref = x @ dense.t()
        tables = [(idx, pair_table(cb)) for idx, cb in books]
        t_int4 = time_ms(
            _cycle([lambda p=p, x=x: K.quant_matmul(x, p[0], p[1], None, 128, 4) for p in int4s]), True
        )[1]
        t_op = time_ms(_cycle([lambda p=p, x=x: K.codebook_matmul(x, *p, 0, 4) for p in books]), True)[1]
        line = f"1x{n}x{k}: int4-g128 {t_int4 * 1e3:.2f} us, codebook_matmul {t_op * 1e3:.2f} us"
        for bn, bw in ((4, 64), (8, 64), (4, 128), (8, 128)):
            err = _rel(pair_matmul(x, *tables[0], bn, bw), y_ref)
            if err > 1e-2:
                line += f"; pair {bn}x{bw} MISMATCH {err:.3g}"
                continue
            fn = _cycle([lambda p=p, x=x, a=bn, b=bw: pair_matmul(x, *p, a, b) for p in tables])
            t = time_ms(fn, True)[1]
            line += f"; pair {bn}x{bw} {t * 1e3:.2f} us ({t_int4 / t:.2f}x int4)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
