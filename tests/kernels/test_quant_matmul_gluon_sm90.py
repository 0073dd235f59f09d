"""The Gluon kernel (kernels/ops/quant_matmul_gluon.py) compiled for sm_90 on a machine without a GPU, at
the tilings quant_matmul's rules choose, with the installed Triton: it builds, and its products stay
pipelined. Gluon has no interpreter, so without this CI would not notice a kernel that no longer compiles
(Triton 3.9 renamed two Gluon calls the kernel made under 3.6: with 3.9 its first call on a Hopper GPU
would have failed) or whose wgmma groups ptxas serialised (a tenth-session bug: tests/benchmarks/NOTES.md).
What it computes is checked on the H100 (test_quant_matmul_gluon.py)."""

import pytest
import torch
import triton

from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import quant_matmul as qm

qg = pytest.importorskip("squeezeserve.kernels.ops.quant_matmul_gluon", exc_type=ImportError)
pytestmark = pytest.mark.skipif(
    not cross_compile.has_cuobjdump(), reason="this Triton wheel has no cuobjdump"
)

SMS = 132  # the H100's

DECODE = [  # (m, n, k, group, zeros, dtype): tilings from gluon_decode_tiles
    (1, 14336, 14336, 128, False, torch.bfloat16),
    (16, 14336, 14336, 128, True, torch.bfloat16),
    (32, 4096, 14336, 256, False, torch.bfloat16),
    (64, 14336, 14336, 128, False, torch.float16),
]
PREFILL = [  # tilings from gluon_tiles
    (128, 14336, 14336, 128, False, torch.bfloat16),  # 128-row tiles, a tile a program
    (128, 4096, 14336, 128, True, torch.bfloat16),  # few tiles: stream-K
    (512, 14336, 4096, 32, True, torch.bfloat16),  # 256-row tiles; two groups a K tile
    (512, 4096, 14336, 128, False, torch.bfloat16),  # 256-row tiles, stream-K
    (2048, 28672, 4096, 64, False, torch.float16),
]


def _compiled(m, n, k, group, zeros, dtype, cfg):
    x = torch.zeros(m, k, dtype=dtype)
    qweight = torch.zeros(n, k // 8, dtype=torch.int32)
    scales = torch.zeros(n, k // group, dtype=dtype)
    zero_points = torch.zeros(n // 8, k // group, dtype=torch.int32) if zeros else None
    assert qg.supported(x, qweight, scales, group, 4, cfg.get("block_k", 64))
    y = torch.empty(m, n, dtype=dtype)
    ws, counts = torch.zeros(m * n, dtype=torch.float32), torch.zeros(4096, dtype=torch.int32)
    _, args, kwargs = qg.launch_args(x, qweight, scales, zero_points, group, y, ws, counts, mode=2, **cfg)
    compiled = cross_compile.compile_for(qg._wgmma_kernel, args, kwargs)
    return cross_compile.summary(cross_compile.sass(compiled))


def _check(s: dict) -> None:
    assert s["groups"] >= 1
    # each group waited for down to one in flight, all of them once at the end: products overlap
    assert s["wait_one"] == s["groups"] and s["wait_all"] <= 1, s
    if triton.__version__.startswith("3.6."):  # the device's (vLLM 0.26), where the tilings were measured
        # no spills in the K loop (the 256-row stream-K tiling spills in its epilogue, once a tile; Triton
        # 3.9 spills 3 in its loop too)
        assert s["loop_local"] == 0, s


@pytest.mark.parametrize(("m", "n", "k", "group", "zeros", "dtype"), DECODE)
def test_decode_tilings_compile_pipelined(m, n, k, group, zeros, dtype):
    _check(_compiled(m, n, k, group, zeros, dtype, qm.gluon_decode_tiles(m, SMS)))


@pytest.mark.parametrize(("m", "n", "k", "group", "zeros", "dtype"), PREFILL)
def test_prefill_tilings_compile_pipelined(m, n, k, group, zeros, dtype):
    assert qm.gluon_in_auto(m, n, k, group)
    _check(_compiled(m, n, k, group, zeros, dtype, qm.gluon_tiles(m, n, k, SMS)))


def test_summary_reads_sass():
    lines = [
        "HGMMA.64x16x16.F32.BF16 R24, R96, gdesc[UR16], R24",
        "HGMMA.64x16x16.F32.BF16 R24, R156, gdesc[UR16], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "@P0 STL [R1], R2",  # in the loop
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "LDL.LU R2, [R1]",  # in the epilogue
    ]
    s = cross_compile.summary(lines)
    assert (s["groups"], s["wait_one"], s["wait_all"], s["local"], s["loop_local"]) == (1, 1, 1, 2, 1)
    assert s["instructions"]["HGMMA"] == 2


def test_serialised_products_fail_the_check():
    # what the tenth session's first kernel compiled to: a full wait after every group
    serial = ["HGMMA.64x16x16.F32.BF16 R24, R96, gdesc[UR16], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 2
    with pytest.raises(AssertionError):
        _check(cross_compile.summary(serial))


def test_compile_for_refuses_interpreted_kernels():
    with pytest.raises(TypeError, match="interpreted"):
        cross_compile.compile_for(lambda: None, (), {})
