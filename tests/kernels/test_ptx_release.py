"""ptx_release's pass over a marked Gluon kernel's PTX (each warpgroup frees its ring stages itself), on
PTX laid out as Triton 3.6 (vLLM 0.26's) and 3.9 write the 64-row decode's K loop. The compiled kernel's
SASS is checked in test_cross_compile.py (no CTA barrier left in its K loop, products still pipelined);
its outputs on the device by test_quant_matmul_gluon.py."""

from __future__ import annotations

import types

import pytest
from triton import knobs

from squeezeserve.kernels.ops import ptx_cluster, ptx_release

WAIT = """\t// begin inline asm
\t
{{
\t@!{pred} bra.uni skipWait;
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [{bar}], %r475;
\t@!complete bra.uni waitLoop;
\tskipWait:
}}
\t// end inline asm"""

# Triton 3.6: the arrival's condition computed between the barrier and the arrival; a barrier before each wait
PTX_36 = f"""\tmov.u32 \t%r1, %tid.x;
\tand.b32 \t%r10, %r1, 255;
\tsetp.eq.b32 \t%p16, %r10, 0;
\t// begin inline asm
\tmov.u32 %r5, 0; // {ptx_release.MARK}
\t// end inline asm
\tbar.sync \t0, 256;
{WAIT.format(pred="%p40", bar="%r229")}
\twgmma.wait_group.sync.aligned 1;
\tadd.s32 \t%r473, %r759, 229408;
\tbar.sync \t0, 256;
\tand.pred \t%p37, %p16, %p44;
\t// begin inline asm
\t@%p37 mbarrier.arrive.shared::cta.b64 _, [%r473];
\t// end inline asm
\tadd.s32 \t%r474, %r775, 229376;
\t.loc\t1 735 20
\tbar.sync \t0, 256;
\tsetp.lt.s32 \t%p43, %r1062, %r41;
{WAIT.format(pred="%p43", bar="%r474")}
\twgmma.wait_group.sync.aligned 0;
\tbar.sync \t0, 256;
\t// begin inline asm
\t@%p16 mbarrier.arrive.shared::cta.b64 _, [%r819];
\t// end inline asm
\tbar.sync \t0, 256;
\tst.shared.v4.b32 \t[%r29+196608], {{%r1030, %r1038, %r1046, %r1054}};
\t@%p11 mbarrier.arrive.expect_tx.shared.b64 _, [%r130], 49152;
"""

# Triton 3.9: the condition computed long before; no barrier before the waits
PTX_39 = f"""\tmov.u32 \t%r1, %tid.x;
\tand.b32 \t%r17, %r1, 255;
\tsetp.eq.b32 \t%p82, %r17, 0;
\tand.pred \t%p53, %p82, %p60;
\t// begin inline asm
\tmov.u32 %r5, 0; // {ptx_release.MARK}
\t// end inline asm
\twgmma.wait_group.sync.aligned 1;
\tadd.s32 \t%r539, %r941, 229408;
\tbar.sync \t0, 256;
\t// begin inline asm
\t@%p53 mbarrier.arrive.shared::cta.b64 _, [%r539];
\t// end inline asm
"""


def _release(address: str, cond: str | None) -> list[str]:
    return [
        "\t{",
        "\t.reg .pred %sq_lead;",
        "\t.reg .b32 %sq_tid;",
        "\tmov.u32 %sq_tid, %tid.x;",
        "\tand.b32 %sq_tid, %sq_tid, 127;",
        "\tsetp.eq.b32 %sq_lead, %sq_tid, 0;",
        *([f"\tand.pred %sq_lead, %sq_lead, {cond};"] if cond else []),
        f"\t@%sq_lead mbarrier.arrive.shared::cta.b64 _, [{address}];",
        "\t}",
    ]


