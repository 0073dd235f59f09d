"""Every Triton kernel our ops launch on a GPU, compiled for sm_90 on this machine at the paths and tilings
the GPU takes (kernels/ops/cross_compile.py). The rest of tests/kernels runs the kernels in Triton's
interpreter, which takes small tiles, skips inline PTX and wgmma, and compiles nothing; this compiles what
the H100 would run, with the installed Triton, so a kernel that no longer builds (a PTX typo in an
``ASM=True`` branch, a Triton API change) fails CI rather than the first request on a GPU. The GPU paths
are also compiled for an A100 and an sm_89 part, whose shared memory holds less than the H100's tilings
ask for (``launch.launch_fitting``)."""

import json
import os
import subprocess
import sys

import pytest
import triton

from squeezeserve.kernels.ops import cross_compile, launch

pytestmark = pytest.mark.skipif(
    not cross_compile.has_cuobjdump(), reason="this Triton wheel has no cuobjdump"
)

# case -> the kernels the GPU path launches there (quant_matmul's choice by rows and groups)
EXPECTED = {
    "quant_matmul 1x14336x4096 int4 g128": ["_gemv_int4_kernel"],
    "quant_matmul 2x4096x14336 int4 g32 zp": ["_gemv_int4_kernel"],
    "quant_matmul 16x14336x4096 int4 g128": ["_skinny_kernel"],
    "quant_matmul 16x4096x14336 int4 g32 zp": ["_skinny_kernel"],
    "quant_matmul 64x4096x4096 int4 g32 zp fp16": ["_skinny_kernel"],  # (symmetric g32 there: Gluon decode)
    "quant_matmul 8x4096x4096 int8 per channel": ["_skinny_kernel"],
    "quant_matmul 256x4096x4096 int4 g64": ["_prefill_kernel"],
    "quant_matmul 256x6144x4096 int4 g128 zp (Gluon prefill)": ["_wgmma_kernel"],
    "quant_matmul 512x4096x14336 int4 g32": ["_prefill_kernel"],
    "quant_matmul 4097x4096x1024 int4 g128 (dequantize, in slices)": ["_dequantize_kernel"],
    "quant_matmul 16x14336x14336 int4 g128 (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul 16x14336x14336 int4 g128 zp (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul 32x4096x14336 int4 g256 (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul 64x14336x14336 int4 g128 fp16 (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul 32x14336x14336 int4 g32 zp (Gluon decode, 8 groups a tile)": ["_wgmma_kernel"],
    "quant_matmul 64x14336x14336 int4 g32 (Gluon decode, 8 groups a tile)": ["_wgmma_kernel"],
    "quant_matmul 128x14336x14336 int4 g128 (Gluon prefill)": ["_wgmma_kernel"],
    "quant_matmul 512x14336x4096 int4 g128 zp (Gluon prefill)": ["_wgmma_kernel"],
    "quant_matmul 512x14336x4096 int4 g32 zp (Gluon prefill)": ["_wgmma_kernel"],
    "quant_matmul 2048x28672x4096 int4 g64 fp16 (Gluon prefill)": ["_wgmma_kernel"],
    "quant_matmul 100x4096x14336 int4 g128 (Gluon stream-K)": ["_wgmma_kernel"],
    "quant_matmul 100x4096x14336 int4 g128 zp (Gluon stream-K)": ["_wgmma_kernel"],
    "quant_matmul_owned 100x4096x14336 int4 g32 zp (Gluon stream-K, 64 deep)": ["_wgmma_kernel"],
    "quant_matmul 136x4096x14336 int4 g128 zp (Gluon stream-K, 256-row tiles)": ["_wgmma_kernel"],
    "quant_matmul 1536x6144x4096 int4 g128 (Gluon whole waves, then stream-K, 256-row tiles)": [
        "_wgmma_kernel"
    ],
    "quant_matmul 128x6144x4096 int4 g128 zp (Gluon 64-row weight tiles)": ["_wgmma_kernel"],
    "quant_matmul 112x6144x4096 int4 g32 zp (Gluon 64-row weight tiles)": ["_wgmma_kernel"],
    "quant_matmul 128x4096x14336 int4 g128 zp (Gluon 64-row weight tiles, K in two parts)": ["_wgmma_kernel"],
    "quant_matmul 128x4096x4096 int4 g128 (Gluon 64-row weight tiles, o_proj)": ["_wgmma_kernel"],
    "quant_matmul_owned 1x14336x4096 int4 g32 (FMA kernel)": ["_gemv_int4_kernel"],
    "quant_matmul_owned 1x28672x4096 int4 g32 (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul_owned 1x28672x4096 int4 g32 zp (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul_owned 16x28672x4096 int4 g128 (Gluon decode)": ["_wgmma_kernel"],
    "quant_matmul_owned 16x14336x4096 int4 g32 zp (Gluon decode, a tile a program)": ["_wgmma_kernel"],
    "quant_matmul_owned 8x14336x4096 int4 g128 (Gluon decode, a tile a program)": ["_wgmma_kernel"],
    # (GLUON_TAIL: two launches, the 256-row tiles persistent in clusters, then the last columns on 128 rows)
    "quant_matmul_owned 512x28672x4096 int4 g128 (Gluon persistent in clusters, a 128-row tail)": [
        "_wgmma_kernel",
        "_wgmma_kernel",
    ],
    "quant_matmul 896x14336x4096 int4 g128 zp (Gluon persistent in clusters, a 128-row tail)": [
        "_wgmma_kernel",
        "_wgmma_kernel",
    ],
    "quant_matmul_owned 320x28672x4096 int4 g128 (Gluon stream-K, 128-row tiles)": ["_wgmma_kernel"],
    "quant_matmul_owned 600x28672x4096 int4 g128 (Gluon whole waves, then stream-K, 128-row tiles)": [
        "_wgmma_kernel"
    ],
    "quant_matmul_owned 1100x4096x14336 int4 g128 zp (Gluon a wave, then stream-K, 256-row tiles)": [
        "_wgmma_kernel"
    ],
    "quant_matmul_owned 1024x4096x14336 int4 g128 zp (Gluon in clusters sharing x, 256-row tiles)": [
        "_wgmma_kernel"
    ],
    "quant_matmul 2048x14336x14336 int4 g128 (Gluon persistent in clusters, 256-row tiles)": [
        "_wgmma_kernel"
    ],
    "quant_matmul_owned 2048x28672x4096 int4 g128 (Gluon persistent in clusters, 256-row tiles)": [
        "_wgmma_kernel"
    ],
    "quant_matmul_owned dequantize 4096x14336 int4 g128": ["_dequantize_kernel"],
    "quant_matmul_owned dequantize 14336x4096 int4 g32 zp": ["_dequantize_kernel"],
    "quant_matmul dequantize 4096x4096 int8 per channel": ["_dequantize_kernel"],
    "codebook_matmul 1x4096x4096 4-bit g128": ["_codebook_fma_kernel"],
    "codebook_matmul 16x4096x4096 4-bit g128": ["_codebook_matmul_kernel"],
    "codebook_matmul 128x4096x4096 3-bit per channel": ["_codebook_matmul_kernel"],
    "swiglu 16x14336": ["_swiglu_fwd"],
    "rmsnorm 16x4096": ["_rmsnorm_fwd"],
    "add_rmsnorm 4096x4096": ["_rmsnorm_fwd"],
    "softmax 16x32768": ["_softmax_fwd"],
    "softmax 4x131072 (split rows)": ["_softmax_fwd_split"],
    "swiglu_backward 4096x4096": ["_swiglu_bwd"],
    "swiglu_oai 16x2880": ["_swiglu_fwd"],
    "silu_and_mul 16x28672": ["_swiglu_fwd"],
    "rmsnorm_backward 4096x4096": ["_rmsnorm_bwd"],
    "add_rmsnorm_backward 16x4096": ["_rmsnorm_bwd"],
    "softmax_backward 4x131072 (split rows)": ["_softmax_bwd_split"],
    "cross_entropy 1024x128256": ["_cross_entropy_fwd"],
    "fused_linear_ce 256x512x32000": ["_cross_entropy_fwd"],  # (its GEMMs are cuBLAS's)
    "fused_linear_kd 256x512x32000": ["_kd_fwd"],
}
# Spills (LDL/STL in all, in the K loop) of the tilings as they were timed on the H100 with Triton 3.6, and
# timed faster than tilings that do not spill (eight groups a tile: the group parameters of three tiles
# ahead; 64-row tiles of one warpgroup 97.5 us at 14336^2 against 85.1; NOTES.md, "thirteenth session").
SPILLS = {
    "quant_matmul 32x14336x14336 int4 g32 zp (Gluon decode, 8 groups a tile)": (13, 6),
    "quant_matmul 64x14336x14336 int4 g32 (Gluon decode, 8 groups a tile)": (47, 30),
    # (in the parts' meeting, after the K loop: results/tests_h200_2026-11-28_down_k_split.log)
    "quant_matmul 128x4096x14336 int4 g128 zp (Gluon 64-row weight tiles, K in two parts)": (12, 0),
}


