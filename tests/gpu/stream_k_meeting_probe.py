"""Issue 16 item 2: what stream-K's parts of tiles cost the Gluon GEMM, on the H100. Each tiling runs
twice: as the product runs it (parts of tiles meet in quant_matmul's workspace, MODE 2), and from a copy of
the module whose ``_write`` never stores (the products stay live behind a store no tile reaches), so the
difference is the writes and the meeting, and the second figure the K loops alone.

    python tests/gpu/stream_k_meeting_probe.py [--cases qkv:384,14336x14336:1536]

Tilings: ``dp`` 256-row tiles a program each; ``sk`` the same tiles shared stream-K over one program an SM;
``hyb`` all full waves but one a tile a program, the rest stream-K (``dp_waves=-1``); ``sk128`` / ``dp128``
the same with 128-row tiles. Weights cold (copies past the L2), each launch in a CUDA graph, g128, packed
words.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.testing import do_bench_cudagraph

from squeezeserve.kernels import quant_layout as ql
from squeezeserve.kernels.ops import quant_matmul_gluon as real

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import COLD_BYTES, cycle  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096),
    "14336x4096": (14336, 4096),
    "14336x14336": (14336, 14336),
    "gate_up": (28672, 4096),
}
TILINGS = {
    "dp": {"block_m": 256, "stages": 4},
    "sk": {"block_m": 256, "stages": 4, "programs": 132},
    "hyb": {"block_m": 256, "stages": 4, "programs": 132, "dp_waves": -1},
    "sk128": {"block_m": 128, "stages": 6, "programs": 132},
    "dp128": {"block_m": 128, "stages": 6},
}


@gluon.jit
def _no_write(acc, y_ptr, ws_ptr, count_ptr, tile, whole, late, units, k_units, off_m, off_n, M, N,
              y_row_stride, MODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              num_warps: gl.constexpr):  # fmt: skip
    if tile < 0:  # (never: keeps the products live)
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
        rows = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout)), 1)
        cols = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout)), 0)
        out = gl.convert_layout(acc, out_layout)
        gl.store(y_ptr + rows + cols * 0, out.to(y_ptr.dtype.element_ty))


def _module_without_writes():
    spec = importlib.util.spec_from_file_location("gluon_no_write", real.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._write = _no_write  # (resolved when the kernel compiles)
    module._LAUNCH = real.FastLaunch(module._wgmma_kernel)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cases", default="qkv:384,14336x4096:256,14336x14336:256,gate_up:512,14336x14336:1536,qkv:768"
    )
    args = ap.parse_args()
    quiet = _module_without_writes()
    dt = torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}; us: the product's writes / no writes")
    for case in args.cases.split(","):
        name, m = case.split(":")
        (n, k), m = SHAPES[name], int(m)
        t = ql.pack_weight(torch.randn(n, k, device="cuda", dtype=dt) / 64, 4, 128)
        qw, sc = t["weight_packed"], t["weight_scale"].to(dt)
        packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(max(1, COLD_BYTES // (n * k // 2)) - 1)]
        x = torch.randn(m, k, device="cuda", dtype=dt)
        ref = (x @ ql.dequantize(qw, sc, None, (n, k), 128, 4).to(dt).t()).float()
        y = torch.empty(m, n, device="cuda", dtype=dt)
        row = []
        for label, tiling in TILINGS.items():
            cells = []
            for module in (real, quiet):
                ws = torch.zeros(m * n, device="cuda")
                counts = torch.zeros(8192, dtype=torch.int32, device="cuda")
                launch = functools.partial(module.launch, group_size=128, y=y, ws=ws, counts=counts, mode=2,
                                           **tiling)  # fmt: skip
                launch(x, qw, sc, None)
                if module is real:
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    assert err < 2e-3, (name, m, label, err)
                fn = cycle([functools.partial(launch, x, a, b, None) for a, b in packs])
                cells.append(f"{do_bench_cudagraph(fn, rep=40) * 1e3:.1f}")
            row.append(f"{label} " + " / ".join(cells))
        print(f"{name} m={m}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
