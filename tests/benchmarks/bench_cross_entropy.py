"""Cross-entropy, fused linear cross-entropy and fused linear KD (forward+backward time and peak memory) vs
torch eager, torch.compile and Liger.

    python3 tests/benchmarks/bench_cross_entropy.py [cross_entropy fused_linear_cross_entropy fused_linear_kd]

``fused_linear_kd`` (issue 19) is one table at N=16k, H=4096, V=128k: our fused linear KD against our fused
linear cross-entropy (the targets are relative to it: peak memory <= 1.5x, time <= 2.2x), Liger's
fused_linear_jsd (beta=0: the same forward KL) and the unfused torch loss; both of ours also through
``torch.ops.squeezeserve.*`` (``squeezeserve.ops``, the path torch.compile traces), whose backward scales
the gradients out of place and so holds each of them twice."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import Recorder, compiled, liger, peaks  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels.functional import fused_linear_kd as kd_loss  # noqa: E402

DTYPE = torch.bfloat16


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def cross_entropy(rec):
    eager = lambda z, t: F.cross_entropy(z.float(), t)  # noqa: E731
    lig = liger("liger_cross_entropy")
    providers = {"squeezeserve": K.cross_entropy, "torch": eager, "torch.compile": compiled(eager),
                 "liger": None if lig is None else (lambda z, t: _first(lig(z, t)))}  # fmt: skip
    for n, v in [(4096, 32000), (8192, 128256)]:
        target = torch.randint(0, v, (n,), device="cuda")
        base = torch.randn(n, v, device="cuda", dtype=DTYPE)
        for name, fn in providers.items():
            if fn is None:
                continue

            def step(fn=fn, base=base, target=target):
                z = base.clone().requires_grad_()  # the clone is counted for every provider alike
                fn(z, target).backward()

            # read logits, write grad (the in-place providers write it over the logits)
            rec.time(name, "fwd+bwd", (n, v), DTYPE, step, nbytes=2 * n * v * 2)
            rec.memory(name, "fwd+bwd", (n, v), DTYPE, step)


def fused_linear_cross_entropy(rec):
    n, h, v = 16384, 4096, 128256
    hidden = (torch.randn(n, h, device="cuda", dtype=DTYPE) / 8).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=DTYPE) / 64).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    lig = liger("liger_fused_linear_cross_entropy")
    providers = {
        "squeezeserve": lambda: K.fused_linear_cross_entropy(hidden, weight, target),
        "torch": lambda: F.cross_entropy((hidden @ weight.t()).float(), target),
        "liger": None if lig is None else (lambda: _first(lig(hidden, weight, target))),
    }
    flops = 3 * 2 * n * h * v  # logits, grad_hidden, grad_weight GEMMs
    for name, fn in providers.items():
        if fn is None:
            continue

        def step(fn=fn):
            hidden.grad = weight.grad = None
            fn().backward()

        rec.time(name, "fwd+bwd", (n, h, v), DTYPE, step, flops=flops)
        hidden.grad = weight.grad = None
        rec.memory(name, "fwd+bwd", (n, h, v), DTYPE, step)
        hidden.grad = weight.grad = None


def _flce_parts(hc, tc, weight, n_tokens):
    """One chunk's steps of fused linear cross-entropy, each a callable (buffers made once)."""
    from squeezeserve.kernels.ops.cross_entropy import launch_cross_entropy

    logits = hc @ weight.t()
    grad_h, grad_w = torch.empty_like(hc), torch.zeros_like(weight)
    n_valid = torch.tensor(n_tokens, device=hc.device)
    return {
        "logits": lambda: torch.matmul(hc, weight.t(), out=logits),
        "ce": lambda: launch_cross_entropy(logits, tc, n_valid, -100, 0.0, "mean", True),
        "grad_hidden": lambda: torch.matmul(logits, weight, out=grad_h),
        "grad_weight": lambda: grad_w.addmm_(logits.t(), hc),
    }


def flce_breakdown(rec):
    """Where fused linear cross-entropy's time goes at N=16k, H=4096, V=128k, per chunk size: each chunk's
    three GEMMs and the cross-entropy kernel timed alone (summed over the chunks of the batch), then the
    whole op with that chunk size. Printed, not recorded: it explains the op's row (whose peak memory
    ``fused_linear_cross_entropy`` records; a chunk's logits are chunk x V x 2 bytes on top)."""
    from squeezeserve.kernels.ops import fused_linear_ce as flce

    n, h, v = 16384, 4096, 128256
    hidden = (torch.randn(n, h, device="cuda", dtype=DTYPE) / 8).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=DTYPE) / 64).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    gflop = 2 * n * h * v / 1e9  # per GEMM
    saved = flce.chunk_tokens
    for chunk in (256, 512, 1024, 2048):
        chunks = n // chunk
        parts = _flce_parts(hidden.detach()[:chunk], target[:chunk], weight.detach(), n)
        times = {name: do_bench(fn, rep=100) * chunks for name, fn in parts.items()}
        flce.chunk_tokens = lambda *a, c=chunk: c

        def step():
            hidden.grad = weight.grad = None
            K.fused_linear_cross_entropy(hidden, weight, target).backward()

        total = do_bench(step, rep=300)
        hidden.grad = weight.grad = None
        flce.chunk_tokens = saved
        print(f"flce chunk={chunk}: total {total:.1f} ms | " + ", ".join(
            f"{name} {t:.1f} ms" + (f" ({gflop / t:.0f} TFLOP/s)" if name != "ce" else "")
            for name, t in times.items()) + f" | sum {sum(times.values()):.1f} ms", flush=True)  # fmt: skip


