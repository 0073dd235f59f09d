"""Device sweep for issue #20: settings of the word-wise LUT codebook kernel (``_codebook_lut_kernel``, one
row) against what ``codebook_matmul`` runs and our int4 g128 ``quant_matmul``, at decode sizes, cold weights
in CUDA graphs as ``bench_codebook_matmul.py`` times them; each setting with the codebook as stored (fp16)
and cast once to bf16. Every setting is checked against the dense product before it is timed. Prints one
line per (shape, bits, setting) and, per (shape, M, bits), the best setting's speed against int4 g128.

    python tests/gpu/codebook_lut_sweep.py [--quick] [--ms 1]
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


def lut_configs(n: int, k: int, bits: int, quick: bool):
    """Settings of the one-row LUT kernel for an [N, K] weight."""
    sms = sm_count(torch.device("cuda"))
    for bn in [4, 8] if quick else [4, 8, 16, 32, 64, 128]:
        for bw in (64, 128, 256):
            tiles = cdiv(cdiv(k, 32 // bits), bw)
            for fill in (1, 2) if quick else (1, 2, 4):
                split = max(1, min(tiles, cdiv(fill * sms, cdiv(n, bn))))
                for warps in (4,) if quick else (2, 4, 8):
                    yield {"kernel": "lut", "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_W": bw, "split": split,
                           "num_warps": warps}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--ms", default="1", help="rows; the LUT kernel takes one, more time int4 and gather only"
    )
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    print(f"# {torch.cuda.get_device_name()} sms={sm_count(torch.device('cuda'))}")
    summary = []
    for k, n, bits, (int4s, _), (books, _), dense in decode_weights():
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            y_ref = x @ dense.t()
            int4 = _cycle([lambda p=p, x=x: K.quant_matmul(x, p[0], p[1], None, 128, 4) for p in int4s])
            t_int4 = median(int4)
            op = _cycle([lambda p=p, x=x, b=bits: K.codebook_matmul(x, *p, 0, b) for p in books])
            t_op = median(op)  # what the op runs: the LUT kernel at one row, the gather kernel at more
            best = None
            # The codebook as stored (fp16) or cast once to the activations' dtype (no convert per weight)
            lut_runs = [(cfg, cast) for cfg in lut_configs(n, k, bits, args.quick) for cast in (False, True)]
            for cfg, cast in lut_runs if m == 1 else []:
                cfg = {**cfg, "codebook": "bf16" if cast else "fp16"}
                runs = [(i, c.to(DTYPE) if cast else c) for i, c in books]
                try:
                    err = _rel(cm.launch(x, *runs[0], 0, bits, cfg), y_ref)
                    if err > 1e-2:
                        print(f"MISMATCH {err:.3g} {(m, n, k)} bits={bits} {cfg}", flush=True)
                        continue
                    fn = _cycle([lambda p=p, x=x, c=cfg, b=bits: cm.launch(x, *p, 0, b, c) for p in runs])
                    t = median(fn)
                except Exception as exc:  # a setting the compiler refuses (registers, shared memory)
                    print(f"FAILED {(m, n, k)} bits={bits} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                print(f"lut {m}x{n}x{k} bits={bits} {cfg} {t * 1e3:.2f} us", flush=True)
                if best is None or t < best[0]:
                    best = (t, cfg)
            line = (
                f"SUMMARY {m}x{n}x{k} bits={bits}: int4-g128 {t_int4 * 1e3:.2f} us, codebook_matmul "
                f"{t_op * 1e3:.2f} us ({t_int4 / t_op:.2f}x int4)"
            )
            if best:
                line += f", best lut {best[0] * 1e3:.2f} us ({t_int4 / best[0]:.2f}x int4) {best[1]}"
            print(line, flush=True)
            summary.append(line)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
