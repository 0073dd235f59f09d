import triton

from squeezeserve.kernels.ops.launch import cdiv, next_power_of_2


def test_host_launch_arithmetic_matches_triton():
    # The launchers use plain-Python twins of Triton's constexpr functions (cheaper on the host); the
    # grids and block sizes they compute must be Triton's.
    for n in [*range(0, 4100), 14336, 65535, 65536, 65537, 131072, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in [*range(0, 300), 4096, 14336, 131071]:
        for b in (1, 2, 3, 7, 16, 128, 256, 16384):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
