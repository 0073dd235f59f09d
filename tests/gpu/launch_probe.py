"""Device probe for issue #16 item 4: where the host time of one eager call of our softmax / RMSNorm /
SwiGLU goes.

Each line is host microseconds per call over 2000 back-to-back calls (the GPU work, ~2-5 us, hides behind
the launches), the minimum of 7 interleaved rounds (this machine's host timings swing +-50% between runs of
one script). The rows peel the call apart: the functional API, the op body below it, the bare
``torch.empty`` it allocates with, the Triton launch through ``FastLaunch``, through Triton's own
``kernel[grid]`` and through the compiled kernel's launcher alone, against torch's and vLLM's ops; "launch
plan" rows replay the op's recorded launches (kernels/ops/replay.py), "plans off" run its body each call.

Second part: whether autograd keeps (steals) the gradients fused linear cross-entropy computes in its
forward, or copies them into ``.grad`` (a copy doubles the gradients' memory at the peak).

``--quant``: the host time of one int4 ``quant_matmul`` call as vLLM makes it (``quant_matmul_eager``,
what our vLLM method calls where nothing traces, and ``quant_matmul_opaque``, the op it puts in compiled
graphs) at prompt sizes, which vLLM runs eagerly (its CUDA graphs hold decode steps only):
enqueue time of 200 calls without a sync (the GPU work, 20-130 us a call, would otherwise be timed), against
the call's GPU time (CUDA graph replay) and torch's bf16 matmul (cuBLAS, all C++).

``--codebook-shapes``: the same for ``codebook_matmul`` (the functional API, the dispatched op, the opaque
op), a codebook of 2**BITS fp16 entries for each GROUP inputs of a row (GROUP 0: one a row).

    python3 tests/gpu/launch_probe.py [--quant | --quant-shapes N:K,... GROUP M,... [float16]
                                       | --codebook-shapes N:K,... GROUP BITS M,...]
"""

from __future__ import annotations

import sys
import time

import torch
from torch._library.triton import set_wrap_triton_enabled

import squeezeserve.kernels as K
from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import fused_linear_ce as flce
from squeezeserve.kernels.ops import launch, native, quant_matmul, replay
from squeezeserve.kernels.ops import rmsnorm as rn
from squeezeserve.kernels.ops import softmax as sm
from squeezeserve.kernels.ops import swiglu as sw

CALLS, ROUNDS = 2000, 7


def per_call_us(fn) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / CALLS


def table(rows: dict) -> None:
    for fn in rows.values():
        for _ in range(200):
            fn()
    torch.cuda.synchronize()
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(ROUNDS):
        for name, fn in rows.items():
            best[name] = min(best[name], per_call_us(fn))
    for name, us in best.items():
        print(f"  {name:<44} {us:7.1f} us", flush=True)


def vllm_silu_and_mul():
    try:
        import vllm._custom_ops  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"# vllm unavailable: {exc}")
        return None
    return torch.ops._C.silu_and_mul


def softmax_rows(x: torch.Tensor) -> dict:
    out = torch.empty_like(x)
    rows, n = x.shape
    block, single, warps = sm.launch_config(n)
    args = (x, out, x.stride(0), out.stride(0), n, rows)
    kw = {"BLOCK_R": 1, "BLOCK": block, "SINGLE": single, "num_warps": warps}
    fast = launch.FastLaunch(sm._softmax_fwd)
    grid = (rows,)
    compiled = sm._softmax_fwd[grid](*args, **kw)
    bound = (*args, 1, block, single)
    stream = torch.cuda.current_stream().cuda_stream

    def body():
        with set_wrap_triton_enabled(False):
            return sm._softmax(x)

    return {
        "torch.softmax": lambda: torch.softmax(x, -1),
        "K.softmax (functional, launch plan)": lambda: K.softmax(x),
        "K.softmax (plan replayed in Python)": python_plans(sm.softmax_eager, lambda: K.softmax(x)),
        "C++ replayer call alone": lambda: cpp_replayer(sm.softmax_eager, (x,)),
        "K.softmax (plans off, fast launch)": without_plans(lambda: K.softmax(x)),
        "launch plan alone (LaunchPlans call)": lambda: sm.softmax_eager.plans(sm._softmax, (x,)),
        "op body (fast launch)": body,
        "torch.empty": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "FastLaunch launch": lambda: fast[grid](*args, **kw),
        "triton kernel[grid]": lambda: sm._softmax_fwd[grid](*args, **kw),
        "compiled.run (launcher alone)": lambda: compiled.run(
            rows, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound
        ),
    }


