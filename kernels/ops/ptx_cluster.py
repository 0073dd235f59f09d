"""A pass over a Gluon kernel's PTX: two programs of a cluster share x's tiles (TMA multicast).

Where N is 14336 or wider, the Gluon prefill GEMM moves about 1.5x the L2-to-SM bytes of vLLM's Machete,
whose 2-CTA clusters load each activation tile once for both (Nsight Compute: ours 69.9% of the L2
crossbar's cycles against 45.5%; tests/benchmarks/NOTES.md, twenty-fourth session). Gluon in Triton 3.6
(vLLM 0.26's) has neither cluster launches nor multicast: a program of several CTAs needs its layouts split
over them, and its TMA lowering stops at "NYI: Support multicast". So the kernel is written for one CTA, and
where its source asks (:data:`MARK`, ``quant_matmul_gluon``'s ``CLUSTER`` 2), this pass makes it a pair:

- each program loads one half of x's tile (x's descriptor has a half box) into both programs' stages: the
  TMA loads through the kernel's first parameter (x's descriptor) become ``.multicast::cluster`` to both
  CTAs (the same shared-memory offset and ``ready`` barrier in each; each ``ready`` expects the whole tile);
- a stage is free once both programs are done with it: every plain ``mbarrier.arrive`` (a stage's release;
  the loader's carry ``expect_tx``) also arrives on the other program's barrier at the same offset
  (``mapa``), and the ring's ``empty`` barriers count both;
- the loading warpgroup's warps arrive on the cluster's barrier where they leave the compute warps, without
  waiting: the compute warps' first instruction waits for the registers those warps give back, so a wait
  there would hold both forever. The compute warps arrive after making the ring's barriers and wait
  (``_cluster_start``, in the source), the loading warp waits before its first load (``_cluster_wait``):
  no load or release reaches a program whose barriers are not made yet;
- the kernel requires clusters of two (``.reqnctapercluster``), and its metadata says so (``num_ctas`` 2:
  Triton's launcher then launches ``grid * 2`` programs in clusters of two, whoever launches it).

The end needs no cluster barrier: each program waits for its stages' last releases, the other's included,
before it ends (in the source), and every byte multicast into a program is one its own products wait for.
The pass refuses a marked kernel whose PTX it does not recognise (:class:`ClusterError`, at compile time).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
MARK = f"squeezeserve: x shared by a cluster of two ({_DIGEST})"
CTAS = 2


class ClusterError(RuntimeError):
    """The pass cannot make a marked kernel a cluster's (its PTX is not what the pass knows)."""


# x's descriptor, the kernel's first parameter, into a register: Triton 3.6 ``mov.b64 %rd, param_0`` then
# ``cvta.param.u64``; 3.9 ``mov.b32 %r, param_0``, ``cvt.u64.u32``, then ``cvta.param.u64``
_X_PARAM = re.compile(r"^\s*mov\.b(?:64|32)\s+(%r[d]?\d+),\s*\w+_param_0;\s*$")
_MOVE = re.compile(r"^\s*(?:cvta\.param\.u64|cvt\.u64\.u32)\s+(%rd\d+),\s*(%r[d]?\d+);\s*$")
# a TMA load (3.6 writes its destination ``shared::cluster``, 3.9 ``shared::cta``)
_TMA = re.compile(
    r"^(\s*)(@%p\d+)\s+cp\.async\.bulk\.tensor\.(\d)d\.shared::(?:cluster|cta)\.global"
    r"\.mbarrier::complete_tx::bytes\s+(\[%r\d+\]),\s*\[(%rd\d+),\s*(\{[^}]*\})\],\s*(\[%r\d+\]);\s*$"
)
_ARRIVE = re.compile(r"^(\s*)(@%p\d+\s+)?mbarrier\.arrive\.shared::cta\.b64\s+_,\s*\[(%r\d+)\];\s*$")
_SPLIT = re.compile(r"^\s*setp\.lt\.u32\s+(%p\d+),\s*%r\d+,\s*(\d+);\s*$")
_BRANCH = re.compile(r"^\s*@(!?)(%p\d+)\s+bra\s+(\$L__\w+);\s*$")
_FALL = re.compile(r"^\s*bra\.uni\s+\$L__\w+;\s*$")
_REQNTID = re.compile(r"^\.reqntid\s+(\d+)\s*$")


