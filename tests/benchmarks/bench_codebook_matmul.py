"""codebook_matmul (weight sharing) vs our int4 quant_matmul at decode sizes, and low-rank decode (two GEMMs)
vs the dense bf16 GEMM, on Llama-sized shapes.

- codebook: 4-bit per-channel codebooks (4 + 256 / K bits a weight: 4.06 at K = 4096) against int4 g128
  symmetric (4 + 16 / 128 = 4.125 bits a weight): equal bits to 2%; and 3-bit per channel. M = 1..16.
- low-rank: ``x @ V^T @ U^T`` (bf16, cuBLAS) at the ranks that keep 90%, 70% and 50% of the parameters
  (``r = F N K / (N + K)``) against ``x @ W^T``.

Decode timings replay CUDA graphs, with cold weights (every call reads another copy; the copies exceed L2),
as ``bench_quant_matmul.py`` does. Rows go to results/kernels.csv (op codebook_matmul / lowrank_linear).

    python tests/benchmarks/bench_codebook_matmul.py
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Recorder, peaks  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import codebook_layout, quant_layout  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul  # noqa: E402

DTYPE = torch.bfloat16
KN = [(4096, 4096), (4096, 14336), (14336, 4096)]
MS = (1, 2, 4, 8, 16)
COLD_BYTES = 256 * 2**20  # working set per timed function: 5x the H100's L2


def _copies(nbytes: int) -> int:
    return max(1, min(64, math.ceil(COLD_BYTES / nbytes)))


def _cycle(fns):
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _codebook(n: int, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.randint(0, 1 << bits, (n, k), device="cuda")
    codebook = (torch.randn(n, 1 << bits, device="cuda") / 64).sort(dim=1).values.to(torch.float16)
    return codebook_layout.pack_indices(index, bits), codebook


def _rel(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    return ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()


def _check(x: torch.Tensor, idx: torch.Tensor, cb: torch.Tensor, bits: int, dense: torch.Tensor) -> None:
    """codebook_matmul against x @ W.T; on a mismatch, what tells a wrong kernel from a race or a split-K
    workspace left dirty: the error per row, two more runs of the same call, and the workspace's state."""
    dirty = any(ws.any().item() or c.any().item() for ws, c in quant_matmul._workspace.current.values())
    y_ref = x @ dense.t()
    err = _rel(K.codebook_matmul(x, idx, cb, 0, bits), y_ref)
    if err < 1e-2:
        return
    y = K.codebook_matmul(x, idx, cb, 0, bits)
    rows = [round(_rel(y[r], y_ref[r]), 4) for r in range(x.shape[0])]
    again = _rel(K.codebook_matmul(x, idx, cb, 0, bits), y_ref)
    raise AssertionError(
        f"codebook_matmul mismatch {err} at {(x.shape[0], idx.shape[0], x.shape[1])} bits {bits}: per row "
        f"{rows}, rerun {again:.4g}, workspace dirty before the call: {dirty}"
    )


def decode_weights():
    """Per (K, N) of KN and bits 4 then 3: cold copies of an int4 g128 weight [(packed, scales)] and of a
    codebook weight [(indices, codebook)] of that shape, with their byte counts and the codebook's dense
    bf16 weight: what the codebook benchmarks time against each other."""
    for k, n in KN:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        packed = quant_layout.pack_weight(weight, 4, 128)
        qw, sc = packed["weight_packed"], packed["weight_scale"]
        int4_bytes = qw.numel() * 4 + sc.numel() * 2
        int4s = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(_copies(int4_bytes) - 1)]
        for bits in (4, 3):
            idx, cb = _codebook(n, k, bits)
            cb_bytes = idx.numel() * 4 + cb.numel() * 2
            books = [(idx, cb)] + [(idx.clone(), cb.clone()) for _ in range(_copies(cb_bytes) - 1)]
            dense = codebook_layout.dequantize(idx, cb, k, None, bits).to(DTYPE)
            yield k, n, bits, (int4s, int4_bytes), (books, cb_bytes), dense


def codebook_vs_int4(rec: Recorder) -> None:
    for k, n, bits, (int4s, int4_bytes), (books, cb_bytes), dense in decode_weights():
        idx, cb = books[0]
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            _check(x, idx, cb, bits, dense)
            shape, io = (m, n, k), 2 * m * (k + n)
            ours = _cycle([lambda p=p, x=x, b=bits: K.codebook_matmul(x, *p, 0, b) for p in books])
            provider = f"squeezeserve-codebook{bits}"
            t_cb = rec.time(provider, "fwd", shape, DTYPE, ours, nbytes=cb_bytes + io, graph=True)
            if bits != 4:
                continue
            int4 = _cycle([lambda p=p, x=x: K.quant_matmul(x, p[0], p[1], None, 128, 4) for p in int4s])
            provider = "squeezeserve-int4-g128"
            t_q = rec.time(provider, "fwd", shape, DTYPE, int4, nbytes=int4_bytes + io, graph=True)
            if t_cb and t_q:
                rec.add(
                    "squeezeserve-codebook4", "fwd", shape, DTYPE, "speed_vs_int4_g128", [t_q / t_cb], "x"
                )


def lowrank_vs_dense(rec: Recorder) -> None:
    for k, n in KN:
        dense = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        denses = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
        for ratio in (0.9, 0.7, 0.5):
            rank = int(ratio * n * k / (n + k))
            u = torch.randn(n, rank, device="cuda", dtype=DTYPE) / 64
            v = torch.randn(rank, k, device="cuda", dtype=DTYPE) / 64
            factors = [(u, v)] + [
                (u.clone(), v.clone()) for _ in range(_copies((u.numel() + v.numel()) * 2) - 1)
            ]
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                shape = (m, n, k)
                two = _cycle([lambda f=f, x=x: (x @ f[1].t()) @ f[0].t() for f in factors])
                one = _cycle([lambda d=d, x=x: x @ d.t() for d in denses])
                provider = f"lowrank-r{rank}-params{ratio}"
                t_lr = rec.time(provider, "fwd", shape, DTYPE, two, graph=True)
                t_d = rec.time("torch-bf16", "fwd", shape, DTYPE, one, graph=True)
                if t_lr and t_d:
                    rec.add(provider, "fwd", shape, DTYPE, "speedup_vs_dense", [t_d / t_lr], "x")


if __name__ == "__main__":
    peaks()
    recorder = Recorder("codebook_matmul")
    codebook_vs_int4(recorder)
    recorder.write()
    recorder = Recorder("lowrank_linear")
    lowrank_vs_dense(recorder)
    recorder.write()