@pytest.fixture(scope="module")
def compiled(run_compiled) -> dict:
    return run_compiled(["-m", "squeezeserve.kernels.ops.cross_compile", "--json"])


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_gpu_path_compiles_for_sm90(compiled, case):
    result = compiled[case]
    assert "error" not in result, result.get("error")
    assert [one["kernel"] for one in result["launches"]] == EXPECTED[case]
    if case.startswith("rmsnorm_backward"):  # persistent: one program an SM of the target
        assert result["launches"][0]["grid"] == [132]
    for one in result["launches"]:
        s = one["summary"]
        if one["kernel"] == "_wgmma_kernel":
            _check_pipelined(s)
        if triton.__version__.startswith("3.6."):  # the device's (vLLM 0.26), where the tilings were measured
            # no spills in a wgmma loop; none at all but in the Gluon kernel's stream-K epilogue at 256-row
            # tiles (once a tile: tests/benchmarks/NOTES.md, "twelfth session"; Triton 3.9 spills in loops)
            # and no more than SPILLS says where they were timed with them
            local, loop_local = SPILLS.get(case, (0, 0))
            assert s["loop_local"] <= loop_local, (case, s)
            assert s["local"] <= local or "256-row tiles" in case, (case, s)


# The kernels that call griddepcontrol.launch_dependents first on Hopper (SASS PREEXIT), so that a kernel
# after them may launch as their programmatic dependent (launch.launches_dependents, quant_matmul.PDL_MAX_M,
# vllm_ops.PDL_AFTER): the norms, SwiGLU and the decode GEMMs.
TRIGGERS = {"_rmsnorm_fwd", "_swiglu_fwd", "_gemv_int4_kernel", "_skinny_kernel", "_wgmma_kernel"}