def python_plans(op, fn):
    """``fn`` with ``op``'s plans replayed in Python, not by the C++ extension (kernels/ops/native.py)."""

    def call():
        saved, op.plans.native = op.plans.native, None
        try:
            return fn()
        finally:
            op.plans.native = saved

    return call


def cpp_replayer(op, inputs: tuple):
    """The op's C++ replayer called directly (what a call costs below the functional layer); the op's
    Python path where the extension took no plan (the probe's first line says whether it built)."""
    replayer = op.plans.native
    out = replayer(*inputs) if replayer is not None else None
    return out if out is not None else op(*inputs)


def without_plans(fn):
    def call():
        replay.LAUNCH_PLANS = False
        try:
            return fn()
        finally:
            replay.LAUNCH_PLANS = True

    return call


def rmsnorm_rows(x: torch.Tensor) -> dict:
    w = torch.rand(x.shape[-1], device=x.device, dtype=x.dtype) + 0.5
    r = torch.randn_like(x)
    rows = {
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "K.rmsnorm (launch plan)": lambda: K.rmsnorm(x, w, 1e-6),
        "K.rmsnorm (plan replayed in Python)": python_plans(rn.rmsnorm_eager, lambda: K.rmsnorm(x, w, 1e-6)),
        "C++ replayer call alone (rmsnorm)": lambda: cpp_replayer(rn.rmsnorm_eager, (x, w, 1e-6)),
        "K.rmsnorm (plans off)": without_plans(lambda: K.rmsnorm(x, w, 1e-6)),
        "torch x + r, F.rms_norm": lambda: torch.nn.functional.rms_norm(x + r, (x.shape[-1],), w, 1e-6),
        "K.add_rmsnorm (launch plan)": lambda: K.add_rmsnorm(x, r, w, 1e-6),
        "K.add_rmsnorm (plan replayed in Python)": python_plans(
            rn.add_rmsnorm_eager, lambda: K.add_rmsnorm(x, r, w, 1e-6)
        ),
        "K.add_rmsnorm (plans off)": without_plans(lambda: K.add_rmsnorm(x, r, w, 1e-6)),
        "op body rmsnorm (fast launch)": lambda: body_of(rn._rmsnorm, x, w, 1e-6),
    }
    try:
        import vllm._custom_ops  # noqa: F401

        def theirs():
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, w, 1e-6)
            return out

        rows["vllm rms_norm (+ empty_like)"] = theirs
    except Exception as exc:  # noqa: BLE001
        print(f"# vllm unavailable: {exc}")
    return rows


def body_of(fn, *args):
    with set_wrap_triton_enabled(False):
        return fn(*args)


