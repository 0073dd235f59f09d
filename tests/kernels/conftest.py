"""Shared fixtures for the kernel tests.

On a machine with a GPU the tests run the compiled Triton kernels on CUDA tensors. Without one they run
the same kernels in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 must be set before the
kernels are imported (it decides how ``@triton.jit`` builds them), so it is set here, at collection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from squeezeserve.kernels import registry  # noqa: E402

registry.load()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances against the reference evaluated in fp32 on the same (rounded) inputs. Kernel and reference
# both compute in fp32 and round once to the output dtype, so they differ by at most ~1 unit in the last
# place of that dtype plus fp32 reduction-order noise. bf16 keeps 8 mantissa bits (ulp 2**-7 relative),
# fp16 11 (2**-10), so rtol sits at about two ulps; a wrong formula (missing eps, wrong mean, dropped
# term) misses by far more. fp32: reduction order across a row and GPU special functions (rsqrt, exp)
# stay under ~1e-5 relative.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}

# opcheck's AOT test decomposes a triton_op into its body on fake CPU tensors, which the interpreter
# cannot launch on; under the interpreter the remaining checks run (the AOT one runs on the reference
# path and on the GPU).
OPCHECK_INTERPRETED = ("test_schema", "test_autograd_registration", "test_faketensor")
OPCHECK_ALL = (*OPCHECK_INTERPRETED, "test_aot_dispatch_dynamic")


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def triton_path():
    """Run the Triton kernels: compiled on CUDA, interpreted on CPU."""
    if DEVICE == "cpu":
        with registry.triton_on_cpu():
            yield
    else:
        yield


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[dtype])


def opcheck(op, args, kwargs=None) -> None:
    """torch.library.opcheck, with the AOT-dispatch test where the Triton path can take it."""
    if DEVICE == "cuda":
        torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_ALL)
        return
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_INTERPRETED)
    with registry.triton_on_cpu(False):  # the reference path, AOT test included
        torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_ALL)


@pytest.fixture
def check():
    """Helpers for tests: ``check.close(actual, expected, dtype)`` and ``check.opcheck(op, args)``."""

    class _Check:
        close = staticmethod(assert_close)
        opcheck = staticmethod(opcheck)

    return _Check


@pytest.fixture(scope="session")
def run_compiled():
    """``run_compiled(args)``: ``python args...`` in a process without Triton's interpreter (this one runs
    it; its kernels cannot be compiled), as ``{case: result}`` from the JSON lines it prints (each with a
    ``case`` key)."""

    def run(args: list[str]) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=900)
        results = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result["case"]] = result
        assert results, f"no results (exit {done.returncode}): {done.stderr[-3000:]}"
        return results

    return run
