"""ptx_cluster's pass over a marked Gluon kernel's PTX (two programs of a cluster share x's tiles), on PTX
laid out as Triton 3.6 (vLLM 0.26's) and 3.9 write the Gluon GEMM's start, loads and releases, then on the
kernel itself compiled for sm_90 with the Triton installed. Its products on the device, bit for bit those
of the programs alone: test_quant_matmul_gluon.py's GPU tests."""

from __future__ import annotations

import pytest

from squeezeserve.kernels.ops import cross_compile, ptx_cluster

MARK = f"\t// begin inline asm\n\tmov.u32 %r9, 0; // {ptx_cluster.MARK}\n\t// end inline asm"

# Triton 3.6: x's descriptor by mov.b64 then cvta; the compute warps branch away, the workers fall through
# to their loop's branch; TMA destinations written shared::cluster
PTX_36 = f""".visible .entry _wgmma_kernel(
\t.param .align 64 .b8 _wgmma_kernel_param_0[128],
\t.param .align 64 .b8 _wgmma_kernel_param_5[128]
)
.reqntid 384
.maxnreg 168
{{
\tmov.b64 \t%rd7, _wgmma_kernel_param_0;
\tmov.b64 \t%rd8, _wgmma_kernel_param_5;
\tcvta.param.u64 \t%rd10, %rd8;
\tcvta.param.u64 \t%rd9, %rd7;
\tsetp.lt.u32 \t%p1, %r2, 8;
\t@%p1 bra \t$L__BB0_13;
\tbra.uni \t$L__BB0_1;
$L__BB0_13:
\tsetmaxnreg.inc.sync.aligned.u32 \t240;
{MARK}
$L__BB0_1:                              // %.preheader
\tsetmaxnreg.dec.sync.aligned.u32 \t24;
\t@%p5 mbarrier.arrive.expect_tx.shared.b64 _, [%r176], 36864;
\t@%p6 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r177], [%rd9, {{%r596, %r178}}], [%r176];
\t@%p7 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r187], [%rd9, {{%r596, %r188}}], [%r176];
\t@%p8 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r179], [%rd10, {{%r597, %r180}}], [%r176];
\t@%p21 mbarrier.arrive.shared::cta.b64 _, [%r342];
\tret;
}}"""  # noqa: E501

# Triton 3.9: x's descriptor by mov.b32, cvt, cvta; the workers branch away to a block they enter once; TMA
# destinations written shared::cta
PTX_39 = f""".visible .entry _wgmma_kernel(
\t.param .align 64 .b8 _wgmma_kernel_param_0[128]
)
.reqntid 384
.maxnreg 168
{{
\tsetp.lt.u32 \t%p2, %r3, 8;
\t@!%p2 bra \t$L__BB0_1;
\tsetmaxnreg.inc.sync.aligned.u32 \t240;
{MARK}
\t@%p44 mbarrier.arrive.shared::cta.b64 _, [%r389];
\tret;
$L__BB0_1:                              // %.preheader.preheader
\tmov.b32 \t%r141, _wgmma_kernel_param_0;
\tcvt.u64.u32 \t%rd9, %r141;
\tcvta.param.u64 \t%rd1, %rd9;
\tsetmaxnreg.dec.sync.aligned.u32 \t24;
\t@%p9 cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r189], [%rd1, {{%r689, %r190}}], [%r188];
\t@%p10 cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r191], [%rd1, {{%r689, %r192}}], [%r188];
\tret;
}}"""  # noqa: E501


def _lines(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.split("\n")]


@pytest.mark.parametrize("ptx", [PTX_36, PTX_39], ids=["triton-3.6", "triton-3.9"])
def test_the_pass_makes_the_kernel_a_pairs(ptx):
    out, clustered = ptx_cluster.share_x(ptx)
    assert clustered
    lines = _lines(out)
    # x's two half loads go to both programs of the cluster; the weight's words stay the program's own
    multicast = [line for line in lines if ".multicast::cluster" in line]
    assert len(multicast) == 2
    assert all("shared::cluster.global" in line and line.endswith("%sq_mask;") for line in multicast)
    assert "mov.b16 %sq_mask, 3;" in lines
    assert sum("cp.async.bulk.tensor" in line and "multicast" not in line for line in lines) == (
        1 if ptx is PTX_36 else 0
    )
    # each release frees the stage in the other program too, under the same condition
    local = [line for line in lines if "mbarrier.arrive.shared::cta.b64" in line]
    remote = [line for line in lines if "mbarrier.arrive.shared::cluster.b64" in line]
    assert len(local) == len(remote) == 1 and local[0].split()[0] == remote[0].split()[0]
    assert (
        "mapa.shared::cluster.u32 %sq_remote, " + local[0].split("[")[1].rstrip("];") + ", %sq_peer;" in lines
    )
    assert ".reqnctapercluster 2, 1, 1" in lines
    # the loading warpgroup's warps arrive once, before they give back their registers (the compute warps'
    # first instruction waits for those), and do not wait there
    arrive = lines.index("barrier.cluster.arrive.relaxed;")
    assert lines.count("barrier.cluster.arrive.relaxed;") == 1
    assert arrive < lines.index("setmaxnreg.dec.sync.aligned.u32 \t24;".strip())
    assert "barrier.cluster.wait" not in "\n".join(lines[arrive : arrive + 2])
    if ptx is PTX_36:  # (on the workers' path: after the compute warps' branch, before their loop's)
        assert lines[arrive - 1].startswith("@%p1 bra") and lines[arrive + 1].startswith("bra.uni")
    else:
        assert lines[arrive - 1].startswith("$L__BB0_1:")


