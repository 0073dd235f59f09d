"""How well each weight format can represent the bundled baseline's weights, without calibration: the
relative reconstruction error ``||W - W'||_F / ||W||_F`` over every decoder Linear, and bits per weight.

The baseline was dequantized from GGUF Q4_1 (every block of 32 weights is ``d * k + m``, k in 0..15), so its
weights already sit on a per-32-block 4-bit grid. This measures what that means for each format: int4 g32
(asymmetric, a per-32-block grid itself, only with an integer zero point) nearly reproduces it, a per-row
codebook of 16 values cannot (a row of K weights holds up to 16 K / 32 distinct values). ``scaled*`` rows:
a row's codebook scaled (and shifted) per group (any4-style), at equal bytes or more.

    python tests/benchmarks/bench_weight_error.py --threads 1 --every 5   # decoder layers 0, 5, 10, ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from pathlib import Path

import torch

from squeezeserve.kernels.checkpoint_format import QuantScheme
from squeezeserve.service.compress.codebook import codebook_quantize, nearest, weighted_kmeans
from squeezeserve.service.compress.pipeline import load_float32, target_linears
from squeezeserve.service.compress.quantize import package, quantize_rtn, quantize_with, search_qparams


def int4_g32(weight: torch.Tensor, search: bool) -> torch.Tensor:
    scheme = QuantScheme("int", 4, 32, symmetric=False)
    if not search:
        return quantize_rtn(weight, scheme).dequantize()
    grouped = weight.reshape(weight.shape[0], -1, 32)
    scale, zero = search_qparams(grouped, scheme)
    codes = quantize_with(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), scheme)
    return package(codes.reshape(weight.shape), scale, zero, scheme).dequantize()


def codebook(weight: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Plain (unweighted) k-means codebooks: an identity Gram makes every channel equally important."""
    identity = torch.eye(weight.shape[1])
    return codebook_quantize(weight, identity, bits, group_size, "kmeans").dequantize()


def scaled_codebook(weight: torch.Tensor, group: int, offset: bool, rounds: int = 3) -> torch.Tensor:
    """A row's 16 codebook values, scaled (and with ``offset`` shifted) per group of ``group`` columns (any4's
    format): w ~ s_g c[i] (+ m_g), fp16 s_g, m_g. Alternates k-means of the row's normalized weights
    (each counted with s_g^2, so that it minimises the error in w) with the least-squares s_g (and m_g) of the
    chosen values; starts from absmax (scale only) or min/max (with offset)."""
    rows, cols = weight.shape
    x = weight.reshape(rows, cols // group, group)
    if offset:
        low = x.amin(-1, keepdim=True)
        scale, shift = (x.amax(-1, keepdim=True) - low).clamp(min=1e-8), low
    else:
        scale, shift = x.abs().amax(-1, keepdim=True).clamp(min=1e-8), torch.zeros_like(x[..., :1])
    book = None
    for step in range(rounds + 1):
        s16, m16 = scale.half().float(), shift.half().float()  # as stored
        normalized = ((x - m16) / s16).reshape(rows, cols)
        if step < rounds:  # the last pass only assigns, with the last codebook and the stored scales
            book = weighted_kmeans(normalized, (s16.expand_as(x) ** 2).reshape(rows, cols), 16)
        values = book.gather(1, nearest(normalized, book)).reshape(x.shape)
        if offset:
            vc, xc = values - values.mean(-1, keepdim=True), x - x.mean(-1, keepdim=True)
            scale = (vc * xc).sum(-1, keepdim=True) / vc.square().sum(-1, keepdim=True).clamp(min=1e-12)
            shift = x.mean(-1, keepdim=True) - scale * values.mean(-1, keepdim=True)
        else:
            energy = values.square().sum(-1, keepdim=True).clamp(min=1e-12)
            scale = (values * x).sum(-1, keepdim=True) / energy
    return (values * s16 + m16).reshape(rows, cols)


def bits_per_weight(name: str, n: int, k: int) -> float:
    """Storage per weight, fp16 scales / codebook values, int4 zero points packed."""
    if name.startswith("int4"):
        return 4 + (16 + 4) / 32
    if name.startswith("scaled"):  # scaled{,+offset}-g{G}: fp16 per group, the row's 16 fp16 values
        group = int(name.rsplit("-g", 1)[1])
        return 4 + 16 * (2 if "+offset" in name else 1) / group + 16 * 16 / k
    bits, group = (4, None) if name == "codebook4" else ((3, None) if name == "codebook3" else (4, 32))
    return bits + 16 * (1 << bits) / (group or k)


FORMATS = {
    "int4-g32-minmax": lambda w: int4_g32(w, search=False),
    "int4-g32-search": lambda w: int4_g32(w, search=True),
    "codebook4": lambda w: codebook(w, 4, None),
    "codebook3": lambda w: codebook(w, 3, None),
    "codebook4-g32": lambda w: codebook(w, 4, 32),
    # any4-style: one codebook a row, scaled (and shifted) per group; groups divide 576 and 1536
    **{
        f"scaled{'+offset' if offset else ''}-g{group}": (
            lambda w, group=group, offset=offset: scaled_codebook(w, group, offset)
        )
        for group in (32, 64, 192)
        for offset in (False, True)
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--baseline", help="baseline checkpoint (default: export the bundled model)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--every", type=int, default=1, help="measure every N-th decoder layer (CPU time)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.baseline:
        baseline = Path(args.baseline)
    else:
        from squeezeserve.service.models.bundled import export_baseline

        baseline = export_baseline().path
    linears = {
        name: module
        for name, module in target_linears(load_float32(baseline, "cpu")).items()
        if int(name.split(".")[2]) % args.every == 0
    }
    squared = dict.fromkeys(FORMATS, 0.0)
    total, weights, bits = 0.0, 0, dict.fromkeys(FORMATS, 0.0)
    distinct_per_row = []
    for module in linears.values():
        weight = module.weight.detach()
        total += float(weight.square().sum())
        weights += weight.numel()
        distinct_per_row.append(float(sum(len(torch.unique(row)) for row in weight[:16])) / 16)
        for name, fn in FORMATS.items():
            squared[name] += float((weight - fn(weight)).square().sum())
            bits[name] += bits_per_weight(name, *weight.shape) * weight.numel()
    result = {
        "relative_error": {name: round(math.sqrt(squared[name] / total), 5) for name in FORMATS},
        "bits_per_weight": {name: round(bits[name] / weights, 3) for name in FORMATS},
        "distinct_values_per_row_mean": round(sum(distinct_per_row) / len(distinct_per_row), 1),
        "linears": len(linears),
        "every_nth_layer": args.every,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))  # noqa: T201


if __name__ == "__main__":
    main()
