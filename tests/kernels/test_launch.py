import torch
import triton
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from squeezeserve.kernels.ops.launch import block_rows, cdiv, next_power_of_2, persistent_programs


def test_host_launch_arithmetic_matches_triton():
    # The launchers use plain-Python twins of Triton's constexpr functions (cheaper on the host); the
    # grids and block sizes they compute must be Triton's.
    for n in [*range(0, 4100), 14336, 65535, 65536, 65537, 131072, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in [*range(0, 300), 4096, 14336, 131071]:
        for b in (1, 2, 3, 7, 16, 128, 256, 16384):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_row_count_arithmetic_adds_no_guard_on_a_symbolic_row_count():
    # vLLM compiles one graph for every batch size, tracing our triton_ops' launchers with a symbolic row
    # count; a guard on it (a branch, a power-of-two rounding) specialises the graph to the size traced,
    # and vLLM refuses to start ("marked ... as dynamic but your code specialized it", seen on the H100 at
    # max_num_batched_tokens 8192). An unbacked symbol raises on any guard.
    rows = ShapeEnv().create_unbacked_symint()
    for block in (64, 1024, 4096):
        assert isinstance(block_rows(rows, block), int)
        cdiv(rows, block_rows(rows, block))
    assert persistent_programs(torch.device("cpu"), rows) == 4
    # and concrete counts keep their tiles
    assert (
        block_rows(3, 64) == 4 and block_rows(1, 64) == 1 and persistent_programs(torch.device("cpu"), 2) == 2
    )
