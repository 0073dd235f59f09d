"""A pass over a Gluon kernel's PTX: each warpgroup of a compute partition frees its ring stages itself.

Gluon's ``mbarrier.arrive`` in a partition of several warpgroups is one thread's arrival after a barrier of
the whole partition (``bar.sync 0, 256`` for two warpgroups), and Triton's barrier placement puts another
before the wait on the next stage's ``ready`` (it tracks the barrier array as one buffer). In the Gluon
decode's 64-row tiling, whose two warpgroups share each stage, that holds every warpgroup to the other's pace
once a K tile: Nsight Compute put 22% of the K loop's warp samples at that barrier (tests/benchmarks/NOTES.md,
thirty-first session). Gluon exposes neither a per-warp arrival nor a barrier's address, so this pass
rewrites the PTX of a kernel that asks for it (:data:`MARK` in its source, and its ``empty`` barriers
counting one arrival a warpgroup):

- every plain ``mbarrier.arrive`` (a stage's release; the loader's arrivals carry ``expect_tx``) is made by
  thread 0 of each warpgroup (``%tid.x % 128 == 0``) under the arrival's own condition, in place of thread 0
  of the partition;
- the partition barrier right before each such arrival, and right before each wait on a barrier, goes.

Why that is safe where the arrival follows ``warpgroup_mma_wait``: a warpgroup's wgmma completes for its
four warps together, and each warp's reads of the stage (its words into the A operand's registers, before
that wgmma could start; x by the wgmma itself) are done by then; the barrier objects themselves are updated
atomically by the hardware. The pass refuses a marked kernel in which it cannot account for every release
(:class:`ReleaseError`, before anything runs: quant_matmul then launches it with Gluon's own release, and
keeps to that, ``WG_RELEASE`` "off").
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import triton


class ReleaseError(RuntimeError):
    """The pass cannot rewrite a marked kernel's releases (or Triton has no stages hook for it)."""


# (the pass's own source in the mark: the marked kernels' cache keys change with the pass, which Triton 3.6's
# cache key, blind to the hook, would not otherwise see)
_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
MARK = f"squeezeserve: stages released by warpgroup ({_DIGEST})"

_BAR = re.compile(r"^\s*bar\.sync\s+0,\s*(\d+);\s*$")
_ARRIVE = re.compile(r"^(\s*)@(%p\d+)\s+mbarrier\.arrive\.shared::cta\.b64\s+_,\s*\[(%r\d+)\];\s*$")
_AND = re.compile(r"^\s*and\.pred\s+(%p\d+),\s*(%p\d+),\s*(%p\d+);\s*$")
_IS_ZERO = re.compile(r"^\s*setp\.eq\.[bsu]32\s+(%p\d+),\s*(%r\d+),\s*0;\s*$")
_MASK = re.compile(r"^\s*and\.b32\s+(%r\d+),\s*(%r\d+),\s*(\d+);\s*$")
_TID = re.compile(r"^\s*mov\.u32\s+(%r\d+),\s*%tid\.x;\s*$")
# lines between a barrier and what it guards that change nothing: debug info, comments, debug labels
_QUIET = re.compile(r"^\s*($|//|\.loc\b|\$L__tmp\d+:)")
# the head of a wait on a barrier, as Triton writes it: an inline block, its skip branch, its loop label
_WAIT_HEAD = re.compile(r"^\s*(\{|\.reg\s+\.pred\s+complete;|@!?%p\d+\s+bra\.uni\s+skipWait;|waitLoop:)\s*$")
_WAIT = re.compile(r"^\s*mbarrier\.try_wait\b")
# predicate arithmetic a wait's condition may be computed by between the barrier and the wait
_PREDICATE = re.compile(r"^\s*(setp\.|and\.pred|or\.pred|not\.pred|mov\.pred)")


def _leaders(lines: list[str], threads: int) -> set[str]:
    """The predicates ``(%tid.x & (threads - 1)) == 0``: thread 0 of a partition of ``threads``."""
    tids = {m.group(1) for m in map(_TID.match, lines) if m}
    masked = {
        m.group(1)
        for m in map(_MASK.match, lines)
        if m and m.group(2) in tids and int(m.group(3)) == threads - 1
    }
    return {m.group(1) for m in map(_IS_ZERO.match, lines) if m and m.group(2) in masked}


def _next(lines: list[str], i: int) -> int:
    """The index of the first line after ``i`` that is not quiet (or len(lines))."""
    i += 1
    while i < len(lines) and _QUIET.match(lines[i]):
        i += 1
    return i


def _guards_wait(lines: list[str], i: int) -> bool:
    """Whether the barrier at ``i`` stands right before a wait on a barrier."""
    j = _next(lines, i)
    while j < len(lines) and (_WAIT_HEAD.match(lines[j]) or _PREDICATE.match(lines[j])):
        j = _next(lines, j)
    return j < len(lines) and bool(_WAIT.match(lines[j]))


