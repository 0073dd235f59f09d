"""Weight-only quantized matmul, ``squeezeserve::quant_matmul``: input checks, the choice of kernel by row
count, tuning, the split-K workspace, registration and autograd. The kernels and their design are in
``quant_matmul_kernels.py``; the layout in ``kernels/quant_layout.py``.

One row of int4, or two with groups of at most GEMV_ROWS_MAX_GROUP values, run on the FMA units
(``_gemv_int4_kernel``), up to SKINNY_MAX_M
rows (and int8 at one row) on tensor cores (``_skinny_kernel``). Prefill (M > SKINNY_MAX_M) is
compute-bound and takes the faster of two paths for its shape (``PREFILL``): ``_prefill_kernel``, a
tensor-core GEMM that dequantizes each weight tile in registers, or ``_dequantize_kernel`` expanding W to
the activation dtype once (bit-exact, as compressed-tensors dequantizes; at memory speed) and cuBLAS. The
transient weight costs N x K x 2 bytes; at thousands of rows it is read once per row, so the expansion is
a small part of the time.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch
import triton
from torch.library import triton_op
from triton.compiler.errors import CompilationError
from triton.runtime import errors as triton_errors

from squeezeserve.kernels import quant_layout, reference
from squeezeserve.kernels.ops import launch
from squeezeserve.kernels.ops.launch import (
    Workspace,
    cdiv,
    lets_dependents_start,
    next_power_of_2,
    no_workspace,
    sm_count,
    traceable,
    traced,
    wgmma,
)
from squeezeserve.kernels.ops.quant_matmul_kernels import (
    _dequantize_kernel,
    _gemv_int4_kernel,
    _prefill_kernel,
    _skinny_kernel,
)
from squeezeserve.kernels.ops.replay import LaunchPlans
from squeezeserve.kernels.registry import EagerOp, eager, interpreting, use_reference

log = logging.getLogger(__name__)

SKINNY_MAX_M = 64
# Prefill: "triton" (_prefill_kernel, the weight dequantized in registers), "dequantize" (the dense weight
# written once, then cuBLAS) or "auto": the faster of the two by `bench_quant_matmul.py --prefill-sweep` on
# the H100 (bf16; results/prefill_sweep_h100_2026-11-24.log and, with K splits that fill the SMs,
# prefill_split_sweep_h100_2026-11-25.log). The Triton GEMM up to TRITON_PREFILL_MAX_M rows (at 128 rows
# 0.67-1.19x bf16 cuBLAS against dequantize + cuBLAS's 0.42-0.53x), and up to TRITON_PREFILL_WIDE_MAX_M
# rows where outputs are at least TRITON_PREFILL_MIN_N wide in groups of at least 64, or narrower with a
# reduction at least TRITON_PREFILL_MIN_K deep (at 512 rows 0.71-0.80x against 0.62-0.67x); everywhere else
# dequantize + cuBLAS (0.77-0.81x at 1024 rows and 0.84-1.0x from 2048, where the Triton GEMM reaches
# 0.64-0.80x).
# Outputs narrower than TRITON_PREFILL_MIN_N_ANY (the bundled model's, 576-3072) leave most SMs idle in the
# Triton GEMM while their dense weights cost cuBLAS little: inside a CUDA graph (GPU time only) they take
# dequantize + cuBLAS (H100, fp16 g32, 128-2048 rows: 4.9-15.6 us against the Triton GEMM's 12.0-30.2);
# outside one, up to TRITON_PREFILL_NARROW_MAX_M rows, the Triton GEMM, whose call its launch plan replays
# (host 6.9-13.3 us against 55.9-58.7 for dequantize + cuBLAS, whose matmul no plan holds:
# `launch_probe.py --quant-shapes`, results/quant_host_bundled_h100_2026-11-26.log). Before the C++ replay,
# the Triton GEMM's Python launches cost more than cuBLAS's GPU time saved (int4-serve run f: c=64 0.86x
# Marlin's tokens/s); with it, the bundled g32 model's prompts were host-bound on dequantize + cuBLAS (TTFT
# at c=1 34.4 ms against Marlin's 21.9; NOTES.md, sixteenth session). vLLM's prompt steps reach 8192 rows
# (its max_num_batched_tokens): up to 2048 on the Triton GEMM, the rest on dequantize + cuBLAS, vLLM's own
# prefill time at c=64 was 1.74-1.90x Marlin's in two runs; up to 8192, 0.80-1.17x in three (its /metrics;
# results/int4_serve_h100_2026-11-26_narrow_8192.txt, NOTES.md, seventeenth session).
#
# Dequantize + cuBLAS expands DEQUANT_SLICE_ROWS rows of W at a time into one reused buffer from
# DEQUANT_SLICE_MIN_M rows of x: the slice (32 MB at K = 4096) stays in the L2 for its product instead of
# the whole dense weight going out to DRAM and back (dequantize_matmul). H100, bf16, cold weights, slices
# of 2048 rows (tests/gpu/gluon_prefill_probe.py --slices, results/slices_h100_2026-11-26.log), whole -> in
# slices:
# 4096 rows of 6144 x 4096 320.0 -> 305.0 us, of 28672 x 4096 1468.6 -> 1425.2 (cuBLAS bf16 1387.0), g32
# 1499.4 -> 1433.9; 8192 rows of 6144 x 4096 650.6 -> 605.9; 2048 rows of 28672 x 4096 g32 840.7 -> 770.5.
# At 512 rows the slices' products are too small to fill the SMs (28672 x 4096: 280.4 -> 354.3 us); at 1024
# they are no slower (469.4 -> 435.2). Reductions of DEQUANT_SLICE_MAX_K or deeper keep the whole weight:
# 4096 x 14336 was within 1% either way there, and 3.6-5% slower at 3072 rows on another lease
# (results/slices_three_h100_2026-11-26.log, whole / in slices: g128 558.3 / 578.4, g32 564.2 / 592.6 us;
# at K = 4096 that run had 4096 rows of 6144 x 4096 323.2 / 308.0 and of 28672 x 4096 1499.6 / 1431.8, 3072
# rows within 2% either way). Each slice costs a dequantize launch and a cuBLAS call of host, which vLLM's
# eager prompt steps wait on (GLUON_PREFILL_MAX_M_SLICED's comment): the 8B layer's four GEMMs as vLLM's
# method calls them, g128, host / GPU us in 2048-row slices against 4096-row ones
# (tests/gpu/prefill_host_probe.py --slice-rows, results/prefill_host_probe_h100_2026-11-27_slices.log):
# 6144 rows 1455 / 3535 against 979 / 3500, 8192 rows 1868 / 4629 against 959 / 4600 (7168-row ones 669 /
# 3595 and 745 / 4616: gate_up's GPU time 3% more at 6144 rows); another lease, 4097 / 6144 / 8192 rows 2086 /
# 2412, 1587 / 3469, 1498 / 4527 against 1341 / 2419, 1011 / 3411, 1427 / 4491, g32 at 1088 / 2064 / 4097 rows
# 649 / 1014, 1358 / 1390, 1698 / 2430 against 521 / 992, 780 / 1332, 789 / 2426
# (results/prefill_host_probe_h100_2026-11-27_slices4096.log). The buffer is also all the transient memory
# the path takes (32 MB where 28672 x 4096 dense is 235 MB). SQUEEZESERVE_DEQUANT_SLICE_ROWS sets the
# slices' rows (A/B runs; 0: the whole weight).
PREFILL = "auto"
# On Hopper, "auto" runs the Gluon GEMM (quant_matmul_gluon.py: dequantization overlapped with the tensor
# cores' products, a loading warp of its own) where it takes the inputs and was measured faster than the paths
# above (tests/gpu/gluon_prefill_probe.py, H100; NOTES.md, "eleventh session";
# results/gluon_prefill_probe_h100_2026-11-25_ws_auto.log): outputs at least TRITON_PREFILL_MIN_N wide up to
# GLUON_PREFILL_MAX_M rows (GLUON_PREFILL_MAX_M_SMALL_GROUP for groups under 64 values; g128 at 128 rows of
# 14336^2 1.35x bf16 against the Triton GEMM's 1.05x, 512 rows 1.00x against 0.75x, 2048 rows 0.95x against
# dequantize + cuBLAS's 0.89x), and narrower ones (down to TRITON_PREFILL_MIN_N_ANY) in groups of 64 or more
# from 257 rows (512 rows of 4096^2 0.81x against 0.69x) or, K at least TRITON_PREFILL_MIN_K deep, up to 128
# (4096 x 14336: 1.30x against 1.19x). Up to TRITON_PREFILL_MAX_M rows also outputs wider than
# TRITON_PREFILL_MIN_N_ANY in any group (timed at 6144, the 8B model's qkv: 256 rows 32.8 us against 41.5,
# 34.6 against 60.4 with zero points, g32 40.3 against 49.5; 128 rows 29.0 against 30.1), and, with zero
# points in groups of 64 or more, outputs of TRITON_PREFILL_MIN_N_ANY from 129 rows (256 x 4096^2 32.6
# against 40.4, 256 x 4096 x 14336 74.9 against 88.0): the Triton GEMM is slow with zero points (NOTES.md,
# "thirteenth session"; results/gluon_prefill_probe_h100_2026-11-25_256rows.log). Short reductions of
# TRITON_PREFILL_MIN_N_ANY in groups of 128 or more take it at GLUON_HALF_TILES_MIN_M to
# GLUON_DEEP_K_HALF_MAX_M rows too, on 64-row weight tiles 128 deep (GLUON_DEEP_K: o_proj at 128 rows 17.8 us
# against the Triton GEMM's 20.6-21.4). "gluon" forces it wherever it takes the inputs.
# Where dequantize + cuBLAS would run in slices (K under DEQUANT_SLICE_MAX_K), groups of 64 or more take the
# Gluon GEMM further, to GLUON_PREFILL_MAX_M_SLICED rows: vLLM runs prompt steps past its CUDA graphs
# eagerly, and the slices' host time (a dequantize launch and a cuBLAS call each, 50-130 us a slice) is the
# GPU's time there. The 8B layer's four GEMMs as vLLM's method calls them, H100, g128
# (tests/gpu/prefill_host_probe.py, results/prefill_host_probe_h100_2026-11-27.log), host / GPU us, the rule
# before (Gluon to 2048 rows, then slices) against the Gluon GEMM: 2064 rows 1189 / 1404 against 49 / 1572,
# 3072 rows 1699 / 1948 against 68 / 1796, 4096 rows 1272 / 2428 against 55 / 2403; past it the slices' GPU
# time leads and their host time hides behind it (6144 rows 1551 / 3532 against 44 / 3703, 8192 1388 / 4633
# against 64 / 5055). In a served step the other ops' host time adds to the slices': vLLM's profiler in a
# server had our 2049-4096-row steps span twice their kernels' time (76 ms, Machete's the same), where
# Machete's spanned 1.04x (results/serve_prof_run62_h100_2026-11-27.txt; the profiler's per-op cost
# included). Deep reductions keep the whole weight (one dequantize launch and one cuBLAS call, 80-155 us of
# host) and GLUON_PREFILL_MAX_M: 4096 x 14336 at 2064 rows took 351 us against the Gluon GEMM's 445.
# SQUEEZESERVE_GLUON_PREFILL_MAX_M sets GLUON_PREFILL_MAX_M_SLICED (A/B runs of a server).
GLUON_PREFILL_MAX_M, GLUON_PREFILL_MAX_M_SMALL_GROUP = 2048, 1024


def _rows_setting(name: str, default: int, multiple: int = 1) -> int:
    """A row count for an A/B run of a server from the environment variable ``name``, else ``default``;
    anything but a whole number of rows (a multiple of ``multiple``) stops the import."""
    value = os.environ.get(name, "")
    if not value:
        return default
    if not value.isdigit() or int(value) % multiple:
        unit = f" (a multiple of {multiple})" if multiple > 1 else ""
        raise ValueError(f"{name} must be a row count{unit}, got {value!r}")
    return int(value)


GLUON_PREFILL_MAX_M_SLICED = _rows_setting("SQUEEZESERVE_GLUON_PREFILL_MAX_M", 4096)
# Decode (up to SKINNY_MAX_M rows) on Hopper: "auto" runs the Gluon kernel as a stream-K GEMM (every SM
# streams an equal share of the weight through TMA; quant_matmul_gluon.py) for int4 in groups of 128, of a
# multiple of 256 (a 256-deep K tile holds two groups or part of one), or of GLUON_DECODE_SMALL_GROUP
# (compress's default; eight a 256-deep tile), where it was measured faster than the tensor-core kernel,
# the larger the weight the fewer the rows (H100, 2026-11-26, after a tile's likely last part stopped paying a
# round trip through the workspace; tests/gpu/gluon_prefill_probe.py, NOTES.md, "eighteenth session",
# results/gluon_decode_rules_h100_2026-11-26.log): weights of at least GLUON_DECODE_MIN_WEIGHT values from 2
# rows (28672 x 4096 at 2-16 rows 31.9-33.9 us against 33.6-35.1; 14336^2 50.3-52.9 against 59.9-62.5), of at
# least GLUON_DECODE_MIN_WEIGHT_WIDE from GLUON_DECODE_WIDE_MIN_M rows (g32 at 32 rows of 14336 x 4096 23.4
# against 30.2, of 28672 x 4096 40.4 against 52.1; 6144 x 4096 at 24 rows 13.7 against 17.0, with zero points
# 13.9 against 18.0), in symmetric small groups of at least GLUON_DECODE_MIN_WEIGHT_WIDE_SMALL_GROUP (4096^2
# g32 at 24-32 rows 11.3-11.7 against 13.4-13.8; g128 there 10.3-11.5 against the Gluon kernel's 11.1-11.7),
# of at least GLUON_DECODE_MIN_WEIGHT_WIDER from GLUON_DECODE_WIDER_MIN_M rows (64 rows of 6144 x 4096: 17.8
# against 26.4; 4096^2 at 48-64 rows 14.4-14.8 against 15.2-16.2 once the 64-row tiling's warpgroups freed
# their own stages; thirty-second session, results/decode_rule_probe_h100_2026-11-27.log). Below those the
# tensor-core kernel is as fast or faster (4096 x 14336 at 2-16 rows 18.1-18.7 against 19.4-20.3).
# Small groups with zero points cost the Gluon kernel more (a row's eight zero-point nibbles a tile): there
# only from GLUON_DECODE_WIDE_MIN_M rows of GLUON_DECODE_MIN_WEIGHT (g32 with zero points, 28672 x 4096: 2-16
# rows 44.1-45.6 against 40.7-42.6, 24 rows 50.3 against 63.6; 4096 x 14336 at 24 rows 27.9 against 26.3;
# results/gluon_decode_rules_h100_2026-11-26_zeros.log), and from GLUON_DECODE_WIDER_MIN_M rows of
# GLUON_DECODE_MIN_WEIGHT_WIDE (4096^2 at 40-64 rows 16.9-17.3 against 15.1-15.4). These are packed words';
# the vLLM method serves the weights of 2^25 values and more on owned words (vllm_ops.owned_shape), which the
# Gluon kernel decodes from 2 rows (_quant_matmul_owned).
# Other groups under GLUON_DECODE_MIN_GROUP (g64) were not timed: the other kernels. "gluon" forces it
# wherever it takes the inputs, "triton" never.
DECODE = "auto"
GLUON_DECODE_BLOCK_K, GLUON_DECODE_MIN_GROUP, GLUON_DECODE_SMALL_GROUP = 256, 128, 32
GLUON_DECODE_MIN_WEIGHT, GLUON_DECODE_MIN_WEIGHT_WIDE, GLUON_DECODE_WIDE_MIN_M = 1 << 26, 6144 * 4096, 17
GLUON_DECODE_MIN_WEIGHT_WIDE_SMALL_GROUP = 1 << 24
GLUON_DECODE_MIN_WEIGHT_WIDER, GLUON_DECODE_WIDER_MIN_M = 1 << 24, 33
TRITON_PREFILL_MAX_M, TRITON_PREFILL_WIDE_MAX_M = 256, 512
TRITON_PREFILL_MIN_N, TRITON_PREFILL_MIN_N_ANY, TRITON_PREFILL_MIN_K = 8192, 4096, 8192
TRITON_PREFILL_NARROW_MAX_M = 8192
DEQUANT_SLICE_MIN_M, DEQUANT_SLICE_MAX_K = 1024, 8192
# (whole int4 and int8 words of packed zero points a slice: a multiple of 8 rows; 0, the whole weight)
DEQUANT_SLICE_ROWS = _rows_setting("SQUEEZESERVE_DEQUANT_SLICE_ROWS", 4096, multiple=8)
# The dequantize kernel's tile (weight rows x K) where K spans a whole one and the groups align to it, else
# DEQUANT_TILE_NARROW. H100, us to expand the 8B model's down_proj (4096 x 14336) / 14336 x 4096 to bf16,
# 4 x 2048 against 32 x 256 (tests/gpu/dequantize_probe.py --tiles,
# results/dequantize_probe_h100_2026-11-28_tiles.log): g32 with zero points on owned words 58.2 / 57.4 against
# 65.5 / 61.2 (a row's zero points are one word a 256-wide tile, 32 scattered words a tile of 32 rows; a
# sector of eight in a 2048-wide one), on packed words 56.6 / 56.2 against 57.9 / 58.5, g128 within 1-3%
# either way; the 2048-row product on owned words 383.0 / 372.0 against 389.7 / 384.1 (medians; packed
# 367.0-380.7 on every tile).
DEQUANT_TILE, DEQUANT_TILE_NARROW = (4, 2048), (32, 256)
# Rows up to which the FMA kernel beats the tensor-core one where groups align to its GEMV_BLOCK_K tiles and
# hold at most GEMV_ROWS_MAX_GROUP values (g32_probe.py --sweep-gemv-rows, H100: g32 1.0-1.4x faster at 2
# rows, slower at 4); other groups one row. Since the tensor-core kernel reads int32 words, 2 rows of g128 run
# faster on it (4-13% at three of four shapes, 2% slower at 14336^2: gemv_rows_h100_2026-11-24_int32_words.log
# in tests/benchmarks/results).
GEMV_MAX_M = 2
GEMV_ROWS_MAX_GROUP = 64
GEMV_BLOCK_K = 512  # the FMA kernel's K tile where groups align to it (g32_probe.py --sweep-gemv-narrow)
# One row on owned words (quant_matmul_owned): the FMA kernel up to this group (it permutes each x tile into
# the words' order in registers), else the Gluon decode. H100, N x K 14336 x 4096 / 4096 x 14336 / 14336^2,
# us (results/owned_one_row_probe_h100_2026-11-26.log; NOTES.md, twentieth session): g32 FMA 16.5 / 17.3 /
# 49.1 against the Gluon decode's 20.1 / 20.4 / 53.5 (packed words' FMA 16.2 / 17.2 / 49.4); g128 Gluon
# 17.2 / 17.9 / 46.5 against FMA 17.8 / 18.7 / 51.3. Except g32 with zero points, since its scales come by TMA
# (twenty-second session, results/owned_one_row_probe_h100_2026-11-26_zeros.log), N x K 14336 x 4096 /
# 28672 x 4096 / 4096 x 14336: the Gluon decode 18.8 / 32.1 / 19.1 against FMA 19.9 / 35.4 / 20.4 (symmetric
# g32 and g64 with zero points stay on the FMA kernel: 16.7 / 30.1 / 17.7 against 17.9 / 30.0 / 18.0, and
# 18.2 / 29.8 / 17.8 against 18.4 / 31.0 / 19.8).
OWNED_FMA_MAX_GROUP = 64
# And symmetric g32 (scales by TMA too) on the Gluon decode where the weight holds at least this many values.
# One row, us, FMA kernel / Gluon decode (owned_one_row_probe.py): H200, 28672 x 4096 29.0 / 25.7, 14336^2
# 47.3 / 38.3 (Marlin 40.8 in bench_quant_matmul's run), 14336 x 4096 16.0 / 16.3
# (results/owned_one_row_probe_h200_2026-11-28.log); H100 30.1 / 30.0 at 28672 x 4096
# (..._h100_2026-11-26_zeros.log), 48.8 / 47.5 at 14336^2 and 16.5 / 17.8 at 14336 x 4096
# (..._h100_2026-11-28.log).
OWNED_ROW_GLUON_MIN_WEIGHT = 1 << 26
# Row split: past ROW_SPLIT_TILE rows, a remainder of at most SKINNY_MAX_M rows over whole tiles costs the
# prefill GEMMs a tile row of their own (256-row tiles: 288 rows cost what 512 do), so those rows run as a
# decode into the output's last rows ("auto": on Hopper, for the weights where that was measured faster:
# outputs of at least TRITON_PREFILL_MIN_N or K at least TRITON_PREFILL_MIN_K, up to ROW_SPLIT_MAX_M rows;
# "on": wherever the rows allow, "off": never; SQUEEZESERVE_ROW_SPLIT sets it). vLLM runs such steps when a
# prompt joins running decodes (synth: 257-319 rows, a few a run). H100, g128 (g32), 288 / 320 rows
# (tests/gpu/gluon_prefill_probe.py --ms 32,64,256,288,320, results/rows_h100_2026-11-26.log): 28672 x 4096
# 259.6 / 246.2 us as one GEMM, 256 rows 100.3 (115.3) and 32 / 64 decode rows 37.0 / 50.6 (52.1 / 66.0)
# apart; 4096 x 14336 109.6 / 111.0 against 72.1 + 22.6 / 29.9; 14336^2 414.2 / 400.8 against 173.6 + 57.3 /
# 78.9. The 4096- and 6144-wide weights with K = 4096 were as fast or faster as one GEMM (4096^2 31.7 at 320
# rows against 31.0 + 16.1). Past 1024 rows g32 runs dequantize + cuBLAS, which wastes no tile: split there,
# its head took the Gluon GEMM and was slower (1030 x 4096 x 14336 237.5 against 219.1 us;
# results/rows_1030_h100_2026-11-26_split_off_on.log). Split as shipped
# (results/rows_split_h100_2026-11-26.log), g128 at 288 / 320 rows: 28672 x 4096 138.5 / 152.5 us (cuBLAS bf16
# 140.4 / 123.6), 4096 x 14336 95.0 / 103.0 (74.0 / 65.6), 14336^2 229.0 / 258.9 (207.3 / 221.3).
ROW_SPLIT = os.environ.get("SQUEEZESERVE_ROW_SPLIT", "auto")  # (for A/B runs of a server)
if ROW_SPLIT not in ("auto", "on", "off"):
    raise ValueError(f"SQUEEZESERVE_ROW_SPLIT must be auto, on or off, got {ROW_SPLIT!r}")
ROW_SPLIT_TILE, ROW_SPLIT_MAX_M = 256, 1024
# Programmatic dependent launch (PDL): where the caller says the kernel before a call is one of ours
# launched as a programmatic dependent itself (``pdl``: vLLM's decode graphs, vllm_ops.PDL_AFTER: our norms
# and SwiGLU there, rmsnorm.rmsnorm_dependent), the Gluon kernel up to this many rows launches as that
# kernel's dependent: it starts while that kernel and the GEMM before it drain (our kernels call
# launch_dependents first, launch.launches_dependents), its first stages' weight words out before it waits
# (griddepcontrol.wait) for the kernel before (quant_matmul_gluon._load_partition). H100,
# tests/gpu/pdl_probe.py --after-norm (NOTES.md, twenty-fifth session), a norm and the GEMM a step, the GEMM
# plain / dependent: after a norm launched as a dependent (--chain) 14336 x 4096 18.8-20.9 / 17.4-19.0 us at
# 1-16 rows, 28672 x 4096 30.8-33.0 / 28.3-30.7, 4096 x 14336 21.4-22.5 / 20.0-20.9, 64 rows 2-5% faster;
# after our norm launched plainly nothing (14336 x 4096 19.4-20.4 / 20.0-21.0); after torch's RMSNorm, which
# does not trigger, 4-8% slower (twenty-fourth session). So only on the caller's word, never by default;
# prefill launches stay as they were (512 rows: within the noise). The FMA kernel and the tensor-core decode
# stay plain launches: as dependents (their first weight words asked of the L2, then the wait; branch
# decode-pdl-trial) they were slower in the same chain, 6144 x 4096 at one row 18.3-19.4 against 10.2-10.6 us,
# up to 1.9 us at 2-16 rows but for one point (tests/gpu/pdl_probe.py --words packed,
# results/pdl_probe_h100_2026-11-28_packed_decode_trial.log; NOTES.md, thirty-third session).
PDL_MAX_M = SKINNY_MAX_M
# bf16: 0x4300 is 128.0 with a 7-bit mantissa (integers 128..255 exact); fp16: 0x6400 is 1024.0 with a
# 10-bit mantissa (1024..2047 exact).
_MAGIC = {torch.bfloat16: (0x4300, 128.0, 7), torch.float16: (0x6400, 1024.0, 10)}


def check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
    owned: bool = False,
) -> None:
    """Shapes and dtypes of quant_matmul's inputs; ``owned``: the owned weights' zero points
    (quant_layout.to_owned_zeros: [N, ceil(groups / 8)])."""
    if bits not in quant_layout.SUPPORTED_BITS:
        raise ValueError(f"quant_matmul: bits must be one of {quant_layout.SUPPORTED_BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"quant_matmul: group_size must be positive, got {group_size}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quant_matmul: x must be fp16, bf16 or fp32, got {x.dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(
            f"quant_matmul: qweight must be int32 [N, K/{32 // bits}], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    n_out, k_in = qweight.shape[0], x.shape[-1]
    per_word = 32 // bits
    if qweight.shape[1] != -(-k_in // per_word):
        raise ValueError(
            f"quant_matmul: qweight has {qweight.shape[1]} words per row; K={k_in} at {bits} bits "
            f"needs {-(-k_in // per_word)}"
        )
    n_groups = -(-k_in // group_size)
    if tuple(scales.shape) != (n_out, n_groups):
        raise ValueError(f"quant_matmul: scales must be [{n_out}, {n_groups}], got {tuple(scales.shape)}")
    want = (n_out, -(-n_groups // per_word)) if owned else (-(-n_out // per_word), n_groups)
    if zeros is not None and (tuple(zeros.shape) != want or zeros.dtype != torch.int32):
        raise ValueError(
            f"quant_matmul: zeros must be int32 [{want[0]}, {want[1]}]{' (owned)' if owned else ''}, "
            f"got {zeros.dtype} {tuple(zeros.shape)}"
        )


# The device's split-K workspace: fp32 partial sums, int32 tile counters; every kernel zeroes what it used
# (``_write_tile`` MODE 2). ``_workspace(device, partials, tiles)``.
_workspace = Workspace((torch.float32, 1 << 20), (torch.int32, 4096))
workspace_buffers = _workspace.buffers


def _tile_k(group_size: int, k_in: int, bits: int) -> tuple[int, bool]:
    """(BLOCK_K, prescale) for the tensor-core kernel: the widest tile of at most 256 inside one group,
    else a PRESCALE tile: 256 (or K, if narrower) when whole groups tile it, else 64. A dot needs depth
    >= 16, so a tile holds at least 16 int16 words: 64 int4 / 32 int8 values."""
    per16 = 16 // bits
    min_k = 16 * per16
    span = min(group_size, next_power_of_2(k_in))  # a group wider than K behaves like K
    for block_k in (256, 128, 64, 32):
        if min_k <= block_k <= span and group_size % block_k == 0:
            return block_k, False
    block_k = max(min_k, min(256, next_power_of_2(k_in)))
    if block_k % group_size or group_size % per16:  # groups straddle tiles: per-value scale gathers
        block_k = max(min_k, 64)  # (a 256-deep tile of gathers would not fit in shared memory)
    return block_k, True


def _groups_per_tile(group_size: int, block_k: int, per_word: int) -> int:
    """GPT of the kernels: 1 when a group holds whole K tiles, BLOCK_K / G when whole groups tile a K
    tile (and a group holds whole words), 0 when groups straddle tiles (scales gathered per value)."""
    if group_size % block_k == 0:
        return 1
    if block_k % group_size == 0 and group_size % per_word == 0:
        return block_k // group_size
    return 0


def tuning(kernel: str, m: int, n_out: int, k_in: int, block_k: int, device: torch.device,
           narrow_groups: bool = False, bits: int = 4, group_size: int = 0,
           zeros: bool = False) -> dict:  # fmt: skip
    """BLOCK_N, split-K, warps and stages for the decode kernels, chosen from the sweeps of
    ``tests/benchmarks/bench_quant_matmul.py --sweep`` and ``tests/gpu/g32_probe.py --sweep / --sweep-gemv``
    (results and figures: tests/benchmarks/NOTES.md): one setting within a few percent of each shape's best,
    and twice the K splits when the N tiles alone fill few SMs and K is long, so that more programs share the
    weight stream.

    ``narrow_groups``: several groups per K tile (int4 g32: the tensor-core kernel's PRESCALE tile, the FMA
    kernel's per-word scales). Those take 64-wide tiles (8 warps on the FMA kernel) and 4 K splits once the N
    tiles fill the SMs twice over or the rows fill a 64-row tile, else 8: at g32 1.3-1.7x faster than the
    g128 tiles at 4-64 rows, 1.1-1.6x at one row (H100; with zero points the most). int8 takes 64-wide
    tiles too, 4 K splits for many N tiles or 256-deep K tiles (per-channel scales), else 8: 1.0-1.3x faster
    than the int4 g128 tiles (``g32_probe.py --sweep-int8``).

    One row on the FMA kernel with GEMV_BLOCK_K tiles (groups that tile 512 columns or hold them: g32, g128,
    per channel): 8 output rows a program on 2 warps, K split only past 16 tiles (8192 columns) or where the
    N tiles leave SMs idle. ``g32_probe.py --sweep-gemv-narrow`` (H100, 2026-11-24; g128 and g32, with and
    without zero points, three decode shapes): among the best four of 36 settings at 9 of the 12 points, where
    the best was 1.15-1.31x faster than the 32-128 x 128-256 tiles on 4-8 warps before; one row of int4 g128
    went from 1.97-2.41x bf16 to 2.44-2.83x (``bench_quant_matmul.py``). Two rows (``--sweep-gemv-rows``):
    16 output rows a program where groups hold 64 columns or more, split as for one row; 8 and no split
    past the SMs' fill for g32: the best of 18 settings at 11 of the 12 points (g128; g32 with and without
    zero points; four shapes), 0.6% off the best at the twelfth.

    33-64 rows of int4 (64-row tiles, one program an SM; ``tests/gpu/skinny_sweep.py 64``, 48 settings, H100):
    where the 128-wide N tiles alone fill half the SMs, no K split at g32 (128 wide, 8 warps, 4 stages) and
    two at g128, else 4 splits of 64-wide tiles (g32) or 8 of 128-wide (g128): the best setting at all 12
    points (g128, g32 with and without zero points, four shapes); 8-30% faster than the rule before it where
    N = 14336 and at g128 K = 14336, N = 4096, the same setting as before elsewhere."""
    tiles = cdiv(k_in, block_k)
    if interpreting():  # small tiles; split-K whenever there are two tiles, so the tests cover both paths
        return {"BLOCK_N": 16, "split": min(2, tiles), "num_warps": 4, "num_stages": 1}
    if kernel == "gemv" and block_k == GEMV_BLOCK_K:
        two_narrow = m > 1 and group_size < 64  # two rows of g32: K split only to fill the SMs
        block_n = 16 if m > 1 and not two_narrow else 8
        split = max(1 if two_narrow else cdiv(tiles, 16), cdiv(sm_count(device), cdiv(n_out, block_n)))
        return {"BLOCK_N": block_n, "split": max(1, min(split, tiles)), "num_warps": 2, "num_stages": 3}
    if m > 32 and bits == 4:  # 64-row tiles: one program per SM at most, so few programs, deep K ranges
        wide = cdiv(n_out, 128) * 2 >= sm_count(device)
        if narrow_groups:
            cfg = {"BLOCK_N": 128, "split": 1, "num_warps": 8, "num_stages": 4} if wide else \
                  {"BLOCK_N": 64, "split": 4, "num_warps": 4, "num_stages": 3}  # fmt: skip
        else:
            cfg = {"BLOCK_N": 128, "split": 2 if wide else 8, "num_warps": 4, "num_stages": 3}
        return cfg | {"split": max(1, min(cfg["split"], tiles))}
    many = cdiv(n_out, 64) * 4 >= 2 * sm_count(device) or m > 32
    if narrow_groups:  # zero points: 4 splits everywhere (H100: 15-18% faster at 4 rows where N = 4096)
        return {"BLOCK_N": 64, "split": max(1, min(4 if many or zeros else 8, tiles)),
                "num_warps": 8 if kernel == "gemv" else 4, "num_stages": 3}  # fmt: skip
    if bits == 8:
        split = 4 if many or block_k >= 256 else 8
        return {"BLOCK_N": 64, "split": max(1, min(split, tiles)), "num_warps": 4, "num_stages": 3}
    block_n = 128
    few_tiles = cdiv(n_out, block_n) * 8 < 2 * sm_count(device)
    split = 16 if few_tiles and tiles >= 64 else 8
    return {"BLOCK_N": block_n, "split": max(1, min(split, tiles)), "num_warps": 4, "num_stages": 3}


def _quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
    pdl: bool = False,
) -> torch.Tensor:
    """The op's body; ``pdl``: the kernel before this call in the stream is one of ours launched as a
    programmatic dependent (:data:`PDL_MAX_M`)."""
    check_inputs(x, qweight, scales, zeros, group_size, bits)
    if use_reference(x) or x.dtype == torch.float32:
        # fp32 activations have no tensor-core path worth a kernel; they run the reference everywhere.
        return reference.quant_matmul(x, qweight, scales, zeros, group_size, bits)
    n_out, k_in = qweight.shape[0], x.shape[-1]
    x2, qweight, scales = _operands(x, qweight, scales)
    m = x2.shape[0]
    weight = (qweight, scales, zeros, zeros.contiguous() if zeros is not None else qweight, group_size, bits)
    head = split_rows(x2, n_out, k_in, (qweight, scales, zeros))
    if not head:
        return _rows(x2, *weight, None, pdl=pdl).reshape(*x.shape[:-1], n_out)
    # (the decode rows follow the prefill's kernel, which does not call launch_dependents: no PDL)
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    _rows(x2[:head], *weight, y[:head])
    _rows(x2[head:], *weight, y[head:])
    return y.reshape(*x.shape[:-1], n_out)


def _operands(x, qweight, scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as [rows, K] with unit stride along K (a copy only if needed), the weight's tensors contiguous."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, qweight.contiguous(), scales.contiguous()


def split_rows(x2: torch.Tensor, n_out: int, k_in: int, weight: tuple = ()) -> int:
    """The rows that run as a prefill before the rest run as a decode (ROW_SPLIT's comment), or 0: one
    GEMM. Eager calls only (the parts write into one output, which the traced paths' fp32 sums do not):
    ``weight``'s tensors are checked with ``x2``."""
    m = x2.shape[0]
    rest = m % ROW_SPLIT_TILE
    if ROW_SPLIT == "off" or m <= ROW_SPLIT_TILE or not 0 < rest <= SKINNY_MAX_M:
        return 0
    if ROW_SPLIT == "auto" and not (
        m <= ROW_SPLIT_MAX_M
        and (n_out >= TRITON_PREFILL_MIN_N or k_in >= TRITON_PREFILL_MIN_K)
        and not interpreting()
        and (x2.is_cuda or launch.capturing())
        and wgmma(x2.device)
    ):
        return 0
    return m - rest if eager(x2, *weight) else 0


def _rows(
    x2, qweight, scales, zeros, zero_arg, group_size, bits, out, owned=False, pdl=False
) -> torch.Tensor:
    """x2 @ W.T, written into ``out`` where given (eager calls: split_rows), else into a new tensor.
    ``owned``: int4 words in quant_layout.to_owned_order's order, for rows the FMA kernel takes; ``pdl``: as
    _quant_matmul's."""
    m, n_out, k_in = x2.shape[0], qweight.shape[0], x2.shape[1]
    if m > SKINNY_MAX_M and not owned:
        if _gluon_prefill(x2, qweight, scales, zeros, group_size, bits):
            cfg = gluon_tiles(m, n_out, k_in, sm_count(x2.device), group_size)
            y = _gluon(x2, qweight, scales, zeros, group_size, cfg, out)
            if y is not None:
                return y
        # (whether a CUDA graph is capturing decides only narrow outputs: asked for those alone)
        graphed = n_out < TRITON_PREFILL_MIN_N_ANY and x2.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (
            PREFILL == "triton"
            or (PREFILL == "auto" and prefill_in_triton(m, n_out, k_in, group_size, graphed))
        ):
            slice_rows = _slice_rows(x2, qweight, scales, zeros)
            return dequantize_matmul(x2, qweight, scales, zeros, k_in, group_size, bits, slice_rows, out)
        return _prefill(x2, qweight, scales, zeros, zero_arg, group_size, bits, out)
    if not owned and _gluon_decode(x2, qweight, scales, zeros, group_size, bits):
        cfg = gluon_decode_tiles(m, sm_count(x2.device), n_out, k_in)
        y = _gluon(x2, qweight, scales, zeros, group_size, cfg, out, pdl)
        if y is not None:
            return y
    per16 = 16 // bits
    deep = GEMV_BLOCK_K % group_size == 0 or group_size % GEMV_BLOCK_K == 0  # whole groups a tile, or in one
    # The FMA kernel reads whole int32 words (groups of 8 values or more).
    rows = GEMV_MAX_M if deep and group_size <= GEMV_ROWS_MAX_GROUP else 1
    gemv = bits == 4 and group_size % 8 == 0 and m <= rows
    if owned and not gemv:
        raise ValueError(f"owned words reach the FMA kernel only ({m} rows, group {group_size})")
    if gemv:
        kernel, block_m, prescale = _gemv_int4_kernel, max(1, next_power_of_2(m)), False  # (0 rows: none run)
        block_k = GEMV_BLOCK_K if deep and not interpreting() else (256 if group_size % 256 == 0 else 128)
        cfg = tuning("gemv", m, n_out, k_in, block_k, x2.device, group_size < block_k, group_size=group_size)
        block_k = cfg.get("BLOCK_K", block_k)  # a probe's tiling (groups aligned to it, as above)
    else:
        kernel, block_m = _skinny_kernel, (16 if m <= 16 else (32 if m <= 32 else 64))
        block_k, prescale = _tile_k(group_size, k_in, bits)
        cfg = tuning("mma", m, n_out, k_in, block_k, x2.device, prescale, bits, zeros=zeros is not None)
    magic, bias, mantissa = _MAGIC[x2.dtype]
    if bits >= mantissa:  # int8 values do not fit bf16's 7-bit mantissa: converted instead (BIAS 0)
        magic, bias = 0, 0.0
    tiles = cdiv(k_in, block_k)
    tiles_per_split = cdiv(tiles, cfg["split"])
    split = cdiv(tiles, tiles_per_split)
    grid = (cdiv(n_out, cfg["BLOCK_N"]), cdiv(m, block_m), split)
    # Split-K partials meet in a self-cleaning workspace (one launch) unless torch may be tracing the
    # launch (the workspace is state outside the op's inputs): then in a zeroed fp32 y, cast afterwards.
    mode = 0 if split == 1 else (2 if eager(x2, qweight, scales, zeros) else 1)
    y = _output(m, n_out, x2, mode, out)
    ws, counts = _workspace(x2.device, m * n_out, grid[0] * grid[1]) if mode == 2 and m else no_workspace(y)
    if m:
        args = (
            x2, qweight, scales, zero_arg, y, ws, counts, m, n_out, k_in,
            x2.stride(0), qweight.stride(0), scales.stride(0), zero_arg.stride(0), y.stride(0),
            tiles_per_split, split,
        )  # fmt: skip
        meta = {"GROUP": group_size, "HAS_ZERO": zeros is not None, "BLOCK_M": block_m,
                "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": block_k, "MODE": mode,
                "EVEN_K": k_in % block_k == 0, "LAUNCH_DEPENDENTS": lets_dependents_start(x2),
                "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}  # fmt: skip
        if cfg.get("maxnreg"):  # a register cap: tests/gpu/maxnreg_probe.py sets one, no shipped tuning does
            # (H100: caps of 96 and 80 registers, 5 and 6 programs an SM, were 5-34% and 34-84% slower)
            meta["maxnreg"] = cfg["maxnreg"]
        if gemv:
            gpt = _groups_per_tile(group_size, block_k, 8)
            meta |= {"STAGES": cfg["num_stages"], "GPT": gpt, "OWNED": owned}
        else:
            # NATIVE: the interpreter's bf16 arithmetic is wrong on the bitcast values, as its bf16 tl.dot is.
            bf16_interpreted = interpreting() and x2.dtype == torch.bfloat16
            meta |= {"BITS": bits, "MAGIC": magic, "BIAS": bias, "PRESCALE": prescale,
                     "NATIVE": scales.dtype == x2.dtype and not bf16_interpreted,
                     "GPT": _groups_per_tile(group_size, block_k, per16),
                     "DOT_FP32": bf16_interpreted}  # fmt: skip
        traceable(kernel)[grid](*args, **meta)
    return y.to(x2.dtype)


def _output(m: int, n_out: int, x2: torch.Tensor, mode: int, out: torch.Tensor | None) -> torch.Tensor:
    """Where a kernel writes: ``out`` (or a new tensor) in the activations' dtype, or, where split parts meet
    in it (mode 1: traced calls, which split_rows never gives an ``out``), zeroed fp32 sums."""
    if mode == 1:
        assert out is None, "split parts meet in fp32 only where nothing writes into a given output"
        return torch.zeros((m, n_out), dtype=torch.float32, device=x2.device)
    return out if out is not None else torch.empty((m, n_out), dtype=x2.dtype, device=x2.device)


# Why the Gluon kernel does not run in this process, once it could not: Gluon's Hopper API did not import,
# or the kernel did not compile, with this Triton (Gluon is experimental: Triton 3.9 renamed two of the calls
# it makes in 3.6, vLLM 0.26's; quant_matmul_gluon takes either). The paths before it run in its place.
GLUON_OFF: str | None = None
# What a kernel that cannot be built raises, before anything runs: Triton's front end, ptxas, or resources
# (shared memory) the GPU does not have.
_BUILD_ERRORS = (CompilationError, *(getattr(triton_errors, n) for n in ("PTXASError", "OutOfResources")
                                     if hasattr(triton_errors, n)))  # fmt: skip


def _release_error(e: BaseException) -> BaseException | None:
    """The ptx_release.ReleaseError or ptx_cluster.ClusterError behind ``e`` (a compile error may wrap it),
    or None."""
    from squeezeserve.kernels.ops.ptx_cluster import ClusterError
    from squeezeserve.kernels.ops.ptx_release import ReleaseError

    while e is not None and not isinstance(e, (ReleaseError, ClusterError)):
        e = e.__cause__ or e.__context__
    return e


def _cluster_off(reason: str) -> None:
    """From now on the Gluon prefill GEMM's programs each load their own x tiles (GLUON_CLUSTER "off")."""
    global GLUON_CLUSTER
    GLUON_CLUSTER = "off"
    log.warning("quant_matmul: the Gluon GEMM's clusters sharing x are off (%s)", reason)


def _wg_release_off(reason: str) -> None:
    """From now on the 64-row decode and the 128-row prefill tiles free their stages as Gluon writes it
    (WG_RELEASE "off")."""
    global WG_RELEASE
    WG_RELEASE = "off"
    log.warning("quant_matmul: the per-warpgroup stage release is off (%s)", reason)


def _gluon_off(reason: str) -> None:
    global GLUON_OFF
    GLUON_OFF = reason
    log.warning("quant_matmul: the Gluon kernel is off (%s); the Triton kernels run in its place", reason)


def gluon_module():
    """``quant_matmul_gluon``, or None where this Triton cannot run it (GLUON_OFF says why)."""
    if GLUON_OFF is not None:
        return None
    try:
        return importlib.import_module("squeezeserve.kernels.ops.quant_matmul_gluon")
    except (ImportError, AttributeError) as e:  # (a name the module takes from Gluon, missing)
        _gluon_off(f"Triton {triton.__version__} has no Gluon for Hopper: {type(e).__name__}: {e}")
        return None


def _gluon_runs(x2, qweight, scales, zeros, group_size, bits, block_k) -> bool:
    """Whether the Gluon kernel may run this call: Hopper, nothing tracing (its launch is not one
    torch.compile can trace), a Triton that runs it, and inputs it takes at this K tile."""
    if interpreting() or not (x2.is_cuda or launch.capturing()) or not wgmma(x2.device):
        return False
    if not eager(x2, qweight, scales, zeros):
        return False
    module = gluon_module()
    return module is not None and module.supported(x2, qweight, scales, group_size, bits, block_k)


def _gluon_prefill(x2, qweight, scales, zeros, group_size, bits) -> bool:
    """Whether this prefill runs on the Gluon GEMM (PREFILL's comment)."""
    if PREFILL not in ("auto", "gluon") or not _gluon_runs(x2, qweight, scales, zeros, group_size, bits, 64):
        return False
    return PREFILL == "gluon" or gluon_in_auto(
        x2.shape[0], qweight.shape[0], x2.shape[1], group_size, zeros is not None
    )


def _gluon_decode(x2, qweight, scales, zeros, group_size, bits) -> bool:
    """Whether these rows run on the Gluon kernel's stream-K decode (DECODE's comment)."""
    if DECODE not in ("auto", "gluon") or not _gluon_runs(
        x2, qweight, scales, zeros, group_size, bits, GLUON_DECODE_BLOCK_K
    ):
        return False
    return DECODE == "gluon" or gluon_decode_in_auto(
        x2.shape[0], qweight.shape[0], x2.shape[1], group_size, zeros is not None
    )


def gluon_decode_group(group_size: int) -> bool:
    """Whether ``DECODE="auto"`` decodes int4 in groups of ``group_size`` on the Gluon kernel at all (DECODE's
    comment: g64 and smaller groups but g32 were not timed)."""
    return group_size >= GLUON_DECODE_MIN_GROUP or group_size == GLUON_DECODE_SMALL_GROUP


def gluon_decode_in_auto(m: int, n_out: int, k_in: int, group_size: int = 128, zeros: bool = False) -> bool:
    """Whether ``DECODE="auto"`` runs ``m`` rows of this weight (with zero points: ``zeros``) on the Gluon
    kernel (DECODE's comment)."""
    if m < 2 or not gluon_decode_group(group_size):
        return False
    small = group_size < GLUON_DECODE_MIN_GROUP
    size = n_out * k_in
    if small and zeros:
        if m >= GLUON_DECODE_WIDER_MIN_M:
            return size >= GLUON_DECODE_MIN_WEIGHT_WIDE
        return m >= GLUON_DECODE_WIDE_MIN_M and size >= GLUON_DECODE_MIN_WEIGHT
    if m >= GLUON_DECODE_WIDER_MIN_M:
        return size >= GLUON_DECODE_MIN_WEIGHT_WIDER
    if m >= GLUON_DECODE_WIDE_MIN_M:
        return size >= (GLUON_DECODE_MIN_WEIGHT_WIDE_SMALL_GROUP if small else GLUON_DECODE_MIN_WEIGHT_WIDE)
    return size >= GLUON_DECODE_MIN_WEIGHT


# SQUEEZESERVE_WG_RELEASE=off: the 64-row decode's warpgroups free their stages as Gluon writes it, after a
# barrier of both (for A/B runs of a server; gluon_decode_tiles). On (the default), each warpgroup frees its
# own (kernels/ops/ptx_release.py), there and in the prefill GEMM's 128-row tiles a tile a program up to 128
# rows, and 128 deep past it up to a wave (groups of 128 and more; gluon_tiles, GLUON_DEEP_K), and its 128-row
# tiles stream-K (GLUON_STREAM_K_RELEASE). H200, 128 rows,
# owned words, us, two runs against the same tiling with the barrier
# (results/prefill_tiling_probe_h200_2026-11-28_prefill_wg_release.log): 14336 x 4096 29.3-29.5 / 31.0-31.4,
# gate_up 59.6-60.4 / 63.2-63.3, 14336^2 99.5-101.2 / 101.9-103.5 (Machete 29.4, 57.6, 92.5 in
# ..._down_k_split_machete.log). 256-row tiles at 512 rows: level (qkv 45.5-46.2 / 45.1-45.6, 14336^2
# 321.7-327.1 / 321.2-327.2).
WG_RELEASE = os.environ.get("SQUEEZESERVE_WG_RELEASE", "on")
if WG_RELEASE not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_WG_RELEASE must be on or off, got {WG_RELEASE!r}")


# SQUEEZESERVE_GLUON_CLUSTER=off: the Gluon prefill GEMM's programs each load their own x tiles. On (the
# default), where the rule runs 256-row tiles a tile a program, the weight's 128-row tiles are even in number
# and K is at least GLUON_CLUSTER_MIN_K, two programs of a cluster share x's tiles, each loading half of each
# into both (TMA multicast; ptx_cluster's pass), bit for bit the products of the programs alone: less of the
# L2-to-SM traffic that held the GEMM below Machete where N >= 14336 (NOTES.md, twenty-fourth and
# thirty-fourth sessions). H100, owned words as served, g128, medians of three interleaved rounds
# (tests/gpu/cluster_probe.py, results/cluster_probe_h100_2026-11-28_machete.log), us alone / in clusters /
# Machete: 14336^2 at 2048 rows 1235.7 / 1175.4 / 1172.3, at 8192 5248.6 / 5099.7 / 4744.0; down_proj
# (4096 x 14336) 350.0 / 342.3 / 402.7 and 1511.1 / 1438.1 / 1592.3. Where K = 4096 it did not pay
# everywhere: gate_up (28672 x 4096) 740.3 / 730.1 at 2048 rows in those rounds but 721.8 / 769.0 in single
# samples through quant_matmul (results/prefill_tiling_probe_h100_2026-11-28_cluster_rule.log), qkv (6144 x
# 4096) 1-6% slower at 512-4096 rows, 14336 x 4096 within 0.3% at 2048, o_proj (4096^2) 1-5% faster, the 8B
# layer's four at 512-4096 rows within -3% / +2%: so deep reductions only. 128-row tiles gained nothing.
GLUON_CLUSTER_MIN_K = 8192
GLUON_CLUSTER = os.environ.get("SQUEEZESERVE_GLUON_CLUSTER", "on")
if GLUON_CLUSTER not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_CLUSTER must be on or off, got {GLUON_CLUSTER!r}")
# Where they are more than a wave, those tiles run persistent instead (SQUEEZESERVE_GLUON_PERSISTENT=off: a
# tile a program, in clusters where K >= GLUON_CLUSTER_MIN_K, else alone, as before, for A/B runs): one
# program an SM (an even count) in clusters of two sharing x's tiles, each program's loading warp filling its
# next tile's stages while its compute warps write the last tile, which goes out through shared memory by a
# TMA store they do not wait for (launch_args' tma_store; GLUON_PERSISTENT_STAGES stages beside the 64 KB
# tile: 213 KB). Where K = 4096 a program's start and end weigh more than where K is deep (a tile is 64 K
# tiles, not 224). H100, g128,
# owned words as served, medians of three interleaved rounds at 2048 rows (tests/gpu/cluster_probe.py), us a
# tile a program alone / in clusters / persistent in clusters / Machete
# (results/cluster_probe_h100_2026-11-28_persistent_machete.log): gate_up (28672 x 4096) 752.5 / 737.4 / 721.6
# / 688.6, 14336 x 4096 377.5 / 369.3 / 358.7 / 346.2, qkv (6144 x 4096) 162.0 / 159.1 / 157.4 / 149.7. Nsight
# Compute at 2048 x 28672 x 4096 (results/ncu_h100_2026-11-28_persistent/summary.txt): x's L2-to-SM traffic
# then Machete's (43.3% of the crossbar's cycles against 44.9%; alone 67.0%), the tensor pipe busy 83.9%
# against 87.7%, idle in the epilogue. Storing by TMA (one run, us persistent with the registers' stores, five
# stages / by TMA, four; results/cluster_probe_h100_2026-11-28_tma_store.log): gate_up 696.6 / 680.8, 14336 x
# 4096 349.8 / 343.3, qkv 152.6 / 146.9, o_proj 99.8 / 100.4 (a tile a program alone gains nothing by it: its
# compute warps have no next tile). Machete, in the run before (..._bf16_epilogue_machete.log): gate_up 689.6,
# 14336 x 4096 358.1, qkv 153.9. A wave or less stays a tile a program alone (o_proj at 768 / 1024 rows 2-5%
# slower persistent; results/prefill_tiling_probe_h100_2026-11-28_persistent_ab.log). Where K is deep
# persistent alone was level with a tile a program in clusters (14336^2 at 2048 rows 1217.3 against 1214.9 us,
# down_proj 350.8 against 350.3), stored by TMA ahead in two runs on two machines: H100 1198.4 against 1215.7
# and 340.6 against 343.0 (..._tma_store.log); H200, medians of three rounds, 14336^2 1211.7 against 1233.3
# (the rule then 1238.3), down_proj 344.7 against 353.6 (the rule 344.7;
# results/cluster_probe_h200_2026-11-28_deep_k.log).
GLUON_PERSISTENT = os.environ.get("SQUEEZESERVE_GLUON_PERSISTENT", "on")
if GLUON_PERSISTENT not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_PERSISTENT must be on or off, got {GLUON_PERSISTENT!r}")
GLUON_PERSISTENT_STAGES = 4
# SQUEEZESERVE_GLUON_TAIL=off: the outputs below share their last partial wave of 256-row tiles stream-K, as
# before (for A/B runs). On (the default), where an output at least GLUON_TAIL_MIN_N wide, K under
# GLUON_CLUSTER_MIN_K, ends its 256-row tiles in a partial wave that the rule would share stream-K
# (GLUON_DP_LAST_WAVE), the columns of that wave run as a second launch on 128-row tiles, a tile a program
# (GLUON_TAIL_TILES: twice the tiles at about 0.6 of the time each, and no parts to meet), after the rest
# persistent in clusters stored by TMA (as GLUON_PERSISTENT's); the two launches' sums are bit for bit the
# whole output's persistent launch's. H200, g128, owned words as served, medians of three interleaved rounds
# (tests/gpu/mixed_tiles_probe.py, results/mixed_tiles_probe_h200_2026-11-28.log), us the two launches / the
# rule then (whole waves, then stream-K) / the whole output persistent: gate_up (28672 x 4096) at 512 rows
# 183.8 / 198.1 / 194.8 (Machete 179.2 in an earlier run), at 448 rows 179.7 / 190.9 / 191.9; 14336 x 4096
# at 1280 rows 229.3 / 244.0 / 242.0 (last waves 39%, 39% and 24% full). Where the 256-row part is a wave or
# less it lost (qkv at 768 rows 79.1 against 72.7), as where K is deep and the last wave a sliver (14336^2 at
# 1536 rows, 9% full: 966.6 against 959.2; a 128-row tile takes about 0.6 of a wave's time, stream-K shares
# the sliver among all the SMs): neither takes it, nor a last wave under GLUON_TAIL_MIN_WAVE.
GLUON_TAIL = os.environ.get("SQUEEZESERVE_GLUON_TAIL", "on")
if GLUON_TAIL not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_TAIL must be on or off, got {GLUON_TAIL!r}")
GLUON_TAIL_MIN_N, GLUON_TAIL_MIN_WAVE = 14336, 0.2
GLUON_TAIL_TILES = {"block_m": 128, "stages": 6}
# SQUEEZESERVE_GLUON_HALF_TILES=off: up to 128 rows, outputs whose 128-row weight tiles fill under half the
# SMs share them stream-K (for A/B runs). On (the default), at GLUON_HALF_TILES_MIN_M to 128 rows, where K
# is under GLUON_CLUSTER_MIN_K and 64-row weight tiles fill at least half the SMs and at most a wave, each
# program takes a whole tile of 64 weight rows on one warpgroup: twice the tiles, no parts to meet in the
# workspace (x is read by twice the programs). H200, g128, 128 rows, us (tests/gpu/prefill_tiling_probe.py,
# results/prefill_tiling_probe_h200_2026-11-28_half_tiles.log): qkv (6144 x 4096, 96 tiles) 18.9 against
# stream-K's 27.6 and Machete's 23.2 (..._item2_machete.log). It lost where 64-row tiles are under half the
# SMs (down_proj, 64 tiles: 56.6 against stream-K's 39.3) and past a wave (14336 x 4096 36.0 against 30.7 on
# 112 tiles of 128). A tile a program's time grows with K, stream-K's cost past its share (about 16 us in
# both, by these figures) does not, so a deep K would need more than half the SMs' worth of tiles: short K
# only (measured at 4096). Fewer rows in the 128-row x tile cost it time (rows, us against stream-K, qkv: 65
# 29.9 / 25.8, 72 27.0 / 25.1, 80 22.4 / 24.3, 88 20.8 / 24.3, 112 19.4 / 26.3; 8192 x 4096: 65 34.3 / 30.4,
# 96 24.1 / 28.0; not profiled), so from 80 rows.
GLUON_HALF_TILES_MIN_M = 80
# Groups under 128 (four or eight scale rows a 256-deep tile) from 104 rows: qkv and 8192 x 4096, zero points
# and not, g32 and g64 (results/prefill_tiling_probe_h200_2026-11-28_half_tiles_groups.log), us against
# stream-K at 128 rows 19.8-29.2 / 28.9-34.2, at 104 20.3-29.2 / 26.1-30.5 (qkv g32 zero points level: 29.2 /
# 29.0); at 80-88 rows mixed (qkv g32 zero points 29.2 / 27.4 at 88, 8192 x 4096 g64 33.2 / 30.5 at 80).
GLUON_HALF_TILES_MIN_M_SMALL_GROUP = 104
# Where K is deep (GLUON_CLUSTER_MIN_K and more), at GLUON_HALF_TILES_DEEP_MIN_M to 128 rows, groups of 128
# and more: where twice the 64-row weight tiles fill half the SMs to a wave, each tile's K split in two (a
# program a part, the two meeting once in the workspace) in place of stream-K over one program an SM. H200,
# down_proj (4096 x 14336, 64 tiles: 128 programs), owned words, us against stream-K, runs on three leases,
# the last two the rule as landed against SQUEEZESERVE_GLUON_HALF_TILES=off
# (results/prefill_tiling_probe_h200_2026-11-28_down_k_split.log, ..._down_k_split_machete.log): 128 rows
# 36.9-38.5 / 39.2-40.8 (seven runs; Machete 36.4-36.6 beside the last two, ours 37.7-38.0 there), zero points
# 40.3 / 41.9 and 43.2 / 45.8; 112 rows 36.4-36.6 / 37.9-38.9 (Machete 36.4-36.5), zero points 39.9 /
# 41.0-41.3; 120 rows 37.0-37.4 / 38.3-38.6, zero points 41.8 / 43.1. Not at 96 rows (37.2-37.6 against
# 35.1-36.7) nor 80 (40.8-48.9 against 34.2-35.2), nor groups of 32 (46.7 against 45.7 at 128 rows). Eight
# stages 37.9-38.1 and four parts on two programs an SM (128 registers, spilling) 37.8: not taken.
GLUON_HALF_TILES_DEEP_MIN_M = 112
GLUON_HALF_TILES = os.environ.get("SQUEEZESERVE_GLUON_HALF_TILES", "on")
if GLUON_HALF_TILES not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_HALF_TILES must be on or off, got {GLUON_HALF_TILES!r}")


# SQUEEZESERVE_GLUON_DEEP_K=off: the prefill GEMM's tiles step through K 64 deep, as before (for A/B runs). On
# (the default), in groups of whole 128s, the tilings a tile a program up to a wave take 128-deep K tiles
# (half the ring's waits, stage releases and wgmma groups a product): 128-row tiles up to 128 rows
# (GLUON_DEEP_K_STAGES stages, the most that fit), the 64-row weight tiles of GLUON_HALF_TILES (4 stages;
# where K is deep, its two parts too), and past 128 rows 128-row tiles a tile a program where they are over
# half a wave and at most one (qkv at 129-256 rows, o_proj at 257-512, down_proj at 385-512) or at 513-640
# rows (GLUON_THIRD_TILE_*: qkv), each warpgroup freeing its own stages (WG_RELEASE). H200, g128, us against
# the 64-deep tiling the rule took before, single samples (tests/gpu/prefill_tiling_probe.py,
# results/prefill_tiling_probe_h200_2026-11-28_deep_k.log): 128 rows 14336^2 92.0 against 98.1, gate_up 52.2 /
# 61.0, 14336 x 4096 26.7 / 32.8, qkv 17.7 / 18.9, down_proj 35.0 / 37.3; 512 rows o_proj 29.1 / 31.8,
# down_proj 93.3 / 101.5; 96-112 rows 5-17% faster, 72 rows mixed (gate_up 63.0 / 66.0, 14336^2 101.9 / 100.5,
# 14336 x 4096 30.7 / 30.2); qkv at 560 / 640 rows 57.6 / 59.1 against 61.9 / 64.4 (..._deep_k_tail.log).
# Beside Machete, two interleaved rounds, us ours / Machete (..._deep_k_machete.log): 128 rows 14336^2 91.5,
# 89.1 / 95.1, 94.1, gate_up 54.6, 54.8 / 58.4, 58.5, 14336 x 4096 27.9, 27.5 / 29.5, 29.9, down_proj 35.1,
# 35.3 / 36.7, 36.7, qkv 17.9, 18.1 / 23.3, 23.3; 512 rows o_proj 29.8, 30.8 / 30.1, 30.3, down_proj 93.5,
# 94.1 / 100.0, 100.9. Not taken: 256-row tiles 128 deep (3 stages) gained little (14336^2 at 512 rows 314.8 /
# 319.4) and lost elsewhere (gate_up 191.5 / 177.3); stream-K 128 deep lost to a tile a program (14336^2 96.5,
# 14336 x 4096 34.3); GLUON_TAIL's second launch 128 deep was level (gate_up at 448 / 512 rows 170.3 / 181.2
# against 172.8 / 178.6, 14336 x 4096 at 896 / 1280 164.1 / 217.9 against 169.1 / 218.9).
GLUON_DEEP_K = os.environ.get("SQUEEZESERVE_GLUON_DEEP_K", "on")
if GLUON_DEEP_K not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_DEEP_K must be on or off, got {GLUON_DEEP_K!r}")
GLUON_DEEP_K_STAGES = 5
# With 128-deep K tiles, the 64-row weight tiles of K up to GLUON_DEEP_K_HALF_MAX_K (as measured) run a tile a
# program where they fill a quarter of the SMs to a wave, up to GLUON_DEEP_K_HALF_MAX_M rows (two rows of
# 128-row x tiles), and take o_proj (4096 x 4096) there onto the Gluon GEMM (gluon_in_auto; it ran the Triton
# prefill GEMM). H200, g128, us, the Gluon GEMM forced, single samples beside Machete
# (results/prefill_tiling_probe_h200_2026-11-28_deep_k_o.log): o_proj at 80 / 128 / 192 / 256 rows 18.2 / 17.8
# / 24.6 / 18.2 against stream-K's 21.3 / 25.4 / 32.1 / 28.6, the Triton GEMM's 20.6-21.4 at 128 and 29.0-32.4
# at 192-256 (..._deep_k_machete.log, ..._deep_k.log), Machete 22.1 / 21.9 / 22.2 / 22.4; 3072 x 4096 (48
# tiles) 17.9 / 17.8 / 20.5 / 18.1 against 18.9 / 23.3 / 27.3 / 27.3. 2048 x 4096 (32 tiles, under a quarter)
# lost at 80 rows (17.7 against 16.8).
GLUON_DEEP_K_HALF_MAX_M, GLUON_DEEP_K_HALF_MAX_K = 256, 4096


def _deep_whole(group_size: int) -> dict:
    """Past 128 rows, 128-row tiles a tile a program: 128 deep on GLUON_DEEP_K_STAGES stages, each warpgroup
    freeing its own (GLUON_DEEP_K); else nothing."""
    deep = _deep_k(group_size, GLUON_DEEP_K_STAGES)
    return deep | {"wg_release": WG_RELEASE == "on"} if deep else {}


def _deep_k(group_size: int, stages: int) -> dict:
    """128-deep K tiles on a ring of ``stages`` (GLUON_DEEP_K), for groups of whole 128s (a tile one group or
    part of one, as quant_matmul_gluon.supported takes them); else nothing."""
    if GLUON_DEEP_K == "on" and group_size >= 128 and group_size % 128 == 0:
        return {"block_k": 128, "stages": stages}
    return {}


# Up to 32 rows, where the 64-row weight tiles fill at least GLUON_DECODE_WHOLE_MIN_FILL of the stream-K
# decode's two programs an SM (and no more) and K is at most GLUON_DECODE_WHOLE_MAX_K, each program takes a
# whole tile, two an SM: stream-K split nearly every tile of the 14336-wide outputs (224 tiles in 264 slots)
# in two parts that meet in the workspace. H200, K 4096, owned words as served, 1 / 4 / 8 rows, us against
# stream-K (tests/gpu/prefill_tiling_probe.py, results/prefill_tiling_probe_h200_2026-11-28_decode_whole.log):
# 14336 x 4096 g128 zero points 16.2 / 16.5 / 16.5 against 17.5 / 17.9 / 17.9 (16 and 32 rows 16.5 / 17.0
# against 18.7 / 19.7; g32 at 2-32 rows 14.6-15.6 against 15.9-18.2). Where K is deep stream-K's balance
# wins (14336^2: 46.5 / 46.7 / 46.8 against 44.2 / 45.2 / 45.4). Four programs an SM on a 3-stage ring, a
# tile each, beat stream-K at 1-8 rows of gate_up (448 tiles in 528 slots: g128 25.3-25.5 against 27.0-27.4
# us, Triton 3.6) but are left out: with the 128 registers a thread that leaves, Triton 3.9's ptxas waits for
# every wgmma group after each (the products no longer overlap: test_cross_compile's pipelining check), and
# at 16-32 rows they lost (35.2 and 45.2 against 28.5 and 30.9).
# SQUEEZESERVE_GLUON_DECODE_WHOLE=off: stream-K at every decode row count, as before (for A/B runs).
GLUON_DECODE_WHOLE_MIN_FILL = 0.75
GLUON_DECODE_WHOLE_MAX_K = 4096
GLUON_DECODE_WHOLE = os.environ.get("SQUEEZESERVE_GLUON_DECODE_WHOLE", "on")
if GLUON_DECODE_WHOLE not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_DECODE_WHOLE must be on or off, got {GLUON_DECODE_WHOLE!r}")


def gluon_decode_tiles(m: int, sms: int, n_out: int = 0, k_in: int = 0) -> dict:
    """The stream-K decode's tiling (gluon_prefill_probe.py, H100; NOTES.md, "eleventh session"): the
    smallest wgmma N that holds the rows (8, 16, 32), 64 weight rows a program of one warpgroup, two
    programs an SM; 64 rows: 128 weight rows a program of two warpgroups, one an SM (14336^2: 77.8 us against
    118.1 on 32-row tiles twice), each warpgroup freeing its ring stages itself (``wg_release``: the two no
    longer meet at a barrier every K tile; H100, prefill_tiling_probe.py, NOTES.md, thirty-first session:
    14336^2 at 64 / 48 / 33 rows 71.1 / 68.3 / 64.0 us against 76.3 / 74.3 / 71.6, the 8B layer's four GEMMs
    99.4 / 95.0 / 101.1 against 104.3 / 100.0 / 104.3). Given the weight's ``n_out`` x ``k_in`` (0: not
    known, stream-K), up to 32 rows a tile a program where GLUON_DECODE_WHOLE_* say."""
    deep = {"block_k": GLUON_DECODE_BLOCK_K, "stages": 4}
    if m > 32:
        wide = {"block_m": 64, "block_n": 128, "num_warps": 8, "programs": sms}
        return wide | {"wg_release": WG_RELEASE == "on"} | deep
    cfg = {"block_m": max(8, next_power_of_2(m)), "block_n": 64, "num_warps": 4, "occupancy": 2} | deep
    if (
        GLUON_DECODE_WHOLE == "on"
        and 0 < k_in <= GLUON_DECODE_WHOLE_MAX_K
        and GLUON_DECODE_WHOLE_MIN_FILL <= cdiv(n_out, 64) / (2 * sms) <= 1
    ):  # a tile a program (GLUON_DECODE_WHOLE_*)
        return cfg | {"split": 1}
    return cfg | {"programs": 2 * sms}


def gluon_prefill_max_m(k_in: int, group_size: int, owned: bool = False, zeros: bool = False) -> int:
    """The most rows the Gluon GEMM takes in ``PREFILL="auto"`` (PREFILL's comment): further where
    dequantize + cuBLAS would slice the weight (GLUON_PREFILL_MAX_M_SLICED), less for small groups of packed
    words or with zero points (g32 with zero points on owned words, H100, thirty-second session,
    prefill_tiling_probe.py --words, results/owned_words_probe_h100_2026-11-27_g32_zeros.log: 4096 x 14336 at
    1536 / 2048 rows 437.3 / 465.3 us on the Gluon GEMM against dequantize + cuBLAS's 331.6 / 387.0)."""
    if group_size < 64:
        return GLUON_PREFILL_MAX_M if owned and not zeros else GLUON_PREFILL_MAX_M_SMALL_GROUP
    return GLUON_PREFILL_MAX_M_SLICED if k_in < DEQUANT_SLICE_MAX_K else GLUON_PREFILL_MAX_M


def gluon_in_auto(m: int, n_out: int, k_in: int, group_size: int, zeros: bool = False) -> bool:
    """Whether ``PREFILL="auto"`` runs ``m`` rows of this weight on the Gluon GEMM (PREFILL's comment)."""
    if n_out >= TRITON_PREFILL_MIN_N:
        return m <= gluon_prefill_max_m(k_in, group_size)
    if n_out < TRITON_PREFILL_MIN_N_ANY:
        return False
    if n_out > TRITON_PREFILL_MIN_N_ANY and m <= TRITON_PREFILL_MAX_M:
        return True
    if group_size < 64:
        return False
    if (
        _deep_k(group_size, 4)
        and GLUON_HALF_TILES == "on"
        and k_in <= GLUON_DEEP_K_HALF_MAX_K
        and GLUON_HALF_TILES_MIN_M <= m <= GLUON_DEEP_K_HALF_MAX_M
    ):  # (o_proj's 64-row weight tiles, 128 deep, a program each: GLUON_DEEP_K)
        return True
    return (
        256 < m <= gluon_prefill_max_m(k_in, group_size)
        or (m <= 128 and k_in >= TRITON_PREFILL_MIN_K)
        or (zeros and 128 < m <= TRITON_PREFILL_MAX_M)
    )


# gluon_tiles: up to these rows a prefill that 256-row tiles would pad by half takes 128-row tiles, stream-K,
# where its weight (int4 bytes) streams from DRAM: past the H100's L2 (50 MB) or already split among programs.
GLUON_NARROW_MAX_M = 384
GLUON_L2_BYTES = 50 * 2**20
# SQUEEZESERVE_GLUON_STREAM_K_RELEASE=off: the Gluon prefill GEMM's stream-K on 128-row tiles frees its stages
# after a barrier of both warpgroups, 64 deep, and takes the narrow rule's rows as before (for A/B runs of a
# server). On (the default, with WG_RELEASE), each warpgroup frees its own stages, 128 deep on
# GLUON_STREAM_K_DEEP_STAGES stages in groups of whole 128s (GLUON_DEEP_K), and the narrow rule's 128-row
# tiles stream-K take more rows: from GLUON_NARROW_MIN_M rows where 256-row tiles would already be stream-K
# (down_proj), from GLUON_NARROW_L2_MIN_M where the weight stays in the L2 (qkv, 14336 x 4096). H200, owned
# words as served (packed for qkv), g128, us, two interleaved rounds against the rule before
# (tests/gpu/prefill_tiling_probe.py,
# results/prefill_tiling_probe_h200_2026-11-29_stream_k_release_rounds.log): down_proj at 72 / 96 / 104 rows
# 33.3-33.6 / 34.2-34.6 / 33.9-34.1 against 34.2-34.4 / 36.5-36.9 / 37.1-37.6; 320 rows down_proj 76.8-77.0
# against 88.5, gate_up 156.9-161.4 against 169.8-175.4, 14336^2 265.2-269.3 against 294.5-302.5; 384 rows
# 80.3-80.6 / 157.1-164.4 / 275.5-283.0 against 89.8-90.0 / 179.4-183.5 / 304.8-313.5; down_proj at 176 / 192
# / 256 rows (256-row tiles before) 59.6 / 56.6-57.0 / 57.0-57.7 against 63.4-63.7 / 60.7-61.0 / 67.6-68.4
# (level at 144-160 rows; at 136 60.9-61.6 against 58.5-59.9); qkv at 280 / 320 / 384 rows 40.1 / 40.1-40.3 /
# 41.8-42.0 against 46.2-46.9 / 44.0-44.2 / 45.9-47.2, 14336 x 4096 at 320 / 384 rows 83.2-83.7 / 81.0-82.0
# against 94.5-95.7 / 91.2-95.1 (at 264 / 272 rows 104.6-105.1 / 101.4-102.7 against 85.2-85.4 / 96.7-98.2:
# GLUON_NARROW_L2_MIN_M). Zero points: down_proj at 96 / 320 rows 35.8 / 83.5-84.8 against 39.6-39.8 /
# 99.3-101.2; g32, 64 deep: down_proj 37.0 / 92.3-93.7 against 41.5-41.7 / 102.6-105.0, gate_up at 320 rows
# 183.3-187.3 against 201.5-212.5. Where the rule keeps 256-row tiles the 128-row stream-K lost: 129-256 rows
# of gate_up, 14336^2, 14336 x 4096 and qkv (gate_up at 192 rows 119.1 against 92.6-95.1), 448-512 rows
# (14336^2 at 512 357.3-372.7 against 316.5-327.3), and o_proj at 272-384 rows its 128-row tiles a tile a
# program (33.7-39.3 against 28.4-30.4).
GLUON_STREAM_K_RELEASE = os.environ.get("SQUEEZESERVE_GLUON_STREAM_K_RELEASE", "on")
if GLUON_STREAM_K_RELEASE not in ("on", "off"):
    raise ValueError(f"SQUEEZESERVE_GLUON_STREAM_K_RELEASE must be on or off, got {GLUON_STREAM_K_RELEASE!r}")
GLUON_STREAM_K_DEEP_STAGES = 4  # (40 KB a stage beside the stream-K epilogue's: 197 KB of shared memory)
GLUON_NARROW_MIN_M, GLUON_NARROW_L2_MIN_M = 144, 280
# gluon_tiles: 256-row tiles of outputs at least GLUON_DP_MIN_N wide whose last wave fills at most
# GLUON_DP_LAST_WAVE of the SMs run their full waves but one a tile a program, then share the rest stream-K
# (the last wave's idle SMs against parts of tiles meeting in the workspace), where x stays in the L2
# (measured slower past it; likely: programs sharing stream-K read x at different K offsets, so past the L2
# each re-reads it from DRAM, not profiled). H100, two runs against the tiles a program a wave, g128
# (tests/gpu/prefill_tiling_probe.py, NOTES.md, "twenty-third session"): qkv 768 / 1536 rows 73.0-73.7 /
# 129.7-130.4 us against 90.3-94.8 / 142.4-146.4;
# 14336 x 4096 1536 rows 277.5-277.6 against 297.2-302.2; 14336^2 1536 rows 919.8-931.9 against 1024.9-1038.8;
# gate_up 512 / 768 rows 193.4-195.4 / 278.9-282.5 against 199.3-201.0 / 300.7-304.6. Parts of 256 x 128
# tiles cost 15-42 us a program to meet (tests/gpu/stream_k_meeting_probe.py: the same launches with stores
# that never happen; plain stores into a slot a program were no faster than the atomics), so a last wave
# over 40% full stays (qkv at 1024 rows, 0.45: +2%, +4%, -4% in three runs; 14336 x 4096 at 768 rows, 0.55:
# 159.8 against 148.2 in one; o_proj at 1536 rows, 0.45: 94-98 against 94-95), as does x past the L2
# (14336^2 at 4096 rows: 2750 against 2534).
# Narrower outputs (4096 wide: o_proj, down_proj) run all their full waves a tile a program, then share the
# rest: a second wave of 1025-1200 rows 21% full (prefill_tiling_probe.py --ms 1025,1100,1200, H100, two
# runs; NOTES.md, twenty-ninth session), us against the tiles a program a wave: down_proj 232.5-235.1 /
# 230.8-237.3 / 237.2-247.3 against 292.5-293.6 / 294.7-313.8 / 294.3-300.3, o_proj 86.8-86.9 / 83.9-86.5 /
# 85.7-87.0 against 88.6-89.5 / 90.5-90.8 / 90.0-91.6 (sharing that wave's tiles as well: down 248.2-267.9).
# GLUON_DP_WHOLE_MIN_N: the narrowest output that takes it (SQUEEZESERVE_GLUON_DP_WHOLE_MIN_N=6144: as
# before, for A/B runs of a server).
GLUON_DP_LAST_WAVE, GLUON_DP_MIN_N = 0.4, 6144
GLUON_DP_WHOLE_MIN_N = _rows_setting("SQUEEZESERVE_GLUON_DP_WHOLE_MIN_N", 0)
# gluon_tiles: at GLUON_THIRD_TILE_MIN_M..GLUON_THIRD_TILE_MAX_M rows a third 256-row tile is at most half
# full; where the 256-row tiles are more than one wave, 128-row tiles pad less: a tile a program where the
# weight stays in the L2 and the last wave is well filled, else whole waves then the rest stream-K (as the
# 6144-wide 256-row tiles). H100, us, 513 / 560 / 600 rows (NOTES.md, twenty-ninth session), against the
# rule before: qkv 63.3 / 63.2 / 64.7 against 99.3 / 86.9 / 84.6 (Machete 59.4 at 600, the session before),
# gate_up 269.0 / 265.4 / 273.7 against 378.7 / 341.6 / 291.8 (Machete 240.2); at 650-700 rows (a third
# tile over half full) 256 rows stayed ahead (qkv 73.3-74.4 against 78.0-94.4). 4096-wide outputs keep 256
# rows there: one partial wave (o_proj at 600 rows 44.9 against 48.2 on 128-row tiles stream-K).
# (SQUEEZESERVE_GLUON_THIRD_TILE_MAX_M=0: none, as before, for A/B runs of a server.)
GLUON_THIRD_TILE_MIN_M = 513
GLUON_THIRD_TILE_MAX_M = _rows_setting("SQUEEZESERVE_GLUON_THIRD_TILE_MAX_M", 640)


def gluon_tiles(m: int, n_out: int, k_in: int, sms: int, group_size: int = 128) -> dict:
    """The Gluon prefill GEMM's tiling (gluon_prefill_probe.py, H100; NOTES.md, "tenth session" and "eleventh
    session"). 128 rows a tile (one wgmma of 128) and 6 stages up to 128 rows; past that 256 rows and 4 stages
    (the most that fit), unless that leaves over half the SMs idle where K is short (512 rows of 4096^2: 0.73x
    bf16 on 128-row tiles, 0.58x on 256). One program a tile while the tiles fill at least half the SMs (their
    parts' meeting in the workspace cost more than the idle SMs: 512 rows of 14336^2 stream-K 371 us against
    335 a tile a program); fewer share all (tile, K unit) pairs among one program an SM (stream-K: 128 rows of
    4096 x 14336 40.9 us against the Triton GEMM's 44.5), but at 80-128 rows tiles of 64 weight rows a program
    where K is short and those fill half the SMs to a wave (GLUON_HALF_TILES), where K is deep at 112-128 rows
    those tiles' K in two parts where twice the tiles fill half the SMs to a wave. At 257-384 rows, where a
    256-row tile would be at most half full, 128-row tiles stream-K where the weight streams from DRAM
    (GLUON_NARROW_MAX_M; NOTES.md, "twenty-first session"); at 513-640 rows past one wave, 128-row tiles too
    (GLUON_THIRD_TILE_MAX_M). Outputs whose last wave of 256-row tiles is mostly idle run their full waves
    (but one, where 6144 wide or more) a tile a program, the rest stream-K (GLUON_DP_LAST_WAVE), or that
    wave's columns in a second launch on 128-row tiles (GLUON_TAIL: ``narrow_tail``). 256-row tiles a tile a
    program run in clusters of two sharing x's tiles where the weight's 128-row tiles pair up (GLUON_CLUSTER):
    persistent, a program an SM, where they are more than a wave (GLUON_PERSISTENT), else a tile a program
    where K >= GLUON_CLUSTER_MIN_K. In groups of whole 128s, the tilings a tile a program up to a wave step
    through K 128 deep (GLUON_DEEP_K), and where K is short the 64-row weight tiles take more
    (GLUON_DEEP_K_HALF_*). Stream-K on 128-row tiles frees its stages by warpgroup, 128 deep in such groups,
    and the narrow rule's 128-row tiles take 144-384 rows where 256-row tiles would be stream-K and 280-384
    where the weight stays in the L2 (GLUON_STREAM_K_RELEASE)."""
    block_m = 128
    if m > 128 and (cdiv(n_out, 128) * cdiv(m, 256) >= sms // 2 or cdiv(k_in, 64) >= 128):
        block_m = 256
    stream_k = cdiv(n_out, 128) * cdiv(m, block_m) < sms // 2
    released = GLUON_STREAM_K_RELEASE == WG_RELEASE == "on"
    if (
        block_m == 256
        and m <= GLUON_NARROW_MAX_M
        and (
            (m > 256 and (stream_k or n_out * k_in // 2 > GLUON_L2_BYTES))
            or (released and (m >= GLUON_NARROW_MIN_M if stream_k else m >= GLUON_NARROW_L2_MIN_M))
        )
    ):
        # 257-384 rows: the second 256-row tile is at most half full. 128-row tiles shared stream-K take
        # the padding from 50% to 25% or none; where the weight streams from DRAM (past the L2, or split
        # among the programs already) that wins (tests/gpu/prefill_tiling_probe.py, H100: gate_up 320 / 384
        # rows 171.9 / 175.8 us against 242.7 / 207.8, down_proj 88.1 / 91.6 against 107.3 / 103.8). Where
        # the tiles of one weight in the L2 meet it twice, 256 rows stayed (320 rows of 14336 x 4096: 76.0
        # against 96.6; 448 rows lose everywhere: NOTES.md, twenty-first session) until each warpgroup freed
        # its own stages, 128 deep: then from GLUON_NARROW_L2_MIN_M rows there, and from GLUON_NARROW_MIN_M
        # where the 256-row tiles would be stream-K (GLUON_STREAM_K_RELEASE).
        return _stream_k_128(sms, group_size, released)
    if (
        block_m == 256
        and GLUON_THIRD_TILE_MIN_M <= m <= GLUON_THIRD_TILE_MAX_M
        and cdiv(n_out, 128) * cdiv(m, 256) > sms
    ):  # a third 256-row tile at most half full, past one wave: 128-row tiles (GLUON_THIRD_TILE_*)
        tiles = cdiv(n_out, 128) * cdiv(m, 128)
        cfg = {"block_m": 128, "stages": 6}
        if 0 < tiles % sms <= GLUON_DP_LAST_WAVE * sms or n_out * k_in // 2 > GLUON_L2_BYTES:
            return cfg | {"programs": sms, "dp_waves": -1}
        return cfg | _deep_whole(group_size)  # (a tile a program: 128 deep, GLUON_DEEP_K)
    cfg = {"block_m": block_m, "stages": 6 if block_m == 128 else 4}
    half = {"block_n": 64, "num_warps": 4}  # 64-row weight tiles on one warpgroup (GLUON_HALF_TILES)
    tiles64 = cdiv(n_out, 64) * cdiv(m, block_m)
    deep_half = _deep_k(group_size, 4)  # (128 deep, the 64-row tiles; where K is short, more take them)
    wider = bool(deep_half) and k_in <= GLUON_DEEP_K_HALF_MAX_K  # (GLUON_DEEP_K_HALF_*)
    if stream_k and GLUON_HALF_TILES == "on" and m <= (GLUON_DEEP_K_HALF_MAX_M if wider else 128):
        if (
            k_in < GLUON_CLUSTER_MIN_K
            and m >= (GLUON_HALF_TILES_MIN_M if group_size >= 128 else GLUON_HALF_TILES_MIN_M_SMALL_GROUP)
            and (sms // 4 if wider else sms // 2) <= tiles64 <= sms
        ):  # short K: one a program
            return cfg | half | deep_half
        if (
            k_in >= GLUON_CLUSTER_MIN_K
            and group_size >= 128
            and GLUON_HALF_TILES_DEEP_MIN_M <= m <= 128
            and sms // 2 <= 2 * tiles64 <= sms
        ):  # deep K: each tile's K in two parts, one a program
            return cfg | half | {"split": 2} | deep_half
    deep = _deep_k(group_size, GLUON_DEEP_K_STAGES)
    tiles128 = cdiv(n_out, 128) * cdiv(m, 128)
    if deep and m > 128 and sms // 2 < tiles128 <= sms:  # a wave of 128-row tiles, 128 deep (GLUON_DEEP_K)
        return {"block_m": 128} | _deep_whole(group_size)
    if stream_k:
        return _stream_k_128(sms, group_size, released) if block_m == 128 else cfg | {"programs": sms}
    if m <= 128 and group_size >= 128:
        # 128-row tiles a tile a program: each warpgroup frees its own stages (WG_RELEASE), 128 deep
        return cfg | {"wg_release": WG_RELEASE == "on"} | deep
    tiles = cdiv(n_out, 128) * cdiv(m, block_m)
    last = tiles % sms  # tiles in the last, partial wave
    if (
        block_m == 256
        and n_out >= GLUON_DP_WHOLE_MIN_N
        and 0 < last <= GLUON_DP_LAST_WAVE * sms
        and m * k_in * 2 <= GLUON_L2_BYTES
    ):  # the last wave mostly idle: whole tiles a wave (but one, where GLUON_DP_MIN_N wide), then the rest
        # shared stream-K (GLUON_DP_*), or that wave's columns on 128-row tiles (GLUON_TAIL)
        tail = narrow_tail(m, n_out, k_in, sms)
        if tail:
            return _persistent_pairs(sms) | {"narrow_tail": tail}
        return cfg | {"programs": sms, "dp_waves": -1 if n_out >= GLUON_DP_MIN_N else tiles // sms}
    if block_m == 256 and cdiv(n_out, 128) % 2 == 0 and GLUON_CLUSTER == "on":
        if GLUON_PERSISTENT == "on" and tiles > sms:  # (GLUON_PERSISTENT's comment)
            return _persistent_pairs(sms)
        if k_in >= GLUON_CLUSTER_MIN_K:
            return cfg | {"cluster": 2}  # (GLUON_CLUSTER's comment)
    return cfg


def _stream_k_128(sms: int, group_size: int, released: bool) -> dict:
    """128-row tiles stream-K over one program an SM: where ``released`` (GLUON_STREAM_K_RELEASE and
    WG_RELEASE on), each warpgroup freeing its own stages, 128 deep in groups of whole 128s; else as before (6
    stages, 64 deep)."""
    cfg = {"block_m": 128, "stages": 6, "programs": sms}
    if released:
        cfg |= {"wg_release": True} | _deep_k(group_size, GLUON_STREAM_K_DEEP_STAGES)
    return cfg


def _persistent_pairs(sms: int) -> dict:
    """256-row tiles persistent in clusters of two, one program an SM (an even count), stored by TMA."""
    return {"block_m": 256, "stages": GLUON_PERSISTENT_STAGES, "programs": sms - sms % 2, "persistent": True,
            "cluster": 2, "tma_store": True}  # fmt: skip


def narrow_tail(m: int, n_out: int, k_in: int, sms: int) -> int:
    """How many of the weight's 128-row tiles (the last) run on 128-row tiles of x, a tile a program, in a
    launch after the rest's 256-row tiles persistent in clusters (GLUON_TAIL): enough for the columns of the
    256-row tiles' last partial wave, leaving an even count of the rest for the clusters; 0 where GLUON_TAIL
    does not apply (or the 256-row part would be a wave or less, or the 128-row part more than one)."""
    on = GLUON_TAIL == GLUON_CLUSTER == GLUON_PERSISTENT == "on"
    if not on or n_out < GLUON_TAIL_MIN_N or n_out % 256 or k_in >= GLUON_CLUSTER_MIN_K:
        return 0
    rows, cols = cdiv(m, 256), n_out // 128
    if rows * cols % sms < GLUON_TAIL_MIN_WAVE * sms:  # (a sliver: stream-K shares it among all the SMs)
        return 0
    tail = cdiv(rows * cols % sms, rows)
    tail += (cols - tail) % 2  # (the clusters pair the rest's weight tiles)
    if (cols - tail) * rows <= sms or tail * cdiv(m, 128) > sms:
        return 0
    return tail


def dependent(pdl: bool, x: torch.Tensor) -> bool:
    """``pdl`` as a serving call takes it (the opaque ops, vLLM's quant_linear): while a CUDA graph captures
    the call on Hopper (launch.graph_dependent)."""
    return pdl and launch.graph_dependent(x)


def _gluon(x2, qweight, scales, zeros, group_size, cfg: dict, out=None, pdl=False) -> torch.Tensor | None:
    """Launch the Gluon kernel at tiling ``cfg`` (into ``out`` where given); parts of tiles meet in the
    workspace (the caller checked eager()). ``pdl``: as _quant_matmul's; up to PDL_MAX_M rows this one then
    launches as the programmatic dependent of the kernel before. None where the kernel does not compile with
    this Triton: it is then off (GLUON_OFF)."""
    m, n_out = x2.shape[0], qweight.shape[0]
    cfg = cfg | {"pdl": pdl and m <= PDL_MAX_M}
    tail = cfg.pop("narrow_tail", 0)
    y = _output(m, n_out, x2, 2, out)
    tiles = cdiv(m, cfg["block_m"]) * cdiv(n_out, cfg.get("block_n", 128))
    ws, counts = _workspace(x2.device, m * n_out, tiles)
    zeros = zeros.contiguous() if zeros is not None else None  # (qweight and scales are, from the caller)
    parts = [(0, n_out, cfg)]
    if tail:  # (GLUON_TAIL: the weight's last ``tail`` 128-row tiles in a second launch, into their columns)
        cut = n_out - 128 * tail
        parts = [(0, cut, cfg), (cut, n_out, GLUON_TAIL_TILES | {"owned": cfg.get("owned", False)})]
    try:
        for start, stop, part in parts:
            _gluon_launch(x2, qweight, scales, zeros, group_size, y, ws, counts, start, stop, part)
    except Exception as e:  # (a build error: nothing ran, or a first part whose columns a retry writes again)
        release = _release_error(e)
        if release is not None and cfg.get("wg_release"):  # (the pass could not apply: Gluon's own release)
            _wg_release_off(str(release))
            return _gluon(x2, qweight, scales, zeros, group_size, cfg | {"wg_release": False}, out, pdl)
        if release is not None and cfg.get("cluster", 1) > 1:  # (ptx_cluster's could not: programs alone)
            _cluster_off(str(release))
            return _gluon(x2, qweight, scales, zeros, group_size, cfg | {"cluster": 1}, out, pdl)
        if not isinstance(e, _BUILD_ERRORS):
            raise
        cause = e
        while cause.__cause__ is not None:  # (a front-end error wraps what the kernel's source hit)
            cause = cause.__cause__
        last = (str(cause).strip().splitlines() or [""])[-1][:300]
        _gluon_off(f"its kernel does not build with Triton {triton.__version__}: {type(cause).__name__}: "
                   f"{last}")  # fmt: skip
        return None
    return y


def _gluon_launch(x2, qweight, scales, zeros, group_size, y, ws, counts, start, stop, cfg) -> None:
    """The Gluon kernel at ``cfg`` on the weight's rows [start, stop) into those columns of ``y`` (all rows:
    the tensors themselves); zero points by row where the words are thread-owned, else 8 rows a word."""
    from squeezeserve.kernels.ops import quant_matmul_gluon

    if (start, stop) != (0, qweight.shape[0]):
        owned = cfg.get("owned", False)
        rows = slice(start, stop)
        y, qweight, scales = y[:, rows], qweight[rows], scales[rows]
        zeros = zeros if zeros is None else zeros[rows] if owned else zeros[start // 8 : stop // 8]
    if cfg.get("tma_store") and not quant_matmul_gluon.tma_storable(x2, y):  # (an ``out`` TMA cannot write)
        cfg = cfg | {"tma_store": False}
    quant_matmul_gluon.launch(x2, qweight, scales, zeros, group_size, y, ws, counts, mode=2, **cfg)


def prefill_in_triton(m: int, n_out: int, k_in: int, group_size: int, graphed: bool = False) -> bool:
    """Whether ``PREFILL="auto"`` runs ``m`` rows of this weight on the Triton GEMM (else dequantize +
    cuBLAS), ``graphed``: inside a CUDA graph's capture; the rule and its measurements are PREFILL's
    comment."""
    if n_out < TRITON_PREFILL_MIN_N_ANY:
        return not graphed and m <= TRITON_PREFILL_NARROW_MAX_M
    if n_out >= TRITON_PREFILL_MIN_N:
        wide_or_deep = group_size >= 64
    else:  # narrow: K splits fill the SMs (fill_split), which pays where K is long
        wide_or_deep = k_in >= TRITON_PREFILL_MIN_K
    return m <= TRITON_PREFILL_MAX_M or (m <= TRITON_PREFILL_WIDE_MAX_M and wide_or_deep)


def fill_split(tiles: int, sms: int, most: int = 4) -> int:
    """K splits that bring ``tiles`` programs of one an SM up to about one wave: ``sms // tiles``, at most
    ``most`` (each split adds a pass of fp32 partial sums). Nsight Compute on the H100 showed the prefill
    GEMM's tile grids leaving SMs idle where N = 4096 (0.48 waves at 512 x 4096 x 14336); there the
    one-program-an-SM tilings have 32 (128 rows) or 64 (512 rows) tiles for 132 SMs. Filled, 128 rows of
    N 4096, K 14336 went from 63.5 to 44.9 us (4 splits) and 256 rows from 114 to 72.8 us."""
    return max(1, min(most, sms // max(tiles, 1)))


def prefill_tuning(m: int, n_out: int, k_in: int, group_size: int, bits: int, device: torch.device) -> dict:
    """Tiles, warps, stages and split-K of :func:`_prefill_kernel`: the best settings of
    ``bench_quant_matmul.py --prefill-sweep`` (and ``--split-grid``) on the H100 (2026-11-24 and 25, int4 g128
    and g32; figures in tests/benchmarks/NOTES.md). BLOCK_M counts activation rows, BLOCK_N weight rows (the
    MMA's M). Both leading tilings hold one program an SM; K splits fill the SMs where the tiles do not
    (:func:`fill_split`)."""
    if interpreting():
        # Small tiles, and split-K so that the tests cover both ways partial tiles meet.
        block_k = 32 if group_size % 32 == 0 or 32 % group_size == 0 else 64
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": block_k, "split": 2, "num_warps": 4,
                "num_stages": 1, "SWIZZLE": 2}  # fmt: skip
    return prefill_tiles(m, n_out, k_in, sm_count(device))


def prefill_tiles(m: int, n_out: int, k_in: int, sms: int) -> dict:
    """:func:`prefill_tuning`'s choice on a GPU with ``sms`` multiprocessors."""
    tiles_n = cdiv(n_out, 128)
    if m <= 128 or (m <= 256 and n_out < TRITON_PREFILL_MIN_N and k_in < TRITON_PREFILL_MIN_K):
        # 128 x 128 tiles of rows: one (g128 1.04-1.19x bf16 where N = 14336 or K = 14336), or two where N and
        # K are short: 256 rows of 8B's qkv_proj (N 6144, K 4096) 40.7 us against 47.6 on 256 x 128 tiles,
        # of o_proj (4096^2) 30.8 against 34.0 (results/prefill_split_sweep_8b_h100_2026-11-25.log)
        split = fill_split(tiles_n * cdiv(m, 128), sms)
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "split": split, "num_warps": 8,
                "num_stages": 3, "SWIZZLE": 8}  # fmt: skip
    if m <= 256 or n_out >= TRITON_PREFILL_MIN_N or k_in >= TRITON_PREFILL_MIN_K:
        # two warpgroups, each 64 weight rows x 256 activation rows
        split = fill_split(tiles_n * cdiv(m, 256), sms)
        return {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "split": split, "num_warps": 8,
                "num_stages": 4, "SWIZZLE": 8}  # fmt: skip
    # Narrow and shallow (forced PREFILL="triton" only): two programs an SM, no split (a split's partial sums
    # cost more than the idle SMs: 512 x 4096 x 4096 39.8 us against 50.1 at 256 x 128 with two splits).
    return {"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "split": 1, "num_warps": 4, "num_stages": 3,
            "SWIZZLE": 8}  # fmt: skip


def _prefill(x2, qweight, scales, zeros, zero_arg, group_size, bits, out=None) -> torch.Tensor:
    """Launch :func:`_prefill_kernel` over [M, N] tiles, split along K as the tuning says (into ``out`` where
    given)."""
    m, k_in = x2.shape
    n_out = qweight.shape[0]
    cfg = prefill_tuning(m, n_out, k_in, group_size, bits, x2.device)
    block_k = cfg["BLOCK_K"]
    tiles = cdiv(k_in, block_k)
    tiles_per_split = cdiv(tiles, cfg["split"])
    split = cdiv(tiles, tiles_per_split)
    grid = (cdiv(n_out, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"]), 1, split)
    mode = 0 if split == 1 else (2 if eager(x2, qweight, scales, zeros) else 1)
    y = _output(m, n_out, x2, mode, out)
    ws, counts = _workspace(x2.device, m * n_out, grid[0]) if mode == 2 else no_workspace(y)
    magic, bias, mantissa = _MAGIC[x2.dtype]
    if bits >= mantissa:  # int8 values do not fit bf16's 7-bit mantissa: converted instead (BIAS 0)
        magic, bias = 0, 0.0
    bf16_interpreted = interpreting() and x2.dtype == torch.bfloat16  # (see _quant_matmul)
    traceable(_prefill_kernel)[grid](
        x2, qweight, scales, zero_arg, y, ws, counts, m, n_out, k_in,
        x2.stride(0), qweight.stride(0), scales.stride(0), zero_arg.stride(0), y.stride(0),
        tiles_per_split, split,
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, MAGIC=magic, BIAS=bias,
        NATIVE=scales.dtype == x2.dtype and not bf16_interpreted, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, MODE=mode, EVEN_K=k_in % block_k == 0,
        GPT=_groups_per_tile(group_size, block_k, 32 // bits), SWIZZLE=cfg["SWIZZLE"],
        DOT_FP32=bf16_interpreted, ASYNC_MMA=not interpreting() and wgmma(x2.device),
        TRACED=traced(x2, qweight, scales, zeros), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y.to(x2.dtype)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    k_in: int,
    group_size: int,
    bits: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    owned: bool = False,
) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype``, expanded by :func:`_dequantize_kernel` (bit-exact), into
    ``out`` (contiguous [N, K]) where given. ``owned``: the owned weights (int4 words in
    quant_layout.to_owned_order's order, zero points as to_owned_zeros; K and the groups multiples of 32)."""
    if owned and (bits != 4 or k_in % 32 or group_size % 32):
        raise ValueError(f"owned words are int4 in groups of 32s over K of 32s: {bits}, {group_size}, {k_in}")
    n_out = qweight.shape[0]
    weight = torch.empty((n_out, k_in), dtype=dtype, device=qweight.device) if out is None else out
    zero_arg = zeros if zeros is not None else qweight
    block_n, block_k = DEQUANT_TILE
    if k_in < block_k or not _groups_per_tile(group_size, block_k, 32 // bits):  # (groups straddling it)
        block_n, block_k = DEQUANT_TILE_NARROW
    grid = (cdiv(n_out, block_n), cdiv(k_in, block_k))
    traceable(_dequantize_kernel)[grid](
        qweight, scales, zero_arg, weight, n_out, k_in,
        qweight.stride(0), scales.stride(0), zero_arg.stride(0), weight.stride(0),
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        GPT=_groups_per_tile(group_size, block_k, 32 // bits), OWNED=owned,
    )  # fmt: skip
    return weight


def _slice_rows(x2, qweight, scales, zeros) -> int:
    """Weight rows :func:`dequantize_matmul` dequantizes at a time for ``x2``: DEQUANT_SLICE_ROWS from
    DEQUANT_SLICE_MIN_M rows over reductions under DEQUANT_SLICE_MAX_K, else 0 (the whole weight). Slices on
    eager calls only: traced, each slice's writes into the buffer and the output would become copies."""
    m, k_in = x2.shape
    sliced = m >= DEQUANT_SLICE_MIN_M and k_in < DEQUANT_SLICE_MAX_K and eager(x2, qweight, scales, zeros)
    return DEQUANT_SLICE_ROWS if sliced else 0


def dequantize_matmul(
    x2, qweight, scales, zeros, k_in, group_size, bits, slice_rows, out=None, owned=False
) -> torch.Tensor:
    """x2 @ W.T by dequantize + cuBLAS, ``slice_rows`` rows of W at a time (0: all at once) through one
    reused buffer, each slice's product written into its columns of the output (``out`` where given).
    ``owned``: the owned weights (quant_layout.to_owned_order's words, to_owned_zeros' zero points)."""
    n_out = qweight.shape[0]
    product = not launch.capturing()  # (launch.capture computes nothing: cuBLAS's products neither)
    if not slice_rows or slice_rows >= n_out:
        w = dequantize(qweight, scales, zeros, k_in, group_size, bits, x2.dtype, owned=owned)
        if not product:
            return out if out is not None else x2.new_empty((x2.shape[0], n_out))
        return torch.matmul(x2, w.t(), out=out)
    # (zero points packed along N: a slice starts on a whole word; the owned ones are a row's own)
    per_word = 1 if owned else 32 // bits
    if slice_rows % per_word:
        raise ValueError(f"slice_rows must be a multiple of {per_word}, got {slice_rows}")
    y = out if out is not None else x2.new_empty((x2.shape[0], n_out))
    buffer = x2.new_empty((slice_rows, k_in))
    for start in range(0, n_out, slice_rows):
        end = min(start + slice_rows, n_out)
        z = zeros[start // per_word : cdiv(end, per_word)] if zeros is not None else None
        w = dequantize(qweight[start:end], scales[start:end], z, k_in, group_size, bits, x2.dtype,
                       buffer[: end - start], owned)  # fmt: skip
        if product:
            torch.matmul(x2, w.t(), out=y[:, start:end])
    return y


def _standard(qweight, zeros, groups):
    """The owned weights' words and zero points in the checkpoint's layouts."""
    zeros = quant_layout.from_owned_zeros(zeros, groups) if zeros is not None else None
    return quant_layout.from_owned_order(qweight), zeros


def _owned_row_on_fma(x2, qweight, scales, zeros, group_size) -> bool:
    """Whether one row of owned weights runs on the FMA kernel: groups up to OWNED_FMA_MAX_GROUP, but not g32
    where the Gluon decode runs it (its scales by TMA) with zero points or on OWNED_ROW_GLUON_MIN_WEIGHT
    values (OWNED_FMA_MAX_GROUP's comment)."""
    large = qweight.shape[0] * x2.shape[1] >= OWNED_ROW_GLUON_MIN_WEIGHT
    gluon = (
        (zeros is not None or large)
        and group_size * 8 == GLUON_DECODE_BLOCK_K
        and _gluon_runs(x2, qweight, scales, zeros, group_size, 4, GLUON_DECODE_BLOCK_K)
    )
    return group_size <= OWNED_FMA_MAX_GROUP and not gluon


def _quant_matmul_owned(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    pdl: bool = False,
) -> torch.Tensor:
    """x @ dequantize(W).T for the owned weights: int4 words in quant_layout.to_owned_order's order and zero
    points as to_owned_zeros lays them out, which the Gluon kernel, the FMA kernel and the dequantize kernel
    read (the vLLM method repacks to them, at load, the layers vllm_ops.owned_shape takes, on Hopper): one
    row of small groups on the FMA kernel (OWNED_FMA_MAX_GROUP, but g32 with zero points or large), the
    Gluon decode up to SKINNY_MAX_M rows, the Gluon GEMM up to gluon_prefill_max_m, dequantize + cuBLAS past
    it or where the Gluon kernel does not run; the reference on CPU. ``pdl`` as quant_matmul's."""
    check_inputs(x, qweight, scales, zeros, group_size, 4, owned=True)
    block = quant_layout.OWNED_BLOCK
    if x.shape[-1] % block or group_size % block:
        raise ValueError(f"quant_matmul_owned: K and the groups must be multiples of {block}")
    if use_reference(x) or x.dtype == torch.float32:
        standard, zeros = _standard(qweight, zeros, scales.shape[1])
        return reference.quant_matmul(x, standard, scales, zeros, group_size, 4)
    n_out, k_in = qweight.shape[0], x.shape[-1]
    x2, qweight, scales = _operands(x, qweight, scales)
    m = x2.shape[0]
    y = None
    if m == 0:
        y = x2.new_empty((0, n_out))
    elif m == 1 and _owned_row_on_fma(x2, qweight, scales, zeros, group_size):
        zero_arg = zeros.contiguous() if zeros is not None else qweight
        y = _rows(x2, qweight, scales, zeros, zero_arg, group_size, 4, None, owned=True)
    elif m <= SKINNY_MAX_M and _gluon_runs(x2, qweight, scales, zeros, group_size, 4, GLUON_DECODE_BLOCK_K):
        cfg = gluon_decode_tiles(m, sm_count(x2.device), n_out, k_in)
        y = _gluon(x2, qweight, scales, zeros, group_size, cfg | {"owned": True}, pdl=pdl)
    elif SKINNY_MAX_M < m <= gluon_prefill_max_m(k_in, group_size, True, zeros is not None) and _gluon_runs(
        x2, qweight, scales, zeros, group_size, 4, 64
    ):
        cfg = gluon_tiles(m, n_out, k_in, sm_count(x2.device), group_size)
        y = _gluon(x2, qweight, scales, zeros, group_size, cfg | {"owned": True})
    if y is None:
        slice_rows = _slice_rows(x2, qweight, scales, zeros)
        y = dequantize_matmul(x2, qweight, scales, zeros, k_in, group_size, 4, slice_rows, owned=True)
    return y.reshape(*x.shape[:-1], n_out)


# Traced by torch.compile on a Hopper GPU, quant_matmul is its opaque op (COMPILED "opaque", the default):
# its eager dispatch then runs per call, the Gluon kernels included, which torch cannot trace; the traced
# body has the Triton kernels alone. H200, Inductor, GPU time a call in a CUDA graph, traced body / opaque op
# (tests/gpu/compile_probe.py, results/compile_probe_h200_2026-11-29.log), g128: 16 x 14336^2 50.4 / 49.2
# us, 64 x 14336 x 4096 38.1 / 25.1, 200 x 4096^2 28.5 / 22.1, 512 x 14336 x 4096 119.4 / 87.0, 2048 rows
# 348.5 / 307.8; g32 with zero points 1.02-1.20x at 16-512 rows, 0.98x at 2048. Where no Gluon kernel runs
# (other GPUs, int8) torch.compile traces the body. SQUEEZESERVE_COMPILED_QUANT_MATMUL=kernels traces it on
# Hopper too, for a graph of Triton kernels alone (torch.export and AOTInductor package those, not a Python
# op).
COMPILED = os.environ.get("SQUEEZESERVE_COMPILED_QUANT_MATMUL", "opaque")
if COMPILED not in ("opaque", "kernels"):
    raise ValueError(f"SQUEEZESERVE_COMPILED_QUANT_MATMUL must be opaque or kernels, got {COMPILED!r}")


def _traced_opaque(x, qweight, scales, zeros, bits) -> bool:
    """Whether a call of the traceable op is its opaque op (COMPILED): traced, int4, on a Hopper GPU whose
    Triton runs the Gluon kernels."""
    if COMPILED != "opaque" or bits != 4 or interpreting() or not (x.is_cuda or launch.capturing()):
        return False
    return traced(x, qweight, scales, zeros) and wgmma(x.device) and gluon_module() is not None


def _quant_matmul_traced(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """The traceable op's body (no ``pdl``: torch.compile's launches of a traced kernel take no PDL); traced
    on Hopper, the opaque op (COMPILED). Dispatched eagerly (torch's ``triton_op`` runs the body with
    ``wrap_triton`` off), the body through :data:`quant_matmul_eager`'s launch plans: a direct eager call of
    ``torch.ops.squeezeserve.quant_matmul`` took the H200 machine's host 100-266 us without them, more than
    the kernel, and 23-38 us with them (1-512 rows; tests/gpu/launch_probe.py --quant-shapes)."""
    if not launch.is_wrap_triton_enabled():
        return quant_matmul_eager.plans(_quant_matmul, (x, qweight, scales, zeros, group_size, bits))
    if _traced_opaque(x, qweight, scales, zeros, bits):
        return torch.ops.squeezeserve.quant_matmul_opaque(x, qweight, scales, zeros, group_size, bits)
    return _quant_matmul(x, qweight, scales, zeros, group_size, bits)


quant_matmul = triton_op("squeezeserve::quant_matmul", _quant_matmul_traced, mutates_args=())


@quant_matmul.register_fake
def _(x, qweight, scales, zeros, group_size, bits):
    check_inputs(x, qweight, scales, zeros, group_size, bits)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("squeezeserve::quant_matmul_opaque", mutates_args=())
def quant_matmul_opaque(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
    pdl: bool = False,
) -> torch.Tensor:
    """``quant_matmul`` as an opaque op: torch.compile does not trace into it, so the row-count dispatch
    (FMA / tensor-core / dequantize + cuBLAS) runs on every call. For engines that compile one graph for a
    range of token counts (vLLM): traced through, the dispatch would be fixed at the trace's size (vLLM
    traces at its largest batch, which took the prefill path for every decode step). No autograd: serving.
    ``pdl``: the kernel before this op in the stream is one of ours launched as a programmatic dependent
    (:data:`PDL_MAX_M`; taken while a CUDA graph captures the call, :func:`dependent`).
    """
    return quant_matmul_eager(x, qweight, scales, zeros, group_size, bits, dependent(pdl, x))


@quant_matmul_opaque.register_fake
def _(x, qweight, scales, zeros, group_size, bits, pdl=False):
    check_inputs(x, qweight, scales, zeros, group_size, bits)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _setup(ctx, inputs, output):
    x, qweight, scales, zeros, group_size, bits = inputs[:6]
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.meta = (x.shape[-1], group_size, bits, x.dtype)
    ctx.inputs = len(inputs)  # (an eager call may pass ``pdl`` too: a None for it)


def _grad(ctx, grad, standard=lambda qweight, zeros, groups: (qweight, zeros)):
    """Weights are frozen: only dx = grad @ dequantize(W). ``standard``: the saved words and zero points in
    weight_packed's and weight_zero_point's layouts."""
    qweight, scales, zeros = ctx.saved_tensors
    k_in, group_size, bits, dtype = ctx.meta
    qweight, zeros = standard(qweight, zeros, scales.shape[1])
    weight = quant_layout.dequantize(qweight, scales, zeros, (qweight.shape[0], k_in), group_size, bits)
    return grad @ weight.to(dtype), *[None] * (ctx.inputs - 1)


quant_matmul.register_autograd(_grad, setup_context=_setup)

# The op without torch's dispatcher (whose custom-op layers cost the H100 host ~25-30 us a call), for callers
# where nothing traces (vLLM's quant_linear, the opaque op's body), with launch plans: vLLM runs a prompt's
# forward eagerly unless it captured its size, and preparing one launch took the H100 machine's host 50-80
# us (tests/gpu/launch_probe.py --quant), more than the GPU needs up to 512 rows. Such a forward is
# host-bound; with plans, an 8B-shaped model's first token for a 256-token prompt came 29.5 -> 24.7 ms
# (tests/gpu/ttft_probe.py; NOTES.md, 2026-11-25, ninth session). Row counts vary in serving: room for many
# signatures. The split-K workspace is long-lived: plans hold it as a constant.
quant_matmul_eager = EagerOp(
    _quant_matmul, _setup, _grad, plans=LaunchPlans(persistent=workspace_buffers, max_plans=2048)
)


def _setup_owned(ctx, inputs, output):
    _setup(ctx, (*inputs[:5], 4), output)
    ctx.inputs = len(inputs)  # (no ``bits``; ``pdl`` where passed)


def _grad_owned(ctx, grad):
    """As :func:`_grad`, from the owned weights."""
    return _grad(ctx, grad, _standard)


# :func:`_quant_matmul_owned` without the dispatcher, with launch plans (as quant_matmul_eager), and as an
# opaque op for traced callers (as quant_matmul_opaque).
quant_matmul_owned_eager = EagerOp(
    _quant_matmul_owned,
    _setup_owned,
    _grad_owned,
    plans=LaunchPlans(persistent=workspace_buffers, max_plans=2048),
)


@torch.library.custom_op("squeezeserve::quant_matmul_owned", mutates_args=())
def quant_matmul_owned(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    pdl: bool = False,
) -> torch.Tensor:
    """quant_matmul on owned words (:func:`_quant_matmul_owned`), opaque to torch.compile (``pdl`` as
    quant_matmul_opaque's). No autograd."""
    return quant_matmul_owned_eager(x, qweight, scales, zeros, group_size, dependent(pdl, x))


@quant_matmul_owned.register_fake
def _(x, qweight, scales, zeros, group_size, pdl=False):
    check_inputs(x, qweight, scales, zeros, group_size, 4, owned=True)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