def test_each_warpgroup_frees_its_stages_without_the_partitions_barrier():
    out = ptx_release.release_by_warpgroup(PTX_36).split("\n")
    # thread 0 of each warpgroup arrives, under the arrival's own condition (the loop's i + j > 0) or none
    assert not any("@%p37" in line for line in out)
    at = out.index("\t{")
    assert out[at : at + 9] == _release("%r473", "%p44")
    last = out.index("\t@%sq_lead mbarrier.arrive.shared::cta.b64 _, [%r819];")
    assert out[last - 6 : last + 2] == _release("%r819", None)
    # the barriers before the releases and the waits are gone; the epilogue's (shared memory it writes) stays
    assert sum("bar.sync" in line for line in out) == 1
    assert out[out.index("\tst.shared.v4.b32 \t[%r29+196608], {%r1030, %r1038, %r1046, %r1054};") - 1] == (
        "\tbar.sync \t0, 256;"
    )
    # the loading warp's arrivals (with the bytes TMA brings) are its own; the waits are kept
    assert "\t@%p11 mbarrier.arrive.expect_tx.shared.b64 _, [%r130], 49152;" in out
    assert sum("mbarrier.try_wait" in line for line in out) == 2
    # a second pass changes nothing (the hook may be chained twice)
    assert ptx_release.release_by_warpgroup("\n".join(out)) == "\n".join(out)


def test_the_condition_may_be_computed_anywhere():
    out = ptx_release.release_by_warpgroup(PTX_39).split("\n")
    assert "bar.sync" not in "\n".join(out)
    at = out.index("\t{")
    assert out[at : at + 9] == _release("%r539", "%p60")


def test_unmarked_kernels_are_left_alone():
    unmarked = PTX_36.replace(ptx_release.MARK, "something else")
    assert ptx_release.release_by_warpgroup(unmarked) == unmarked


def test_a_release_it_cannot_account_for_is_refused():
    # an arrival not by the partition's thread 0: the stage would be freed by every thread of it
    odd = PTX_39.replace("and.pred \t%p53, %p82, %p60;", "and.pred \t%p53, %p81, %p60;")
    with pytest.raises(ptx_release.ReleaseError, match="is not partition thread 0's"):
        ptx_release.release_by_warpgroup(odd)
    # a release left as it was (no barrier before it): the ring's count of two would never be reached
    unguarded = PTX_39.replace("\tbar.sync \t0, 256;\n", "")
    with pytest.raises(ptx_release.ReleaseError, match="1 of the kernel's 1 stage releases left as they"):
        ptx_release.release_by_warpgroup(unguarded)
    # a partition of one warpgroup has nothing to gain and is not rewritten
    one = PTX_39.replace("bar.sync \t0, 256;", "bar.sync \t0, 128;").replace("%r1, 255;", "%r1, 127;")
    with pytest.raises(ptx_release.ReleaseError, match="barrier of 128 threads"):
        ptx_release.release_by_warpgroup(one)


def test_install_chains_the_hook_in_place(monkeypatch):
    seen = []

    def before(*args):
        if not args:
            return "theirs", "h"
        seen.append(args)

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", before)
    monkeypatch.setattr(ptx_release, "_hook", None)
    ptx_release.install()
    hook = knobs.runtime.add_stages_inspection_hook
    assert hook is not before
    ptx_release.install()  # (in place already: unchanged)
    assert knobs.runtime.add_stages_inspection_hook is hook
    # Triton 3.9's cache key: the hook before's, then this pass's (with its mark, so the pass's version)
    key, digest = hook()
    assert key == "theirs+squeezeserve-ptx-release" and digest == "h" + ptx_release.MARK + ptx_cluster.MARK
    stages = {"ptx": lambda src, metadata: src}
    hook("backend", stages, "options", "language", 90)
    assert len(seen) == 1  # the hook before ran too
    assert stages["ptx"](PTX_39, {}) == ptx_release.release_by_warpgroup(PTX_39)
    assert stages["ptx"]("unmarked", {}) == "unmarked"
    # a hook set since (that does not call this one) is chained under it again before the next launch
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", before)
    ptx_release.install()
    assert knobs.runtime.add_stages_inspection_hook not in (before, hook)
    # a Triton without the hook: the pass cannot run, and says so (quant_matmul then keeps Gluon's release)
    monkeypatch.setattr(ptx_release, "triton", types.SimpleNamespace(__version__="3.0.0"))
    with pytest.raises(ptx_release.ReleaseError, match="Triton 3.0.0 has no stages hook"):
        ptx_release.install()
