"""Issue 16 items 1-2: the Gluon GEMM's tilings through quant_matmul's own path (its workspace, where parts of
stream-K tiles meet), against the tiling ``quant_matmul.gluon_tiles`` (``gluon_decode_tiles`` up to 64 rows,
where the Gluon kernel runs as a decode) chooses today. Up to 64 rows a candidate runs on the Gluon kernel's
decode even where the rule runs another kernel (the rule's column says which).

    python tests/gpu/prefill_tiling_probe.py [--ms 128,256,512] [--tiles 128:6:p132,256:4:p132] \\
        [--machete] [--gluon-max-m 8192]

Each candidate replaces ``gluon_tiles`` for the call (a tiling as ``gluon_prefill_probe.py`` writes it,
BLOCK_M:STAGES:SPLIT[:BLOCK_N[:BLOCK_K[:WARPS]]], ``pN`` stream-K over N programs). Weights are cold (copies
past the L2), each call in a CUDA graph; the weights ``vllm_ops.owned_shape`` takes run on thread-owned
words (``quant_matmul_owned``), as the vLLM method serves them on Hopper, the others on packed words
(``--words packed`` / ``owned``: all on one kind, ``--tiles ''`` the rule alone). Each result is
checked against bf16 cuBLAS on the dequantized weight before it is timed. ``--machete`` adds vLLM's Machete
(vLLM staged) on the same weights; ``--gluon-max-m`` lets the Gluon GEMM take rows past GLUON_PREFILL_MAX_M
(the rule's column then is its tiling, where dequantize + cuBLAS would run); where qkv, o, gate_up and down
are all probed, a last line a row count sums the 8B layer's four. A candidate ``rule:NAME=V+...``
is the rule with quant_matmul's constants set so for the call (e.g. ``rule:GLUON_THIRD_TILE_MAX_M=0``: the
rule without its 128-row tiles at 513-640 rows).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from squeezeserve.kernels.ops import quant_matmul as qm

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import cold_copies, cycle, machete, served_weights, tiling  # noqa: E402

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096),
          "14336x4096": (14336, 4096), "14336x14336": (14336, 14336), "8192x4096": (8192, 4096),
          "3072x4096": (3072, 4096), "2048x4096": (2048, 4096)}  # fmt: skip
LAYER = ("qkv", "o", "gate_up", "down")  # the 8B model's four GEMMs a layer: summed where all are probed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="128,192,256,384,512")
    # (a tiling that does not fit, e.g. 64 weight rows on eight warps, aborts the process in LLVM: check it
    # first with tests/gpu/sass_probe.py --tiles)
    ap.add_argument("--tiles", default="128:6:p132,128:6:1,64:6:p132")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--group", type=int, default=128)
    # (asymmetric weights, packed zero points as compress writes them; Machete's are symmetric)
    ap.add_argument("--zeros", action="store_true")
    # (the words each weight is probed on: as the vLLM method serves it, vllm_ops.owned_shape, or all alike)
    ap.add_argument("--words", choices=("served", "packed", "owned"), default="served")
    ap.add_argument("--machete", action="store_true")
    ap.add_argument("--gluon-max-m", type=int, default=0)
    args = ap.parse_args()
    if args.gluon_max_m:
        qm.GLUON_PREFILL_MAX_M = max(qm.GLUON_PREFILL_MAX_M, args.gluon_max_m)
        qm.PREFILL = "gluon"
    rule, decode_rule = qm.gluon_tiles, qm.gluon_decode_tiles
    kind = f"g{args.group}" + (" zero points" if args.zeros else "")
    print(f"# {torch.cuda.get_device_name()}; {kind}; us (x bf16 cuBLAS), the rule's tiling first")
    totals: dict[int, dict[str, float]] = {}  # rows -> column (rule, a candidate, machete) -> us over LAYER

    def add(name: str, m: int, column: str, us: float) -> None:
        if name in LAYER:
            totals.setdefault(m, {})[column] = totals.get(m, {}).get(column, 0.0) + us

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        qw, sc, zp, dense, owned = served_weights(n, k, args.group, args.zeros, args.words)
        packs, denses = cold_copies(qw, sc, zp, dense)
        # (the ops' bodies: no launch plan holds a tiling from an earlier call)
        op = qm._quant_matmul_owned if owned else functools.partial(qm._quant_matmul, bits=4)
        peer = machete(dense, args.group) if args.machete else []
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = (x @ dense.t()).float()
            t_bf16 = do_bench_cudagraph(cycle([lambda d=d, x=x: x @ d.t() for d in denses]), rep=40)
            row = []
            for spec in ["rule"] + [t for t in args.tiles.split(",") if t]:
                ruled = spec == "rule" or spec.startswith("rule:")
                cfg = None if ruled else tiling(spec)
                # (up to 64 rows the Gluon kernel's decode takes the candidate: gluon_decode_tiles)
                qm.gluon_tiles = rule if cfg is None else (lambda *a, cfg=cfg: dict(cfg))
                qm.gluon_decode_tiles = decode_rule if cfg is None else (lambda *a, cfg=cfg: dict(cfg))
                saved = {}
                if cfg is not None and m <= qm.SKINNY_MAX_M:  # (a candidate decode tiling runs on the Gluon
                    saved["DECODE"], qm.DECODE = qm.DECODE, "gluon"  # kernel even where the rule's would not)
                try:
                    for setting in spec.partition(":")[2].split("+") if spec.startswith("rule:") else []:
                        key, _, value = setting.partition("=")
                        saved[key] = getattr(qm, key)
                        setattr(qm, key, type(saved[key])(value))
                    y = op(x, qw, sc, zp, args.group).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    assert err < 4e-3, f"{name} {m} {spec}: rel err {err}"  # (both sides rounded to bf16)
                    calls = [functools.partial(op, x, *p, args.group) for p in packs]
                    t_q = do_bench_cudagraph(cycle(calls), rep=40)
                    # (the label: where the rule runs the Gluon kernel; owned words take it from 2 rows to
                    # gluon_prefill_max_m, _quant_matmul_owned)
                    if m <= qm.SKINNY_MAX_M:
                        fma_row = m == 1 and qm._owned_row_on_fma(x, qw, sc, zp, args.group)
                        gluon = not fma_row if owned else qm.gluon_decode_in_auto(
                            m, n, k, args.group, args.zeros)  # fmt: skip
                        chosen = decode_rule(m, 132, n, k) if gluon else "(not the Gluon kernel)"
                    else:
                        most = qm.gluon_prefill_max_m(k, args.group, True, args.zeros)
                        gluon = m <= most if owned else qm.gluon_in_auto(m, n, k, args.group, args.zeros)
                        gluon = gluon or m <= args.gluon_max_m
                        chosen = rule(m, n, k, 132, args.group) if gluon else "(not the Gluon kernel)"
                    label = f"{spec} {chosen}" if ruled else spec
                    row.append(f"{label} {t_q * 1e3:.1f} ({t_bf16 / t_q:.2f}x)")
                    add(name, m, spec, t_q * 1e3)
                finally:
                    qm.gluon_tiles, qm.gluon_decode_tiles = rule, decode_rule
                    for key, value in saved.items():
                        setattr(qm, key, value)
            if peer:
                t_peer = do_bench_cudagraph(cycle([lambda f=f, x=x: f(x) for f in peer]), rep=40)
                row.append(f"machete {t_peer * 1e3:.1f} ({t_bf16 / t_peer:.2f}x)")
                add(name, m, "machete", t_peer * 1e3)
            print(
                f"{name} m={m}{' owned' if owned else ''}: bf16 {t_bf16 * 1e3:.1f} | " + " | ".join(row),
                flush=True,
            )

    if set(LAYER) <= set(args.shapes.split(",")):
        for m, column in totals.items():  # (a layer's four GEMMs; "x": the rule's time over the column's)
            cells = " | ".join(f"{spec} {us:.1f} ({column['rule'] / us:.2f}x)" for spec, us in column.items())
            print(f"layer m={m} ({' + '.join(LAYER)}): {cells}", flush=True)


if __name__ == "__main__":
    main()
