"""Compile a kernel launch for a CUDA GPU on a machine without one, and read the machine code it would run.

Triton's wheel carries ptxas and cuobjdump, so ``@triton.jit`` and ``@gluon.jit`` kernels compile for sm_90
here as they would on the H100: specialized the way the launch ``kernel[grid](*args, **kwargs)`` would
specialize them (dtypes, 16-byte alignment, integers equal to 1 or multiples of 16, TMA descriptors), down
to the cubin. CI compiles the Gluon kernel this way at the tilings quant_matmul runs (Gluon has no
interpreter), and ``tests/gpu/sass_probe.py`` prints what the SASS holds before a device run.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
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


def sass(compiled) -> list[str]:
    """The kernel's SASS, one instruction a line (predicate and operands, no addresses or encodings)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True)
    lines = []
    for line in out.stdout.splitlines():
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
    - ``instructions``: the count of each opcode."""
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
    }
