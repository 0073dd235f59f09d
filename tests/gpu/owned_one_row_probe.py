"""One row on thread-owned int4 words (quant_layout.to_owned_order): the FMA kernel reading x in the words'
order against the Gluon decode, beside quant_matmul on the packed words and quant_matmul_owned's pick
(OWNED_FMA_MAX_GROUP). Cold weights and CUDA graphs, as bench_quant_matmul.py times them. H100 only.
``--zeros``: asymmetric weights (the owned ones with quant_layout.to_owned_zeros' zero points).

    python tests/gpu/owned_one_row_probe.py [--zeros] [--groups 128,64,32] [--shapes 4096:14336,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_quant_matmul import _copies, _cycle, _packed  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout as ql  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402

SHAPES = "4096:14336,14336:4096,14336:14336,4096:4096"  # K:N


def paths(x, group, sms):
    """name -> fn(qweight, scales, zeros): the packed words' dispatch; on owned weights each kernel and the
    pick."""
    tiles = qm.gluon_decode_tiles(1, sms) | {"owned": True}
    return {
        "packed": lambda q, s, z: K.quant_matmul(x, q, s, z, group, 4),
        "fma_owned": lambda q, s, z: qm._rows(x, q, s, z, q if z is None else z, group, 4, None, owned=True),
        "gluon_owned": lambda q, s, z: qm._gluon(x, q, s, z, group, tiles),
        "product_owned": lambda q, s, z: qm.quant_matmul_owned(x, q, s, z, group),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zeros", action="store_true")
    ap.add_argument("--groups", default="128,64,32")
    ap.add_argument("--shapes", default=SHAPES, help="K:N pairs")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for group in map(int, args.groups.split(",")):
        for k, n in (map(int, pair.split(":")) for pair in args.shapes.split(",")):
            qw, sc, zp = _packed(n, k, 4, group, args.zeros)
            packs = [(qw, sc, zp)] + [
                (qw.clone(), sc.clone(), None if zp is None else zp.clone())
                for _ in range(_copies(qw.numel() * 4) - 1)
            ]
            owned = [
                (ql.to_owned_order(q), s, None if z is None else ql.to_owned_zeros(z, n)) for q, s, z in packs
            ]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = K.quant_matmul(x, qw, sc, zp, group, 4).float()
            times = {}
            for name, fn in paths(x, group, sms).items():
                weights = packs if name == "packed" else owned
                y = fn(*weights[0]).float()
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, group, k, n, err)
                times[name] = do_bench_cudagraph(_cycle([lambda w=w, f=fn: f(*w) for w in weights]))
            row = " ".join(f"{a} {b * 1000:.1f}" for a, b in times.items())
            print(f"g{group}{' zp' if args.zeros else ''} 1x{n}x{k} {row}", flush=True)


if __name__ == "__main__":
    main()