@pytest.mark.parametrize("case", sorted(c for c, kernels in EXPECTED.items() if TRIGGERS & set(kernels)))
def test_forwards_let_a_dependent_launch_on_hopper(compiled, case):
    for one in compiled[case]["launches"]:
        assert one["constexprs"].get("LAUNCH_DEPENDENTS", True) is True, (case, one["constexprs"])
        ops = one["summary"]["instructions"]
        assert ops.get("PREEXIT") == 1 and "ACQBULK" not in ops, (case, ops)  # (no wait: launched plainly)


def test_no_other_kernel_lets_a_dependent_launch(compiled):
    for case, result in compiled.items():
        for one in result["launches"]:
            if one["kernel"] not in TRIGGERS:
                assert "PREEXIT" not in one["summary"]["instructions"], (case, one["kernel"])


_DEPENDENT = """
import json
import torch
from squeezeserve.kernels.ops import cross_compile, rmsnorm, swiglu

x = torch.empty(16, 4096, dtype=torch.bfloat16)
w = torch.empty(4096, dtype=torch.bfloat16)
cases = {
    "rmsnorm": (rmsnorm._rmsnorm_dependent, x, w, 1e-6),
    "add_rmsnorm": (rmsnorm._add_rmsnorm_dependent, x, x.clone(), w, 1e-6),
    "silu_and_mul": (swiglu._silu_and_mul_dependent, torch.empty(16, 28672, dtype=torch.bfloat16)),
}
for case, (body, *args) in cases.items():
    (one,) = cross_compile.compile_launches(body, *args)
    ops = one["summary"]["instructions"]
    constexprs = one["constexprs"]
    print(json.dumps({"case": case, "wait": constexprs["WAIT"], "pdl": constexprs.get("launch_pdl"),
                      "PREEXIT": ops.get("PREEXIT", 0), "ACQBULK": ops.get("ACQBULK", 0)}))
"""


