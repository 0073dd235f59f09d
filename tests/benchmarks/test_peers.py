"""bench_quant_matmul's peers (vLLM's Marlin and Machete) skip the shapes they refuse instead of ending the
run: the shared cache of their re-quantized weights (peers.py; loaded alone: importing the benchmark would
import squeezeserve.kernels before tests/kernels/conftest.py sets TRITON_INTERPRET for the whole suite)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# tests/benchmarks is a folder of scripts, not a package: load the helper module from its file.
_spec = importlib.util.spec_from_file_location("peers", Path(__file__).with_name("peers.py"))
peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)


def test_a_peer_that_refuses_a_shape_skips_it_once_and_packs_the_next(capsys):
    calls = []

    def pack_for(k):
        def pack():
            calls.append(k)
            if k % 128:
                raise ValueError(f"machete_prepack_B: K must be a multiple of 128, got {k}")
            return f"weight {k}"

        return pack

    cache = {}
    assert peers.peer_weight(cache, (960, 576, 32), pack_for(576), "vllm-machete-int4-g32") is None
    assert peers.peer_weight(cache, (960, 576, 32), pack_for(576), "vllm-machete-int4-g32") is None
    err = capsys.readouterr().err
    assert err.count("skipped") == 1  # said once; the shape's other row counts skip quietly
    assert "vllm-machete-int4-g32 (960, 576, 32): skipped, ValueError: machete_prepack_B" in err
    assert peers.peer_weight(cache, (576, 1536, 32), pack_for(1536), "vllm-machete-int4-g32") == "weight 1536"
    assert peers.peer_weight(cache, (576, 1536, 32), pack_for(1536), "vllm-machete-int4-g32") == "weight 1536"
    assert calls == [576, 1536]  # one packing a shape, whatever the row count
    assert list(cache) == [(576, 1536, 32)]  # the latest shape's weight only
