"""Issue 16 item 1 (and the prompts of item 3): the decode GEMMs launched as programmatic dependents (PDL)
against their plain launch, through quant_matmul's own path on owned words (as the vLLM method serves Hopper)
or, ``--words packed``, on the checkpoint's words (the Gluon decode where quant_matmul picks it; the FMA and
tensor-core decode kernels it picks elsewhere launch plainly whatever ``pdl`` says, so those columns time one
launch twice: branch decode-pdl-trial made them dependents, measured slower, NOTES.md thirty-third session).

A decode GEMM of 30-60 MB is a ~20 us kernel that reaches under half the DRAM bandwidth: its start and its
end cost what its streaming does not (Nsight Compute, NOTES.md, twenty-fourth session). Under PDL (``pdl``,
which vLLM's graphs give the projections after our norms and SwiGLU) the kernel may start while the one
before it in the stream drains: its loading warp sends the weight's words for the first ring stages (no
kernel before writes them), then waits for the previous kernel (``griddepcontrol.wait``) before it loads x,
and the compute warps wait before they write.

    python tests/gpu/pdl_probe.py [--ms 1,4,16,64,512,2048] [--shapes 14336x4096,...] [--group 128] [--zeros]

Each call is timed in a CUDA graph cycling through weight copies past the L2 (cold weights; the kernels back
to back, so each one's predecessor is the same GEMM), with PDL off, on, off, on; each column's result is
checked against the first (stream-K's fp32 atomics may order the sums differently: compared to 1e-3).
``--after-norm`` puts our add-RMSNorm before every GEMM in the graph, as in a decoder layer (it calls
launch_dependents first: what vLLM serves with our plugin); ``--torch-norm`` torch's RMSNorm instead (which
does not); ``--chain`` an RMSNorm that is itself launched as a programmatic dependent of the GEMM before it
(it lets the next kernel launch, then waits for the GEMM), so that a GEMM's start may overlap the previous
GEMM's end across the norm. ``--marlin``
adds vLLM's Marlin on the same weights re-quantized (its launch as vLLM makes it; vLLM staged), timed the same
way in the same call.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

import squeezeserve.kernels as K
from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import quant_matmul as qm

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import COLD_BYTES, cycle  # noqa: E402

SHAPES = {"14336x4096": (14336, 4096), "4096x14336": (4096, 14336), "28672x4096": (28672, 4096),
          "14336x14336": (14336, 14336), "6144x4096": (6144, 4096), "4096x4096": (4096, 4096)}  # fmt: skip


def _marlin(w: torch.Tensor, group: int, zeros: bool, copies: int):
    """(call(x, copy), copies): vLLM's Marlin GEMM of ``w`` re-quantized, as bench_quant_matmul.py has it."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_quant_matmul import marlin_pack

    n, k = w.shape
    wtype, q_w, s, zp, g_idx, sort_idx = marlin_pack(w, group, zeros)
    ws = mu.marlin_make_workspace_new(w.device)
    packs = [(q_w, s, zp)] + [(q_w.clone(), s.clone(), zp.clone()) for _ in range(copies - 1)]

    def call(x, c):
        return mu.apply_gptq_marlin_linear(x, *c, g_idx, sort_idx, ws, wtype, n, k, True)

    return call, packs


@triton.jit
def _dependent_rmsnorm(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    """y = x * rsqrt(mean(x^2) + eps) * w, a row a program, launched as a programmatic dependent: the next
    kernel may launch at once, this one waits for the kernel before it before it reads or writes."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * r * w).to(y_ptr.dtype.element_ty), mask=mask)


def dependent_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    y = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[-1])
    _dependent_rmsnorm[(x.shape[0],)](x, w, y, x.shape[-1], eps, BLOCK=block, num_warps=8, launch_pdl=True)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4,16,64,512,2048")
    ap.add_argument("--shapes", default="14336x4096,4096x14336,28672x4096,14336x14336")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--zeros", action="store_true")
    ap.add_argument("--after-norm", action="store_true")
    ap.add_argument("--torch-norm", action="store_true", help="with --after-norm: torch's F.rms_norm")
    ap.add_argument("--chain", action="store_true", help="with --after-norm: a norm launched as a dependent")
    ap.add_argument("--marlin", action="store_true")
    ap.add_argument(
        "--words", choices=("owned", "packed"), default="owned",
        help="packed: quant_matmul on the checkpoint's words (vLLM serves the weights under 2^25 values so: "
        "qkv_proj, o_proj)",
    )  # fmt: skip
    args = ap.parse_args()
    zeros = " zero points" if args.zeros else ""
    which = "torch's RMSNorm" if args.torch_norm else "our add-RMSNorm"
    which = "an RMSNorm launched as a programmatic dependent" if args.chain else which
    norm = f"; each GEMM after {which}" if args.after_norm else ""
    device = torch.cuda.get_device_name()
    print(f"# {device}; g{args.group}{zeros}; {args.words} words; us, PDL off / on / off / on{norm}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        t = quant_layout.pack_weight(w, 4, args.group, symmetric=not args.zeros)
        owned = args.words == "owned"
        qw = quant_layout.to_owned_order(t["weight_packed"]) if owned else t["weight_packed"]
        sc = t["weight_scale"].to(torch.bfloat16)
        zp = t.get("weight_zero_point")
        zp = quant_layout.to_owned_zeros(zp, n) if zp is not None and owned else zp
        copies = max(1, min(64, math.ceil(COLD_BYTES / (qw.numel() * 4))))
        packs = [(qw, sc, zp)] + [(qw.clone(), sc.clone(), zp) for _ in range(copies - 1)]
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        marlin = _marlin(w, args.group, args.zeros, copies) if args.marlin else None
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def before(x=x, res=res, k=k, norm_w=norm_w):
                if not args.after_norm:
                    return x
                if args.torch_norm:
                    return F.rms_norm(x, (k,), norm_w)
                if args.chain:
                    return dependent_rmsnorm(x, norm_w)
                return K.add_rmsnorm(x, res, norm_w, 1e-6)[0]

            def step(p, pdl, before=before, owned=owned):
                if owned:
                    return qm._quant_matmul_owned(before(), *p, args.group, pdl)
                return qm._quant_matmul(before(), *p, args.group, 4, pdl)

            row, first = [], None
            for pdl in (False, True, False, True):
                y = step(packs[0], pdl).float()
                if first is None:
                    first = y
                err = ((y - first).norm() / first.norm().clamp_min(1e-30)).item()
                assert err < 1e-3, f"{name} m={m} pdl={pdl}: rel diff {err}"
                steps = [functools.partial(step, p, pdl) for p in packs]
                t_us = do_bench_cudagraph(cycle(steps), rep=40) * 1e3
                row.append(f"{t_us:.2f}")
            if args.after_norm:
                t_us = do_bench_cudagraph(before, rep=40) * 1e3
                row.append(f"norm alone {t_us:.2f}")
            if marlin is not None:

                def peer(c, before=before, gemm=marlin[0]):
                    return gemm(before(), c)

                t_us = (
                    do_bench_cudagraph(cycle([functools.partial(peer, c) for c in marlin[1]]), rep=40) * 1e3
                )
                row.append(f"Marlin {t_us:.2f}")
            print(f"{name} m={m}: " + " / ".join(row), flush=True)


if __name__ == "__main__":
    main()
