"""Launch settings shared by the row-wise kernels (one program per row, the row in one block)."""

from __future__ import annotations

import functools

import torch
import triton
from torch._library.triton import is_wrap_triton_enabled
from torch.library import wrap_triton

from squeezeserve.kernels.registry import interpreting

# The widest row a single-block kernel holds in registers; wider rows need a looping kernel.
MAX_FUSED_COLS = 65536


# Host-side launch arithmetic. triton.cdiv / triton.next_power_of_2 are constexpr functions in Triton
# >= 3.4: called from Python each unwraps its arguments as constexprs (microseconds a call; figures in
# tests/benchmarks/NOTES.md), and launchers make several per launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def traceable(kernel: triton.JITFunction):
    """``kernel`` to index with a grid: wrapped by ``wrap_triton`` where torch may be tracing the launch
    (torch.compile's decomposition of a triton_op), the JIT function itself on eager paths, where
    ``wrap_triton`` would only launch it after building two wrapper objects (host time per launch)."""
    return wrap_triton(kernel) if is_wrap_triton_enabled() else kernel


def row_block(n_cols: int, op: str, limit: int = MAX_FUSED_COLS) -> int:
    """Block width for a row of ``n_cols`` elements; raises when the row does not fit one block."""
    if n_cols < 1:
        raise ValueError(f"{op}: the last dimension must be at least 1, got {n_cols}")
    if n_cols > limit:
        raise ValueError(f"{op}: rows of {n_cols} elements exceed the {limit}-element limit of this kernel")
    return next_power_of_2(n_cols)


def num_warps_for(block: int) -> int:
    """Warp ladder: enough threads that each holds at most ~64 fp32 values of the row."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def block_rows(n_rows: int, block: int) -> int:
    """Rows per program for narrow rows: tiles of about ``TILE_ELEMENTS`` elements.

    On a GPU this keeps enough bytes in flight per program for rows narrower than 2048; under the
    interpreter every program costs milliseconds, so it packs 16k elements into each.
    """
    tile = 16384 if interpreting() else 2048
    most = max(1, tile // block)
    if not isinstance(n_rows, int):
        # A symbolic row count (torch.compile tracing a triton_op, as vLLM does for every batch size up to
        # max_num_batched_tokens): the widest tile, with no guard on the row count. Rounding it to a power
        # of two would specialise the whole graph to the traced size (vLLM then refuses to start).
        return most
    return max(1, min(next_power_of_2(max(n_rows, 1)), most))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def persistent_programs(device: torch.device, n_rows: int) -> int:
    """Programs for a kernel that loops over rows: one per SM on a GPU, a few under the interpreter."""
    most = sm_count(device) if device.type == "cuda" else 4
    if not isinstance(n_rows, int):  # symbolic (see block_rows): no guard on the row count
        return most
    return max(1, min(n_rows, most))


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as [rows, last dim] with a unit stride along the last dim (copies only if needed)."""
    if x.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension, got a scalar")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])
