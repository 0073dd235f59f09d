"""The Gluon prefill GEMM (kernels/ops/quant_matmul_gluon.py): which calls take it, and, on a Hopper GPU,
that it computes dequantize + matmul. Gluon has no interpreter: the products run only where sm_90 does
(tests/gpu/gluon_prefill_probe.py runs the same checks and the timings on the H100)."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import quant_layout as ql
from squeezeserve.kernels.ops import cross_compile, rmsnorm, swiglu
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma kernel runs on sm_90 only")


def _packed(n, k, group, zeros, dtype=torch.bfloat16, device="cpu"):
    torch.manual_seed(n + k + group)
    t = ql.pack_weight(torch.randn(n, k) / 64, 4, group, symmetric=not zeros)
    qw, sc = t["weight_packed"].to(device), t["weight_scale"].to(device=device, dtype=dtype)
    zp = t["weight_zero_point"].to(device) if zeros else None
    return qw, sc, zp


def test_supported_inputs():
    qw, sc, _ = _packed(256, 4096, 128, False)
    x = torch.zeros(128, 4096, dtype=torch.bfloat16)
    assert qg.supported(x, qw, sc, 128, 4)
    assert qg.supported(x, qw, sc, 32, 4)  # two groups a 64-deep K tile
    assert not qg.supported(x, qw, sc, 16, 4)  # four groups a tile: not built
    assert not qg.supported(x, qw, sc.float(), 128, 4)  # scales in another dtype than the activations
    assert not qg.supported(x, qw, sc, 128, 8)  # int8
    assert not qg.supported(x.float(), qw, sc.float(), 128, 4)
    x_odd = torch.zeros(
        128, 4112, dtype=torch.bfloat16
    )  # K % 32 != 0: the words' rows are not 16-byte aligned
    assert not qg.supported(x_odd, torch.zeros(256, 514, dtype=torch.int32), sc, 128, 4)
    assert not qg.supported(torch.zeros(128, 8192, dtype=torch.bfloat16)[:, ::2], qw, sc, 128, 4)
    assert not qg.supported(
        x, torch.zeros(256 * 512 + 1, dtype=torch.int32)[1:].view(256, 512), sc, 128, 4
    )  # TMA base


def test_cpu_calls_never_take_it(monkeypatch):
    monkeypatch.setattr(qm, "PREFILL", "gluon")
    qw, sc, _ = _packed(256, 4096, 128, False)
    assert not qm._gluon_prefill(torch.zeros(128, 4096, dtype=torch.bfloat16), qw, sc, None, 128, 4)


# The rule's tiling where the 256-row tiles pair up and are more than a wave (quant_matmul.GLUON_PERSISTENT)
PERSIST = {"block_m": 256, "stages": 4, "programs": 132, "persistent": True, "cluster": 2, "tma_store": True}
# 128-row tiles stream-K over one program an SM, each warpgroup freeing its own stages: 128 deep in groups of
# whole 128s, else 64 deep on 6 stages (quant_matmul.GLUON_STREAM_K_RELEASE)
SK = {"block_m": 128, "stages": 4, "programs": 132, "wg_release": True, "block_k": 128}
SK64 = {"block_m": 128, "stages": 6, "programs": 132, "wg_release": True}


def test_gluon_tiles_measured_choices():
    # (gluon_prefill_probe.py on the H100: NOTES.md, "tenth session" and "eleventh session"); 256-row tiles a
    # tile a program run in clusters of two sharing x's tiles where K is deep, the weight's 128-row tiles are
    # even in number and they are a wave or less (test_gluon_tiles_pair_programs_where_the_weight_tiles_pair)
    pair = {"block_m": 256, "stages": 4, "cluster": 2}
    # 112 tiles: one each, each warpgroup freeing its own stages (WG_RELEASE), 128-deep K tiles
    # (GLUON_DEEP_K; groups of 128 and more)
    own = {"block_m": 128, "stages": 5, "wg_release": True, "block_k": 128}
    assert qm.gluon_tiles(128, 14336, 14336, 132) == qm.gluon_tiles(65, 28672, 4096, 132, 256) == own
    assert qm.gluon_tiles(128, 28672, 4096, 132, 32) == {"block_m": 128, "stages": 6}
    assert qm.gluon_tiles(256, 14336, 14336, 132) == pair
    assert qm.gluon_tiles(512, 4096, 4096, 132, 32) == {"block_m": 128, "stages": 6}  # 256-row tiles: 64
    assert qm.gluon_tiles(512, 6144, 4096, 132) == {"block_m": 256, "stages": 4}  # one wave: 96 tiles
    # under half the SMs' worth of tiles: stream-K over one program an SM
    assert qm.gluon_tiles(512, 4096, 14336, 132, 32) == {"block_m": 256, "stages": 4, "programs": 132}
    assert qm.gluon_tiles(128, 4096, 14336, 114) == SK | {"programs": 114}
    # up to 128 rows, where 64-row weight tiles fill half the SMs to a wave: those, a program each (H200;
    # quant_matmul.GLUON_HALF_TILES): qkv's 96; not down_proj's 64 (under half) nor 14336 x 4096's 224
    half = {"block_m": 128, "stages": 6, "block_n": 64, "num_warps": 4}
    deep = {"stages": 4, "block_k": 128}  # (GLUON_DEEP_K, groups of 128 and more)
    assert qm.gluon_tiles(128, 6144, 4096, 132) == qm.gluon_tiles(80, 8192, 4096, 132) == half | deep
    assert qm.gluon_tiles(79, 6144, 4096, 132) == SK  # few rows
    # groups under 128 from 104 rows (GLUON_HALF_TILES_MIN_M_SMALL_GROUP)
    assert qm.gluon_tiles(103, 6144, 4096, 132, 32) == SK64
    assert qm.gluon_tiles(104, 6144, 4096, 132, 32) == qm.gluon_tiles(128, 8192, 4096, 132, 64) == half
    # where K is deep, at 112-128 rows of groups of 128 and more, where twice the 64-row tiles fill half the
    # SMs to a wave: each tile's K in two parts (GLUON_HALF_TILES_DEEP_MIN_M): down_proj's 64 tiles
    assert (
        qm.gluon_tiles(128, 4096, 14336, 132)
        == qm.gluon_tiles(112, 4096, 8192, 132, 256)
        == half | {"split": 2} | deep
    )
    assert qm.gluon_tiles(111, 4096, 14336, 132) == SK and qm.gluon_tiles(128, 4096, 14336, 132, 32) == SK64
    assert qm.gluon_tiles(128, 4096, 8191, 132) == SK  # (short K: 64 tiles under half the SMs)
    assert qm.gluon_tiles(128, 2048, 14336, 132) == SK  # 64 programs: under half the SMs
    assert qm.gluon_tiles(128, 8192, 14336, 132) == SK  # 256 programs: past a wave
    assert qm.gluon_tiles(128, 14336, 4096, 132) == own
    assert qm.gluon_tiles(256, 4096, 4096, 132, 64) == SK64
    assert qm.gluon_tiles(2048, 4096, 4096, 132) == PERSIST
    # 257-384 rows, where 256-row tiles pad by half: 128-row tiles stream-K where the weight comes from DRAM
    # (gate_up, 58.7 MB of words; down_proj, already stream-K), 256 rows where it stays in the L2 or the
    # padding is less (prefill_tiling_probe.py on the H100: NOTES.md, twenty-first session), up to
    # GLUON_NARROW_L2_MIN_M rows (test_gluon_tiles_stream_k_frees_stages_by_warpgroup)
    assert qm.gluon_tiles(320, 28672, 4096, 132) == qm.gluon_tiles(257, 28672, 4096, 132) == SK
    assert qm.gluon_tiles(257, 4096, 14336, 132) == SK
    assert qm.gluon_tiles(384, 4096, 14336, 132) == SK
    assert qm.gluon_tiles(272, 14336, 4096, 132) == PERSIST
    assert qm.gluon_tiles(256, 28672, 4096, 132) == PERSIST
    # 256-row tiles whose last wave is at most 40% full, of outputs 6144 wide or more, x in the L2: all full
    # waves but one a tile a program, then the rest stream-K (prefill_tiling_probe.py on the H100: NOTES.md,
    # twenty-third session)
    hybrid = {"block_m": 256, "stages": 4, "programs": 132, "dp_waves": -1}
    assert qm.gluon_tiles(768, 6144, 4096, 132) == hybrid  # 144 tiles: 12 in the last wave
    assert qm.gluon_tiles(1536, 14336, 14336, 132) == hybrid  # 672 tiles: 12 in the last wave
    assert qm.gluon_tiles(448, 28672, 4096, 132) == PERSIST | {"narrow_tail": 26}  # 448 tiles: 52 (a tail)
    assert qm.gluon_tiles(768, 14336, 4096, 132) == PERSIST  # 336 tiles: 72
    assert qm.gluon_tiles(1024, 6144, 4096, 132) == PERSIST  # 192 tiles: 60
    assert qm.gluon_tiles(2048, 14336, 4096, 132) == PERSIST  # 896 tiles: 104
    assert qm.gluon_tiles(1536, 4096, 4096, 132) == PERSIST  # 4096 wide: 60 of 132
    assert qm.gluon_tiles(4096, 14336, 14336, 132) == PERSIST  # x 117 MB: past the L2
    # Outputs under 6144 wide run all their full waves a tile a program, then the rest stream-K (NOTES.md,
    # twenty-ninth session: down_proj at 1025-1200 rows 20% faster, o_proj 2-7%)
    whole = {"block_m": 256, "stages": 4, "programs": 132}
    assert qm.gluon_tiles(1025, 4096, 4096, 132) == whole | {"dp_waves": 1}  # 160 tiles: 28 in the last wave
    assert qm.gluon_tiles(1100, 4096, 14336, 132) == whole | {"dp_waves": 1}  # x 31.5 MB: in the L2
    assert qm.gluon_tiles(2100, 4096, 4096, 132) == whole | {"dp_waves": 2}  # 288 tiles: 24
    assert qm.gluon_tiles(1300, 4096, 4096, 132) == PERSIST  # 192 tiles: 60
    assert qm.gluon_tiles(2048, 4096, 14336, 132) == PERSIST  # 256 tiles: 124
    assert qm.gluon_tiles(1100, 4096, 28672, 132) == PERSIST  # x 63 MB: past the L2
    assert qm.gluon_tiles(1024, 4096, 14336, 132) == pair  # 128 tiles: a wave


def test_gluon_tiles_step_128_deep_where_a_program_takes_whole_tiles(monkeypatch):
    # (prefill_tiling_probe.py on the H200: NOTES.md, fortieth session; quant_matmul.GLUON_DEEP_K) groups of
    # 128 and more: the tilings a tile a program up to 128 rows, and past 128 rows 128-row tiles a tile a
    # program where they are over half a wave and at most one, step through K 128 deep
    wave = {"block_m": 128, "stages": 5, "block_k": 128, "wg_release": True}
    assert qm.gluon_tiles(256, 6144, 4096, 132) == qm.gluon_tiles(129, 6144, 4096, 132) == wave  # qkv: 96
    assert qm.gluon_tiles(512, 4096, 4096, 132) == qm.gluon_tiles(257, 4096, 4096, 132) == wave  # o_proj
    assert qm.gluon_tiles(448, 4096, 14336, 132) == wave  # down_proj at 385-512 rows: 128 tiles
    assert qm.gluon_tiles(600, 6144, 4096, 132) == wave  # qkv at 513-640 rows (GLUON_THIRD_TILE_*): 240 tiles
    assert qm.gluon_tiles(65, 14336, 14336, 132, 256) == wave  # (a tile a program up to 128 rows)
    # 64-row weight tiles where K is short, a program each: from a quarter of the SMs' worth to a wave, up to
    # 256 rows (GLUON_DEEP_K_HALF_MAX_M): o_proj's 64 at 80-128 rows, 128 at 129-256
    half = {"block_m": 128, "stages": 4, "block_n": 64, "num_warps": 4, "block_k": 128}
    assert qm.gluon_tiles(128, 4096, 4096, 132) == qm.gluon_tiles(256, 4096, 4096, 132) == half
    assert qm.gluon_tiles(80, 3072, 4096, 132) == half  # 48 tiles
    assert qm.gluon_tiles(128, 2048, 4096, 132) == SK  # 32 tiles: stream-K (GLUON_STREAM_K_RELEASE)
    # not 128-row tiles a tile a program past a wave; not groups under 128 (stream-K's 128-row tiles, 128
    # deep too: test_gluon_tiles_stream_k_frees_stages_by_warpgroup)
    assert "block_k" not in qm.gluon_tiles(256, 14336, 4096, 132)  # 224 128-row tiles
    assert "block_k" not in qm.gluon_tiles(640, 4096, 4096, 132)  # 160 tiles
    assert qm.gluon_tiles(384, 4096, 14336, 132) == SK
    assert qm.gluon_tiles(128, 14336, 14336, 132, 64) == {"block_m": 128, "stages": 6}
    assert qm.gluon_tiles(512, 4096, 4096, 132, 32) == {"block_m": 128, "stages": 6}
    assert "block_k" not in qm.gluon_tiles(128, 14336, 14336, 132, 192)  # (a group across two 128-deep tiles)
    x, qw = torch.zeros(128, 4096, dtype=torch.bfloat16), torch.zeros(4096, 512, dtype=torch.int32)
    assert qg.supported(x, qw, torch.zeros(4096, 32, dtype=torch.bfloat16), 128, 4, 128)
    assert not qg.supported(x, qw, torch.zeros(4096, 22, dtype=torch.bfloat16), 192, 4, 128)
    monkeypatch.setattr(qm, "GLUON_DEEP_K", "off")  # (SQUEEZESERVE_GLUON_DEEP_K=off: 64 deep, as before)
    assert qm.gluon_tiles(128, 14336, 14336, 132) == {"block_m": 128, "stages": 6, "wg_release": True}
    assert qm.gluon_tiles(512, 4096, 4096, 132) == {"block_m": 128, "stages": 6}
    half64 = {"block_m": 128, "stages": 6, "block_n": 64, "num_warps": 4}
    assert qm.gluon_tiles(128, 6144, 4096, 132) == half64
    assert qm.gluon_tiles(256, 4096, 4096, 132) == SK64
    assert qm.gluon_tiles(448, 4096, 14336, 132) == {"block_m": 256, "stages": 4, "programs": 132}


def test_gluon_tiles_stream_k_frees_stages_by_warpgroup(monkeypatch):
    # (prefill_tiling_probe.py on the H200: NOTES.md, forty-first session;
    # quant_matmul.GLUON_STREAM_K_RELEASE) 128-row tiles stream-K: each warpgroup frees its own stages, 128
    # deep in groups of whole 128s: down_proj at 65-111 rows, qkv at 65-79, the narrow rule's 257-384 rows
    assert qm.gluon_tiles(65, 4096, 14336, 132) == qm.gluon_tiles(111, 4096, 14336, 132, 256) == SK
    assert qm.gluon_tiles(72, 6144, 4096, 132) == qm.gluon_tiles(320, 14336, 14336, 132) == SK
    assert qm.gluon_tiles(96, 4096, 14336, 132, 32) == qm.gluon_tiles(320, 28672, 4096, 132, 64) == SK64
    # the narrow rule takes more rows: where 256-row tiles would be stream-K (down_proj) from
    # GLUON_NARROW_MIN_M, where the weight stays in the L2 (qkv, 14336 x 4096) from GLUON_NARROW_L2_MIN_M
    assert qm.gluon_tiles(143, 4096, 14336, 132) == {"block_m": 256, "stages": 4, "programs": 132}
    assert qm.gluon_tiles(144, 4096, 14336, 132) == qm.gluon_tiles(256, 4096, 14336, 132) == SK
    assert qm.gluon_tiles(279, 14336, 4096, 132) == PERSIST and qm.gluon_tiles(280, 14336, 4096, 132) == SK
    assert qm.gluon_tiles(279, 6144, 4096, 132) == {"block_m": 256, "stages": 4}
    assert qm.gluon_tiles(280, 6144, 4096, 132) == qm.gluon_tiles(384, 6144, 4096, 132) == SK
    # not where 256-row tiles a tile a program stay (129-256 rows of the wide outputs, 385 rows on), nor
    # o_proj's 128-row tiles a tile a program, nor the third-tile rule's whole waves
    assert qm.gluon_tiles(192, 28672, 4096, 132) == PERSIST
    assert qm.gluon_tiles(192, 14336, 14336, 132) == {"block_m": 256, "stages": 4, "cluster": 2}
    assert qm.gluon_tiles(385, 6144, 4096, 132) == {"block_m": 256, "stages": 4}
    wave = {"block_m": 128, "block_k": 128, "stages": 5, "wg_release": True}
    assert qm.gluon_tiles(320, 4096, 4096, 132) == wave
    waves_then_sk = {"block_m": 128, "stages": 6, "programs": 132, "dp_waves": -1}
    assert qm.gluon_tiles(600, 28672, 4096, 132) == waves_then_sk
    before = {"block_m": 128, "stages": 6, "programs": 132}
    for name in ("GLUON_STREAM_K_RELEASE", "WG_RELEASE"):  # (off: the rule before, for A/B runs)
        monkeypatch.setattr(qm, name, "off")
        assert qm.gluon_tiles(96, 4096, 14336, 132) == qm.gluon_tiles(320, 28672, 4096, 132) == before
        assert qm.gluon_tiles(256, 4096, 14336, 132) == {"block_m": 256, "stages": 4, "programs": 132}
        assert qm.gluon_tiles(320, 14336, 4096, 132) == PERSIST
        assert qm.gluon_tiles(320, 6144, 4096, 132) == {"block_m": 256, "stages": 4}
        monkeypatch.setattr(qm, name, "on")
    monkeypatch.setattr(qm, "GLUON_DEEP_K", "off")  # (64 deep, the warpgroups' release kept)
    assert qm.gluon_tiles(96, 4096, 14336, 132) == SK64


def test_gluon_tiles_pair_programs_where_the_weight_tiles_pair(monkeypatch):
    # (tests/gpu/cluster_probe.py on the H100: NOTES.md, thirty-fourth session; quant_matmul.GLUON_CLUSTER);
    # a wave or less where K is deep: a tile a program
    assert qm.gluon_tiles(256, 14336, 14336, 132) == {"block_m": 256, "stages": 4, "cluster": 2}  # 112 tiles
    assert qm.gluon_tiles(1024, 4096, 8192, 132) == {"block_m": 256, "stages": 4, "cluster": 2}  # (MIN_K)
    assert qm.gluon_tiles(1024, 4096, 8191, 132) == {"block_m": 256, "stages": 4}
    # more than a wave: persistent in clusters, one program an SM (an even count; GLUON_PERSISTENT), however
    # deep K (thirty-sixth session: 14336^2 at 2048 rows on the H200 1211.7 us against 1233.3 a tile a
    # program)
    assert qm.gluon_tiles(2048, 14336, 14336, 132) == PERSIST
    assert qm.gluon_tiles(2048, 4096, 8192, 132) == PERSIST
    assert qm.gluon_tiles(2048, 14336 + 128, 14336, 132) == {"block_m": 256, "stages": 4}  # 113 weight tiles
    assert qm.gluon_tiles(2048, 14336, 4096, 132) == PERSIST
    assert qm.gluon_tiles(2048, 14336, 4096, 133) == PERSIST
    # a wave or less (o_proj at 768 / 1024 rows: 47.4, 45.9 / 51.0, 50.6 us persistent against 45.1, 45.1 /
    # 49.5, 49.5 a tile a program; results/prefill_tiling_probe_h100_2026-11-28_persistent_ab.log)
    assert qm.gluon_tiles(1024, 4096, 4096, 132) == {"block_m": 256, "stages": 4}  # 128 tiles
    assert qm.gluon_tiles(2048, 14336 + 128, 4096, 132) == {"block_m": 256, "stages": 4}  # 113 weight tiles
    assert "cluster" not in qm.gluon_tiles(1536, 14336, 14336, 132)  # whole waves, then stream-K
    assert "cluster" not in qm.gluon_tiles(512, 4096, 14336, 132)  # stream-K
    assert "cluster" not in qm.gluon_tiles(128, 14336, 14336, 132)  # 128-row tiles
    monkeypatch.setattr(qm, "GLUON_PERSISTENT", "off")
    assert qm.gluon_tiles(2048, 14336, 4096, 132) == {"block_m": 256, "stages": 4}
    assert qm.gluon_tiles(2048, 14336, 14336, 132) == {"block_m": 256, "stages": 4, "cluster": 2}
    monkeypatch.setattr(qm, "GLUON_PERSISTENT", "on")
    monkeypatch.setattr(qm, "GLUON_CLUSTER", "off")  # (persistent goes with the clusters)
    assert qm.gluon_tiles(2048, 14336, 14336, 132) == {"block_m": 256, "stages": 4}
    assert qm.gluon_tiles(2048, 14336, 4096, 132) == {"block_m": 256, "stages": 4}


def test_gluon_tiles_run_a_partial_waves_columns_on_128_row_tiles(monkeypatch):
    # (tests/gpu/mixed_tiles_probe.py on the H200: NOTES.md, thirty-sixth session; quant_matmul.GLUON_TAIL)
    # gate_up at 512 rows: 448 tiles, 52 in the last wave; 198 weight tiles (396 tiles: three waves)
    # persistent in clusters, the last 26 on 128-row tiles (104: one wave)
    assert qm.narrow_tail(512, 28672, 4096, 132) == 26
    assert qm.gluon_tiles(512, 28672, 4096, 132) == PERSIST | {"narrow_tail": 26}
    assert qm.gluon_tiles(1280, 14336, 4096, 132) == PERSIST | {"narrow_tail": 8}  # 32 left: 7, then even
    assert qm.narrow_tail(896, 14336, 4096, 132) == 14  # 52 left over 4 rows of tiles: 13, then even
    # not where the 256-row part would be a wave or less (qkv at 768 rows), K is deep, the output narrower,
    # the last wave a sliver (gate_up at 700 rows: 12 tiles), or the 128-row part over a wave
    assert qm.narrow_tail(768, 6144, 4096, 132) == 0
    assert "narrow_tail" not in qm.gluon_tiles(1536, 14336, 14336, 132)
    assert qm.narrow_tail(1536, 14336, 14336, 132) == qm.narrow_tail(1536, 14336, 8192, 132) == 0
    assert qm.narrow_tail(2100, 4096, 4096, 132) == 0
    assert qm.narrow_tail(700, 28672, 4096, 132) == 0
    hybrid = {"block_m": 256, "stages": 4, "programs": 132, "dp_waves": -1}
    assert qm.gluon_tiles(700, 28672, 4096, 132) == hybrid
    assert qm.narrow_tail(512, 28672, 4096, 80) == 0  # (80 SMs: 48 of 448 left, 24 weight tiles of 128 rows)
    for name in ("GLUON_TAIL", "GLUON_PERSISTENT", "GLUON_CLUSTER"):  # (its first launch is persistent's)
        monkeypatch.setattr(qm, name, "off")
        assert qm.narrow_tail(512, 28672, 4096, 132) == 0
        assert qm.gluon_tiles(512, 28672, 4096, 132) == hybrid
        monkeypatch.setattr(qm, name, "on")


@pytest.mark.parametrize(("owned", "zeros"), [(True, False), (False, True), (True, True)])
def test_a_tail_launch_writes_its_columns_from_its_rows_of_the_weight(owned, zeros, monkeypatch):
    # GLUON_TAIL's two launches, as _gluon makes them: the first on the weight's first rows into those
    # columns of y at the rule's tiling, the second on the rest at GLUON_TAIL_TILES; zero points by row where
    # the words are thread-owned, else 8 rows a word. The Gluon kernel runs on sm_90 only: here each launch
    # computes what the kernel computes from the tensors it is handed (the reference), and together they must
    # give the whole product (the kernel itself: test_a_tail_launch_gives_the_whole_outputs_products, on a
    # Hopper GPU).
    from squeezeserve.kernels import reference

    m, n, k, group = 300, 1024, 256, 32
    qw, sc, zp = _packed(n, k, group, zeros, torch.float16)
    x = torch.randn(m, k, dtype=torch.float16)
    want = reference.quant_matmul(x, qw, sc, zp, group, 4)
    words = ql.to_owned_order(qw) if owned else qw
    word_zp = ql.to_owned_zeros(zp, n) if zeros and owned else zp
    launched = []

    def launch(x2, qweight, scales, zeros, group_size, y, ws, counts, mode, owned=False, **cfg):
        launched.append((qweight.shape[0], y.shape[1], y.data_ptr(), cfg))
        if owned:
            qweight = ql.from_owned_order(qweight)
            zeros = None if zeros is None else ql.from_owned_zeros(zeros, k // group)
        y.copy_(reference.quant_matmul(x2, qweight, scales, zeros, group_size, 4))

    monkeypatch.setattr(qg, "launch", launch)
    cfg = {"block_m": 256, "stages": 4, "programs": 132, "persistent": True, "cluster": 2, "tma_store": True}
    cfg |= {"narrow_tail": 3} | ({"owned": True} if owned else {})
    y = qm._gluon(x, words, sc, word_zp, group, cfg)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    (first, last) = launched
    assert first[:3] == (640, 640, y.data_ptr()) and first[3]["persistent"] and first[3]["tma_store"]
    assert last[:3] == (384, 384, y.data_ptr() + 640 * y.element_size())
    assert last[3] == {"block_m": 128, "stages": 6}
    # an ``out`` whose rows TMA cannot write (unaligned): the first launch stores from the registers
    launched.clear()
    out = torch.empty(m * n + 1, dtype=torch.float16)[1:].view(m, n)
    qm._gluon(x, words, sc, word_zp, group, cfg, out=out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert launched[0][3]["tma_store"] is False and len(launched) == 2


@needs_hopper
@pytest.mark.parametrize(("m", "n", "zeros", "owned"), [(512, 28672, False, True), (448, 14336, True, False)])
def test_a_tail_launch_gives_the_whole_outputs_products(m, n, zeros, owned):
    # GLUON_TAIL's two launches (the first columns persistent in clusters, the last on 128-row tiles) make the
    # same products in the same order as one launch over the whole output: equal bit for bit (H200,
    # tests/gpu/mixed_tiles_probe.py), also through quant_matmul's rule.
    k, group = 4096, 128
    qw, sc, zp = _packed(n, k, group, zeros, torch.bfloat16, "cuda")
    words, word_zp = qw, zp
    if owned:
        words, word_zp = ql.to_owned_order(qw), ql.to_owned_zeros(zp, n) if zeros else None
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws, counts = qm._workspace(x.device, m * n, 4096)
    whole = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    cfg = dict(PERSIST)
    qg.launch(x, words, sc, word_zp, group, whole, ws, counts, mode=2, owned=owned, **cfg)
    tail = qm.narrow_tail(m, n, k, 132) or 4
    y = qm._gluon(x, words, sc, word_zp, group, cfg | {"narrow_tail": tail, "owned": owned})
    assert torch.equal(y, whole)
    ref = (x @ ql.dequantize(qw, sc, zp, (n, k), group, 4).to(torch.bfloat16).t()).float()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-3


def test_a_persistent_launch_takes_every_tile_whole_a_wave_at_a_time_and_may_store_them_by_tma():
    x, y = torch.zeros(2048, 4096, dtype=torch.bfloat16), torch.zeros(2048, 4096, dtype=torch.bfloat16)
    qw, sc = torch.zeros(4096, 512, dtype=torch.int32), torch.zeros(4096, 32, dtype=torch.bfloat16)
    # 8 x 32 tiles over 132 programs: every tile whole (the last wave partial), none split, no workspace
    grid, args, kwargs = qg.launch_args(
        x, qw, sc, None, 128, y, y, y, block_m=256, programs=132, persistent=True
    )
    assert grid == (132,) and args[-1] == 256 and kwargs["DP"] and kwargs["STREAM_K"] and kwargs["MODE"] == 0
    # in clusters: 66 of two, on an even count of programs only
    grid, args, kwargs = qg.launch_args(
        x, qw, sc, None, 128, y, y, y, block_m=256, programs=132, persistent=True, cluster=2
    )
    assert grid == (66, 1) and kwargs["CLUSTER"] == 2 and args[-1] == 256
    with pytest.raises(ValueError, match="clusters take whole tiles"):
        qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, programs=131, persistent=True, cluster=2)
    with pytest.raises(ValueError, match="a persistent launch needs its programs"):
        qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, persistent=True)
    # a TMA store of each tile: y in x's dtype, its start and rows 16-byte aligned (else quant_matmul's _gluon
    # stores from the registers)
    grid, args, kwargs = qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, tma_store=True)
    assert kwargs["TMA_STORE"] and args[3].block_shape == [256, 128] and qg.tma_storable(x, y)
    flat = torch.zeros(2048 * 4096 + 8, dtype=torch.bfloat16)
    rows = torch.zeros(2048, 4100, dtype=torch.bfloat16)[:, :4096]  # (8200-byte rows)
    for bad in (y.float(), flat[1 : 1 + 2048 * 4096].view(2048, 4096), rows):
        assert not qg.tma_storable(x, bad)
    with pytest.raises(ValueError, match="a TMA store takes whole tiles"):
        qg.launch_args(x, qw, sc, None, 128, y.float(), y, y, block_m=256, tma_store=True)
    with pytest.raises(ValueError, match="a TMA store takes whole tiles"):
        qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, split=2, mode=2, tma_store=True)


def test_clusters_take_whole_tiles_of_even_weight_tiles():
    x, y = torch.zeros(512, 4096, dtype=torch.bfloat16), torch.zeros(512, 4096, dtype=torch.bfloat16)
    qw, sc = torch.zeros(4096, 512, dtype=torch.int32), torch.zeros(4096, 32, dtype=torch.bfloat16)
    grid, args, kwargs = qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, cluster=2)
    # 2 x 32 tiles in 32 clusters of two (Triton's launcher launches num_ctas programs a grid point); each
    # program's x descriptor holds half a tile: each loads one half into both programs' stages
    assert grid == (32, 1) and kwargs["CLUSTER"] == 2 and args[0].block_shape == [128, 64]
    assert qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256)[1][0].block_shape == [256, 64]
    for bad in ({"programs": 132}, {"split": 2}, {"pdl": True}, {"block_n": 4096 // 3 + 1}):  # (3 tiles)
        with pytest.raises(ValueError, match="clusters take whole tiles"):
            qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, cluster=2, mode=2, **bad)
    with pytest.raises(ValueError, match="clusters of 1 or 2 programs, not 4"):
        qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, cluster=4)


def test_a_cluster_kernel_compiled_without_the_pass_is_refused_before_it_launches(monkeypatch):
    # Compiled without ptx_cluster's pass (another stages hook in its place), a CLUSTER kernel's ring would
    # wait for releases nobody sends: launch compiles it first and refuses it unless its metadata launches
    # clusters (num_ctas 2), once for each specialization. (A stand-in for Triton's compile: the kernel
    # compiles for sm_90 in test_ptx_cluster.py; no GPU compiles here.)
    from types import SimpleNamespace

    from squeezeserve.kernels.ops import ptx_cluster

    x, y = torch.zeros(512, 8192, dtype=torch.bfloat16), torch.zeros(512, 4096, dtype=torch.bfloat16)
    qw, sc = torch.zeros(4096, 1024, dtype=torch.int32), torch.zeros(4096, 64, dtype=torch.bfloat16)
    grid, args, kwargs = qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=256, cluster=2)
    compiled = []

    def warmup(*a, grid, **kw):
        compiled.append(grid)
        return SimpleNamespace(metadata=SimpleNamespace(num_ctas=ctas))

    monkeypatch.setattr(qg._wgmma_kernel, "warmup", warmup)
    monkeypatch.setattr(qg, "_CLUSTERED", set())
    ctas = 1
    with pytest.raises(ptx_cluster.ClusterError, match="compiled without the pass"):
        qg._check_clustered(grid, args, kwargs)
    ctas = 2
    qg._check_clustered(grid, args, kwargs)
    qg._check_clustered(grid, args, kwargs)  # (known: not compiled again)
    assert compiled == [grid, grid]


@pytest.mark.parametrize(
    ("name", "call", "mark"),
    [
        ("SQUEEZESERVE_GLUON_CLUSTER", "gluon_tiles(2048, 4096, 14336, 132)", "'cluster': 2"),
        ("SQUEEZESERVE_GLUON_PERSISTENT", "gluon_tiles(2048, 14336, 4096, 132)", "'persistent': True"),
        ("SQUEEZESERVE_GLUON_TAIL", "gluon_tiles(512, 28672, 4096, 132)", "'narrow_tail': 26"),
        ("SQUEEZESERVE_GLUON_HALF_TILES", "gluon_tiles(128, 6144, 4096, 132)", "'block_n': 64"),
        ("SQUEEZESERVE_GLUON_DECODE_WHOLE", "gluon_decode_tiles(8, 132, 14336, 4096)", "'split': 1"),
        ("SQUEEZESERVE_GLUON_DEEP_K", "gluon_tiles(128, 14336, 14336, 132)", "'block_k': 128"),
        ("SQUEEZESERVE_GLUON_STREAM_K_RELEASE", "gluon_tiles(96, 4096, 14336, 132)", "'wg_release': True"),
    ],
)
def test_gluon_cluster_settings_turn_them_off_and_refuse_a_bad_value(name, call, mark):
    code = f"from squeezeserve.kernels.ops import quant_matmul as q; print(q.{call})"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQUEEZESERVE_")}

    def run(value: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code]
        return subprocess.run(command, env=env | {name: value}, capture_output=True, text=True, timeout=300)

    for value, seen in (("on", True), ("off", False)):
        r = run(value)
        assert r.returncode == 0 and (mark in r.stdout) == seen, r.stderr[-2000:]
    refused = run("2")
    assert refused.returncode != 0 and f"{name} must be on or off, got '2'" in refused.stderr


def test_a_prefill_the_cluster_pass_refuses_runs_its_programs_alone(monkeypatch):
    # Where ptx_cluster cannot rewrite the kernel (a Triton whose PTX it does not know), the compile fails
    # before anything runs (or, compiled without the pass, launch refuses it before its first launch:
    # _check_clustered); quant_matmul launches the same tiles a program alone and keeps to that.
    from squeezeserve.kernels.ops import ptx_cluster

    asked = []

    def launch(*args, **cfg):
        asked.append(cfg.get("cluster", 1))
        if cfg.get("cluster", 1) > 1:
            raise RuntimeError("compile failed") from ptx_cluster.ClusterError("ptx_cluster: not this PTX")

    monkeypatch.setattr(qg, "launch", launch)
    monkeypatch.setattr(qm, "GLUON_CLUSTER", "on")
    monkeypatch.setattr(qm, "GLUON_OFF", None)
    x2 = torch.zeros(512, 256, dtype=torch.bfloat16)
    qw, sc, _ = _packed(512, 256, 128, False)
    cfg = {"block_m": 256, "stages": 4, "cluster": 2}
    y = qm._gluon(x2, qw, sc, None, 128, cfg)
    assert asked == [2, 1] and y is not None and y.shape == (512, 512)
    assert qm.GLUON_CLUSTER == "off" and "cluster" not in qm.gluon_tiles(2048, 4096, 14336, 132)
    assert qm.GLUON_OFF is None


def test_gluon_tiles_take_128_row_tiles_where_a_third_256_row_tile_is_at_most_half_full():
    # 513-640 rows past one wave of 256-row tiles: 128-row tiles, a tile a program where the weight stays in
    # the L2 and the last wave is over 40% full (qkv), else whole waves but one, then the rest stream-K
    # (gate_up's words: 58.7 MB). NOTES.md, twenty-ninth session: qkv 63-65 us against 85-99, gate_up 266-274
    # against 292-379.
    # (128 deep in groups of 128 and more: GLUON_DEEP_K, fortieth session)
    own = {"block_m": 128, "stages": 5, "block_k": 128, "wg_release": True}
    assert qm.gluon_tiles(513, 6144, 4096, 132) == own  # 240 tiles: 108 last
    assert qm.gluon_tiles(640, 6144, 4096, 132, 64) == {"block_m": 128, "stages": 6}
    sk = {"block_m": 128, "stages": 6, "programs": 132, "dp_waves": -1}
    assert qm.gluon_tiles(600, 28672, 4096, 132) == sk  # past the L2
    assert qm.gluon_tiles(600, 14336, 4096, 132) == sk  # 560 tiles: 32 in the last wave
    hybrid = {"block_m": 256, "stages": 4, "programs": 132, "dp_waves": -1}
    assert qm.gluon_tiles(641, 6144, 4096, 132) == hybrid  # a third tile over half full: as before
    # one partial wave of 256-row tiles (4096 wide: 96 tiles) keeps them
    assert qm.gluon_tiles(600, 4096, 4096, 132) == {"block_m": 256, "stages": 4}
    assert qm.gluon_tiles(600, 4096, 14336, 132) == {"block_m": 256, "stages": 4, "cluster": 2}
    assert qm.gluon_tiles(512, 6144, 4096, 132) == {"block_m": 256, "stages": 4}  # two whole 256-row tiles


def test_gluon_in_auto_measured_choices():
    # (gluon_prefill_probe.py on the H100: NOTES.md, "eleventh session")
    rule = qm.gluon_in_auto
    assert rule(128, 14336, 14336, 128) and rule(2048, 28672, 4096, 128)
    assert not rule(2049, 14336, 14336, 128)  # a deep K: the whole weight's dequantize + cuBLAS past 2048
    # where dequantize + cuBLAS would slice the weight (K = 4096), the Gluon GEMM to 4096 rows: the slices'
    # host time (prefill_host_probe.py, NOTES.md, twenty-seventh session)
    assert rule(4096, 28672, 4096, 128) and rule(3072, 6144, 4096, 128) and rule(4096, 4096, 4096, 128)
    assert not rule(4097, 28672, 4096, 128) and not rule(4097, 4096, 4096, 128)
    assert not rule(2049, 4096, 14336, 128) and not rule(1025, 28672, 4096, 32)
    assert rule(1024, 14336, 14336, 32) and not rule(2048, 14336, 14336, 32)
    assert rule(512, 4096, 4096, 128) and rule(128, 4096, 14336, 128)
    assert not rule(256, 4096, 14336, 128) and not rule(128, 4096, 4096, 64)  # (the Triton GEMM)
    # o_proj-wide short reductions in groups of 128 or more at 80-256 rows: 64-row weight tiles 128 deep, a
    # program each (NOTES.md, fortieth session; GLUON_DEEP_K_HALF_MAX_M)
    assert rule(80, 4096, 4096, 128) and rule(256, 4096, 4096, 128) and not rule(79, 4096, 4096, 128)
    assert not rule(512, 4096, 4096, 32)  # narrow with small groups: the paths before
    assert not rule(512, 2048, 2048, 128)  # the bundled model's widths: dequantize + cuBLAS
    # (NOTES.md, "thirteenth session") qkv-wide outputs up to 256 rows in any group; 4096 wide from 129 rows
    # with zero points in groups of 64 or more
    assert rule(256, 6144, 4096, 128) and rule(128, 6144, 4096, 32, True) and not rule(512, 6144, 4096, 32)
    assert rule(256, 4096, 4096, 64, True) and rule(256, 4096, 14336, 128, True)
    assert not rule(128, 4096, 4096, 64, True) and not rule(256, 4096, 4096, 32, True)


@pytest.mark.parametrize(
    "name, shown, good, seen, bad, message",
    [
        ("SQUEEZESERVE_GLUON_PREFILL_MAX_M", "qm.gluon_prefill_max_m(4096, 128)", "2048", "2048", "4k", ""),
        ("SQUEEZESERVE_DEQUANT_SLICE_ROWS", "qm.DEQUANT_SLICE_ROWS", "2048", "2048", "100",
         " (a multiple of 8)"),
        # (the rule before: 256-row tiles at 600 rows of qkv, and no whole waves first on o_proj at 1025)
        ("SQUEEZESERVE_GLUON_THIRD_TILE_MAX_M", "qm.gluon_tiles(600, 6144, 4096, 132)['block_m']", "0", "256",
         "off", ""),
        ("SQUEEZESERVE_GLUON_DP_WHOLE_MIN_N", "qm.gluon_tiles(1025, 4096, 4096, 132).get('dp_waves')", "6144",
         "None", "-1", ""),
    ],
)  # fmt: skip
def test_prompt_row_settings_take_an_ab_value_and_refuse_a_bad_one(name, shown, good, seen, bad, message):
    # A/B runs of a server (run_h100.sh pdl-ab's B_ENV): SQUEEZESERVE_GLUON_PREFILL_MAX_M sets the rows the
    # Gluon GEMM takes where dequantize + cuBLAS would slice, SQUEEZESERVE_DEQUANT_SLICE_ROWS the slices'
    # weight rows (whole words of packed zero points), SQUEEZESERVE_GLUON_THIRD_TILE_MAX_M and
    # SQUEEZESERVE_GLUON_DP_WHOLE_MIN_N gluon_tiles' rule before the twenty-ninth session; anything else stops
    # the import with the reason.
    code = f"from squeezeserve.kernels.ops import quant_matmul as qm; print({shown})"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQUEEZESERVE_")}

    def run(value: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code]
        return subprocess.run(command, env=env | {name: value}, capture_output=True, text=True, timeout=300)

    set_to = run(good)
    assert set_to.returncode == 0 and set_to.stdout.split() == [seen], set_to.stderr[-2000:]
    refused = run(bad)
    assert refused.returncode != 0
    assert f"{name} must be a row count{message}, got '{bad}'" in refused.stderr


def test_wg_release_setting_turns_it_off_and_refuses_a_bad_value():
    # SQUEEZESERVE_WG_RELEASE=off: the 64-row decode and the 128-row prefill tiles free their stages after a
    # barrier of both warpgroups, as before the thirty-first session (A/B runs of a server); anything but on /
    # off stops the import.
    code = "from squeezeserve.kernels.ops import quant_matmul as qm\n"
    code += "print(qm.gluon_decode_tiles(64, 132)['wg_release'],"
    code += " qm.gluon_tiles(128, 14336, 4096, 132)['wg_release'])"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQUEEZESERVE_")}

    def run(value: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code]
        return subprocess.run(
            command, env=env | {"SQUEEZESERVE_WG_RELEASE": value}, capture_output=True, text=True, timeout=300
        )

    for value, seen in (("on", "True"), ("off", "False")):
        r = run(value)
        assert r.returncode == 0 and r.stdout.split() == [seen, seen], r.stderr[-2000:]
    refused = run("0")
    assert refused.returncode != 0 and "SQUEEZESERVE_WG_RELEASE must be on or off, got '0'" in refused.stderr


def test_a_decode_the_release_pass_refuses_runs_with_gluons_own_release(monkeypatch):
    # Where ptx_release cannot rewrite the kernel (a Triton whose PTX it does not know), the compile fails
    # before anything runs; quant_matmul launches the same tiling with Gluon's own release and keeps to that.
    # (The launch is a stand-in: the Gluon kernel runs on sm_90 only; the pass's refusals are
    # test_ptx_release.py's, its launches on the H100 test_quant_matmul_gluon.py's GPU tests.)
    from squeezeserve.kernels.ops import ptx_release

    asked = []

    def launch(*args, **cfg):
        asked.append(cfg["wg_release"])
        if cfg["wg_release"]:  # (as Triton's compile passes it on: wrapped)
            raise RuntimeError("compile failed") from ptx_release.ReleaseError("ptx_release: not this PTX")

    monkeypatch.setattr(qg, "launch", launch)
    monkeypatch.setattr(qm, "WG_RELEASE", "on")
    monkeypatch.setattr(qm, "GLUON_OFF", None)
    x2 = torch.zeros(64, 256, dtype=torch.bfloat16)
    qw, sc, _ = _packed(256, 256, 128, False)
    y = qm._gluon(x2, qw, sc, None, 128, qm.gluon_decode_tiles(64, 132))
    assert asked == [True, False] and y is not None and y.shape == (64, 256)
    assert qm.WG_RELEASE == "off" and not qm.gluon_decode_tiles(64, 132)["wg_release"]
    assert qm.GLUON_OFF is None  # (the Gluon kernel itself stays on)
    # any other error is not the pass's: it is raised as it was
    monkeypatch.setattr(qg, "launch", lambda *a, **k: (_ for _ in ()).throw(KeyError("not a build error")))
    with pytest.raises(KeyError):
        qm._gluon(x2, qw, sc, None, 128, qm.gluon_decode_tiles(64, 132))


def _through_quant_matmul(takes, m, n, k, group, zeros, dtype):
    """Random inputs that ``takes`` sends to the Gluon kernel, through quant_matmul twice (the second call
    replays nothing: a launch plan cannot hold this launch), against dequantize + matmul."""
    qw, sc, zp = _packed(n, k, group, zeros, dtype, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert takes(x, qw, sc, zp, group, 4)
    ref = (x @ ql.dequantize(qw, sc, zp, (n, k), group, 4).to(dtype).t()).float()
    for _ in range(2):
        y = K.quant_matmul(x, qw, sc, zp, group, 4).float()
        assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    return x, qw, sc, zp, ref


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "dtype"),
    [
        (128, 4096, 4096, 128, False, torch.bfloat16),
        (200, 4160, 4096, 128, True, torch.bfloat16),  # M and N tails
        (77, 4096, 4160, 32, True, torch.bfloat16),  # odd K tile count: a zero tile pads it
        (130, 4096, 4128, 32, True, torch.bfloat16),  # K ends inside a tile
        (512, 6144, 4096, 32, False, torch.bfloat16),
        (256, 4096, 2048, 64, True, torch.float16),
        (300, 4096, 14336, 128, True, torch.bfloat16),  # 257-384 rows: 128-row tiles, stream-K
        (320, 28672, 4096, 128, False, torch.bfloat16),  # the same past the L2 (gate_up)
        (2048, 8192, 4096, 256, False, torch.bfloat16),
    ],
)
def test_gluon_prefill_is_dequantize_then_matmul(m, n, k, group, zeros, dtype, monkeypatch):
    monkeypatch.setattr(qm, "PREFILL", "gluon")
    x, qw, sc, zp, ref = _through_quant_matmul(qm._gluon_prefill, m, n, k, group, zeros, dtype)
    for split, mode in ((1, 0), (3, 1), (4, 2)):  # every way the K splits meet, directly
        ws, counts = qm._workspace(x.device, m * n, 4096)
        out = torch.zeros((m, n), device="cuda", dtype=torch.float32 if mode == 1 else dtype)
        qg.launch(x, qw, sc, zp, group, out, ws, counts, block_m=128, split=split, mode=mode)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (split, mode, err)
    assert all(not t.any() for t in qm.workspace_buffers())  # the last split of each tile cleaned up


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "zeros", "tiling"),
    [
        (600, 6144, 4096, False, {"block_m": 128, "block_k": 128}),  # qkv: 128-row tiles, a tile a program
        (560, 28672, 4096, True, {"block_m": 128, "programs": 132, "dp_waves": -1}),  # gate_up
        (1100, 4096, 14336, True, {"block_m": 256, "programs": 132, "dp_waves": 1}),  # down_proj
        (2100, 4096, 4096, False, {"block_m": 256, "programs": 132, "dp_waves": 2}),  # o_proj
        # (GLUON_DEEP_K's 128-deep K tiles from here)
        (100, 6144, 4096, True, {"block_n": 64, "num_warps": 4, "block_k": 128}),  # qkv: 64-row weight tiles
        (128, 8192, 4160, False, {"block_n": 64, "num_warps": 4, "block_k": 128}),  # (K ends inside a tile)
        (120, 4096, 14336, True, {"block_n": 64, "split": 2, "block_k": 128}),  # down_proj: K in two parts
        (128, 4096, 14368, False, {"block_n": 64, "split": 2, "block_k": 128}),  # (K ends inside a tile)
        (128, 14336, 4096, True, {"block_m": 128, "wg_release": True, "block_k": 128}),  # warpgroup releases
        (100, 14336, 4160, False, {"block_m": 128, "wg_release": True, "block_k": 128}),  # (K ends in a tile)
        (200, 6144, 4096, True, {"block_m": 128, "wg_release": True, "block_k": 128}),  # qkv: a wave, M tail
        (480, 4096, 14336, False, {"block_m": 128, "wg_release": True, "block_k": 128}),  # down_proj: a wave
        (300, 4096, 4160, True, {"block_m": 128, "wg_release": True, "block_k": 128}),  # (K ends in a tile)
        (128, 4096, 4096, False, {"block_n": 64, "num_warps": 4, "block_k": 128}),  # o_proj: 64-row tiles
        (200, 4096, 4096, True, {"block_n": 64, "num_warps": 4, "block_k": 128}),  # (two rows of x tiles)
        # (GLUON_STREAM_K_RELEASE: 128-row tiles stream-K, each warpgroup freeing its own stages, 128 deep)
        (96, 4096, 14336, True, SK),  # down_proj
        (72, 6144, 4160, False, SK),  # qkv (K ends in a tile)
        (200, 4096, 14336, True, SK),  # down_proj at 144-256 rows: an M tail (packed: zero points)
        (320, 28672, 4096, True, SK),  # gate_up: past the L2
        (300, 14336, 4096, False, SK),  # in the L2, from GLUON_NARROW_L2_MIN_M rows
        (280, 6144, 4160, True, SK),  # qkv (K ends in a tile)
    ],
)
def test_the_rules_mid_row_tilings_give_dequantize_then_matmul(m, n, k, zeros, tiling):
    # The tilings gluon_tiles takes at mid-size prompts (64-row weight tiles up to 128 rows, 128-row tiles at
    # 513-640 rows, whole waves before stream-K on 4096-wide outputs), on packed words and on owned ones (as
    # the vLLM method repacks the 8B model's gate_up and down_proj), with zero points too; the workspace's
    # tiles cleaned up after.
    group, dtype = 128, torch.bfloat16
    assert tiling.items() <= qm.gluon_tiles(m, n, k, 132).items()
    x, qw, sc, zp, ref = _through_quant_matmul(qm._gluon_prefill, m, n, k, group, zeros, dtype)
    owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
    y = qm.quant_matmul_owned(x, ql.to_owned_order(qw), sc, owned_zp, group).float()
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    assert all(not t.any() for t in qm.workspace_buffers())


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "dtype"),
    [
        (128, 6144, 4096, 32, True, torch.bfloat16),  # qkv, 8 groups a 256-deep tile, zero points
        (96, 6144, 4096, 64, False, torch.bfloat16),
        (100, 8192, 4160, 32, True, torch.float16),  # K ends inside a tile
        (80, 8192, 4096, 64, True, torch.float16),
    ],
)
def test_64_row_weight_tiles_at_groups_under_128(monkeypatch, m, n, k, group, zeros, dtype):
    # GLUON_HALF_TILES' tiles with groups of 32 and 64 (the rule's from GLUON_HALF_TILES_MIN_M_SMALL_GROUP
    # rows; here from 80): the tiling taken, the product on packed and owned words, the workspace unused.
    monkeypatch.setattr(qm, "GLUON_HALF_TILES_MIN_M_SMALL_GROUP", 80)
    assert {"block_n": 64, "num_warps": 4}.items() <= qm.gluon_tiles(m, n, k, 132, group).items()
    x, qw, sc, zp, ref = _through_quant_matmul(qm._gluon_prefill, m, n, k, group, zeros, dtype)
    owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
    y = qm.quant_matmul_owned(x, ql.to_owned_order(qw), sc, owned_zp, group).float()
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    assert all(not t.any() for t in qm.workspace_buffers())


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "zeros"),
    [
        (3344, 6144, 4096, False),  # qkv: whole waves, then stream-K (its warm-up row)
        (4096, 4096, 4096, True),  # o_proj at the limit, zero points
        (2560, 28672, 4096, False),  # gate_up, owned words as the vLLM method repacks them
    ],
)
def test_rows_past_2048_where_k_would_slice_take_the_gluon_gemm(m, n, k, zeros):
    # PREFILL="auto": where dequantize + cuBLAS would slice the weight, g128 takes the Gluon GEMM to 4096
    # rows (gluon_prefill_max_m), on packed words and on owned ones, and gives dequantize + matmul's product.
    group, dtype = 128, torch.bfloat16
    assert qm.gluon_prefill_max_m(k, group) == qm.gluon_prefill_max_m(k, group, owned=True) == 4096
    x, qw, sc, zp, ref = _through_quant_matmul(qm._gluon_prefill, m, n, k, group, zeros, dtype)
    owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
    y = qm.quant_matmul_owned(x, ql.to_owned_order(qw), sc, owned_zp, group).float()
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3


@needs_hopper
@pytest.mark.parametrize(("m", "n", "zeros"), [(4097, 6144, True), (6144, 28672, False)])
def test_rows_past_4096_take_dequantize_and_cublas_in_slices_of_the_weight(m, n, zeros):
    # Past gluon_prefill_max_m where K = 4096: dequantize + cuBLAS, DEQUANT_SLICE_ROWS weight rows at a time
    # (qkv's 6144: a whole slice and part of one, its packed zero points from mid-tensor; gate_up's 28672),
    # on packed words and on owned ones, gives dequantize + matmul's product.
    group, k, dtype = 128, 4096, torch.bfloat16
    qw, sc, zp = _packed(n, k, group, zeros, dtype, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert m > qm.gluon_prefill_max_m(k, group) and qm._slice_rows(x, qw, sc, zp) == qm.DEQUANT_SLICE_ROWS < n
    ref = (x @ ql.dequantize(qw, sc, zp, (n, k), group, 4).to(dtype).t()).float()
    owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
    for y in (
        K.quant_matmul(x, qw, sc, zp, group, 4),
        qm.quant_matmul_owned(x, ql.to_owned_order(qw), sc, owned_zp, group),
    ):
        assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-3


def test_split_tiles_need_a_way_to_meet():
    qw, sc, _ = _packed(256, 4096, 128, False)
    x = torch.zeros(16, 4096, dtype=torch.bfloat16)
    y = torch.empty(16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mode 1 or 2"):  # 2 tiles over 3 programs: parts of tiles
        qg.launch(x, qw, sc, None, 128, y, y, y, block_m=16, programs=3)
    with pytest.raises(ValueError, match="mode 1 or 2"):
        qg.launch(x, qw, sc, None, 128, y, y, y, block_m=16, split=2)


def test_a_tiles_likely_last_part_reads_the_count_first_unless_asked_not_to():
    # (tests/gpu/decode_stream_probe.py on the H100: NOTES.md, "eighteenth session"; correctness of both ways
    # where parts of tiles meet: test_gluon_stream_k_is_dequantize_then_matmul, compiled on the device)
    qw, sc, _ = _packed(256, 4096, 128, False)
    x = torch.zeros(16, 4096, dtype=torch.bfloat16)
    y = torch.empty(16, 256, dtype=torch.bfloat16)
    on = qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=16, programs=3, mode=2)[2]
    off = qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=16, programs=3, mode=2, late_first=False)[2]
    assert on["LATE_FIRST"] and not off["LATE_FIRST"] and on["MODE"] == off["MODE"] == 2


def test_data_parallel_waves_take_whole_tiles_before_the_shared_rest():
    # 640 x 4096 on 128 x 128 tiles: 160 tiles over 7 programs, 22 full waves and 6 tiles over
    x, qw = torch.zeros(640, 4096, dtype=torch.bfloat16), torch.zeros(4096, 512, dtype=torch.int32)
    sc = torch.zeros(4096, 32, dtype=torch.bfloat16)
    y = torch.zeros(640, 4096)

    def dp_tiles(**tiling):
        grid, args, kwargs = qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=128, mode=2, **tiling)
        return args[-1], kwargs["MODE"], grid

    assert dp_tiles(programs=7) == (0, 2, (7,))  # all shared
    assert dp_tiles(programs=7, dp_waves=2) == (14, 2, (7,))
    assert dp_tiles(programs=7, dp_waves=-1) == (21 * 7, 2, (7,))  # all the full waves but one
    assert dp_tiles(programs=7, dp_waves=99)[0] == 22 * 7  # at most the full waves
    assert dp_tiles(programs=7, dp_waves=-99)[0] == 0
    assert dp_tiles(programs=8, dp_waves=99) == (160, 0, (8,))  # 20 whole waves: no tile in parts
    assert dp_tiles(split=2, dp_waves=3)[0] == 0  # split mode: no waves


_DEEP = {"block_n": 64, "block_k": 256, "num_warps": 4}  # decode's tiles: one warpgroup, 256-deep K tiles


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "tiling"),
    [
        (512, 2304, 4160, 128, False, {"block_m": 256, "programs": 132}),  # parts of up to three tiles
        (16, 14336, 4096, 128, False, {"block_m": 16, "block_k": 256, "programs": 132}),
        (5, 4160, 4160, 128, True, {"block_m": 8, "block_k": 256, "programs": 100}),  # odd K tiles, tails
        (64, 4096, 14336, 32, True, {"block_m": 64, "stages": 8, "programs": 132}),
        (33, 4096, 4096, 64, True, {"block_m": 64, "block_n": 64, "num_warps": 4, "programs": 99}),
        (1, 2048, 2048, 128, False, {"block_m": 8, "block_k": 256, "programs": 8}),  # whole tiles each
        (300, 2048, 4160, 128, True, {"block_m": 256, "split": 3}),
        # eight groups a 256-deep K tile (g32), four (g64): each row's group parameters in one vector
        (16, 14336, 4096, 32, True, {"block_m": 16, "programs": 132} | _DEEP),
        (5, 4160, 3840, 64, True, {"block_m": 8, "programs": 100} | _DEEP),  # N tail; odd K tiles: pad masked
        (40, 4096, 2048, 32, False, {"block_m": 64, "block_k": 256, "stages": 3, "programs": 132}),  # 8 warps
        # runs of about ten tiles (whole tiles between a first and a last part), and of part of one tile
        (16, 4096, 2048, 128, True, {"block_m": 16, "programs": 7} | _DEEP),
        (3, 4096, 4096, 128, False, {"block_m": 8, "programs": 500} | _DEEP),
        # whole tiles a wave first (data-parallel), then the rest shared: parts of tiles, none, all
        (640, 4096, 4096, 128, False, {"block_m": 128, "programs": 7, "dp_waves": 2}),  # 160 tiles: 2 x 7
        (512, 2304, 4160, 32, True, {"block_m": 128, "programs": 9, "dp_waves": -1}),  # 72 tiles: 7 x 9, 9
        (256, 4096, 2048, 128, True, {"block_m": 128, "programs": 16, "dp_waves": 99}),  # 64: whole
    ],
)
def test_gluon_stream_k_is_dequantize_then_matmul(m, n, k, group, zeros, tiling):
    qw, sc, zp = _packed(n, k, group, zeros, torch.bfloat16, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = (x @ ql.dequantize(qw, sc, zp, (n, k), group, 4).to(x.dtype).t()).float()
    y = qg.prefill(x, qw, sc, zp, group, **tiling).float()  # parts meet in fp32 atomics (MODE 1)
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    ws, counts = qm._workspace(x.device, m * n, 4096)
    out = torch.empty((m, n), device="cuda", dtype=x.dtype)
    qg.launch(x, qw, sc, zp, group, out, ws, counts, mode=2, **tiling)  # in the workspace
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3
    assert all(not t.any() for t in qm.workspace_buffers())  # each tile's last part cleaned up


def test_gluon_decode_measured_choices():
    # (gluon_prefill_probe.py on the H100: NOTES.md, "eleventh session" and "eighteenth session")
    auto = qm.gluon_decode_in_auto
    assert auto(2, 14336, 14336) and auto(64, 14336, 14336) and auto(2, 28672, 4096)
    assert not auto(1, 14336, 14336)  # one row: the FMA kernel
    assert not auto(16, 14336, 4096) and auto(17, 14336, 4096) and not auto(16, 4096, 14336)
    assert not auto(16, 6144, 4096) and auto(17, 6144, 4096) and auto(24, 6144, 4096) and auto(64, 6144, 4096)
    assert auto(24, 6144, 4096, zeros=True)  # (thirty-second session: 13.9 us against 18.0)
    # 4096^2 (2^24 values): from 33 rows (the 64-row tiling's warpgroups free their own stages), g32 from 17
    assert not auto(32, 4096, 4096) and auto(33, 4096, 4096) and auto(64, 4096, 4096)
    assert not auto(16, 4096, 4096, 32) and auto(17, 4096, 4096, 32) and auto(64, 4096, 4096, 32)
    assert not auto(64, 4096, 4096, 32, zeros=True) and auto(64, 6144, 4096, 32, zeros=True)
    assert not auto(64, 4096, 2048) and not auto(32, 4096, 2048, 32)  # (smaller weights: the other kernels)
    one = qm.gluon_decode_tiles(1, 132)
    assert (one["block_m"], one["block_n"], one["num_warps"], one["block_k"]) == (8, 64, 4, 256)
    assert one["programs"] == 264 and one["occupancy"] == 2  # two programs an SM
    assert qm.gluon_decode_tiles(9, 132)["block_m"] == 16 and qm.gluon_decode_tiles(32, 132)["block_m"] == 32
    wide = qm.gluon_decode_tiles(33, 132)
    assert (wide["block_m"], wide["block_n"], wide["num_warps"], wide["programs"]) == (64, 128, 8, 132)
    assert "occupancy" not in wide
    # its two warpgroups free their stages each for itself; a one-warpgroup program has no other to wait for
    assert wide["wg_release"] and not qm.gluon_decode_tiles(32, 132).get("wg_release")

    # a tile a program, two an SM, where the 64-row tiles fill 3/4 of those slots to all and K is short
    # (GLUON_DECODE_WHOLE_*: 14336-wide outputs, 224 tiles in 264 slots); stream-K elsewhere
    for m in (1, 8, 16, 32):
        shared = {k: v for k, v in qm.gluon_decode_tiles(m, 132).items() if k != "programs"}
        assert qm.gluon_decode_tiles(m, 132, 14336, 4096) == shared | {"split": 1}, m
    assert qm.gluon_decode_tiles(64, 132, 14336, 4096)["programs"] == 132  # (the 64-row tiling)
    assert qm.gluon_decode_tiles(8, 132, 14336, 14336)["programs"] == 264  # deep K
    assert qm.gluon_decode_tiles(16, 132, 12672, 4096)["split"] == 1  # 198 tiles: 3/4 of 264
    assert qm.gluon_decode_tiles(16, 132, 12608, 4096)["programs"] == 264  # 197
    assert qm.gluon_decode_tiles(16, 132, 16960, 4096)["programs"] == 264  # 265 tiles: past two an SM
    assert qm.gluon_decode_tiles(1, 132, 28672, 4096)["programs"] == 264  # gate_up's 448 (not four an SM)


def test_groups_a_deep_tile_takes():
    # 256-deep decode tiles: one group (g256 and up), two (g128), or four or eight of whole words (g64, g32)
    # where K is whole tiles; auto decodes groups under GLUON_DECODE_MIN_GROUP on the other kernels.
    x = torch.zeros(16, 4096, dtype=torch.bfloat16)
    for group, taken in ((512, True), (256, True), (128, True), (64, True), (32, True), (16, False)):
        qw, sc, _ = _packed(512, 4096, group, False)
        assert qg.supported(x, qw, sc, group, 4, 256) is taken, group
    qw, sc, _ = _packed(512, 4160, 32, False)  # 16.25 tiles of 256: one ends past K
    assert not qg.supported(torch.zeros(16, 4160, dtype=torch.bfloat16), qw, sc, 32, 4, 256)
    assert qg.supported(torch.zeros(16, 4160, dtype=torch.bfloat16), qw, sc, 32, 4, 64)  # two a 64-deep tile
    # auto: g32 as g128 (NOTES.md, "eighteenth session"), g64 not timed
    auto = qm.gluon_decode_in_auto
    assert auto(16, 14336, 14336, 32) and auto(16, 14336, 14336, 128) and not auto(16, 14336, 4096, 32)
    assert auto(17, 14336, 4096, 32) and auto(64, 6144, 4096, 32)
    assert not auto(32, 14336, 14336, 64) and not auto(32, 14336, 14336, 16)
    # g32 with zero points: from 17 rows of 2^26 values, from 33 as the others
    assert not auto(16, 28672, 4096, 32, zeros=True) and auto(17, 28672, 4096, 32, zeros=True)
    assert not auto(24, 4096, 14336, 32, zeros=True) and auto(33, 4096, 14336, 32, zeros=True)
    assert auto(2, 28672, 4096, 128, zeros=True)


def test_cpu_decode_never_takes_it(monkeypatch):
    monkeypatch.setattr(qm, "DECODE", "gluon")
    qw, sc, _ = _packed(256, 4096, 128, False)
    assert not qm._gluon_decode(torch.randn(16, 4096, dtype=torch.bfloat16), qw, sc, None, 128, 4)


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "dtype"),
    [
        (1, 4160, 4096, 128, False, torch.bfloat16),  # N tail
        (2, 4096, 4352, 128, True, torch.bfloat16),  # odd K tile count: a zero tile pads it
        (5, 2048, 14336, 128, True, torch.bfloat16),
        (16, 4096, 4096, 256, False, torch.bfloat16),
        (33, 4096, 4096, 128, True, torch.float16),
        (64, 6144, 4096, 128, False, torch.bfloat16),
        (2, 4096, 3840, 32, True, torch.bfloat16),  # eight groups a K tile, odd K tile count
        (16, 4160, 4096, 32, True, torch.float16),
        (33, 4096, 14336, 64, False, torch.bfloat16),  # four
    ],
)
def test_gluon_decode_is_dequantize_then_matmul(m, n, k, group, zeros, dtype, monkeypatch):
    monkeypatch.setattr(qm, "DECODE", "gluon")
    _through_quant_matmul(qm._gluon_decode, m, n, k, group, zeros, dtype)
    assert all(not t.any() for t in qm.workspace_buffers())


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "dtype"),
    [
        (4, 14336, 4096, 128, True, torch.bfloat16),  # the 8B model's 14336-wide outputs: 224 tiles
        (16, 14336, 4096, 32, False, torch.float16),
        (32, 12680, 3840, 32, True, torch.bfloat16),  # an N tail (199 tiles), an odd count of K tiles
        (1, 14336, 4096, 128, False, torch.bfloat16),
    ],
)
def test_a_decode_of_a_tile_a_program_on_packed_and_owned_words(m, n, k, group, zeros, dtype, monkeypatch):
    # GLUON_DECODE_WHOLE_*: the decode's tiling a tile a program, two an SM, through quant_matmul on packed
    # words and quant_matmul_owned on owned ones, launched plainly and as a programmatic dependent.
    monkeypatch.setattr(qm, "DECODE", "gluon")
    assert qm.gluon_decode_tiles(m, 132, n, k)["split"] == 1
    x, qw, sc, zp, ref = _through_quant_matmul(qm._gluon_decode, m, n, k, group, zeros, dtype)
    owned = (ql.to_owned_order(qw), sc, ql.to_owned_zeros(zp, n) if zeros else None)
    for y in (qm._quant_matmul(x, qw, sc, zp, group, 4, True), qm.quant_matmul_owned(x, *owned, group),
              qm._quant_matmul_owned(x, *owned, group, True)):  # fmt: skip
        assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-3
    assert all(not t.any() for t in qm.workspace_buffers())


def test_a_triton_without_gluon_turns_it_off(monkeypatch, caplog):
    # Gluon's Hopper API missing (an older Triton): quant_matmul says so once and runs the Triton kernels.
    monkeypatch.setattr(qm, "GLUON_OFF", None)
    monkeypatch.setitem(sys.modules, "squeezeserve.kernels.ops.quant_matmul_gluon", None)  # import fails
    with caplog.at_level(logging.WARNING, logger=qm.__name__):
        assert qm.gluon_module() is None
    assert "has no Gluon for Hopper" in qm.GLUON_OFF
    assert "the Gluon kernel is off" in caplog.text
    caplog.clear()
    assert qm.gluon_module() is None and not caplog.text  # said once
    monkeypatch.setitem(sys.modules, "squeezeserve.kernels.ops.quant_matmul_gluon", qg)  # importable again
    assert qm.gluon_module() is None  # off for the rest of the process
    monkeypatch.setattr(qm, "GLUON_OFF", None)
    assert qm.gluon_module() is qg


@needs_hopper
def test_a_kernel_that_does_not_build_falls_back(monkeypatch):
    # What Triton raises when the kernel does not build (here ptxas's error, injected) turns the Gluon kernel
    # off; the call, and those after it, run the Triton kernels with the same result.
    from triton.runtime.errors import PTXASError

    def refuse(*args, **kwargs):
        raise PTXASError("ptxas fatal: injected")

    monkeypatch.setattr(qm, "GLUON_OFF", None)
    monkeypatch.setattr(qm, "PREFILL", "gluon")
    monkeypatch.setattr(qg, "launch", refuse)
    qw, sc, zp = _packed(4096, 4096, 128, True, torch.bfloat16, "cuda")
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    ref = (x @ ql.dequantize(qw, sc, zp, (4096, 4096), 128, 4).to(x.dtype).t()).float()
    for _ in range(2):
        y = K.quant_matmul(x, qw, sc, zp, 128, 4).float()
        assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    assert "PTXASError: PTXAS error: ptxas fatal: injected" in qm.GLUON_OFF
    assert not qm._gluon_prefill(x, qw, sc, zp, 128, 4)


@needs_hopper
@pytest.mark.parametrize("cpp", [False, True], ids=["python-replay", "cpp-replay"])
@pytest.mark.parametrize(
    ("m", "n", "k", "zeros", "exact"),
    [
        (32, 4096, 14336, False, False),
        (256, 6144, 4096, True, True),
        (128, 4096, 14336, True, False),
        (2048, 4096, 8192, False, True),  # clusters of two programs sharing x (launched as the kernel's own)
        (2048, 14336, 4096, True, True),  # persistent, in clusters (quant_matmul.GLUON_PERSISTENT)
        (896, 14336, 4096, True, True),  # and a tail of 128-row tiles (GLUON_TAIL: views of W and y)
    ],
    ids=["decode", "prefill", "stream-k", "clusters", "persistent-clusters", "tail"],
)
def test_launch_plans_replay_the_gluon_kernel(m, n, k, zeros, exact, cpp, monkeypatch):
    # Its TMA descriptors are made again over each call's tensors (in Python, or as tensor maps in C++):
    # replays equal the body's own launch on inputs at other addresses, a 3-D x among them: bit for bit where
    # every output tile is one program's; within one bf16 rounding step where stream-K programs add their
    # parts of a tile in fp32 atomics, whose order differs from run to run (two body runs differ as much;
    # the H100, 2026-11-25).
    from squeezeserve.kernels import registry
    from squeezeserve.kernels.ops import native, replay

    monkeypatch.setattr(native, "NATIVE_REPLAY", True)  # (which makes descriptor launches replayable)
    monkeypatch.setattr(native, "_loaded", [] if cpp else [None])  # [None]: as where the extension is absent
    qw, sc, zp = _packed(n, k, 128, zeros, device="cuda")
    plans = replay.LaunchPlans(persistent=qm.workspace_buffers)
    runs = []

    def body(*inputs):
        runs.append(1)
        return qm._quant_matmul(*inputs)

    def make_x():
        return torch.randn(2, m // 2, k, device="cuda", dtype=torch.bfloat16)

    with torch.no_grad():
        with (
            registry.direct_launches
        ):  # (the workspace made first: making it is a fill, which no plan repeats)
            qm._quant_matmul(make_x(), qw, sc, zp, 128, 4)
        for _ in range(3):
            x = make_x()
            got = plans(body, (x, qw, sc, zp, 128, 4))
            with registry.direct_launches:
                expected = qm._quant_matmul(x, qw, sc, zp, 128, 4)
            if exact:
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)
    assert len(runs) == 1, "the body ran again where the plan should have replayed"
    assert (plans.native is not None and len(plans.native) == 1) == cpp
    assert all(not t.any() for t in qm.workspace_buffers()), "a replay left partial sums in the workspace"


# --- thread-owned words (quant_layout.to_owned_order) ------------------------------------------------------


def test_owned_words_hold_each_lanes_pairs():
    # Word p of every 32-deep block holds the pairs (K 2 p + 8 j, 2 p + 8 j + 1) of lane p, pair j in
    # nibbles j and j + 4, and the order round-trips.
    values = torch.randint(0, 16, (24, 96), dtype=torch.int32)
    qw = ql.pack_int32((values - 8).to(torch.int8), 4)
    owned = ql.to_owned_order(qw)
    assert torch.equal(ql.from_owned_order(owned), qw)
    nibbles = ql.unpack_unsigned(owned, 4, 96).view(24, 3, 4, 8)  # (row, block, word p, nibble)
    for p in range(4):
        for j in range(4):
            k = torch.arange(3) * 32 + 8 * j + 2 * p
            assert torch.equal(nibbles[:, :, p, j], values[:, k])
            assert torch.equal(nibbles[:, :, p, j + 4], values[:, k + 1])
    with pytest.raises(ValueError, match="multiple of 32"):
        ql.to_owned_order(qw[:, :3])


def test_scales_come_by_tma_where_a_tile_holds_eight_groups():
    # g32 in the decode's 256-deep tiles: a [block_n, 8] box of the scales (16 bytes a row) rides with the
    # words, where the ring has room (the 1-32-row tilings; not the 64-row one, whose ring would not fit) and
    # the scales' rows are TMA's (16-byte aligned); anything else loads them as before.
    def tma(m, group, scales=None, **tiling):
        qw, sc, _ = _packed(256, 4096, group, False)
        sc = sc if scales is None else scales
        x, y = torch.zeros(m, 4096, dtype=torch.bfloat16), torch.empty(m, 256, dtype=torch.bfloat16)
        cfg = qm.gluon_decode_tiles(m, 132) | tiling
        return qg.launch_args(x, qw, sc, None, group, y, y, y, mode=2, **cfg)[2]["SCALES_TMA"]

    assert all(tma(m, 32) for m in (1, 8, 16, 32))
    assert not tma(64, 32) and tma(64, 32, stages=3)  # (the 64-row ring: 192 KB at 4 stages, 144 at 3)
    assert not tma(16, 64) and not tma(16, 128) and not tma(300, 32, block_k=64)
    assert tma(16, 32, scales=torch.zeros(256, 136, dtype=torch.bfloat16)[:, :128])  # (rows 272 bytes apart)
    assert not tma(16, 32, scales=torch.zeros(256, 132, dtype=torch.bfloat16)[:, :128])  # (264: not TMA's)
    shifted = torch.zeros(256 * 128 + 1, dtype=torch.bfloat16)[1:].view(256, 128)
    assert not tma(16, 32, scales=shifted)  # (2 bytes past a 16-byte boundary)


def test_owned_zeros_hold_a_rows_groups():
    # Nibble i of word j of row n is the zero point of group 8 j + i of row n (a row's last word padded with
    # zeros), stored as weight_zero_point stores it; the layout round-trips, and a wrong shape is refused.
    t = ql.pack_weight(torch.randn(21, 11 * 32), 4, 32, symmetric=False)
    zp = t["weight_zero_point"]  # [3, 11]: 21 rows' nibbles along N
    owned = ql.to_owned_zeros(zp, 21)
    assert owned.shape == (21, 2) and owned.dtype == torch.int32
    values = ql.unpack_int32(zp, 4, (21, 11), packed_dim=0).int() + 8
    for j in range(2):
        for i in range(8):
            g = 8 * j + i
            want = values[:, g] if g < 11 else torch.zeros(21, dtype=torch.int32)
            assert torch.equal((owned[:, j] >> (4 * i)) & 0xF, want), (j, i)
    assert torch.equal(ql.from_owned_zeros(owned, 11), zp)
    with pytest.raises(ValueError, match="to_owned_zeros: int4 zero points of 16 rows"):
        ql.to_owned_zeros(zp, 16)
    with pytest.raises(ValueError, match="from_owned_zeros: int4 zero points of 17 groups"):
        ql.from_owned_zeros(owned, 17)


def test_owned_words_are_a_launch_key():
    # and so are the zero points' layout: the owned one with owned words unless a caller says otherwise
    qw, sc, zp = _packed(256, 4096, 128, True)
    x = torch.zeros(16, 4096, dtype=torch.bfloat16)
    y = torch.empty(16, 256, dtype=torch.bfloat16)
    args = (x, qw, sc, None, 128, y, y, y)
    assert not qg.launch_args(*args, block_m=16, programs=3, mode=2)[2]["OWNED"]
    assert qg.launch_args(*args, block_m=16, programs=3, mode=2, owned=True)[2]["OWNED"]
    args = (x, qw, sc, zp, 128, y, y, y)
    for owned, zero_rows, want in ((False, None, False), (True, None, True), (True, False, False)):
        kwargs = qg.launch_args(*args, block_m=16, programs=3, mode=2, owned=owned, zero_rows=zero_rows)[2]
        assert kwargs["ZERO_ROWS"] == want, (owned, zero_rows)
    assert not qg.launch_args(x, qw, sc, None, 128, y, y, y, block_m=16, owned=True)[2]["ZERO_ROWS"]


_OWNED_COMPILE = """
import json
import torch
from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