def test_unmarked_ptx_is_left_as_it_is():
    plain = PTX_36.replace(MARK, "")
    assert ptx_cluster.share_x(plain) == (plain, False)


@pytest.mark.parametrize(
    "change",
    [
        ("_param_0;", "_param_7;"),  # x's loads not found
        ("mbarrier.arrive.shared::cta.b64", "mbarrier.arrive.relaxed.shared::cta.b64"),  # no release
        ("setp.lt.u32 \t%p1", "setp.lt.u32 \t%p3"),  # the workers' split not found
        (".reqntid 384", ".reqntid 256"),  # a split at 8 warps, but the compute warps would be 4
    ],
)
def test_a_marked_kernel_the_pass_does_not_know_is_refused(change):
    with pytest.raises(ptx_cluster.ClusterError, match="not the PTX this pass knows"):
        ptx_cluster.share_x(PTX_36.replace(*change))


_COMPILE = """
import json
import torch
from squeezeserve.kernels.ops import cross_compile
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

for case, (m, n, k, g, zeros, owned) in {
    "14336^2 2048 rows g128 (persistent)": (2048, 14336, 14336, 128, False, False),
    "down_proj 1000 rows g32 zero points owned": (1000, 4096, 14336, 32, True, True),
    "gate_up 2048 rows g32 zero points owned (persistent)": (2048, 28672, 4096, 32, True, True),
}.items():
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    qw, sc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // g, dtype=torch.bfloat16)
    rows = n if owned else n // 8
    zp = torch.zeros(rows, k // g // (8 if owned else 1), dtype=torch.int32) if zeros else None
    y, ws, counts = torch.empty(m, n, dtype=x.dtype), torch.zeros(m * n), torch.zeros(4096, dtype=torch.int32)
    cfg = qm.gluon_tiles(m, n, k, 132)
    assert cfg.get("cluster") == 2, cfg
    grid, args, kwargs = qg.launch_args(x, qw, sc, zp, g, y, ws, counts, mode=2, owned=owned, **cfg)
    c = cross_compile.compile_for(qg._wgmma_kernel, args, kwargs)
    one = cfg | {"cluster": 1}
    alone = cross_compile.compile_for(
        qg._wgmma_kernel, *qg.launch_args(x, qw, sc, zp, g, y, ws, counts, mode=2, owned=owned, **one)[1:]
    )
    s, s1 = (cross_compile.summary(cross_compile.sass(k)) for k in (c, alone))
    ptx = c.asm["ptx"]
    bars = [s["instructions"].get(i, 0) for i in ("UCGABAR_ARV", "UCGABAR_WAIT")]
    print(json.dumps({
        "case": case, "grid": grid, "tiles": -(-m // 256) * (n // 128), "programs": cfg.get("programs", 0),
        "persistent": cfg.get("persistent", False), "smem": c.metadata.shared,
        "tma_store": ptx.count("cp.async.bulk.tensor.2d.global.shared"), "num_ctas": c.metadata.num_ctas,
        "alone_num_ctas": alone.metadata.num_ctas, "multicast": ptx.count(".multicast::cluster"),
        "remote": ptx.count("mbarrier.arrive.shared::cluster.b64"),
        "local": ptx.count("mbarrier.arrive.shared::cta.b64"),
        "cluster_dims": ".reqnctapercluster 2, 1, 1" in ptx, "spills": s["local"], "cluster_barriers": bars,
        "loop": s["loop_instructions"], "alone_loop": s1["loop_instructions"],
    }))
"""


@pytest.mark.skipif(not cross_compile.has_cuobjdump(), reason="this Triton wheel has no cuobjdump")
def test_the_rules_cluster_tilings_compile_for_sm90_as_pairs(run_compiled):
    # The rule's clusters: a tile a program at a deep reduction of a wave of tiles (the 8B model's down_proj
    # on owned words with g32 zero points), persistent where the tiles are more (14336^2 on packed words,
    # gate_up; a wave of tiles at a time, one program an SM), compiled with this Triton down to SASS:
    # launched in pairs, the x loads
    # multicast, a remote release for each release, the cluster's barriers in the SASS, no spills, and a K
    # loop a few instructions longer than the programs' alone (the remote releases).
    results = run_compiled(["-c", _COMPILE])
    assert len(results) == 3
    for case, r in results.items():
        assert r["num_ctas"] == 2 and r["alone_num_ctas"] == 1, (case, r)
        assert r["persistent"] == ("persistent" in case) and r["programs"] == (132 if r["persistent"] else 0)
        # (clusters: Triton's launcher doubles the grid)
        assert r["grid"][0] * 2 == (r["programs"] if r["persistent"] else r["tiles"]), (case, r)
        assert r["multicast"] == 2 and r["remote"] == r["local"] >= 2 and r["cluster_dims"], (case, r)
        assert r["spills"] == 0 and min(r["cluster_barriers"]) >= 1, (case, r)
        # persistent: each tile's sum stored by TMA from shared memory beside the ring (in the H100's 227 KB)
        assert r["tma_store"] == (1 if r["persistent"] else 0) and r["smem"] <= 232448, (case, r)
        assert r["loop"] <= r["alone_loop"] + 12, (case, r)  # (a release's remote arrival: 319 against 311)
