"""Weight-only int4/int8 quant_matmul vs bf16 torch.matmul at decode (M <= 16) and prefill shapes.
Decode timings replay CUDA graphs (one launch each, as vLLM serves them)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Recorder, peaks  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout  # noqa: E402

DTYPE = torch.bfloat16
KN = [(4096, 4096), (4096, 14336), (14336, 4096), (14336, 14336)]


def run(rec, bits=4, group=128, ms_=(1, 2, 4, 8, 16, 4096), kn=KN):
    for k, n in kn:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        t = quant_layout.pack_weight(weight, bits, group)
        qw, sc = t["weight_packed"], t["weight_scale"]
        dense = quant_layout.dequantize(qw, sc, None, (n, k), group, bits)
        for m in ms_:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            graph = m <= 16
            ours = lambda x=x, qw=qw, sc=sc: K.quant_matmul(x, qw, sc, None, group, bits)  # noqa: E731
            ref = lambda x=x, dense=dense: x @ dense.t()  # noqa: E731
            ours()
            err = ((ours().float() - ref().float()).norm() / ref().float().norm()).item()
            assert err < 1e-2, f"quant_matmul mismatch {err} at {(m, n, k)}"
            shape = (m, n, k)
            w_bytes = n * k * bits // 8 + sc.numel() * 2
            tag = f"int{bits}-g{group}"
            t_ours = rec.time(f"squeezeserve-{tag}", "fwd", shape, DTYPE, ours,
                              nbytes=w_bytes + 2 * m * (k + n), graph=graph)  # fmt: skip
            t_ref = rec.time(
                "torch-bf16", "fwd", shape, DTYPE, ref, nbytes=n * k * 2 + 2 * m * (k + n), graph=graph
            )
            if t_ours and t_ref:
                rec.add(f"squeezeserve-{tag}", "fwd", shape, DTYPE, "speedup_vs_bf16", [t_ref / t_ours], "x")


if __name__ == "__main__":
    peaks()
    recorder = Recorder("quant_matmul")
    run(recorder)
    run(recorder, bits=8, group=128, ms_=(1, 16), kn=[(4096, 14336)])
    run(recorder, bits=4, group=64, ms_=(1, 16), kn=[(4096, 14336)])
    recorder.write()