def release_by_warpgroup(ptx: str) -> str:
    """``ptx`` rewritten as the module says where it holds :data:`MARK`; otherwise unchanged."""
    if MARK not in ptx:
        return ptx
    lines = ptx.split("\n")
    ands = {m.group(1): (m.group(2), m.group(3)) for m in map(_AND.match, lines) if m}
    leaders_of: dict[int, set[str]] = {}  # partition threads -> its thread 0's predicates
    drop: set[int] = set()
    released = 0
    for i, line in enumerate(lines):
        bar = _BAR.match(line)
        if not bar:
            continue
        threads = int(bar.group(1))
        j = _next(lines, i)
        while j < len(lines) and _AND.match(lines[j]):  # (the arrival's condition, computed in between)
            j = _next(lines, j)
        arrive = _ARRIVE.match(lines[j]) if j < len(lines) else None
        if arrive:
            if threads % 128 or threads < 256:
                raise ReleaseError(f"ptx_release: a release after a barrier of {threads} threads")
            indent, pred, address = arrive.groups()
            if threads not in leaders_of:
                leaders_of[threads] = _leaders(lines, threads)
            leaders = leaders_of[threads]
            if pred in leaders:
                cond = None
            elif pred in ands and ands[pred][0] in leaders:
                cond = ands[pred][1]
            elif pred in ands and ands[pred][1] in leaders:
                cond = ands[pred][0]
            else:
                what = lines[j].strip()
                raise ReleaseError(f"ptx_release: the release {what!r} is not partition thread 0's")
            block = [
                "{",
                ".reg .pred %sq_lead;",
                ".reg .b32 %sq_tid;",
                "mov.u32 %sq_tid, %tid.x;",
                "and.b32 %sq_tid, %sq_tid, 127;",
                "setp.eq.b32 %sq_lead, %sq_tid, 0;",
                *([f"and.pred %sq_lead, %sq_lead, {cond};"] if cond else []),
                f"@%sq_lead mbarrier.arrive.shared::cta.b64 _, [{address}];",
                "}",
            ]
            lines[j] = "\n".join(indent + b for b in block)
            drop.add(i)
            released += 1
        elif _guards_wait(lines, i):
            drop.add(i)
    left = sum(1 for line in lines if _ARRIVE.match(line))  # (a rewritten line spans several: no match)
    if not released and not left and "@%sq_lead mbarrier.arrive" in ptx:  # (the pass ran already)
        return ptx
    if not released or left:
        raise ReleaseError(
            f"ptx_release: {left} of the kernel's {released + left} stage releases left as they were; its "
            "ring's barriers count one arrival a warpgroup, so every release must be rewritten"
        )
    return "\n".join(line for i, line in enumerate(lines) if i not in drop)


def _passes(ptx: str, metadata: dict) -> str:
    """Each marked kernel's passes: :func:`release_by_warpgroup`, then ``ptx_cluster.share_x`` (whose kernel
    launches as clusters: its metadata's ``num_ctas``, which Triton's launcher reads)."""
    from squeezeserve.kernels.ops import ptx_cluster

    ptx, clustered = ptx_cluster.share_x(release_by_warpgroup(ptx))
    if clustered:
        metadata["num_ctas"] = ptx_cluster.CTAS
    return ptx


_hook = None


def install() -> None:
    """Run :func:`release_by_warpgroup` on every PTX Triton makes from now on (through its stages hook,
    chained after any hook already there), unless the hook in place is this one's. Triton 3.6 (vLLM 0.26's)
    calls the hook with the stages to change; later Triton also without arguments, for a key its cache adds
    to every kernel's. Called before each launch of a marked kernel (``launch_args``), so that a hook set
    since cannot leave one compiled without the pass (its stages would never be freed)."""
    global _hook
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    before = getattr(runtime, "add_stages_inspection_hook", install)  # (install: no such hook)
    if before is _hook and _hook is not None:  # (in place: the call's whole cost on a decode's host path)
        return
    if before is install:
        raise ReleaseError(f"ptx_release: Triton {triton.__version__} has no stages hook")

    def hook(*args):
        if not args:  # (the cache key's part)
            key, digest = before() if before is not None else ("", "")
            from squeezeserve.kernels.ops import ptx_cluster

            return key + "+squeezeserve-ptx-release", digest + MARK + ptx_cluster.MARK
        if before is not None:
            before(*args)
        stages = args[1]
        make_ptx = stages["ptx"]
        stages["ptx"] = lambda src, metadata: _passes(make_ptx(src, metadata), metadata)

    runtime.add_stages_inspection_hook = _hook = hook
