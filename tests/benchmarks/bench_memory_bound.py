"""SwiGLU, RMSNorm and softmax on the H100: ours vs torch eager, torch.compile and Liger (forward and
forward+backward), achieved GB/s counting each input read once and each output written once.

Forward times replay CUDA graphs (GPU time: no host launch gaps); forward+backward runs eagerly, so at
small shapes it measures the host's autograd and launch overhead. Each fwd+bwd step starts with the
inputs' .grad cleared: otherwise autograd adds each new gradient into the previous step's .grad (read
both, write the sum: three more passes per input, six for SwiGLU), which the byte counts leave out.
"squeezeserve.ops" is our registered ops called through torch.ops (the path torch.compile traces) at
the decode-sized shapes, against "squeezeserve", the functional API's eager fast path."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import Recorder, compiled, host_ms, liger, peaks, vllm_op  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels.ops import launch, replay  # noqa: E402

DTYPE = torch.bfloat16
ROW_SHAPES = [(1, 4096), (16, 4096), (4096, 4096), (16384, 4096), (16, 14336), (4096, 14336), (16384, 14336)]
SOFTMAX_SHAPES = [(16, 32768), (4096, 32768), (16, 131072), (1024, 131072), (4096, 131072)]


# Providers timed only at shapes of at most this many rows (host-overhead comparisons).
SMALL_ONLY = {
    "squeezeserve.ops": 16, "vllm": 16, "squeezeserve.triton-launch": 16, "squeezeserve.no-plans": 16
}  # fmt: skip


def switched_off(module, switch: str):
    """Wraps one of our functional ops so that ``module.switch`` is False during its calls."""

    def wrap(fn):
        def call(*args):
            setattr(module, switch, False)
            try:
                return fn(*args)
            finally:
                setattr(module, switch, True)

        return call

    return wrap


# Every kernel launched through Triton's own dispatch instead of launch.FastLaunch (and so without launch
# plans): the same kernels, the host cost the fast path removes.
triton_launch = switched_off(launch, "FAST_LAUNCH")
# The op body run on every call instead of a replayed launch plan (kernels/ops/replay.py): what plans save.
no_plans = switched_off(replay, "LAUNCH_PLANS")


EAGER_MAX_ROWS = 16  # shapes also timed as back-to-back eager calls ("fwd-eager", host included)


def _bench(rec, providers, make_inputs, shape, fwd_bytes, bwd_bytes):
    for name, fn in providers.items():
        if fn is None or shape[0] > SMALL_ONLY.get(name, shape[0]):
            continue
        inputs = make_inputs()
        graph_ms = rec.time(
            name, "fwd", shape, DTYPE, lambda fn=fn, inputs=inputs: fn(*inputs), nbytes=fwd_bytes, graph=True
        )
        if graph_ms is not None and shape[0] <= EAGER_MAX_ROWS:  # host-inclusive: back-to-back eager calls
            eager_ms = host_ms(lambda fn=fn, inputs=inputs: fn(*inputs))
            rec.add(name, "fwd-eager", shape, DTYPE, "time", eager_ms, "ms")
        if name.startswith("vllm"):  # vLLM's ops have no autograd
            continue
        grads_in = [t.detach().requires_grad_() for t in inputs]
        try:
            out = fn(*grads_in)
        except Exception as exc:
            print(f"# {rec.op} {name} {shape}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
            continue
        g = torch.randn_like(out)

        def step(fn=fn, grads_in=grads_in, g=g):
            for t in grads_in:
                t.grad = None
            fn(*grads_in).backward(g)

        rec.time(name, "fwd+bwd", shape, DTYPE, step, nbytes=fwd_bytes + bwd_bytes)


def swiglu(rec):
    eager = lambda a, b: F.silu(a) * b  # noqa: E731
    providers = {
        "squeezeserve": K.swiglu,
        "squeezeserve.triton-launch": triton_launch(K.swiglu),
        "squeezeserve.no-plans": no_plans(K.swiglu),
        "squeezeserve.ops": torch.ops.squeezeserve.swiglu,
        "torch": eager,
        "torch.compile": compiled(eager),
        "liger": liger("liger_swiglu"),
    }
    for m, n in ROW_SHAPES:
        if m <= EAGER_MAX_ROWS:
            silu_and_mul(rec, m, n)
        e = m * n * 2
        make = lambda m=m, n=n: [torch.randn(m, n, device="cuda", dtype=DTYPE) for _ in range(2)]  # noqa: E731
        # fwd: read a, b, write out; bwd: read g, a, b, write da, db.
        _bench(rec, providers, make, (m, n), 3 * e, 5 * e)


def silu_and_mul(rec, m, n):
    """The packed form vLLM's models call ([m, 2n] -> [m, n]): ours against vLLM's CUDA op."""
    op = vllm_op("silu_and_mul")

    def theirs(x):
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        op(out, x)
        return out

    providers = {
        "squeezeserve.silu_and_mul": K.silu_and_mul,
        "squeezeserve.triton-launch": triton_launch(K.silu_and_mul),
        "squeezeserve.no-plans": no_plans(K.silu_and_mul),
        "vllm": None if op is None else theirs,
    }
    e = m * n * 2
    make = lambda: [torch.randn(m, 2 * n, device="cuda", dtype=DTYPE)]  # noqa: E731
    _bench(rec, providers, make, (m, n), 3 * e, 5 * e)


def rmsnorm(rec):
    def eager(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    lig = liger("liger_rms_norm")
    vllm_rms = vllm_op("rms_norm")

    def vllm_rmsnorm(x, w):
        out = torch.empty_like(x)
        vllm_rms(out, x, w, 1e-6)
        return out

    providers = {
        "squeezeserve": lambda x, w: K.rmsnorm(x, w, 1e-6),
        "squeezeserve.triton-launch": triton_launch(lambda x, w: K.rmsnorm(x, w, 1e-6)),
        "squeezeserve.no-plans": no_plans(lambda x, w: K.rmsnorm(x, w, 1e-6)),
        "squeezeserve.ops": lambda x, w: torch.ops.squeezeserve.rmsnorm(x, w, 1e-6),
        "torch": eager, "torch.compile": compiled(eager),
        "liger": None if lig is None else (lambda x, w: lig(x, w, 1e-6, 0.0, "llama", False)),
        "vllm": None if vllm_rms is None else vllm_rmsnorm,
    }  # fmt: skip
    for m, n in ROW_SHAPES:
        e = m * n * 2

        def make(m=m, n=n):
            return [
                torch.randn(m, n, device="cuda", dtype=DTYPE),
                torch.rand(n, device="cuda", dtype=DTYPE) + 0.5,
            ]

        _bench(rec, providers, make, (m, n), 2 * e, 3 * e)


def add_rmsnorm(rec):
    """Residual add + RMSNorm (what every decoder layer after the first runs): ours fused, torch eager and
    compiled, vLLM's fused CUDA op (in place on x and the residual, as vLLM calls it). Decode shapes."""

    def eager(x, r, w):
        h = x + r
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    op = vllm_op("fused_add_rms_norm")

    def theirs(x, r, w):
        op(x, r, w, 1e-6)
        return x

    providers = {
        "squeezeserve": lambda x, r, w: K.add_rmsnorm(x, r, w, 1e-6)[0],
        "squeezeserve.triton-launch": triton_launch(lambda x, r, w: K.add_rmsnorm(x, r, w, 1e-6)[0]),
        "squeezeserve.no-plans": no_plans(lambda x, r, w: K.add_rmsnorm(x, r, w, 1e-6)[0]),
        "torch": eager, "torch.compile": compiled(eager), "vllm": None if op is None else theirs,
    }  # fmt: skip
    for m, n in [(1, 4096), (16, 4096), (16, 14336)]:
        e = m * n * 2

        def make(m=m, n=n):
            x, r = (torch.randn(m, n, device="cuda", dtype=DTYPE) for _ in range(2))
            return [x, r, torch.rand(n, device="cuda", dtype=DTYPE) + 0.5]

        # fwd: read x, residual, write y, h; bwd: read g, h, write dx
        _bench(rec, providers, make, (m, n), 4 * e, 3 * e)


