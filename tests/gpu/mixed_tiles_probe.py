"""Issue 16 item 2, a trial: a prefill whose 256-row tiles end in a partial wave, run as two launches over
the weight's rows: the columns of y that fill whole waves on 256-row tiles (persistent in clusters, stored by
TMA, as ``gluon_tiles`` runs them where they are more than a wave), the rest on 128-row tiles, twice as many
at about 0.6 of the time each (no stream-K parts to meet), against the rule and the whole output persistent.

    python tests/gpu/mixed_tiles_probe.py [--cases gate_up:512,qkv:768] [--rounds 3] [--machete]

Each case prints its split (weight tiles of 128 rows to each launch, the launches' tiles), checks the two
launches' y against bf16 cuBLAS on the dequantized weight (and whether it equals the whole persistent launch
bit for bit), then times cold weights (copies past the L2, each call in a CUDA graph) in interleaved rounds;
``--machete`` adds vLLM's Machete on the same weight (vLLM staged).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg
from squeezeserve.kernels.ops.launch import cdiv

sys.path.insert(0, str(Path(__file__).parent))
from cluster_probe import rounds  # noqa: E402
from gluon_prefill_probe import cold_copies, machete, served_weights, tiling  # noqa: E402
from prefill_tiling_probe import SHAPES  # noqa: E402

WHOLE = "256:4:P132:c:t"  # (the whole output persistent in clusters, stored by TMA)


def split(m: int, n: int, sms: int) -> tuple[int, int]:
    """(weight tiles of 128 rows on 256-row tiles, on 128-row tiles): the first take whole waves of 256-row
    tiles (an even count, for the clusters), the rest the last partial wave's columns."""
    row_blocks, cols = cdiv(m, 256), n // 128
    last = (row_blocks * cols) % sms
    rest = cdiv(last, row_blocks)
    rest += (cols - rest) % 2  # (the clusters pair the 256-row launch's weight tiles)
    return cols - rest, rest


def mixed(x, qw, sc, zp, group, y, owned, first: int, wide: dict, narrow: dict) -> None:
    """y = x @ W^T as two launches: weight rows [0, 128 * first) on ``wide``, the rest on ``narrow``."""
    cut = 128 * first
    for rows, cfg in ((slice(0, cut), wide), (slice(cut, qw.shape[0]), narrow)):
        part = y[:, rows]
        zeros = None if zp is None else zp[rows]
        qg.launch(x, qw[rows], sc[rows], zeros, group, part, part, part, owned=owned, **cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="gate_up:512,gate_up:448,qkv:768,14336x4096:1280,14336x14336:1536")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--machete", action="store_true")  # (vLLM staged)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}; g{args.group}; {sms} SMs; us (x bf16 cuBLAS); rounds "
          f"interleaved, then each column's median", flush=True)  # fmt: skip
    whole = tiling(WHOLE)
    for case in args.cases.split(","):
        name, _, rows = case.partition(":")
        m, (n, k) = int(rows), SHAPES[name]
        first, rest = split(m, n, sms)
        wide = whole if first * cdiv(m, 256) > sms else tiling("256:4:1:c")
        narrow = tiling("128:6:P132:t") if rest * cdiv(m, 128) > sms else tiling("128:6:1")
        print(f"{name} m={m}: {n // 128} weight tiles, {first} on 256-row tiles ({first * cdiv(m, 256)} "
              f"tiles), {rest} on 128-row tiles ({rest * cdiv(m, 128)})", flush=True)  # fmt: skip
        qw, sc, zp, dense, owned = served_weights(n, k, args.group, False)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x @ dense.t()).float()
        y, y_whole = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mixed(x, qw, sc, zp, args.group, y, owned, first, wide, narrow)
        qg.launch(x, qw, sc, zp, args.group, y_whole, y_whole, y_whole, owned=owned, **whole)
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(f"check {name} m={m}: rel err against cuBLAS {err:.2e}, bit-exact with {WHOLE} "
              f"{torch.equal(y, y_whole)}", flush=True)  # fmt: skip
        assert err < 4e-3, f"{name} m={m}: rel err {err}"  # (both sides rounded to bf16)
        packs, denses = cold_copies(qw, sc, zp, dense)
        op = qm._quant_matmul_owned if owned else functools.partial(qm._quant_matmul, bits=4)
        columns = {
            "bf16": [lambda d=d, x=x: x @ d.t() for d in denses],
            "rule": [functools.partial(op, x, *p, args.group) for p in packs],
            WHOLE: [
                functools.partial(qg.launch, x, *p, args.group, y, y, y, owned=owned, **whole) for p in packs
            ],
            "mixed": [
                functools.partial(mixed, x, *p, args.group, y, owned, first, wide, narrow) for p in packs
            ],
        }
        if args.machete:
            columns["machete"] = [lambda f=f, x=x: f(x) for f in machete(dense, args.group)]
        med = rounds(columns, args.rounds, f"{name} m={m}")
        cells = " | ".join(f"{label} {us:.1f} ({med['bf16'] / us:.3f}x)" for label, us in med.items())
        print(f"{name} m={m} median: {cells} | mixed / rule {med['rule'] / med['mixed']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
