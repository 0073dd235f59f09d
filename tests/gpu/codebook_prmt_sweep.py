"""Device sweep for issue #20: settings of the 4-bit codebook kernels that look values up with ``prmt`` byte
tables in registers (``_codebook_fma_kernel`` on the FMA units, ``_codebook_matmul_kernel`` with TABLES on
tensor cores) against what ``codebook_matmul`` runs and our int4 g128 ``quant_matmul`` (equal bits to 2%),
at decode sizes, cold weights in CUDA graphs as ``bench_codebook_matmul.py`` times them. Every setting is
checked against the dense product before it is timed. Prints one line per (shape, M, setting) and, per
(shape, M), the best setting of each kernel against int4 g128.

    python tests/gpu/codebook_prmt_sweep.py [--quick] [--ms 1,2,4,8,16] [--kernels fma,mma]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_codebook_matmul import _cycle, _rel, decode_weights  # noqa: E402
from common import time_ms  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels.ops import codebook_matmul as cm  # noqa: E402
from squeezeserve.kernels.ops.launch import cdiv, sm_count  # noqa: E402

DTYPE = torch.bfloat16


def median(fn) -> float:
    return time_ms(fn, graph=True)[1]


def configs(kernel: str, m: int, n: int, k: int, quick: bool):
    """(BLOCK_N, BLOCK_K, K splits, warps, stages) around the best of the last sweep (NOTES.md, issue 20):
    the FMA kernel's narrow N tiles and deep K tiles, the tensor-core kernel's 64-128 wide N tiles."""
    block_m = 1 if kernel == "fma" else 16
    if kernel == "fma":
        grid = [(bn, bk, split, warps, 3) for bn in (4, 8, 16) for bk in (256, 512) for split in (1, 2, 4)
                for warps in (2, 4)]  # fmt: skip
    else:
        grid = [(bn, 128, split, 4, 3) for bn in (64, 128) for split in (2, 4, 8, 16)]
    if quick:
        grid = grid[:: max(1, len(grid) // 4)]
    for bn, bk, split, warps, stages in grid:
        cfg = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "split": min(split, cdiv(k, bk)),
               "num_warps": warps, "num_stages": stages}  # fmt: skip
        yield {"kernel": kernel, **cfg} if kernel == "fma" else cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--kernels", default="fma,mma")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    kernels = args.kernels.split(",")
    print(f"# {torch.cuda.get_device_name()} sms={sm_count(torch.device('cuda'))}")
    summary = []
    for k, n, bits, (int4s, _), (books, _), dense in decode_weights():
        if bits != 4:
            continue
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            y_ref = x @ dense.t()
            int4 = _cycle([lambda p=p, x=x: K.quant_matmul(x, p[0], p[1], None, 128, 4) for p in int4s])
            t_int4 = median(int4)
            op = _cycle([lambda p=p, x=x: K.codebook_matmul(x, *p, 0, 4) for p in books])
            t_op = median(op)
            line = (f"SUMMARY {m}x{n}x{k}: int4-g128 {t_int4 * 1e3:.2f} us, "
                    f"codebook_matmul {t_op * 1e3:.2f} us ({t_int4 / t_op:.2f}x int4)")  # fmt: skip
            for kernel in kernels:
                if kernel == "fma" and m > 1:  # one row
                    continue
                best = None
                for cfg in configs(kernel, m, n, k, args.quick):
                    try:
                        err = _rel(cm.launch(x, *books[0], 0, 4, cfg), y_ref)
                        if err > 1e-2:
                            print(f"MISMATCH {err:.3g} {(m, n, k)} {cfg}", flush=True)
                            continue
                        fn = _cycle([lambda p=p, x=x, c=cfg: cm.launch(x, *p, 0, 4, c) for p in books])
                        t = median(fn)
                    except Exception as exc:  # a setting the compiler refuses (registers, shared memory)
                        print(f"FAILED {(m, n, k)} {cfg}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                        continue
                    print(f"{kernel} {m}x{n}x{k} {cfg} {t * 1e3:.2f} us", flush=True)
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best:
                    line += f"; best {kernel} {best[0] * 1e3:.2f} us ({t_int4 / best[0]:.2f}x int4) {best[1]}"
            print(line, flush=True)
            summary.append(line)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
