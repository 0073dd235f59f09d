"""The Gluon decode's group parameters, launch for launch, on the H100: zero points as compressed-tensors
packs them (eight rows' nibbles a word) against the owned weights' layout (quant_layout.to_owned_zeros: a
row's eight groups a word), and the scales' DRAM traffic.

    python tests/gpu/zero_rows_probe.py [--ms 1,2,4,8,16,32,64] [--shapes 14336x4096,4096x14336]

The same tiling (``quant_matmul.gluon_decode_tiles``) on the same owned words, cold (enough copies to exceed
the L2), each in a CUDA graph, interleaved twice (the fastest of each's two runs kept), groups 32, 64 and 128:
packed zero points, owned zero points, none (symmetric), and none with every row reading row 0's scales
(``row0``: an ``expand``ed tensor, stride 0, so the scales come from the L1 / L2, not DRAM: what the scales'
traffic costs). Before timing, the two zero-point layouts' outputs are checked against each other.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from squeezeserve.kernels import quant_layout as ql
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import COLD_BYTES, cycle  # noqa: E402

LAYOUTS = ("packed", "owned", "symmetric", "row0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,28672x4096", help="N x K")
    ap.add_argument("--groups", default="32,64,128")
    args = ap.parse_args()
    dt = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}; us, zero points packed / owned / none / none, row 0's scales")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for group in map(int, args.groups.split(",")):
            packs = {name: [] for name in LAYOUTS}
            for _ in range(max(1, COLD_BYTES // (n * k // 2))):
                t = ql.pack_weight(torch.randn(n, k, device="cuda", dtype=dt) / 64, 4, group, symmetric=False)
                qw, sc, zp = (
                    ql.to_owned_order(t["weight_packed"]),
                    t["weight_scale"].to(dt),
                    t["weight_zero_point"],
                )
                packs["packed"].append((qw, sc, zp))
                packs["owned"].append((qw, sc, ql.to_owned_zeros(zp, n)))
                packs["symmetric"].append((qw, sc, None))
                packs["row0"].append((qw, sc[:1].expand(n, -1), None))
            row = []
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=dt)
                cfg = qm.gluon_decode_tiles(m, sms)
                ws, counts = qm._workspace(x.device, m * n, 4096)
                y = torch.empty(m, n, device="cuda", dtype=dt)
                launches = {
                    name: functools.partial(
                        qg.launch,
                        group_size=group,
                        y=y,
                        ws=ws,
                        counts=counts,
                        mode=2,
                        owned=True,
                        zero_rows=name == "owned",
                        **cfg,
                    )  # fmt: skip
                    for name in LAYOUTS
                }
                outs = {}
                for name in ("packed", "owned"):
                    launches[name](x, *packs[name][0])
                    outs[name] = y.clone()
                # (an ulp of the output apart at most: stream-K parts add in arrival order)
                torch.testing.assert_close(outs["owned"], outs["packed"], rtol=8e-3, atol=8e-3)
                times = {name: [] for name in LAYOUTS}
                for name in LAYOUTS * 2:
                    fn = cycle([functools.partial(launches[name], x, *p) for p in packs[name]])
                    times[name].append(do_bench_cudagraph(fn, rep=40) * 1e3)
                p, o, s, r = (min(times[name]) for name in LAYOUTS)
                row.append(f"m{m} {p:.1f}/{o:.1f}/{s:.1f}/{r:.1f} ({p / o:.3f}x)")
            print(f"{n}x{k} g{group} owned words: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
