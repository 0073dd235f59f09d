"""One row on thread-owned int4 words (quant_layout.to_owned_order): the FMA kernel reading x in the words'
order against the Gluon decode, beside quant_matmul on the packed words and quant_matmul_owned's pick
(OWNED_FMA_MAX_GROUP). Cold weights and CUDA graphs, as bench_quant_matmul.py times them. H100 only.

    python tests/gpu/owned_one_row_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_quant_matmul import _copies, _cycle, _packed  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout as ql  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402

SHAPES = ((4096, 14336), (14336, 4096), (14336, 14336), (4096, 4096))  # (K, N)


def paths(x, group, sms):
    """name -> fn(qweight, scales): the packed words' dispatch; on owned words each kernel and the pick."""
    tiles = qm.gluon_decode_tiles(1, sms) | {"owned": True}
    return {
        "packed": lambda q, s: K.quant_matmul(x, q, s, None, group, 4),
        "fma_owned": lambda q, s: qm._rows(x, q, s, None, q, group, 4, None, owned=True),
        "gluon_owned": lambda q, s: qm._gluon(x, q, s, None, group, tiles),
        "product_owned": lambda q, s: qm.quant_matmul_owned(x, q, s, None, group),
    }


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for group in (128, 64, 32):
        for k, n in SHAPES:
            qw, sc, _ = _packed(n, k, 4, group)
            packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(_copies(qw.numel() * 4) - 1)]
            owned = [(ql.to_owned_order(q), s) for q, s in packs]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = K.quant_matmul(x, qw, sc, None, group, 4).float()
            times = {}
            for name, fn in paths(x, group, sms).items():
                weights = packs if name == "packed" else owned
                y = fn(*weights[0]).float()
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, group, k, n, err)
                times[name] = do_bench_cudagraph(_cycle([lambda w=w, f=fn: f(*w) for w in weights]))
            row = " ".join(f"{a} {b * 1000:.1f}" for a, b in times.items())
            print(f"g{group} 1x{n}x{k} {row}", flush=True)


if __name__ == "__main__":
    main()