CASES = {  # decode g128, g32 with zero points (eight groups a tile), fp16; prefill's 64-deep tiles
    "16x14336x14336 g128": (16, 14336, 14336, 128, False, torch.bfloat16, qm.gluon_decode_tiles(16, 132)),
    "64x14336x14336 g128": (64, 14336, 14336, 128, False, torch.bfloat16, qm.gluon_decode_tiles(64, 132)),
    "32x14336x14336 g32 zp": (32, 14336, 14336, 32, True, torch.bfloat16, qm.gluon_decode_tiles(32, 132)),
    "16x4096x4096 g128 zp fp16": (16, 4096, 4096, 128, True, torch.float16, qm.gluon_decode_tiles(16, 132)),
    "512x14336x4096 g128 zp": (512, 14336, 4096, 128, True, torch.bfloat16,
                               qm.gluon_tiles(512, 14336, 4096, 132)),
}
for case, (m, n, k, g, zeros, dtype, cfg) in CASES.items():
    x = torch.zeros(m, k, dtype=dtype)
    qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // g, dtype=dtype)
    packed_zp = torch.zeros(n // 8, k // g, dtype=torch.int32) if zeros else None
    owned_zp = torch.zeros(n, -(-k // g // 8), dtype=torch.int32) if zeros else None  # (to_owned_zeros')
    y, ws, counts = torch.empty(m, n, dtype=dtype), torch.zeros(m * n), torch.zeros(4096, dtype=torch.int32)
    out = {"case": case}
    for owned, zp in ((False, packed_zp), (True, owned_zp)):
        _, args, kwargs = qg.launch_args(x, qw, sc, zp, g, y, ws, counts, mode=2, owned=owned, **cfg)
        compiled = cross_compile.compile_for(qg._wgmma_kernel, args, kwargs)
        sass = cross_compile.sass(compiled)
        s = cross_compile.summary(sass)
        summary = {key: s[key] for key in ("local", "loop_local", "groups", "wait_one", "wait_all")}
        # (the K loop's: between the first wgmma and the last wait for all groups, as summary() reads it)
        first = next(i for i, line in enumerate(sass) if "HGMMA" in line)
        last = max(i for i, line in enumerate(sass) if "DEPBAR.LE gsb0, 0x0" in line)
        prmt = sum(1 for line in sass[first:last] if " PRMT " in f" {line} ")
        out["owned" if owned else "packed"] = summary | {"prmt": prmt}
    print(json.dumps(out))
"""


@pytest.mark.skipif(not cross_compile.has_cuobjdump(), reason="this Triton wheel has no cuobjdump")
def test_owned_words_compile_for_sm90_with_fewer_instructions(run_compiled):
    # The operand from owned weights is laid out as the packed words' is (the kernel's convert_layout asserts
    # it when it compiles), its products stay pipelined, nothing spills, and the pairs need few prmt in the K
    # loop (the epilogue's change of layout of bf16 values has its own since the thirty-fifth session). Owned
    # zero points (a row's groups a word) are what took the spills out of 32 rows of g32 with zero points:
    # Triton 3.6 / 3.9, packed 6 / 66 registers (3 / 6 in the K loop), owned 0 / 0 (twenty-second session;
    # the twenty-first's owned words with packed zero points spilled 14 / 22).
    results = run_compiled(["-c", _OWNED_COMPILE])
    assert len(results) == 5
    for case, r in results.items():
        owned, packed = r["owned"], r["packed"]
        assert owned["groups"] >= 1 and owned["wait_one"] == owned["groups"] and owned["wait_all"] <= 1, case
        assert owned["local"] == 0, (case, r)
        assert owned["prmt"] < packed["prmt"] / 2, (case, r)


_GROUPS_COMPILE = """
import json
import torch
from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

m, n, k = 16, 14336, 4096  # the 8B model's gate / up rows at 16 rows, on owned words as vLLM serves them
for g, zeros in ((128, False), (32, False), (128, True), (32, True)):
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // g, dtype=torch.bfloat16)
    zp = torch.zeros(n, k // g // 8, dtype=torch.int32) if zeros else None  # (to_owned_zeros')
    y, ws, counts = torch.empty(m, n, dtype=x.dtype), torch.zeros(m * n), torch.zeros(4096, dtype=torch.int32)
    cfg = qm.gluon_decode_tiles(m, 132)
    _, args, kwargs = qg.launch_args(x, qw, sc, zp, g, y, ws, counts, mode=2, owned=True, **cfg)
    s = cross_compile.summary(cross_compile.sass(cross_compile.compile_for(qg._wgmma_kernel, args, kwargs)))
    print(json.dumps({"case": f"g{g}" + (" zp" if zeros else ""), "loop": s["loop_instructions"],
                      "loop_local": s["loop_local"]}))
"""


@pytest.mark.skipif(not cross_compile.has_cuobjdump(), reason="this Triton wheel has no cuobjdump")
def test_eight_groups_a_tile_cost_the_decode_about_what_two_do(run_compiled):
    # A 256-deep tile of g32 holds eight groups a row where g128 holds two: its scales come by TMA with the
    # words and are made value pairs where they are used, one PRMT each; its zero points, one word a row a
    # tile (quant_layout.to_owned_zeros), become pairs by a shift and a lop3 each. Triton 3.6 (vLLM 0.26's)
    # / 3.9, K loop instructions: g32 618 / 655 against g128's 646 / 706 (scales by plain loads: 654 / 679;
    # before the twenty-first session 721 / 749); with zero points 702 / 754 against 701 / 722 (packed zero
    # points, twenty-first session: 788 / 817 against 711 / 727; twentieth: 921 / 947 against 746 / 759).
    r = run_compiled(["-c", _GROUPS_COMPILE])
    assert r["g32"]["loop"] <= 1.02 * r["g128"]["loop"], r
    assert r["g32 zp"]["loop"] <= 1.1 * r["g128 zp"]["loop"], r
    assert all(one["loop_local"] == 0 for one in r.values()), r


_EIGHT_WARPS = {"block_k": 256, "programs": 132}  # (two warpgroups: launch_args's block_n, num_warps)


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "dtype", "tiling", "exact"),
    [
        (16, 14336, 4096, 128, False, torch.bfloat16, {"block_m": 16, "programs": 264} | _DEEP, True),
        # tails, 4 groups a tile
        (5, 4160, 3840, 64, True, torch.bfloat16, {"block_m": 8, "programs": 100} | _DEEP, True),
        (40, 4096, 2048, 32, True, torch.float16, {"block_m": 64, "stages": 3} | _EIGHT_WARPS, False),
        # prefill: 64-deep tiles
        (300, 2048, 4160, 128, True, torch.bfloat16, {"block_m": 256, "split": 3}, False),
        (512, 2304, 4096, 32, False, torch.bfloat16, {"block_m": 128, "programs": 132}, True),
    ],
)
def test_owned_words_give_the_packed_words_results(m, n, k, group, zeros, dtype, tiling, exact):
    # The same operand in the same K order: the same products, bit for bit where each output tile is one
    # program's. Where programs split a tile's K (the last two tilings' shapes) they add fp32 partial sums
    # atomically in arrival order: two runs on the packed words differ by an ulp of the output (measured
    # on the H100: up to 0.00098 in fp16, 0.00049 in bf16), and owned words as much.
    qw, sc, zp = _packed(n, k, group, zeros, dtype, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ws, counts = qm._workspace(x.device, m * n, 4096)
    packed, owned = (torch.empty((m, n), device="cuda", dtype=dtype) for _ in range(2))
    qg.launch(x, qw, sc, zp, group, packed, ws, counts, mode=2, **tiling)
    owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
    qg.launch(x, ql.to_owned_order(qw), sc, owned_zp, group, owned, ws, counts, mode=2, owned=True, **tiling)
    if exact:
        assert torch.equal(owned, packed)
    else:
        torch.testing.assert_close(owned, packed, rtol=4e-3, atol=2e-3)
    ref = (x @ ql.dequantize(qw, sc, zp, (n, k), group, 4).to(dtype).t()).float()
    assert ((owned.float() - ref).norm() / ref.norm()).item() < 2e-3


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "owned", "dtype"),
    [
        (2048, 28672, 4096, 128, False, False, torch.bfloat16),  # the 8B model's gate_up
        # 44 rows past the last whole tile: the second program's half of that tile is past x's end
        (300, 4096, 14336, 32, True, True, torch.bfloat16),
        (1000, 2304, 4160, 64, True, False, torch.float16),  # a K tail
    ],
)
def test_clusters_give_the_programs_alone_results(m, n, k, group, zeros, owned, dtype):
    # Two programs of a cluster sharing x's tiles (ptx_cluster) make the same products in the same order as
    # each alone: equal bit for bit, a tile a program or persistent.
    qw, sc, zp = _packed(n, k, group, zeros, dtype, "cuda")
    words, word_zp = qw, zp
    if owned:
        words, word_zp = ql.to_owned_order(qw), ql.to_owned_zeros(zp, n) if zeros else None
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ws, counts = qm._workspace(x.device, m * n, 4096)
    alone, paired = (torch.empty((m, n), device="cuda", dtype=dtype) for _ in range(2))
    tiling = {"block_m": 256, "stages": 4, "mode": 2, "owned": owned}
    qg.launch(x, words, sc, word_zp, group, alone, ws, counts, **tiling)
    # a tile a program; persistent (the rule's where K is shallow), its last wave partial or many waves of a
    # few programs; persistent alone
    for extra in (
        {"cluster": 2},
        {"cluster": 2, "programs": 132, "persistent": True, "stages": 5},
        {"cluster": 2, "programs": 6, "persistent": True},
        {"programs": 7, "persistent": True},
        {"cluster": 2, "programs": 132, "persistent": True, "tma_store": True},  # (the rule's, K shallow)
        {"programs": 5, "persistent": True, "tma_store": True},
        {"tma_store": True},
    ):
        paired.fill_(float("nan"))
        qg.launch(x, words, sc, word_zp, group, paired, ws, counts, **(tiling | extra))
        assert torch.equal(paired, alone), extra
    ref = (x @ ql.dequantize(qw, sc, zp, (n, k), group, 4).to(dtype).t()).float()
    assert ((paired.float() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize(
    ("n", "k", "group", "zeros"), [(48, 256, 32, True), (40, 320, 64, False), (24, 640, 128, True)]
)
def test_dequantize_reads_owned_words(n, k, group, zeros, device):
    # The dequantize kernel stores each value of owned words where it belongs: the packed words' dense
    # weight, bit for bit (K tails of a tile included: 320 and 640 are not whole 256-deep tiles).
    qw, sc, zp = _packed(n, k, group, zeros, torch.float16, device)
    want = qm.dequantize(qw, sc, zp, k, group, 4, torch.float16)
    owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
    got = qm.dequantize(ql.to_owned_order(qw), sc, owned_zp, k, group, 4, torch.float16, owned=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="owned words"):
        qm.dequantize(qw, sc, zp, k, 16, 4, torch.float16, owned=True)


@pytest.mark.parametrize(
    ("n", "k", "group", "bits", "zeros"),
    [
        (10, 2304, 32, 4, True),
        (6, 4096, 128, 4, False),
        (10, 2304, 128, 8, False),
        (12, 2048, 64, 8, True),
        (8, 2304, 2304, 8, False),
    ],
)
def test_dequantize_on_wide_tiles_is_the_reference(n, k, group, bits, zeros, device):
    # K of a whole DEQUANT_TILE or more takes its 2048-wide tiles (a tail past them at 2304, rows past a
    # tile's four at 6 and 10; groups of 2304 straddle them and take the narrow ones): the packed words'
    # values, and int4's on owned words, bit for bit those of the layout's reference dequantization (in
    # fp16: the interpreter rounds to bf16 otherwise than CUDA).
    assert k >= qm.DEQUANT_TILE[1]
    torch.manual_seed(n + k)
    t = ql.pack_weight(torch.randn(n, k) / 64, bits, group, symmetric=not zeros)
    qw, sc = t["weight_packed"].to(device), t["weight_scale"].to(device=device, dtype=torch.float16)
    zp = t["weight_zero_point"].to(device) if zeros else None
    want = ql.dequantize(qw, sc, zp, (n, k), group, bits).to(torch.float16)
    assert torch.equal(qm.dequantize(qw, sc, zp, k, group, bits, torch.float16), want)
    if bits == 4:
        owned_zp = ql.to_owned_zeros(zp, n) if zeros else None
        got = qm.dequantize(ql.to_owned_order(qw), sc, owned_zp, k, group, 4, torch.float16, owned=True)
        assert torch.equal(got, want)


@pytest.mark.parametrize(("m", "zeros"), [(0, False), (1, False), (1, True), (3, False), (70, True)])
def test_quant_matmul_owned_is_quant_matmul(m, zeros, device):
    # One row of groups of 32 runs on the FMA kernel reading x in the owned words' order; elsewhere, where the
    # Gluon kernel does not run (CPU, the interpreter), owned words go through the dequantize kernel that
    # reads them. The result is quant_matmul's on the packed words.
    qw, sc, zp = _packed(96, 256, 32, zeros, torch.float16, device)
    x = torch.randn(m, 256, dtype=torch.float16, device=device)
    want = qm.quant_matmul_eager(x, qw, sc, zp, 32, 4)
    owned_zp = ql.to_owned_zeros(zp, 96) if zeros else None
    got = qm.quant_matmul_owned(x, ql.to_owned_order(qw), sc, owned_zp, 32)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    if zeros:  # the checkpoint's zero points are not the owned ones: refused, not misread
        with pytest.raises(ValueError, match=r"zeros must be int32 \[96, 1\] \(owned\)"):
            qm.quant_matmul_owned(x, ql.to_owned_order(qw), sc, zp, 32)
    with pytest.raises(ValueError, match="multiples of 32"):
        qm.quant_matmul_owned(
            x, ql.to_owned_order(qw), torch.zeros(96, 16, dtype=sc.dtype, device=device), None, 16
        )


def test_quant_matmul_owned_gradient_wrt_x(device):
    # The eager body's backward reads the owned words back into weight_packed's order: dx = grad @ W.
    qw, sc, zp = _packed(24, 64, 32, True, torch.float16, device)
    x = torch.randn(5, 64, dtype=torch.float16, device=device, requires_grad=True)
    qm.quant_matmul_owned_eager(x, ql.to_owned_order(qw), sc, ql.to_owned_zeros(zp, 24), 32).sum().backward()
    weight = ql.dequantize(qw, sc, zp, (24, 64), 32, 4)
    torch.testing.assert_close(x.grad.float(), weight.float().sum(0).expand(5, 64), atol=2e-2, rtol=2e-3)


_OWNED_PATHS = """
import json
import torch
from squeezeserve.kernels.ops import launch
from squeezeserve.kernels.ops import quant_matmul as qm

n, k = 14336, 4096
qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 128, dtype=torch.bfloat16)
for m in (1, 16, 64, 65, 512, 2048, 2049, 4096, 4097):
    with launch.capture(sms=132, wgmma=True) as launches:
        qm._quant_matmul_owned(torch.empty(m, k, dtype=torch.bfloat16), qw, sc, None, 128)
    got = [(kernel.__name__, bool(kw.get("OWNED"))) for kernel, _, _, kw in launches]
    print(json.dumps({"case": m, "launches": got}))
"""


_OWNED_ONE_ROW = """
import json
import torch
from squeezeserve.kernels.ops import launch
from squeezeserve.kernels.ops import quant_matmul as qm

k = 4096
cases = ((14336, 32, True), (14336, 32, False), (28672, 32, False), (14336, 64, True), (14336, 128, True))
for n, g, zeros in cases:
    qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // g, dtype=torch.bfloat16)
    zp = torch.zeros(n, -(-k // g // 8), dtype=torch.int32) if zeros else None
    with launch.capture(sms=132, wgmma=True) as launches:
        qm._quant_matmul_owned(torch.empty(1, k, dtype=torch.bfloat16), qw, sc, zp, g)
    kernels = [kernel.__name__ for kernel, *_ in launches]
    print(json.dumps({"case": f"{n} g{g}" + (" zp" if zeros else ""), "kernels": kernels}))
"""


def test_one_owned_row_takes_the_gluon_decode_at_g32_with_zero_points_or_large(run_compiled):
    # One row: the FMA kernel up to groups of 64, but g32 on the Gluon decode, whose scales come by TMA, with
    # zero points (H100: 18.8 / 32.1 / 19.1 against 19.9 / 35.4 / 20.4 us) or from 2^26 values (H200 28672 x
    # 4096 25.7 against 29.0; quant_matmul.OWNED_FMA_MAX_GROUP, OWNED_ROW_GLUON_MIN_WEIGHT).
    r = run_compiled(["-c", _OWNED_ONE_ROW])
    want = {"14336 g32 zp": "_wgmma_kernel", "14336 g32": "_gemv_int4_kernel", "28672 g32": "_wgmma_kernel",
            "14336 g64 zp": "_gemv_int4_kernel", "14336 g128 zp": "_wgmma_kernel"}  # fmt: skip
    assert {case: one["kernels"] for case, one in r.items()} == {case: [k] for case, k in want.items()}, r


def test_owned_words_take_the_gluon_kernel_or_a_dequantize_that_reads_them(run_compiled):
    # On Hopper (replayed under launch.capture): the Gluon kernel, told the words are owned, up to the Gluon
    # GEMM's rows (4096 here: K = 4096 would slice); past them the dequantize kernel, told the same (then
    # cuBLAS).
    results = run_compiled(["-c", _OWNED_PATHS])
    most = qm.gluon_prefill_max_m(4096, 128, owned=True)
    assert most == 4096
    for m, r in results.items():
        kernel = "_wgmma_kernel" if int(m) <= most else "_dequantize_kernel"
        assert r["launches"] and all(one == [kernel, True] for one in r["launches"]), (m, r)


def test_a_programmatic_dependent_launch_is_asked_for_only_under_pdl():
    # launch_args' ``pdl`` makes the kernel a programmatic dependent: the PDL constexpr and Triton's
    # launch_pdl option, which its launcher turns into CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
    # Otherwise (the default) neither.
    m, n, k = 16, 14336, 4096
    x, qw = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(n, k // 8, dtype=torch.int32)
    sc = torch.zeros(n, k // 128, dtype=torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16)
    cfg = qm.gluon_decode_tiles(m, 132)
    kwargs = qg.launch_args(x, qw, sc, None, 128, y, y, y, mode=2, **cfg)[2]
    assert kwargs["PDL"] is False and "launch_pdl" not in kwargs
    kwargs = qg.launch_args(x, qw, sc, None, 128, y, y, y, mode=2, pdl=True, **cfg)[2]
    assert kwargs["PDL"] is True and kwargs["launch_pdl"] is True


_PDL_PATHS = """
import json
import torch
from squeezeserve.kernels.ops import launch
from squeezeserve.kernels.ops import quant_matmul as qm

n, k = 28672, 4096  # the 8B model's gate_up: the Gluon decode from 2 rows, the Gluon GEMM past 64
qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 128, dtype=torch.bfloat16)
for m in (1, 2, 16, 64, 65, 512, 300):
    for owned in (True, False):
        for pdl in (False, True):
            x = torch.empty(m, k, dtype=torch.bfloat16)
            with launch.capture(sms=132, wgmma=True) as launches:
                if owned:
                    qm._quant_matmul_owned(x, qw, sc, None, 128, pdl)
                else:
                    qm._quant_matmul(x, qw, sc, None, 128, 4, pdl)
            got = [(f.__name__, bool(kw.get("PDL")), bool(kw.get("launch_pdl"))) for f, _, _, kw in launches]
            print(json.dumps({"case": f"{m} {owned} {pdl}", "launches": got}))
"""


def test_quant_matmul_launches_the_gluon_decode_as_a_dependent_only_when_told_and_up_to_64_rows(run_compiled):
    # ``pdl`` (the caller's word that the kernel before is one of ours launched as a programmatic dependent,
    # which lets this one launch early): the Gluon kernel launches as its programmatic dependent at decode
    # rows (PDL_MAX_M), on owned and packed words; prefill tilings, the FMA kernel (one row of packed words)
    # and a row split's parts (300 rows: the second part follows the first, a prefill launched plainly)
    # launch as without it. Without ``pdl`` nothing does.
    results = run_compiled(["-c", _PDL_PATHS])
    assert len(results) == 28
    for case, r in results.items():
        m, owned, pdl = case.split()
        m = int(m)
        launches = r["launches"]
        assert launches, case
        gluon = [one for one in launches if one[0] == "_wgmma_kernel"]
        dependent = pdl == "True" and m <= qm.PDL_MAX_M and m != 300
        for kernel, constexpr, attribute in launches:
            assert constexpr == attribute == (dependent and kernel == "_wgmma_kernel"), (case, launches)
        if dependent and not (m == 1 and owned == "False"):
            assert gluon and all(one[1] for one in gluon), (case, launches)
    assert results["300 False True"]["launches"] == results["300 False False"]["launches"]
    assert len(results["300 False True"]["launches"]) == 2  # (the split: a prefill, then a decode)


_PDL_COMPILE = """
import json
import torch
from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

for m, n, k in ((16, 14336, 4096), (2048, 14336, 4096)):  # the decode and a prefill of the 8B model's gate
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 128, dtype=torch.bfloat16)
    y, ws, counts = torch.empty(m, n, dtype=x.dtype), torch.zeros(m * n), torch.zeros(4096, dtype=torch.int32)
    cfg = qm.gluon_decode_tiles(m, 132) if m <= 64 else qm.gluon_tiles(m, n, k, 132)
    cfg.pop("cluster", None)  # (a programmatic dependent launches its programs alone)
    out = {"case": m}
    for pdl in (False, True):
        launch = qg.launch_args(x, qw, sc, None, 128, y, ws, counts, mode=2, owned=True, pdl=pdl, **cfg)
        compiled = cross_compile.compile_for(qg._wgmma_kernel, launch[1], launch[2])
        s = cross_compile.summary(cross_compile.sass(compiled))
        ptx = compiled.asm["ptx"]
        out[str(pdl)] = {key: s[key] for key in ("local", "loop_local", "groups", "wait_one", "wait_all")} | {
            "waits": ptx.count("griddepcontrol.wait"),
            "triggers": ptx.count("griddepcontrol.launch_dependents"),
            "launch_pdl": bool(compiled.metadata.launch_pdl),
            "loop": s["loop_instructions"],
        }
    print(json.dumps(out))
"""


@pytest.mark.skipif(not cross_compile.has_cuobjdump(), reason="this Triton wheel has no cuobjdump")
def test_a_programmatic_dependent_kernel_compiles_for_sm90_as_pipelined(run_compiled):
    # Under PDL the loading warp lets the next kernel launch, sends the first stages' weight words, then
    # waits (griddepcontrol.wait) for the kernel before it; the compute warps wait before their first
    # product. The K loop is the one without PDL (its products pipelined, nothing spilled in it).
    results = run_compiled(["-c", _PDL_COMPILE])
    assert len(results) == 2
    for m, r in results.items():
        off, on = r["False"], r["True"]
        # (the loader lets a dependent launch either way: our kernels do on Hopper)
        assert (off["waits"], off["triggers"], off["launch_pdl"]) == (0, 1, False), (m, off)
        assert on["waits"] >= 2 and on["triggers"] == 1 and on["launch_pdl"], (m, on)  # (loader's, compute's)
        assert on["wait_one"] == on["groups"] >= 1 and on["loop_local"] == 0, (m, on)
        # (Triton 3.6, the H200's, schedules the persistent 2048-row tiling's loop one instruction apart,
        # either way: 233 under PDL against 232, results/tests_h200_2026-11-28_decode_whole.log, then 232
        # against 233, results/tests_h200_2026-11-29_gpu_suites.log; Triton 3.9's are equal)
        assert abs(on["loop"] - off["loop"]) <= 1, (m, r)


@needs_hopper
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("zeros", [False, True])
def test_a_chain_of_programmatic_dependents_gives_the_same_products(m, zeros):
    # As vLLM's decode graphs launch a decoder layer's MLP: o_proj's GEMM (4096^2, packed words), the
    # add-RMSNorm launched as its programmatic dependent, gate_up (28672 x 4096, owned words) as the norm's,
    # SiluAndMul as gate_up's, down (4096 x 14336, owned) as SiluAndMul's. Each kernel may start while the one
    # before it runs and must read that one's output only after it waits for it: eagerly and replayed from a
    # CUDA graph, the chain gives what it gives launched plainly (stream-K's fp32 atomics may add in another
    # order: within a bf16 ulp or two).
    o = _packed(4096, 4096, 128, zeros, torch.bfloat16, "cuda")
    shapes = ((28672, 4096), (4096, 14336))
    gate_up, down = (_packed(n, k, 128, zeros, torch.bfloat16, "cuda") for n, k in shapes)
    gate_up, down = ((ql.to_owned_order(q), s, ql.to_owned_zeros(z, q.shape[0]) if zeros else None)
                     for q, s, z in (gate_up, down))  # fmt: skip
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    xs = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    res = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def mlp(x, r, pdl):
        attn = qm.quant_matmul_eager(x, *o, 128, 4)
        if pdl:
            h, r = rmsnorm.add_rmsnorm_dependent(attn, r, w, 1e-6)
            a = swiglu.silu_and_mul_dependent(qm.quant_matmul_owned_eager(h, *gate_up, 128, True))
        else:
            h, r = K.add_rmsnorm(attn, r, w, 1e-6)
            a = K.silu_and_mul(qm.quant_matmul_owned_eager(h, *gate_up, 128, False))
        return qm.quant_matmul_owned_eager(a, *down, 128, pdl), r

    def close(got, want):
        for g, e in zip(got, want, strict=True):
            err = ((g.float() - e.float()).norm() / e.float().norm()).item()
            assert err < 1e-2, err

    plain = [mlp(x, r, False) for x, r in zip(xs, res, strict=True)]
    dependent = [mlp(x, r, True) for x, r in zip(xs, res, strict=True)]
    torch.cuda.synchronize()
    for got, want in zip(dependent, plain, strict=True):
        close(got, want)
    x_in, r_in = xs[0].clone(), res[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp(x_in, r_in, True)
    for x, r, want in zip(xs, res, plain, strict=True):
        x_in.copy_(x)
        r_in.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        close(out, want)


@needs_hopper
@pytest.mark.parametrize("m", [1, 16, 64])
def test_the_chain_compiled_by_inductor_gives_the_same_products(m, monkeypatch):
    # As vLLM's compiled model launches a decoder layer's MLP on Hopper (vllm_ops.compiled_chain): the
    # add-RMSNorm and SiluAndMul as the opaque chain ops, the projections as the opaque GEMM ops with pdl,
    # all through Inductor; captured in a CUDA graph (where the chain ops launch as programmatic dependents)
    # and replayed: what the traced ops launched plainly give (stream-K's atomics: within a bf16 ulp or two).
    from squeezeserve.kernels import vllm_ops

    ops = torch.ops.squeezeserve
    o = _packed(4096, 4096, 128, False, torch.bfloat16, "cuda")
    gate_up, down = (
        _packed(n, k, 128, False, torch.bfloat16, "cuda") for n, k in ((28672, 4096), (4096, 14336))
    )
    gate_up, down = ((ql.to_owned_order(q), s, None) for q, s, _ in (gate_up, down))
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5

    def mlp(x, r, chain):
        attn = ops.quant_matmul_opaque(x, *o, 128, 4, False)
        if chain:
            h, r = ops.fused_add_rms_norm_chain(attn, r, w, 1e-6)
            a = ops.silu_and_mul_chain(ops.quant_matmul_owned(h, *gate_up, 128, True))
        else:
            h, r = ops.add_rmsnorm(attn, r, w, 1e-6, True)
            a = ops.silu_and_mul(ops.quant_matmul_owned(h, *gate_up, 128, False))
        return ops.quant_matmul_owned(a, *down, 128, chain), r

    plain = torch.compile(lambda x, r: mlp(x, r, False), fullgraph=True)
    chained = torch.compile(lambda x, r: mlp(x, r, True), fullgraph=True)
    xs = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    res = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    want = [plain(x, r) for x, r in zip(xs, res, strict=True)]

    def close(got, expected):
        for g, e in zip(got, expected, strict=True):
            err = ((g.float() - e.float()).norm() / e.float().norm()).item()
            assert err < 1e-2, err

    x_in, r_in = xs[0].clone(), res[0].clone()
    close(chained(x_in, r_in), want[0])  # (compiles; off a graph the chain ops launch plainly)
    for k, weights in ((4096, gate_up), (14336, down)):  # (the GEMMs' PDL launches compile before capture,
        qm.quant_matmul_owned_eager(xs[0].new_zeros(m, k), *weights, 128, True)  # as vllm_ops.warm_prefill)
    dependents = []  # (what the chain ops launch while the graph captures)

    def spy(module, name, mark):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a: dependents.append(mark) or real(*a))

    spy(rmsnorm, "add_rmsnorm_dependent", 1)
    spy(swiglu, "silu_and_mul_dependent", 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chained(x_in, r_in)
    assert sorted(dependents) == [1, 2] and vllm_ops.compiled_chain()
    for x, r, expected in zip(xs, res, want, strict=True):
        x_in.copy_(x)
        r_in.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        close(out, expected)