def test_norms_and_swiglu_launched_as_dependents_wait_first(run_compiled):
    # vLLM's decode graphs launch them as programmatic dependents of the GEMM before (launch_pdl, Triton's
    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): they let the next kernel launch, then wait for
    # the one before (griddepcontrol.wait, SASS ACQBULK) before they read or write anything.
    results = run_compiled(["-c", _DEPENDENT])
    assert set(results) == {"rmsnorm", "add_rmsnorm", "silu_and_mul"}
    for case, r in results.items():
        assert (r["wait"], r["pdl"], r["PREEXIT"], r["ACQBULK"]) == (True, True, 1, 1), (case, r)


def test_forwards_before_hopper_take_no_trigger():
    # griddepcontrol needs sm_90: an A100's norm compiles without it (and builds)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "squeezeserve.kernels.ops.cross_compile", "--json", "--arch", "80", "--sms",
           "108", "--no-wgmma", "rmsnorm 16x4096", "silu_and_mul"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2, run.stderr[-2000:]
    for result in results:
        assert "error" not in result, result
        (one,) = result["launches"]
        assert one["constexprs"]["LAUNCH_DEPENDENTS"] is False
        assert "PREEXIT" not in one["summary"]["instructions"]


def _check_pipelined(s: dict) -> None:
    """The Gluon kernel's products overlap: each wgmma group waited for down to one in flight, all of them
    once at the end (a loop whose operand registers ptxas saw rewritten waits for every group after each:
    the tenth session's bug, tests/benchmarks/NOTES.md)."""
    assert s["groups"] >= 1 and s["wait_one"] == s["groups"] and s["wait_all"] <= 1, s


def test_summary_reads_sass():
    lines = [
        "HGMMA.64x16x16.F32.BF16 R24, R96, gdesc[UR16], R24",
        "HGMMA.64x16x16.F32.BF16 R24, R156, gdesc[UR16], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "@P0 STL [R1], R2",  # in the loop
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100",  # in the loop
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "LDL.LU R2, [R1]",  # in the epilogue
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100",  # in the epilogue
    ]
    s = cross_compile.summary(lines)
    assert (s["groups"], s["wait_one"], s["wait_all"], s["local"], s["loop_local"]) == (1, 1, 1, 2, 1)
    assert s["loop_barriers"] == 1
    assert s["instructions"]["HGMMA"] == 2
    _check_pipelined(s)


TWO_WARPGROUP_RELEASES = sorted(
    c for c in EXPECTED if c.startswith("quant_matmul 64x") and "Gluon decode" in c
) + [
    "quant_matmul 128x14336x14336 int4 g128 (Gluon prefill)",
    "quant_matmul 100x4096x14336 int4 g128 zp (Gluon stream-K)",
    "quant_matmul_owned 100x4096x14336 int4 g32 zp (Gluon stream-K, 64 deep)",
    "quant_matmul_owned 320x28672x4096 int4 g128 (Gluon stream-K, 128-row tiles)",
]


@pytest.mark.parametrize("case", TWO_WARPGROUP_RELEASES)
def test_two_warpgroup_loops_hold_no_barrier(compiled, case):
    # The 64-row decode's and the 128-row prefill tiles' two warpgroups free their ring stages each for
    # itself (ptx_release's pass): the K loop has no CTA barrier left, and its products are still pipelined
    # (NOTES.md, thirty-first, thirty-ninth and forty-first sessions: stream-K's too).
    (one,) = compiled[case]["launches"]
    assert one["constexprs"]["RELEASES"] == 2, one["constexprs"]
    assert one["summary"]["loop_barriers"] == 0, one["summary"]
    _check_pipelined(one["summary"])


