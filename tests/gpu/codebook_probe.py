"""Issue 20 on a GPU: codebook_matmul's error at K = N = 4096, bits 4 and 3, M 1..16, per launch variant.

    PYTHONPATH=<a site with squeezeserve> python3 tests/gpu/codebook_probe.py

On the H100 (2026-11-23) bench_codebook_matmul.py found a 0.147 relative error at bits 3, M 4, which no
interpreter run of the same configuration reproduces. Each line here runs the chosen configuration, then
with one pipeline stage (no double-buffered index loads), then without split-K, then the default again
(leftover workspace state would show as a changed error): what differs names the cause.
"""

import torch

from squeezeserve.kernels import codebook_layout, registry
from squeezeserve.kernels.ops import codebook_matmul as C
from squeezeserve.kernels.ops.launch import sm_count

registry.load()
torch.manual_seed(0)
n = k = 4096
for bits in (4, 3):
    index = torch.randint(0, 1 << bits, (n, k), device="cuda")
    cb = (torch.randn(n, 1 << bits, device="cuda") / 64).sort(dim=1).values.half()
    idx = codebook_layout.pack_indices(index, bits)
    dense = codebook_layout.dequantize(idx, cb, k, None, bits).to(torch.bfloat16)
    for m in (1, 2, 3, 4, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x @ dense.t()).float()
        base = C.launch_config(m, n, k, 0, sm_count(x.device))
        variants = {"default": base, "stages1": {**base, "num_stages": 1}, "split1": {**base, "split": 1}}
        out = []
        for name, cfg in [*variants.items(), ("default-again", base)]:
            y = C.launch(x, idx, cb, 0, bits, cfg).float()
            torch.cuda.synchronize()
            out.append(f"{name} {((y - ref).norm() / ref.norm()).item():.2e}")
        print(f"bits {bits} m {m} cfg {base}: " + "; ".join(out), flush=True)