def share_x(ptx: str) -> tuple[str, bool]:
    """``ptx`` rewritten as the module says where it holds :data:`MARK` (and whether it did)."""
    if MARK not in ptx:
        return ptx, False
    lines = ptx.split("\n")
    # the compute partition's warps: all but the loading warpgroup's four (what the split compares with)
    threads = [int(m.group(1)) for m in map(_REQNTID.match, lines) if m]
    compute_warps = threads[0] // 32 - 4 if len(threads) == 1 else None
    x_regs: set[str] = set()
    for line in lines:
        m = _X_PARAM.match(line)
        if m:
            x_regs.add(m.group(1))
    for line in lines:
        m = _MOVE.match(line)
        if m and m.group(2) in x_regs:
            x_regs.add(m.group(1))
    loads = releases = 0
    split = None  # where the loading warpgroup's warps arrive on the cluster's barrier
    workers = None  # (3.9: the label of their first block)
    out: list[str] = []
    for i, line in enumerate(lines):
        tma = _TMA.match(line)
        if tma and tma.group(5) in x_regs:
            indent, pred, dims, dst, tmap, coords, bar = tma.groups()
            out.extend(
                indent + b
                for b in (
                    "{",
                    ".reg .b16 %sq_mask;",
                    f"mov.b16 %sq_mask, {(1 << CTAS) - 1};",
                    f"{pred} cp.async.bulk.tensor.{dims}d.shared::cluster.global.mbarrier::complete_tx::bytes"
                    f".multicast::cluster {dst}, [{tmap}, {coords}], {bar}, %sq_mask;",
                    "}",
                )
            )
            loads += 1
            continue
        arrive = _ARRIVE.match(line)
        if arrive:
            indent, pred, address = arrive.groups()
            pred = pred or ""
            out.append(line)
            out.extend(
                indent + b
                for b in (
                    "{",
                    ".reg .b32 %sq_peer, %sq_remote;",
                    "mov.u32 %sq_peer, %cluster_ctarank;",
                    f"xor.b32 %sq_peer, %sq_peer, {CTAS - 1};",
                    f"mapa.shared::cluster.u32 %sq_remote, {address}, %sq_peer;",
                    f"{pred}mbarrier.arrive.shared::cluster.b64 _, [%sq_remote];",
                    "}",
                )
            )
            releases += 1
            continue
        if _REQNTID.match(line):
            out.append(line)
            out.append(f".reqnctapercluster {CTAS}, 1, 1")
            continue
        out.append(line)
        if workers is not None and split is None and line.split("//")[0].strip() == f"{workers}:":
            split = len(out)  # (the workers' first line, a block they enter once)
        if split is None and workers is None:
            m = _SPLIT.match(line)
            m = m if m and int(m.group(2)) == compute_warps else None
            # where the warps past the compute partition's leave it: Triton 3.6 `@%p bra <compute>; bra.uni
            # <workers' loop>` (before that branch), 3.9 `@!%p bra <workers' preheader>` (its first line)
            branch = _BRANCH.match(lines[i + 1]) if m and i + 1 < len(lines) else None
            if branch and branch.group(2) == m.group(1):
                if branch.group(1) == "!":
                    workers = branch.group(3)
                elif i + 2 < len(lines) and _FALL.match(lines[i + 2]):
                    split = len(out) + 1
    if not loads or not releases or split is None or ".reqnctapercluster" not in "\n".join(out):
        raise ClusterError(
            f"ptx_cluster: {loads} multicast loads of x, {releases} releases, the workers' split "
            f"{'found' if split is not None else 'not found'}: not the PTX this pass knows"
        )
    out.insert(split, "\tbarrier.cluster.arrive.relaxed;")
    return "\n".join(out), True