def test_serialised_products_fail_the_check():
    # what the tenth session's first kernel compiled to: a full wait after every group
    serial = ["HGMMA.64x16x16.F32.BF16 R24, R96, gdesc[UR16], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 2
    with pytest.raises(AssertionError):
        _check_pipelined(cross_compile.summary(serial))


def test_compile_for_refuses_interpreted_kernels():
    with pytest.raises(TypeError, match="interpreted"):
        cross_compile.compile_for(lambda: None, (), {})


def test_every_case_is_expected():
    assert set(cross_compile.cases()) == set(EXPECTED)


def test_capture_needs_compiled_kernels(monkeypatch):
    # (as this process does on CPU, tests/kernels/conftest.py; on a GPU it compiles, and the test says so)
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    with pytest.raises(RuntimeError, match="compiled kernels"), launch.capture():
        pass
    assert launch.recording.target is None and launch.recording.captured is None


# GPUs before Hopper with less shared memory a block than the H100's 227 KB, which our tilings were tuned
# for: the A100 (163 KB, 108 SMs) and an sm_89 part such as the L4 (99 KB, 58 SMs; sm_86 has as much).
SMALLER = {"sm_80": ("80", "108", 166912), "sm_89": ("89", "58", 101376)}


@pytest.mark.parametrize("gpu", sorted(SMALLER))
def test_gpu_paths_fit_smaller_gpus(gpu):
    # quant_matmul's and the codebook kernels' tilings, which use the most shared memory, compiled for that
    # GPU as launch.launch_fitting runs them there: with fewer pipeline stages where a tiling does not fit
    # (before that, the first call on an A100 failed: the codebook kernel at 128 rows needed 192 KB).
    arch, sms, smem = SMALLER[gpu]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "squeezeserve.kernels.ops.cross_compile", "--json", "--arch", arch, "--sms",
           sms, "--smem", str(smem), "--no-wgmma", "quant_matmul", "codebook_matmul"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == sum(name.startswith(("quant_matmul", "codebook_matmul")) for name in EXPECTED)
    fewer = []
    for result in results:
        assert "error" not in result, result
        for one in result["launches"]:
            assert one["shared"] <= smem and one["stages"] >= 1, (result["case"], one)
            if one["stages"] < one["asked_stages"]:
                fewer.append(result["case"])
    # where the H100's tilings do not fit, fewer stages do
    assert "codebook_matmul 128x4096x4096 3-bit per channel" in fewer


_TRACED_WRITES = """
import json
import torch
import triton
from torch._higher_order_ops import triton_kernel_wrap
from triton.backends.compiler import GPUTarget
from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import launch, quant_matmul


class Hopper:  # (torch makes the kernel's TTIR for the current target; there is no GPU here)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
quant_matmul.PREFILL = "triton"
for m, n, k, group, zeros in [(200, 256, 512, 128, True), (80, 40, 576, 48, False)]:
    t = quant_layout.pack_weight(torch.zeros(n, k), 4, group, symmetric=not zeros)
    x = torch.zeros(m, k, dtype=torch.float16)
    zp = t["weight_zero_point"] if zeros else None
    with launch.capture(sms=132, wgmma=True) as launches:
        quant_matmul._quant_matmul(x, t["weight_packed"], t["weight_scale"].half(), zp, group, 4)
    ((kernel, grid, args, kwargs),) = launches
    for traced in (False, True):
        named = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
        named["TRACED"] = traced
        access = triton_kernel_wrap.identify_accessed_tensors(kernel, named, {})
        print(json.dumps({"case": f"{m}x{n}x{k} g{group} traced={traced}", "kernel": kernel.__name__,
                          "writes": sorted(dep.name for dep in access.read_writes.writes)}))
"""


def test_traced_prefill_writes_only_its_outputs_to_torch(run_compiled):
    # torch.compile reads which arguments a kernel writes off its TTIR, and takes every argument as written
    # where inline PTX not marked pure stops it (aot_eager then copies each, the weights too, every call).
    # The prefill GEMM's wgmma wait is such PTX; launched by torch.compile's code (TRACED) it is marked pure,
    # and torch sees the output, the workspace and the counts written, nothing else (NOTES.md, forty-third
    # session).
    results = run_compiled(["-c", _TRACED_WRITES])
    assert len(results) == 4
    for case, r in results.items():
        assert r["kernel"] == "_prefill_kernel", r
        everything = ["count_ptr", "qw_ptr", "scale_ptr", "ws_ptr", "x_ptr", "y_ptr", "zero_ptr"]
        assert r["writes"] == (["count_ptr", "ws_ptr", "y_ptr"] if case.endswith("True") else everything), r