def swiglu_rows(a: torch.Tensor, b: torch.Tensor) -> dict:
    op = vllm_silu_and_mul()
    ab = torch.cat([a, b], -1)
    rows = {"torch silu(a)*b": lambda: torch.nn.functional.silu(a) * b, "K.swiglu": lambda: K.swiglu(a, b)}
    rows["K.swiglu (plan replayed in Python)"] = python_plans(sw.swiglu_eager, lambda: K.swiglu(a, b))
    rows["K.swiglu (plans off)"] = without_plans(lambda: K.swiglu(a, b))
    rows["K.silu_and_mul"] = lambda: K.silu_and_mul(ab)
    rows["K.silu_and_mul (plan replayed in Python)"] = python_plans(
        sw.silu_and_mul_eager, lambda: K.silu_and_mul(ab)
    )
    rows["K.silu_and_mul (plans off)"] = without_plans(lambda: K.silu_and_mul(ab))
    if op is not None:

        def theirs():
            out = ab.new_empty(ab.shape[0], ab.shape[1] // 2)
            op(out, ab)
            return out

        rows["vllm silu_and_mul (+ new_empty)"] = theirs
    rows["sw._swiglu body"] = lambda: sw._swiglu(a, b)
    return rows


def flce_grads() -> None:
    n, h, v = 4096, 256, 32000
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    seen = {}
    grad = flce.fused_linear_cross_entropy_eager.backward

    def spy(ctx, *g):
        out = grad(ctx, *g)
        seen["ptrs"] = (out[0].data_ptr(), out[1].data_ptr())
        seen["in_backward"] = torch.cuda.memory_allocated()
        return out

    shipped = flce.fused_linear_cross_entropy_eager
    op = flce.EagerOp(shipped.forward, shipped.setup_context, spy, shipped.materialize_grads)
    for step in range(2):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = op(hidden, weight, target, None, -100, 0.0, "mean", True)[0]
        after_fwd = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        mb = lambda b, base=base: f"{(b - base) / 2**20:.1f} MiB"  # noqa: E731
        kept = (hidden.grad.data_ptr(), weight.grad.data_ptr()) == seen["ptrs"]
        print(f"  flce step {step}: after forward {mb(after_fwd)}, in backward {mb(seen['in_backward'])}, "
              f"after {mb(torch.cuda.memory_allocated())}, peak {mb(torch.cuda.max_memory_allocated())}; "
              f"gradients {(n + v) * h * 2 / 2**20:.1f} MiB; .grad is the op's tensor: {kept}",
              flush=True)  # fmt: skip
        del loss


def enqueue_us(fn, calls: int = 200) -> float:
    """Host microseconds a call to enqueue ``fn`` (no sync inside: the launch queue absorbs ``calls``)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def _direct(body, x, qweight, scales, group=128):
    """``body`` as the opaque op runs it: kernels launched directly, not through torch's wrap_triton."""
    from squeezeserve.kernels.registry import direct_launches

    with direct_launches:
        return body(x, qweight, scales, None, group, 4)


def _dispatched(fn, *args):
    """``fn(*args)`` with FastLaunch off: every launch through Triton's own ``kernel[grid]``."""
    launch.FAST_LAUNCH = False
    try:
        return fn(*args)
    finally:
        launch.FAST_LAUNCH = True


def _prefill_forced(path: str, fn, *args):
    """``fn(*args)`` with quant_matmul.PREFILL set to ``path`` (plans are per signature, not per path: the
    caller's plans must be cleared around it)."""
    saved, quant_matmul.PREFILL = quant_matmul.PREFILL, path
    try:
        return fn(*args)
    finally:
        quant_matmul.PREFILL = saved


def quant_host(shapes=((14336, 4096), (4096, 14336), (6144, 4096)), group=128, ms=(16, 128, 256, 512, 2048),
               dtype=torch.bfloat16) -> None:  # fmt: skip
    from triton.testing import do_bench_cudagraph

    assert quant_matmul.quant_matmul_opaque  # registers the op
    opaque = torch.ops.squeezeserve.quant_matmul_opaque  # what our vLLM method calls
    eager = quant_matmul.quant_matmul_eager
    for n, k in shapes:
        t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=dtype) / 64, 4, group)
        qw, sc = t["weight_packed"], t["weight_scale"].to(dtype)
        dense = torch.randn(n, k, device="cuda", dtype=dtype)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            rows = {
                "quant_matmul_opaque": lambda x=x, q=qw, s=sc: opaque(x, q, s, None, group, 4),
                "quant_matmul_eager": lambda x=x, q=qw, s=sc: eager(x, q, s, None, group, 4),
                "quant_matmul_eager, plan replayed in Python": python_plans(
                    eager, lambda x=x, q=qw, s=sc: eager(x, q, s, None, group, 4)
                ),
                "K.quant_matmul": lambda x=x, q=qw, s=sc: K.quant_matmul(x, q, s, None, group, 4),
                "torch.ops.squeezeserve.quant_matmul": lambda x=x, q=qw, s=sc: (
                    torch.ops.squeezeserve.quant_matmul(x, q, s, None, group, 4)
                ),
                "torch.ops.squeezeserve.quant_matmul, plans off (its body each call)": python_plans(
                    eager,
                    without_plans(
                        lambda x=x, q=qw, s=sc: torch.ops.squeezeserve.quant_matmul(x, q, s, None, group, 4)
                    ),
                ),
                "K.quant_matmul, Triton's dispatch": lambda x=x, q=qw, s=sc: _dispatched(
                    K.quant_matmul, x, q, s, None, group, 4
                ),
                "its body (_quant_matmul)": lambda x=x, q=qw, s=sc: _direct(
                    quant_matmul._quant_matmul, x, q, s, group
                ),
                "torch x @ w.t()": lambda x=x, d=dense: x @ d.t(),
            }
            if m > quant_matmul.SKINNY_MAX_M:  # each prefill path, its plan recorded and replayed
                for path in ("triton", "dequantize"):
                    timed = {}
                    for name, fn in (("host", enqueue_us), ("GPU", None)):
                        eager.plans.clear()
                        run = lambda x=x, q=qw, s=sc, p=path: _prefill_forced(  # noqa: E731
                            p, eager, x, q, s, None, group, 4
                        )
                        for _ in range(20):
                            run()
                        timed[name] = (min(fn(run) for _ in range(ROUNDS)) if fn else
                                       do_bench_cudagraph(run, rep=20) * 1e3)  # fmt: skip
                    print(f"{m}x{n}x{k} g{group}: quant_matmul_eager, PREFILL={path}: "
                          f"host {timed['host']:.1f} us, GPU {timed['GPU']:.1f} us", flush=True)  # fmt: skip
                eager.plans.clear()
            for fn in rows.values():
                for _ in range(20):
                    fn()
            best = {name: min(enqueue_us(fn) for _ in range(ROUNDS)) for name, fn in rows.items()}
            gpu = {name: do_bench_cudagraph(fn, rep=20) * 1e3 for name, fn in rows.items()}
            print(f"{m}x{n}x{k}: " + "; ".join(f"{name} host {best[name]:.1f} us, GPU {gpu[name]:.1f} us"
                                               for name in rows), flush=True)  # fmt: skip


