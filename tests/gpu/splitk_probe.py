"""Issue 20 on a GPU: which part of split-K's self-cleaning workspace (``_write_tile`` MODE 2) goes wrong.

    PYTHONPATH=<a site with squeezeserve> python3 tests/gpu/splitk_probe.py [REPS]

On the H100 (2026-11-23) codebook_matmul at K = N = 4096, 3-12 rows (BLOCK_M 16, split 5) answered up to
0.2 off (relative) in 1-35% of launches at 3 and 4 bits, and int4 quant_matmul in 1 of 200 at 5 rows; one
row and 16 rows never. Each line runs REPS launches of one variant and counts those more than 1e-2 off:
``_write_tile`` MODE 2 as shipped now (the last split reads the sums with an atomic), MODE 1 (fp32 atomics
into a zeroed output, no counter), "barriers" (the old read: a ".cg" load of the workspace, after release
adds and a barrier after the count) and "xchg" (the read by atomic exchange); then int4 quant_matmul, which
shares ``_write_tile``. Before the fix: shipped 1-69 of 200 off at 3-12 rows, barriers 146-200, mode1 and
xchg none.
"""

import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch

from squeezeserve.kernels import codebook_layout, quant_layout, registry
from squeezeserve.kernels.ops import codebook_matmul as C
from squeezeserve.kernels.ops.launch import cdiv, sm_count
from squeezeserve.kernels.ops.quant_matmul import _workspace

VARIANT = """
import triton
import triton.language as tl


@triton.jit
def _write_tile_xchg(acc, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, mask_m, y_row_stride, n_splits,
                     MODE: tl.constexpr, EXCHANGE: tl.constexpr):
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * y_row_stride + offs_n[:, None]
    y_mask = mask_n[:, None] & mask_m[None, :]
    ws_ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * y_row_stride + offs_n[:, None]
    tl.atomic_add(ws_ptrs, acc, mask=y_mask, sem="release")
    tl.debug_barrier()
    tile = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    if tl.atomic_add(tile, 1, sem="acq_rel") == n_splits - 1:
        tl.debug_barrier()
        if EXCHANGE:
            total = tl.atomic_xchg(ws_ptrs, tl.zeros_like(acc), mask=y_mask, sem="acquire")
        else:
            total = tl.load(ws_ptrs, mask=y_mask, other=0.0, cache_modifier=".cg")  # the old read
            tl.store(ws_ptrs, tl.zeros_like(total), mask=y_mask)
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
        tl.store(tile, 0)

"""


def variant_kernel():
    """codebook_matmul's kernel with the exchange-reading _write_tile, from a file (Triton reads source)."""
    src = inspect.getsource(C._codebook_matmul_kernel.fn)  # with its @triton.jit line
    src = src.replace("_write_tile(", "_write_tile_xchg(").replace("_codebook_matmul_kernel", "_variant")
    src = src.replace("n_splits, MODE)", "n_splits, MODE, EXCHANGE)").replace(
        "DOT_FP32: tl.constexpr,", "DOT_FP32: tl.constexpr, EXCHANGE: tl.constexpr,"
    )
    path = Path(tempfile.mkdtemp()) / "splitk_variant.py"
    path.write_text(VARIANT + src)
    spec = importlib.util.spec_from_file_location("splitk_variant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._variant


def launch_variant(kernel, x2, indices, codebook, bits, cfg, exchange):
    n_out, k_in = indices.shape[0], x2.shape[-1]
    m = x2.shape[0]
    tiles_per_split = cdiv(cdiv(k_in, cfg["BLOCK_K"]), cfg["split"])
    split = cdiv(cdiv(k_in, cfg["BLOCK_K"]), tiles_per_split)
    grid = (cdiv(n_out, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    y = torch.empty((m, n_out), dtype=x2.dtype, device=x2.device)
    ws, counts = _workspace(x2.device, m * n_out, grid[0] * grid[1])
    kernel[grid](
        x2, indices, codebook, y, ws, counts, m, n_out, k_in,
        x2.stride(0), indices.stride(0), codebook.stride(0), y.stride(0), tiles_per_split,
        BITS=bits, GROUP=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        MODE=2, DOT_FP32=False, EXCHANGE=exchange, num_warps=4,
    )  # fmt: skip
    return y


def count_bad(run, args, ref, reps):
    errors = []
    for _ in range(reps):
        y = run(*args).float()
        torch.cuda.synchronize()
        errors.append(((y - ref).norm() / ref.norm()).item())
    return sum(e > 1e-2 for e in errors), max(errors)


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    registry.load()
    torch.manual_seed(0)
    kernel = variant_kernel()
    n = k = 4096
    for bits in (3, 4):
        index = torch.randint(0, 1 << bits, (n, k), device="cuda")
        cb = (torch.randn(n, 1 << bits, device="cuda") / 64).sort(dim=1).values.half()
        idx = codebook_layout.pack_indices(index, bits)
        dense = codebook_layout.dequantize(idx, cb, k, None, bits).to(torch.bfloat16)
        for m in (2, 3, 4, 5, 8, 12, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = (x @ dense.t()).float()
            cfg = C.launch_config(m, n, k, 0, sm_count(x.device))
            runs = {
                "shipped": (C.launch, (x, idx, cb, 0, bits, cfg)),
                "mode1": (C.launch, (x, idx, cb, 0, bits, {**cfg, "mode": 1})),
                "barriers": (launch_variant, (kernel, x, idx, cb, bits, cfg, False)),
                "xchg": (launch_variant, (kernel, x, idx, cb, bits, cfg, True)),
            }
            cells = []
            for name, (run, args) in runs.items():
                bad, worst = count_bad(run, args, ref, reps)
                cells.append(f"{name} {bad}/{reps} max {worst:.2g}")
            print(f"codebook bits {bits} m {m} {cfg}: " + "; ".join(cells), flush=True)
    from squeezeserve.kernels.ops.quant_matmul import quant_matmul

    t = quant_layout.pack_weight(torch.randn(n, k, device="cuda") / 64, 4, 32, symmetric=False)
    packed, scales, zeros = t["weight_packed"], t["weight_scale"].bfloat16(), t["weight_zero_point"]
    dense = quant_layout.dequantize(packed, scales, zeros, (n, k), 32, 4).to(torch.bfloat16)
    for m in (2, 3, 4, 5, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x @ dense.t()).float()
        try:
            bad, worst = count_bad(quant_matmul, (x, packed, scales, zeros, 32, 4), ref, reps)
            print(f"quant_matmul int4 g32 m {m}: {bad}/{reps} max {worst:.2g}", flush=True)
        except Exception as exc:  # the layout guess above may not be quant_matmul's: say so, go on
            print(f"quant_matmul int4 m {m}: {type(exc).__name__}: {exc}"[:300], flush=True)
            break


if __name__ == "__main__":
    main()
