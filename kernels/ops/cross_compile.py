"""Compile kernel launches for a CUDA GPU on a machine without one, and read the machine code they would run.

Triton's wheel carries ptxas and cuobjdump, so ``@triton.jit`` and ``@gluon.jit`` kernels compile for sm_90
here as they would on the H100, specialized the way their launch would specialize them (dtypes, 16-byte
alignment, integers equal to 1 or multiples of 16, TMA descriptors), down to the cubin:

- :func:`compile_for` compiles one launch's kernel; :func:`sass` and :func:`summary` read the cubin;
- :func:`compile_launches` runs an op body under ``launch.capture`` (CPU tensors taking the paths and
  tilings of a given GPU, launches collected instead of run) and compiles what it launched;
- :func:`cases` are our ops at the 8B model's shapes; ``python -m squeezeserve.kernels.ops.cross_compile
  [--json] [NAME ...]`` compiles them and prints each kernel's summary.

CI runs the cases, the Gluon kernel's rule tilings among them (tests/kernels/test_cross_compile.py), in a
process without Triton's interpreter: the interpreter that runs the other kernel tests compiles nothing,
takes small tiles and skips inline PTX and wgmma (Gluon has none at all), and once it has run, Triton 3.9's
Gluon front end builds layouts with its builder. ``tests/gpu/sass_probe.py`` prints the Gluon kernel's SASS
summary by shape before a device run.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction, create_function_from_signature


def compile_for(kernel: JITFunction, args: tuple, kwargs: dict, arch: int = 90):
    """``kernel`` compiled for sm_``arch`` as its launch with ``args`` and ``kwargs`` would compile it (no
    GPU needed; CPU tensors stand for device ones of the same dtype and alignment). Returns Triton's
    CompiledKernel, whose ``asm`` holds the ttgir, ptx and cubin."""
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"compile_for needs a compiled (not interpreted) Triton kernel, got {type(kernel)}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        from triton.compiler import ASTSource as source
    src = source(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def has_cuobjdump() -> bool:
    return os.access(_tool("cuobjdump"), os.X_OK)


def _cuobjdump(compiled, flag: str) -> str:
    """What ``cuobjdump flag`` prints of the kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([_tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True)
    return out.stdout


def registers(compiled) -> str:
    """Registers a thread (each function's, from cuobjdump's resource usage)."""
    found = re.findall(r"REG:(\d+)", _cuobjdump(compiled, "-res-usage"))
    return "/".join(found) if found else "?"


def sass(compiled) -> list[str]:
    """The kernel's SASS, one instruction a line (predicate and operands, no addresses or encodings)."""
    lines = []
    for line in _cuobjdump(compiled, "-sass").splitlines():
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if match:
            lines.append(match.group(1))
    return lines


def summary(lines: list[str]) -> dict:
    """What decides a wgmma kernel's speed, read off its SASS:

    - ``local``: spill loads and stores (LDL / STL), which a kernel in budget has none of; ``loop_local``
      those between the first wgmma and the last wait for all groups (the K loop), where they cost every
      tile rather than once a tile (spills in the epilogue's layout conversion);
    - ``groups``: wgmma groups (HGMMA instructions that commit a group, ``gsb0``);
    - ``wait_one`` / ``wait_all``: waits for all but the newest group / for every group. A pipelined loop
      waits for all but one after each group and for all once at the end; a loop whose products ptxas
      serialised (an operand register rewritten while its group may still read it) waits for every group
      after each (tests/benchmarks/NOTES.md, "tenth session");
    - ``instructions``: the count of each opcode; ``loop_instructions``: all of them between the first
      wgmma and the last wait for all groups (a pipelined kernel's K loop, unrolled as ptxas left it);
      ``loop_barriers``: the CTA barriers (``BAR.SYNC``) there, which hold every warp of a partition to the
      others' pace (ptx_release)."""
    ops: dict[str, int] = {}
    for line in lines:
        words = [w for w in line.split() if not w.startswith("@")]  # (past a predicate)
        op = words[0].split(".")[0] if words else ""
        ops[op] = ops.get(op, 0) + 1
    spill = [i for i, line in enumerate(lines) if re.search(r"(^|\s)(LDL|STL)(\.|\s)", line)]
    products = [i for i, line in enumerate(lines) if "HGMMA" in line]
    ends = [i for i, line in enumerate(lines) if "DEPBAR.LE gsb0, 0x0" in line]
    loop = (products[0], ends[-1]) if products and ends else (0, -1)
    return {
        "local": ops.get("LDL", 0) + ops.get("STL", 0),
        "loop_local": sum(1 for i in spill if loop[0] < i < loop[1]),
        "groups": sum(1 for line in lines if "HGMMA" in line and "gsb0" in line),
        "wait_one": sum(1 for line in lines if "DEPBAR.LE gsb0, 0x1" in line),
        "wait_all": sum(1 for line in lines if "DEPBAR.LE gsb0, 0x0" in line),
        "instructions": ops,
        "loop_instructions": max(0, loop[1] - loop[0]),
        "loop_barriers": sum(1 for line in lines[loop[0] + 1 : loop[1]] if "BAR.SYNC" in line),
    }


def compile_launches(
    body, *args, sms: int = 132, wgmma: bool = True, arch: int = 90, smem: int | None = None
) -> list[dict]:
    """``body(*args)`` (an op body on CPU tensors) as it runs on a GPU of ``sms`` SMs: each kernel it
    launches, compiled for sm_``arch``, with its SASS summary (:func:`summary`), grid, constexprs and shared
    memory. With ``smem`` (the GPU's bytes a block), as ``launch.launch_fitting`` runs it there: with fewer
    pipeline stages while the kernel needs more shared memory than that (``stages``: what it runs with;
    ``asked_stages``: what the launch asked for)."""
    from squeezeserve.kernels.ops import launch

    with launch.capture(sms=sms, wgmma=wgmma) as launches:
        body(*args)
    out, seen = [], set()
    for kernel, grid, largs, kwargs in launches:
        key = (kernel, launch.specialization_key(largs, kwargs))
        if key in seen:  # (a chunked op launches one specialization many times)
            continue
        seen.add(key)
        compiled = compile_for(kernel, largs, kwargs, arch)
        asked = kwargs.get("num_stages", launch.DEFAULT_STAGES)
        while smem is not None and compiled.metadata.shared > smem:
            refusal = OutOfResources(compiled.metadata.shared, smem, "shared memory")  # (loading it raises)
            fewer = launch.fewer_stages(kwargs, refusal)
            if fewer is None:
                break
            kwargs = fewer
            compiled = compile_for(kernel, largs, kwargs, arch)
        scalars = {k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool, str))}
        stages = kwargs.get("num_stages", launch.DEFAULT_STAGES)
        out.append({"kernel": kernel.__name__, "grid": list(grid), "summary": summary(sass(compiled)),
                    "constexprs": scalars, "shared": compiled.metadata.shared, "stages": stages,
                    "asked_stages": asked})  # fmt: skip
    return out