def torch_kd(student_hidden, student_weight, teacher_hidden, teacher_weight, temperature=1.0):
    """The unfused loss: both [N, V] logits in fp32, T^2 KL(teacher || student) averaged over tokens."""
    student = F.log_softmax((student_hidden @ student_weight.t()).float() / temperature, dim=-1)
    teacher = F.log_softmax((teacher_hidden @ teacher_weight.t()).float() / temperature, dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    return temperature**2 * kl


def fused_linear_kd(rec):
    """Issue 19's shape. Every provider gets the same student (hidden and head train) and teacher."""
    n, h, v = 16384, 4096, 128256
    hidden = (torch.randn(n, h, device="cuda", dtype=DTYPE) / 8).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=DTYPE) / 64).requires_grad_()
    teacher_hidden = torch.randn(n, h, device="cuda", dtype=DTYPE) / 8
    teacher_weight = torch.randn(v, h, device="cuda", dtype=DTYPE) / 64
    target = torch.randint(0, v, (n,), device="cuda")
    ops = torch.ops.squeezeserve
    lig = liger("liger_fused_linear_jsd")
    teacher = (teacher_hidden, teacher_weight)
    providers = {  # name: (loss function, loss); KD's flops: student + teacher logits, both gradients
        "squeezeserve": (lambda: kd_loss(hidden, weight, *teacher), 4),
        "squeezeserve.ops": (lambda: ops.fused_linear_kd(hidden, weight, *teacher, None, 1.0, 0.0, -100,
                                                         "mean", True, True)[0], 4),
        "flce": (lambda: K.fused_linear_cross_entropy(hidden, weight, target), 3),
        "flce.ops": (lambda: ops.fused_linear_cross_entropy(hidden, weight, target, None, -100, 0.0, "mean",
                                                            True)[0], 3),
        "liger.jsd": None if lig is None else (lambda: lig(hidden, weight, *teacher, None, 0.0), 4),
        "torch": (lambda: torch_kd(hidden, weight, *teacher), 4),
    }  # fmt: skip
    results = {}
    for name, entry in providers.items():
        if entry is None:
            continue
        fn, gemms = entry

        def step(fn=fn):
            hidden.grad = weight.grad = None
            fn().backward()

        with torch.no_grad():
            loss = float(fn()) if not name.startswith("flce") else None
        ms = rec.time(name, "fwd+bwd", (n, h, v), DTYPE, step, flops=gemms * 2 * n * h * v, rep=2000)
        hidden.grad = weight.grad = None
        mb = rec.memory(name, "fwd+bwd", (n, h, v), DTYPE, step)
        hidden.grad = weight.grad = None
        torch.cuda.empty_cache()
        results[name] = (ms, mb, loss)
    base_ms, base_mb, _ = results.get("flce", (None, None, None))
    print("\n| provider | fwd+bwd ms | peak MB | time / FLCE | memory / FLCE | loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (ms, mb, loss) in results.items():
        ratios = []
        for value, base, metric in ((ms, base_ms, "time_vs_flce"), (mb, base_mb, "mem_vs_flce")):
            ratio = value / base if value is not None and base else None
            if ratio is not None:
                rec.add(name, "fwd+bwd", (n, h, v), DTYPE, metric, [ratio], "x")
            ratios.append("-" if ratio is None else f"{ratio:.2f}x")
        cells = ["-" if x is None else f"{x:.1f}" for x in (ms, mb)] + ratios
        print(f"| {name} | {' | '.join(cells)} | {'-' if loss is None else f'{loss:.6f}'} |")
    print("targets (issue 19): squeezeserve memory <= 1.5x FLCE, time <= 2.2x FLCE")


BENCHES = {
    b.__name__: b for b in (cross_entropy, fused_linear_cross_entropy, fused_linear_kd, flce_breakdown)
}

if __name__ == "__main__":
    unknown = [name for name in sys.argv[1:] if name not in BENCHES]
    if unknown:
        sys.exit(f"unknown bench {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    peaks()
    for name in sys.argv[1:] or BENCHES:
        recorder = Recorder(name)
        BENCHES[name](recorder)
        recorder.write()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
