"""The Gluon decode against another version of itself, launch for launch, on the H100.

    git show HEAD~1:kernels/ops/quant_matmul_gluon.py > /tmp/gluon_old.py
    python tests/gpu/gluon_ab_probe.py --old /tmp/gluon_old.py

Both modules launch the same tiling (``quant_matmul.gluon_decode_tiles``) on the same weights, cold (enough
copies to exceed the L2), each in a CUDA graph, interleaved twice (old, new, old, new; the faster of each
pair kept), at 4-64 rows of the 8B model's wide shapes, groups 128 and 32, with and without zero points.
Weights whose N exceeds K are in thread-owned order, as the vLLM method serves them there, with the zero
points in the layout each module reads with owned words (quant_layout.to_owned_zeros' where ``launch_args``
takes ``zero_rows``, the checkpoint's before).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from squeezeserve.kernels import quant_layout as ql
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as new

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import COLD_BYTES, cycle  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="path of the other quant_matmul_gluon.py")
    ap.add_argument("--ms", default="4,8,16,32,64")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,28672x4096", help="N x K")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("gluon_old", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    dt = torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}; old: {args.old}; time in us, old / new")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for group, zeros in ((128, False), (32, False), (128, True), (32, True)):
            owned = n > k
            packs = []
            for _ in range(max(1, COLD_BYTES // (n * k // 2))):
                w = torch.randn(n, k, device="cuda", dtype=dt) / 64
                t = ql.pack_weight(w, 4, group, symmetric=not zeros)
                qw = ql.to_owned_order(t["weight_packed"]) if owned else t["weight_packed"]
                zp = t["weight_zero_point"] if zeros else None
                packs.append((qw, t["weight_scale"].to(dt), zp, ql.to_owned_zeros(zp, n) if zeros else None))
            row = []
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=dt)
                cfg = qm.gluon_decode_tiles(m, torch.cuda.get_device_properties(0).multi_processor_count)
                ws, counts = qm._workspace(x.device, m * n, 4096)
                y = torch.empty(m, n, device="cuda", dtype=dt)
                times = {"old": [], "new": []}
                for name, mod in (("old", old), ("new", new)) * 2:
                    launch = functools.partial(mod.launch, group_size=group, y=y, ws=ws, counts=counts,
                                               mode=2, owned=owned, **cfg)  # fmt: skip
                    rows = owned and "zero_rows" in inspect.signature(mod.launch_args).parameters
                    fn = cycle([functools.partial(launch, x, qw, sc, owned_zp if rows else zp)
                                for qw, sc, zp, owned_zp in packs])  # fmt: skip
                    times[name].append(do_bench_cudagraph(fn, rep=40) * 1e3)
                o, nw = min(times["old"]), min(times["new"])
                row.append(f"m{m} {o:.1f}/{nw:.1f} ({o / nw:.3f}x)")
            label = f"{n}x{k} g{group}{' zp' if zeros else ''}{' owned' if owned else ''}"
            print(f"{label}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