def cases() -> dict:
    """Named calls of our op bodies at the shapes and settings the GPU paths see (the 8B model's decode and
    prefill GEMMs; int4 g128 / g32, with and without zero points, int8 per channel; codebooks; the
    memory-bound ops, cross-entropy and the fused linear losses). Each value makes (body, args) when called
    (the inputs are made only for the cases compiled)."""
    import torch

    from squeezeserve.kernels import codebook_layout, quant_layout
    from squeezeserve.kernels.ops import (
        codebook_matmul,
        cross_entropy,
        fused_linear_ce,
        fused_linear_kd,
        quant_matmul,
        rmsnorm,
        softmax,
        swiglu,
    )

    bf = torch.bfloat16

    def qm(m, n, k, group, bits=4, zeros=False, dtype=bf):
        t = quant_layout.pack_weight(torch.zeros(n, k), bits, group, symmetric=not zeros)
        zp = t["weight_zero_point"] if zeros else None
        x, scales = torch.zeros(m, k, dtype=dtype), t["weight_scale"].to(dtype)
        return quant_matmul._quant_matmul, (x, t["weight_packed"], scales, zp, group, bits)

    def owned(m, n, k, group, zeros=False):  # quant_matmul_owned (the vLLM method's owned_shape layers)
        _, (x, qw, scales, zp, _, _) = qm(m, n, k, group, zeros=zeros)
        zp = quant_layout.to_owned_zeros(zp, n) if zeros else None
        return quant_matmul._quant_matmul_owned, (x, quant_layout.to_owned_order(qw), scales, zp, group)

    def dequantize(n, k, group, bits=4, zeros=False, owned=False):
        t = quant_layout.pack_weight(torch.zeros(n, k), bits, group, symmetric=not zeros)
        qw, scales, zp = t["weight_packed"], t["weight_scale"].to(bf), t.get("weight_zero_point")
        if owned:
            qw, zp = quant_layout.to_owned_order(qw), quant_layout.to_owned_zeros(zp, n) if zeros else None
        return quant_matmul.dequantize, (qw, scales, zp if zeros else None, k, group, bits, bf, None, owned)

    def cb(m, n, k, group, bits):
        idx = codebook_layout.pack_indices(torch.zeros(n, k, dtype=torch.int32), bits)
        book = torch.zeros(n, (k // group if group else 1) << bits, dtype=bf)
        return codebook_matmul._codebook_matmul, (torch.zeros(m, k, dtype=bf), idx, book, group, bits)

    def rows(m, n):
        return torch.zeros(m, n, dtype=bf)

    def tokens(n, vocab):
        return torch.randint(0, vocab, (n,))

    w = torch.ones(4096, dtype=bf)

    def call(body, *args):
        return body, args

    return {
        "quant_matmul 1x14336x4096 int4 g128": lambda: qm(1, 14336, 4096, 128),
        "quant_matmul 2x4096x14336 int4 g32 zp": lambda: qm(2, 4096, 14336, 32, zeros=True),
        "quant_matmul 16x14336x4096 int4 g128": lambda: qm(16, 14336, 4096, 128),
        "quant_matmul 16x4096x14336 int4 g32 zp": lambda: qm(16, 4096, 14336, 32, zeros=True),
        "quant_matmul 64x4096x4096 int4 g32 zp fp16": lambda: qm(
            64, 4096, 4096, 32, zeros=True, dtype=torch.float16),
        "quant_matmul 8x4096x4096 int8 per channel": lambda: qm(8, 4096, 4096, 4096, bits=8),
        "quant_matmul 256x4096x4096 int4 g64": lambda: qm(256, 4096, 4096, 64),
        "quant_matmul 256x6144x4096 int4 g128 zp (Gluon prefill)": lambda: qm(
            256, 6144, 4096, 128, zeros=True),
        "quant_matmul 512x4096x14336 int4 g32": lambda: qm(512, 4096, 14336, 32),
        "quant_matmul 4097x4096x1024 int4 g128 (dequantize, in slices)": lambda: qm(4097, 4096, 1024, 128),
        # the Gluon kernel at the tilings its rules choose (gluon_decode_tiles, gluon_tiles)
        "quant_matmul 16x14336x14336 int4 g128 (Gluon decode)": lambda: qm(16, 14336, 14336, 128),
        "quant_matmul 16x14336x14336 int4 g128 zp (Gluon decode)": lambda: qm(
            16, 14336, 14336, 128, zeros=True),
        "quant_matmul 32x4096x14336 int4 g256 (Gluon decode)": lambda: qm(32, 4096, 14336, 256),
        "quant_matmul 64x14336x14336 int4 g128 fp16 (Gluon decode)": lambda: qm(
            64, 14336, 14336, 128, dtype=torch.float16),
        "quant_matmul 32x14336x14336 int4 g32 zp (Gluon decode, 8 groups a tile)": lambda: qm(
            32, 14336, 14336, 32, zeros=True),
        "quant_matmul 64x14336x14336 int4 g32 (Gluon decode, 8 groups a tile)": lambda: qm(
            64, 14336, 14336, 32),
        "quant_matmul 128x14336x14336 int4 g128 (Gluon prefill)": lambda: qm(128, 14336, 14336, 128),
        "quant_matmul 512x14336x4096 int4 g128 zp (Gluon prefill)": lambda: qm(
            512, 14336, 4096, 128, zeros=True),
        "quant_matmul 512x14336x4096 int4 g32 zp (Gluon prefill)": lambda: qm(
            512, 14336, 4096, 32, zeros=True),
        "quant_matmul 2048x28672x4096 int4 g64 fp16 (Gluon prefill)": lambda: qm(
            2048, 28672, 4096, 64, dtype=torch.float16),
        # (128-row tiles stream-K: each warpgroup frees its own stages, 128 deep in groups of 128, else 64)
        "quant_matmul 100x4096x14336 int4 g128 (Gluon stream-K)": lambda: qm(100, 4096, 14336, 128),
        "quant_matmul 100x4096x14336 int4 g128 zp (Gluon stream-K)": lambda: qm(
            100, 4096, 14336, 128, zeros=True),
        "quant_matmul_owned 100x4096x14336 int4 g32 zp (Gluon stream-K, 64 deep)": lambda: owned(
            100, 4096, 14336, 32, True),
        "quant_matmul 136x4096x14336 int4 g128 zp (Gluon stream-K, 256-row tiles)": lambda: qm(
            136, 4096, 14336, 128, zeros=True),
        "quant_matmul 1536x6144x4096 int4 g128 (Gluon whole waves, then stream-K, 256-row tiles)": lambda: qm(
            1536, 6144, 4096, 128),
        # (GLUON_HALF_TILES: 64-row weight tiles, one a program, on one warpgroup)
        "quant_matmul 128x6144x4096 int4 g128 zp (Gluon 64-row weight tiles)": lambda: qm(
            128, 6144, 4096, 128, zeros=True),
        "quant_matmul 112x6144x4096 int4 g32 zp (Gluon 64-row weight tiles)": lambda: qm(
            112, 6144, 4096, 32, zeros=True),
        # (where K is deep: each 64-row tile's K in two parts, a program each)
        "quant_matmul 128x4096x14336 int4 g128 zp (Gluon 64-row weight tiles, K in two parts)": lambda: qm(
            128, 4096, 14336, 128, zeros=True),
        # (o_proj: 64 such tiles, a quarter of the SMs' worth and more, where K is short and 128 deep)
        "quant_matmul 128x4096x4096 int4 g128 (Gluon 64-row weight tiles, o_proj)": lambda: qm(
            128, 4096, 4096, 128),
        # thread-owned words: one row of g32 on the FMA kernel, the Gluon decode, the dequantize kernel
        "quant_matmul_owned 1x14336x4096 int4 g32 (FMA kernel)": lambda: owned(1, 14336, 4096, 32),
        "quant_matmul_owned 1x28672x4096 int4 g32 (Gluon decode)": lambda: owned(1, 28672, 4096, 32),
        "quant_matmul_owned 1x28672x4096 int4 g32 zp (Gluon decode)": lambda: owned(1, 28672, 4096, 32, True),
        "quant_matmul_owned 16x28672x4096 int4 g128 (Gluon decode)": lambda: owned(16, 28672, 4096, 128),
        # (GLUON_DECODE_WHOLE_*: a tile a program where 64-row tiles nearly fill two programs an SM)
        "quant_matmul_owned 16x14336x4096 int4 g32 zp (Gluon decode, a tile a program)": lambda: owned(
            16, 14336, 4096, 32, True
        ),
        "quant_matmul_owned 8x14336x4096 int4 g128 (Gluon decode, a tile a program)": lambda: owned(
            8, 14336, 4096, 128
        ),
        "quant_matmul_owned 512x28672x4096 int4 g128 (Gluon persistent in clusters, a 128-row tail)": (
            lambda: owned(512, 28672, 4096, 128)
        ),
        "quant_matmul 896x14336x4096 int4 g128 zp (Gluon persistent in clusters, a 128-row tail)": lambda: qm(
            896, 14336, 4096, 128, zeros=True
        ),
        "quant_matmul_owned 320x28672x4096 int4 g128 (Gluon stream-K, 128-row tiles)": (
            lambda: owned(320, 28672, 4096, 128)
        ),
        "quant_matmul_owned 600x28672x4096 int4 g128 (Gluon whole waves, then stream-K, 128-row tiles)": (
            lambda: owned(600, 28672, 4096, 128)
        ),
        "quant_matmul_owned 1100x4096x14336 int4 g128 zp (Gluon a wave, then stream-K, 256-row tiles)": (
            lambda: owned(1100, 4096, 14336, 128, True)
        ),
        "quant_matmul_owned 1024x4096x14336 int4 g128 zp (Gluon in clusters sharing x, 256-row tiles)": (
            lambda: owned(1024, 4096, 14336, 128, True)
        ),
        "quant_matmul 2048x14336x14336 int4 g128 (Gluon persistent in clusters, 256-row tiles)": lambda: qm(
            2048, 14336, 14336, 128
        ),
        "quant_matmul_owned 2048x28672x4096 int4 g128 (Gluon persistent in clusters, 256-row tiles)": (
            lambda: owned(2048, 28672, 4096, 128)
        ),
        "quant_matmul_owned dequantize 4096x14336 int4 g128": (
            lambda: dequantize(4096, 14336, 128, owned=True)
        ),
        "quant_matmul_owned dequantize 14336x4096 int4 g32 zp": (
            lambda: dequantize(14336, 4096, 32, zeros=True, owned=True)
        ),
        "quant_matmul dequantize 4096x4096 int8 per channel": lambda: dequantize(4096, 4096, 4096, bits=8),
        "codebook_matmul 1x4096x4096 4-bit g128": lambda: cb(1, 4096, 4096, 128, 4),
        "codebook_matmul 16x4096x4096 4-bit g128": lambda: cb(16, 4096, 4096, 128, 4),
        "codebook_matmul 128x4096x4096 3-bit per channel": lambda: cb(128, 4096, 4096, 0, 3),
        "swiglu 16x14336": lambda: call(swiglu._swiglu, rows(16, 14336), rows(16, 14336)),
        "rmsnorm 16x4096": lambda: call(rmsnorm._rmsnorm, rows(16, 4096), w, 1e-6),
        "add_rmsnorm 4096x4096": lambda: call(
            rmsnorm._add_rmsnorm, rows(4096, 4096), rows(4096, 4096), w, 1e-6),
        "softmax 16x32768": lambda: call(softmax._softmax, rows(16, 32768)),
        "softmax 4x131072 (split rows)": lambda: call(softmax._softmax, rows(4, 131072)),
        "swiglu_backward 4096x4096": lambda: call(swiglu._swiglu_backward, *(rows(4096, 4096),) * 3),
        "swiglu_oai 16x2880": lambda: call(swiglu._swiglu_oai, rows(16, 2880), rows(16, 2880), 1.702, 7.0),
        "silu_and_mul 16x28672": lambda: call(swiglu._silu_and_mul, rows(16, 28672)),
        "rmsnorm_backward 4096x4096": lambda: call(
            rmsnorm._rmsnorm_backward, rows(4096, 4096), rows(4096, 4096), w, 1e-6),
        "add_rmsnorm_backward 16x4096": lambda: call(
            rmsnorm._add_rmsnorm_backward, rows(16, 4096), rows(16, 4096), rows(16, 4096), w, 1e-6),
        "softmax_backward 4x131072 (split rows)": lambda: call(
            softmax._softmax_backward, rows(4, 131072), rows(4, 131072)),
        "cross_entropy 1024x128256": lambda: call(
            cross_entropy._cross_entropy_, rows(1024, 128256), tokens(1024, 128256), -100, 0.1, "mean", True),
        "fused_linear_ce 256x512x32000": lambda: call(
            fused_linear_ce._fused_linear_cross_entropy, rows(256, 512), rows(32000, 512), tokens(256, 32000),
            None, -100, 0.0, "mean", True),
        "fused_linear_kd 256x512x32000": lambda: call(
            fused_linear_kd._fused_linear_kd, rows(256, 512), rows(32000, 512), rows(256, 768),
            rows(32000, 768), tokens(256, 32000), 2.0, 0.5, -100, "mean", True, True),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m squeezeserve.kernels.ops.cross_compile [--json] [NAME ...]``: compile :func:`cases`
    (all, or those whose name contains a NAME) for sm_90 and print each kernel's SASS summary."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--json", action="store_true", help="one JSON object a case")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H100 SXM 132, A100 108, L4 58)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 Hopper, 80, 86, 89)")
    ap.add_argument("--no-wgmma", action="store_true", help="a GPU without Hopper's wgmma (before sm_90)")
    ap.add_argument("--smem", type=int, help="shared memory a block, bytes (A100 166912, sm_86/89 101376)")
    args = ap.parse_args(argv)
    failed = 0
    for name, make in cases().items():
        if args.names and not any(n in name for n in args.names):
            continue
        try:
            body, call_args = make()
            gpu = {"sms": args.sms, "wgmma": not args.no_wgmma, "arch": args.arch, "smem": args.smem}
            launches = compile_launches(body, *call_args, **gpu)
            result = {"case": name, "launches": launches}
        except Exception as e:  # noqa: BLE001 - reported per case; the exit status says one failed
            failed += 1
            result = {"case": name, "error": f"{type(e).__name__}: {str(e).strip()[-2000:]}"}
        if args.json:
            lines = [json.dumps(result)]
        elif "error" in result:
            lines = [f"{name}: FAILED {result['error']}"]
        else:
            lines = [f"{name}: {one['kernel']} grid {one['grid']}: {s['local']} LDL/STL ({s['loop_local']} "
                     f"in a wgmma loop), {s['groups']} wgmma groups, {one['shared']} B shared at "
                     f"{one['stages']} stages"
                     for one in result["launches"] for s in (one["summary"],)]  # fmt: skip
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