def softmax(rec):
    eager = lambda x: torch.softmax(x, dim=-1)  # noqa: E731
    providers = {
        "squeezeserve": K.softmax,
        "squeezeserve.triton-launch": triton_launch(K.softmax),
        "squeezeserve.no-plans": no_plans(K.softmax),
        "squeezeserve.ops": torch.ops.squeezeserve.softmax,
        "torch": eager,
        "torch.compile": compiled(eager),
        "liger": liger("liger_softmax"),
    }
    for m, n in SOFTMAX_SHAPES:
        e = m * n * 2
        make = lambda m=m, n=n: [torch.randn(m, n, device="cuda", dtype=DTYPE) * 3]  # noqa: E731
        _bench(rec, providers, make, (m, n), 2 * e, 3 * e)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="swiglu,rmsnorm,add_rmsnorm,softmax", help="comma-separated subset")
    parser.add_argument("--max-rows", type=int, help="only shapes of at most N rows (16: the eager rows)")
    args = parser.parse_args()
    chosen = args.ops.split(",")
    if args.max_rows:
        ROW_SHAPES[:] = [s for s in ROW_SHAPES if s[0] <= args.max_rows]
        SOFTMAX_SHAPES[:] = [s for s in SOFTMAX_SHAPES if s[0] <= args.max_rows]
    peaks()
    for bench in [b for b in (swiglu, rmsnorm, add_rmsnorm, softmax) if b.__name__ in chosen]:
        recorder = Recorder(bench.__name__)
        bench(recorder)
        recorder.write()
        torch._dynamo.reset()
