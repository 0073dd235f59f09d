"""What the Gluon kernel compiles to for sm_90, read on a machine without a GPU, before spending device time.

    python tests/gpu/sass_probe.py                       # quant_matmul's tilings for the 8B shapes
    python tests/gpu/sass_probe.py --m 16 512 --group 32 --zeros --dump /tmp/sass   # and the SASS itself
    python tests/gpu/sass_probe.py --m 16 --group 32 --tiles 16:8:p264:64:64:4   # gluon_prefill_probe's

For each (rows, N x K) it prints the tiling quant_matmul's rules choose (gluon_decode_tiles up to 64 rows,
gluon_tiles above), then the compiled kernel's registers, spills (LDL/STL), wgmma groups and waits (pipelined:
one wait for all but one group after each group, one wait for all at the end) and its dequantizing
instruction counts. The Triton that compiles is the one installed: the device runs vLLM's (3.6 for 0.26).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import tiling  # noqa: E402 (this folder: a tiling spec as the probe takes it)

SHAPES = ((14336, 14336), (28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128, 512, 2048])
    ap.add_argument("--shape", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="N x K")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--zeros", action="store_true", help="asymmetric: packed zero points")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SM count (H100 SXM: 132)")
    ap.add_argument("--dump", type=Path, help="write each kernel's SASS into this folder")
    ap.add_argument(
        "--tiles", nargs="+", help="tilings as gluon_prefill_probe.py takes them, in place of the rules'"
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# triton {triton.__version__}, sm_90, int4 g{args.group}{' zero points' if args.zeros else ''}, "
          f"{args.dtype}, {args.sms} SMs")  # fmt: skip
    for shape in args.shape:
        n, k = map(int, shape.split("x"))
        for m, spec in itertools.product(args.m, args.tiles or [None]):
            if m <= qm.SKINNY_MAX_M:
                cfg = qm.gluon_decode_tiles(m, args.sms)
                auto = qm.gluon_decode_in_auto(m, n, k, args.group, args.zeros)
            else:
                cfg = qm.gluon_tiles(m, n, k, args.sms, args.group)
                cfg.pop("narrow_tail", None)  # (GLUON_TAIL's second launch: the first launch's tiling here)
                auto = qm.gluon_in_auto(m, n, k, args.group, args.zeros)
            x = torch.zeros(m, k, dtype=dtype)
            qweight = torch.zeros(n, k // 8, dtype=torch.int32)
            scales = torch.zeros(n, k // args.group, dtype=dtype)
            zeros = torch.zeros(n // 8, k // args.group, dtype=torch.int32) if args.zeros else None
            # what quant_matmul runs: the rule, at a tiling the kernel takes these inputs
            auto = auto and qg.supported(x, qweight, scales, args.group, 4, cfg.get("block_k", 64))
            if spec:
                cfg = tiling(spec)
            label = f"{m}x{n}x{k}" + (f"@{spec}" if spec else "")
            if not qg.supported(x, qweight, scales, args.group, 4, cfg.get("block_k", 64)):
                print(f"{label}: not taken by the Gluon kernel at {cfg}")
                continue
            y = torch.empty(m, n, dtype=dtype)
            ws, counts = torch.zeros(m * n, dtype=torch.float32), torch.zeros(4096, dtype=torch.int32)
            grid, a, kw = qg.launch_args(x, qweight, scales, zeros, args.group, y, ws, counts, mode=2, **cfg)
            compiled = cross_compile.compile_for(qg._wgmma_kernel, a, kw)
            lines = cross_compile.sass(compiled)
            s = cross_compile.summary(lines)
            ops, regs = s["instructions"], cross_compile.registers(compiled)
            print(f"{label}: auto {'Gluon' if auto else 'other paths'}; {cfg}, grid {grid}, maxnreg "
                  f"{kw['maxnreg']}: {regs} registers, {s['local']} LDL/STL ({s['loop_local']} in the K "
                  f"loop), {s['groups']} groups, waits {s['wait_one']} for all but one + {s['wait_all']} for "
                  f"all; HGMMA {ops.get('HGMMA', 0)} PRMT {ops.get('PRMT', 0)} LOP3 {ops.get('LOP3', 0)}"
                  f" IMAD {ops.get('IMAD', 0)} LDS {ops.get('LDS', 0)} LDG {ops.get('LDG', 0)}")  # fmt: skip
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{label}.sass").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