def codebook_host(shapes, group: int, bits: int, ms, dtype=torch.bfloat16) -> None:
    """The host time of one ``codebook_matmul`` call, each way a caller reaches it: the functional API
    (``codebook_matmul_eager``, no dispatcher), the registered op through torch's dispatcher, and the opaque
    op vLLM's method calls; enqueue time of 200 calls, against each call's GPU time (CUDA graph replay)."""
    from triton.testing import do_bench_cudagraph

    from squeezeserve.kernels import codebook_layout
    from squeezeserve.kernels.ops import codebook_matmul

    assert codebook_matmul.codebook_matmul_opaque  # registers the ops
    ops = torch.ops.squeezeserve
    for n, k in shapes:
        index = torch.randint(0, 1 << bits, (n, k))
        words = codebook_layout.pack_indices(index, bits).cuda()
        book = torch.randn(n, (k // group if group else 1) << bits, device="cuda", dtype=torch.float16)
        dense = torch.randn(n, k, device="cuda", dtype=dtype)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = (words, book, group, bits)
            rows = {
                "K.codebook_matmul": lambda x=x, w=w: K.codebook_matmul(x, *w),
                "torch.ops.squeezeserve.codebook_matmul": lambda x=x, w=w: ops.codebook_matmul(x, *w),
                "codebook_matmul_opaque": lambda x=x, w=w: ops.codebook_matmul_opaque(x, *w),
                "torch x @ w.t()": lambda x=x, d=dense: x @ d.t(),
            }
            for fn in rows.values():
                for _ in range(20):
                    fn()
            best = {name: min(enqueue_us(fn) for _ in range(ROUNDS)) for name, fn in rows.items()}
            gpu = {name: do_bench_cudagraph(fn, rep=20) * 1e3 for name, fn in rows.items()}
            print(f"codebook {m}x{n}x{k} g{group} {bits}-bit: " + "; ".join(
                f"{name} host {best[name]:.1f} us, GPU {gpu[name]:.1f} us" for name in rows),
                flush=True)  # fmt: skip


def quant_parts(m: int = 256, n: int = 4096, k: int = 4096) -> None:
    """Host time of the pieces of one prefill call of ``quant_matmul_opaque``, split along K as the tuning
    says (four splits at the default shape: the workspace path)."""
    from squeezeserve.kernels.ops import quant_matmul_kernels as qk
    from squeezeserve.kernels.registry import direct_launches, eager

    qm = quant_matmul
    t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64, 4, 128)
    qw, sc = t["weight_packed"], t["weight_scale"]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    opaque = torch.ops.squeezeserve.quant_matmul_opaque
    cfg = qm.prefill_tuning(m, n, k, 128, 4, x.device)
    tiles = launch.cdiv(k, cfg["BLOCK_K"])
    per = launch.cdiv(tiles, cfg["split"])
    split = launch.cdiv(tiles, per)
    grid = (launch.cdiv(n, cfg["BLOCK_N"]) * launch.cdiv(m, cfg["BLOCK_M"]), 1, split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws, counts = qm._workspace(x.device, m * n, grid[0])
    args = (x, qw, sc, qw, y, ws, counts, m, n, k, x.stride(0), qw.stride(0), sc.stride(0), qw.stride(0),
            y.stride(0), per, split)  # fmt: skip
    meta = {"BITS": 4, "GROUP": 128, "HAS_ZERO": False, "MAGIC": 0x4300, "BIAS": 128.0, "NATIVE": True}
    meta |= {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
    meta |= {"MODE": 2 if split > 1 else 0, "EVEN_K": True, "GPT": 1, "SWIZZLE": cfg["SWIZZLE"]}
    meta |= {
        "DOT_FP32": False,
        "ASYNC_MMA": True,
        "num_warps": cfg["num_warps"],
        "num_stages": cfg["num_stages"],
    }

    def body():
        with direct_launches:
            qm._quant_matmul(x, qw, sc, None, 128, 4)

    def prefill():
        with direct_launches:
            qm._prefill(x, qw, sc, None, qw, 128, 4)

    def launched():
        with direct_launches:
            launch.traceable(qk._prefill_kernel)[grid](*args, **meta)

    rows = {
        "quant_matmul_opaque (torch.ops)": lambda: opaque(x, qw, sc, None, 128, 4),
        "body: _quant_matmul under direct_launches": body,
        "_prefill under direct_launches": prefill,
        "FastLaunch of the kernel, arguments made": launched,
        "specialization_key": lambda: launch.specialization_key(args, meta),
        "check_inputs": lambda: qm.check_inputs(x, qw, sc, None, 128, 4),
        "prefill_in_triton + prefill_tuning": lambda: (
            qm.prefill_in_triton(m, n, k, 128),
            qm.prefill_tuning(m, n, k, 128, 4, x.device),
        ),
        "torch.empty((m, n), dtype=, device=)": lambda: torch.empty((m, n), dtype=x.dtype, device=x.device),
        "eager(x, qw, sc, None)": lambda: eager(x, qw, sc, None),
        "with direct_launches: pass": lambda: (
            direct_launches.__enter__() or direct_launches.__exit__(None, None, None)
        ),
        "torch bf16 x @ x.t() (a cuBLAS call)": lambda: x @ x.t(),
    }
    print(f"{m}x{n}x{k}, {split} K splits:")
    for fn in rows.values():
        for _ in range(50):
            fn()
    best = {name: min(enqueue_us(fn, 1000) for _ in range(ROUNDS)) for name, fn in rows.items()}
    for name, us in best.items():
        print(f"  {name:<48} {us:7.1f} us", flush=True)


def plan_report() -> None:
    """``--plans``: for quant_matmul's probe shapes, what a recording of the serving path sees (its launches,
    torch ops other than views, aliasing) and whether it makes a plan; then whether the calls the probe's
    rows make (the opaque op first) leave a plan or failed recordings in ``quant_matmul_eager``'s memo."""
    from squeezeserve.kernels.registry import direct_launches

    qm = quant_matmul
    assert qm.quant_matmul_opaque  # registers the op
    opaque = torch.ops.squeezeserve.quant_matmul_opaque
    for n, k in ((14336, 4096), (4096, 14336)):
        t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64, 4, 128)
        qw, sc = t["weight_packed"], t["weight_scale"]
        for m in (16, 256):
            for attempt in range(2):
                inputs = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), qw, sc, None, 128, 4)
                launches: list = []
                views = replay._OnlyViews()
                launch.recording.launches = launches
                try:
                    with direct_launches, views:
                        result = qm._quant_matmul(*inputs)
                finally:
                    launch.recording.launches = None
                plan = replay._build(inputs, result, launches, views.other, qm.workspace_buffers())
                names = [None if e is None else e[0].compiled.name for e in launches]
                print(
                    f"{m}x{n}x{k} recording {attempt}: launches {names}, other ops {views.other}, "
                    f"aliased {replay._aliased(inputs)}, plan {plan is not None}",
                    flush=True,
                )
            args = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), qw, sc, None, 128, 4)
            memo = qm.quant_matmul_eager.plans
            key = (replay.signature(args), torch.cuda.current_device())
            for name, fn in (("opaque", opaque), ("eager", qm.quant_matmul_eager)):
                for _ in range(3):
                    fn(*args)
                state = memo.plans.get(key, "absent")
                native_plans = len(memo.native) if memo.native is not None else None
                print(
                    f"  after 3 {name} calls: memo {'a plan' if type(state) is replay._Plan else state}, "
                    f"C++ plans {native_plans}",
                    flush=True,
                )


