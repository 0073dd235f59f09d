"""Cross-entropy and fused linear cross-entropy (forward+backward time and peak memory) vs torch eager,
torch.compile and Liger."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import Recorder, compiled, liger, peaks  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402

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


if __name__ == "__main__":
    peaks()
    for bench in (cross_entropy, fused_linear_cross_entropy):
        recorder = Recorder(bench.__name__)
        bench(recorder)
        recorder.write()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
