import os
import subprocess
import sys


def test_importing_the_package_loads_neither_torch_nor_triton():
    code = "import sys, squeezeserve.kernels; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False"]


def test_ops_register_without_a_gpu_and_run_the_reference_on_cpu():
    code = (
        "import torch, squeezeserve.kernels as K\n"
        "x = torch.randn(3, 8); w = torch.rand(8)\n"
        "from squeezeserve.kernels import reference\n"
        "assert torch.equal(K.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6))\n"
        "print(sorted(n for n in dir(torch.ops.squeezeserve) if not n.startswith('_'))[:3])\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # triton importable, no GPU visible
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