def main() -> None:
    # Plans replayed in C++ where the extension builds ("launch plan" rows; "replayed in Python" rows without)
    native.NATIVE_REPLAY = True
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; C++ replay: {native.load()}",
        flush=True,
    )
    if sys.argv[1:] == ["--plans"]:
        plan_report()
        return
    if sys.argv[1:] == ["--quant"]:
        quant_host()
        quant_parts()
        return
    if sys.argv[1:2] == ["--quant-shapes"]:  # --quant-shapes N:K,... GROUP M,... [float16]: those only
        shapes = [tuple(int(v) for v in s.split(":")) for s in sys.argv[2].split(",")]
        dtype = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.bfloat16
        quant_host(shapes, int(sys.argv[3]), [int(v) for v in sys.argv[4].split(",")], dtype)
        return
    if sys.argv[1:2] == ["--codebook-shapes"]:  # --codebook-shapes N:K,... GROUP BITS M,...
        shapes = [tuple(int(v) for v in s.split(":")) for s in sys.argv[2].split(",")]
        codebook_host(shapes, int(sys.argv[3]), int(sys.argv[4]), [int(v) for v in sys.argv[5].split(",")])
        return
    for shape in ((16, 32768), (1, 4096)):
        print(f"softmax {shape}:")
        table(softmax_rows(torch.randn(*shape, device="cuda", dtype=torch.bfloat16)))
    for shape in ((1, 4096), (16, 4096)):
        print(f"rmsnorm {shape}:")
        table(rmsnorm_rows(torch.randn(*shape, device="cuda", dtype=torch.bfloat16)))
    for shape in ((1, 4096), (16, 14336)):
        print(f"swiglu {shape}:")
        a, b = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table(swiglu_rows(a, b))
    flce_grads()


if __name__ == "__main__":
    main()
