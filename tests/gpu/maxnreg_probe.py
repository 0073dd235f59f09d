"""Device probe for issue #16 item 1: does capping the decode kernel's registers help where N = 14336?

Nsight Compute (results/ncu_h100_2026-11-25/summary.txt) showed ``_skinny_kernel`` at 16 rows of 14336^2
reading DRAM at 52% of peak with 4 programs of 4 warps an SM, held there by its 122 registers a thread
(theoretical occupancy 25%). A cap of ``maxnreg`` registers lets 5 (<= 102) or 6 (<= 85) programs share an
SM, at the price of spills. This times the shipped setting with and without caps (CUDA graph replay over
cold weight copies, as bench_quant_matmul.py), each with its error against the dense product.

    python3 tests/gpu/maxnreg_probe.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from bench_quant_matmul import _copies, _cycle  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402

CAPS = (None, 128, 112, 96, 80)


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    shipped = qm.tuning
    for group, zeros in ((128, False), (32, True)):
        for k, n in ((14336, 14336), (4096, 14336), (14336, 4096)):
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
            t = quant_layout.pack_weight(weight, 4, group, symmetric=not zeros)
            qw, sc, zp = t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")
            packs = [(qw, sc, zp)] + [
                (qw.clone(), sc.clone(), None if zp is None else zp.clone())
                for _ in range(_copies(qw.numel() * 4 + sc.numel() * 2) - 1)
            ]
            dense = quant_layout.dequantize(qw, sc, zp, (n, k), group, 4).to(torch.bfloat16)
            for m in (4, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                fn = _cycle(
                    [lambda p=p, x=x, g=group: K.quant_matmul(x, p[0], p[1], p[2], g, 4) for p in packs]
                )
                point = {"g": group, "zp": zeros, "n": n, "k": k, "m": m}
                for cap in CAPS:
                    qm.tuning = lambda *a, cap=cap, **kw: (
                        shipped(*a, **kw) | ({"maxnreg": cap} if cap else {})
                    )
                    try:
                        y = K.quant_matmul(x, qw, sc, zp, group, 4).float()
                        ref = (x @ dense.t()).float()
                        err = ((y - ref).norm() / ref.norm()).item()
                        point[str(cap)] = [round(do_bench_cudagraph(fn, rep=30) * 1e3, 2), f"{err:.1e}"]
                    finally:
                        qm.tuning = shipped
                print(json.dumps(point), flush=True)
            del packs


if __name__ == "__main__":
    main()
