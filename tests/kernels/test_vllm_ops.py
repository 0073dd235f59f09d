"""The vLLM ops' arithmetic and checkpoint handling, without vLLM: on CPU (reference path and Triton's
interpreter) or, on a GPU machine, the compiled kernels on CUDA.

What vLLM adds at serving time is loading: for a merged layer (qkv_proj, gate_up_proj) its loader writes
each shard's checkpoint tensors into consecutive output rows of one parameter. These tests build exactly
that from per-shard checkpoint tensors and check that ``quant_linear`` on the stacked tensors equals the
shards' dequantized weights stacked and multiplied in plain PyTorch -- through the reference path and
through the Triton kernel. RMSNorm must round like the vLLM path it replaces (eager: Hugging Face's
rounding; compiled: only the outputs rounded).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from squeezeserve.kernels import functional, quant_layout, reference, registry, vllm_ops
from squeezeserve.kernels.checkpoint_format import QuantScheme
from squeezeserve.service.compress.formats import quantization_config

PATHS = ["reference", "triton"]


def _path(path: str, device: str) -> tuple[str, contextlib.AbstractContextManager]:
    """Where a case runs: the reference on CPU, or the Triton kernel (compiled on CUDA, interpreted on CPU,
    where conftest's autouse fixture routes CPU tensors to the kernels)."""
    if path == "reference":
        return "cpu", registry.triton_on_cpu(False)
    return device, contextlib.nullcontext()


def _config(bits: int, group_size: int | None, symmetric: bool, kind: str = "int") -> dict:
    pytest.importorskip("compressed_tensors")  # the config writer's library (absent on the GPU image)
    return quantization_config(QuantScheme(kind=kind, bits=bits, group_size=group_size, symmetric=symmetric))


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric"), [(4, 32, False), (4, 128, True), (8, None, True)]
)
def test_parse_scheme_reads_what_compress_writes(bits, group_size, symmetric):
    scheme = vllm_ops.parse_scheme(_config(bits, group_size, symmetric))
    assert scheme == vllm_ops.WeightOnlyScheme(bits, group_size, symmetric, ("lm_head",))


def test_parse_scheme_refuses_fp8_with_the_reason():
    with pytest.raises(ValueError, match="integer weight-only"):
        vllm_ops.parse_scheme(_config(8, None, True, kind="float"))


def test_parse_scheme_refuses_activation_reordering():
    config = _config(4, 32, True)
    config["config_groups"]["group_0"]["weights"]["actorder"] = "weight"  # column order only: served
    assert vllm_ops.parse_scheme(config).group_size == 32
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(ValueError, match="actorder"):
        vllm_ops.parse_scheme(config)


def test_asymmetric_shards_must_fill_whole_zero_point_words():
    scheme = vllm_ops.WeightOnlyScheme(4, 32, False, ())
    vllm_ops.check_partition(scheme, [64, 32, 32])
    with pytest.raises(ValueError, match="multiple of 8"):
        vllm_ops.check_partition(scheme, [64, 36])
    vllm_ops.check_partition(vllm_ops.WeightOnlyScheme(4, 32, True, ()), [64, 36])  # no zero points


def _stacked_checkpoint(shards: list[torch.Tensor], scheme: vllm_ops.WeightOnlyScheme):
    """What vLLM's loader leaves in a merged layer: each shard's checkpoint tensors stacked along the output
    dim (zero points are packed along it, so their int32 rows stack)."""
    group = scheme.group_size_for(shards[0].shape[1])
    packed = [quant_layout.pack_weight(w, scheme.bits, group, scheme.symmetric) for w in shards]
    stacked = {
        name: torch.cat([p[name] for p in packed])
        for name in ("weight_packed", "weight_scale", "weight_zero_point")
        if name in packed[0]
    }
    dense = torch.cat([
        quant_layout.dequantize(
            p["weight_packed"], p["weight_scale"], p.get("weight_zero_point"), tuple(w.shape), group,
            scheme.bits,
        )
        for p, w in zip(packed, shards, strict=True)
    ])  # fmt: skip
    return stacked, dense


CASES = [
    # qkv-like shards (q 64, k 32, v 32), int4 asymmetric group 32 -- squeezeserve compress's int4 default
    (vllm_ops.WeightOnlyScheme(4, 32, False, ()), [64, 32, 32], 96),
    # gate_up-like, int4 symmetric group 128 over K = 256 (two groups)
    (vllm_ops.WeightOnlyScheme(4, 128, True, ()), [48, 48], 256),
    # int8 per channel (one group as wide as K), K not a multiple of the 4-per-word packing
    (vllm_ops.WeightOnlyScheme(8, None, True, ()), [40, 24], 70),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("scheme", "widths", "k_in"), CASES)
def test_quant_linear_on_stacked_shards_equals_dequantize_then_matmul(scheme, widths, k_in, path, device):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16
    shards = [(torch.randn(n, k_in, generator=gen) * 0.05).to(dtype) for n in widths]
    stacked, dense = _stacked_checkpoint(shards, scheme)
    x = torch.randn(5, k_in, generator=gen).to(dtype)
    bias = torch.randn(sum(widths), generator=gen).to(dtype)
    on, context = _path(path, device)
    with context:
        y = vllm_ops.quant_linear(
            x.to(on),
            stacked["weight_packed"].to(on),
            stacked["weight_scale"].to(on),
            stacked["weight_zero_point"].to(on) if "weight_zero_point" in stacked else None,
            scheme,
            bias.to(on),
        ).cpu()
    expected = x.float() @ dense.float().T + bias.float()
    assert y.shape == (5, sum(widths)) and y.dtype == dtype
    # Both sides multiply the same fp16 values; they differ by the fp32 summation order and the final fp16
    # rounding of y (|y| ~ 1: half an ulp is 5e-4). A wrong shard offset or nibble order is off by O(|y|).
    torch.testing.assert_close(y.float(), expected, rtol=2e-3, atol=2e-3)


class _TorchOpsSeen(torch.overrides.TorchFunctionMode):
    """The torch functions and ops called while active (torch.ops calls included)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_quant_linear_skips_the_dispatcher_eagerly_and_stays_opaque_compiled(device):
    # vLLM's eager prompt forwards call the op's body directly (torch's custom-op layers cost the H100 host
    # ~25-30 us a call), through the serving launch plans; under torch.compile quant_linear still puts the
    # one opaque op in the graph, whose row-count dispatch then runs per call.
    from squeezeserve.kernels.ops import quant_matmul as qm

    scheme = vllm_ops.WeightOnlyScheme(4, 32, True, ())
    stacked, _ = _stacked_checkpoint([torch.randn(24, 64, dtype=torch.float16)], scheme)
    weights = (stacked["weight_packed"].to(device), stacked["weight_scale"].to(device), None)
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    expected = torch.ops.squeezeserve.quant_matmul_opaque(x, *weights, 32, 4)
    qm.quant_matmul_eager.plans.clear()
    with torch.no_grad(), _TorchOpsSeen() as seen:
        for _ in range(2):
            assert torch.equal(vllm_ops.quant_linear(x, *weights, scheme), expected)
    assert "squeezeserve.quant_matmul_opaque" not in seen.calls
    assert len(qm.quant_matmul_eager.plans.plans) == 1
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(
        lambda t: vllm_ops.quant_linear(t, *weights, scheme), backend=backend, fullgraph=True
    )
    assert torch.equal(compiled(x), expected)
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    opaque = torch.ops.squeezeserve.quant_matmul_opaque
    assert [t for t in targets if t in (opaque, opaque.default)], targets


def test_projections_after_our_kernels_launch_as_programmatic_dependents(monkeypatch):
    # qkv_proj and gate_up_proj follow our RMSNorm / add-RMSNorm, down_proj our SwiGLU (each a kernel that
    # calls launch_dependents first); o_proj follows attention, vLLM's. Only where that op of ours replaced
    # vLLM's in this process, and not with SQUEEZESERVE_PDL=off.
    monkeypatch.setattr(vllm_ops, "_REGISTERED", {"rms_norm", "silu_and_mul"})
    monkeypatch.delenv(vllm_ops.PDL_ENV, raising=False)
    layer = "model.layers.3."
    expected = {"self_attn.qkv_proj": True, "mlp.gate_up_proj": True, "mlp.down_proj": True,
                "self_attn.o_proj": False, "mlp.gate_proj": False}  # fmt: skip
    for name, want in expected.items():
        assert vllm_ops.follows_our_kernel(layer + name) is want, name
    assert not vllm_ops.follows_our_kernel("lm_head")
    monkeypatch.setattr(vllm_ops, "_REGISTERED", {"rms_norm"})
    assert vllm_ops.follows_our_kernel(layer + "mlp.gate_up_proj")
    assert not vllm_ops.follows_our_kernel(layer + "mlp.down_proj")
    monkeypatch.setattr(vllm_ops, "_tensor_parallel_size", lambda: 2)  # (norms after all-reduces)
    assert not vllm_ops.follows_our_kernel(layer + "mlp.gate_up_proj") and not vllm_ops.pdl_enabled()
    monkeypatch.setattr(vllm_ops, "_tensor_parallel_size", lambda: 1)
    assert vllm_ops._tensor_parallel_size() == 1 and vllm_ops.pdl_enabled()
    monkeypatch.setenv(vllm_ops.PDL_ENV, "off")
    assert not vllm_ops.follows_our_kernel(layer + "mlp.gate_up_proj")
    monkeypatch.setenv(vllm_ops.PDL_ENV, "on")
    with pytest.raises(ValueError, match="SQUEEZESERVE_PDL must be auto or off"):
        vllm_ops.follows_our_kernel(layer + "mlp.gate_up_proj")


def test_quant_linear_compiled_keeps_pdl_for_the_opaque_op(device):
    # Compiled, the norms and SiluAndMul before qkv / gate_up / down compile to the opaque chain ops
    # (compiled_chain), launched as programmatic dependents in CUDA graphs: the opaque GEMM op gets the
    # layer's pdl, and takes it only while a graph captures on Hopper (quant_matmul.dependent). Off a graph
    # the products are those without it.
    scheme = vllm_ops.WeightOnlyScheme(4, 32, True, ())
    stacked, _ = _stacked_checkpoint([torch.randn(24, 64, dtype=torch.float16)], scheme)
    weights = (stacked["weight_packed"].to(device), stacked["weight_scale"].to(device), None)
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    expected = vllm_ops.quant_linear(x, *weights, scheme)
    assert torch.equal(vllm_ops.quant_linear(x, *weights, scheme, None, False, True), expected)
    opaque = torch.ops.squeezeserve.quant_matmul_opaque
    for pdl in (True, False):
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        layer = functools.partial(vllm_ops.quant_linear, bias=None, owned=False, pdl=pdl)
        compiled = torch.compile(
            lambda t, layer=layer: layer(t, *weights, scheme), backend=backend, fullgraph=True
        )
        assert torch.equal(compiled(x), expected)
        (node,) = [n for gm in graphs for n in gm.graph.nodes if n.target in (opaque, opaque.default)]
        assert node.args[-1] is pdl and len(node.args) == 7, node.args


def test_compiled_norms_and_silu_and_mul_in_the_chain_are_opaque_ops(device):
    # With the chain (compiled_chain), torch.compile keeps our norms and SiluAndMul as the opaque *_chain
    # ops, whose Python runs on each call (a programmatic dependent launch while a CUDA graph captures); off
    # a graph they compute what the traced ops (fused rounding) compute.
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 64, generator=gen).to(torch.float16).to(device) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.float16).to(device)
    gate_up = torch.randn(5, 128, generator=gen).to(torch.float16).to(device)
    expected = (
        torch.ops.squeezeserve.rmsnorm(x, weight, 1e-6, True),
        *torch.ops.squeezeserve.add_rmsnorm(x, res, weight, 1e-6, True),
        torch.ops.squeezeserve.silu_and_mul(gate_up),
    )
    ops = torch.ops.squeezeserve
    chain_ops = {ops.rms_norm_chain, ops.fused_add_rms_norm_chain, ops.silu_and_mul_chain}
    traced_ops = {ops.rmsnorm, ops.add_rmsnorm, ops.silu_and_mul}

    def layer(x, res, gate_up, chain):
        y = vllm_ops.rms_norm(x, None, weight, 1e-6, True, chain)
        h, r = vllm_ops.rms_norm(x, res, weight, 1e-6, True, chain)
        a = vllm_ops.silu_and_mul_chain(gate_up) if chain else functional.silu_and_mul(gate_up)
        return y, h, r, a

    for chain in (True, False):
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(functools.partial(layer, chain=chain), backend=backend, fullgraph=True)
        for got, want in zip(compiled(x, res, gate_up), expected, strict=True):
            assert torch.equal(got, want)
        targets = {getattr(n.target, "overloadpacket", n.target) for gm in graphs for n in gm.graph.nodes}
        assert targets & chain_ops == (chain_ops if chain else set()), targets
        assert targets & traced_ops == (set() if chain else traced_ops), targets


def test_norms_and_silu_and_mul_launch_as_dependents_at_decode_rows_only(monkeypatch):
    # While a graph captures on Hopper (launch.graph_dependent), up to PDL_MAX_M rows: there the GEMMs around
    # them are decode kernels (launch_dependents first, dependents themselves); past it prefill kernels, after
    # which a dependent launch only costs. Not with SQUEEZESERVE_PDL=off.
    from squeezeserve.kernels.ops import quant_matmul as qm

    monkeypatch.delenv(vllm_ops.PDL_ENV, raising=False)
    monkeypatch.setattr(vllm_ops.launch, "graph_dependent", lambda x: True)
    rows = qm.PDL_MAX_M
    assert vllm_ops.chained(torch.empty(rows, 64)) and vllm_ops.chained(torch.empty(2, rows // 2, 128))
    assert not vllm_ops.chained(torch.empty(rows + 1, 64))
    assert not vllm_ops.chained(torch.empty(2, rows // 2 + 1, 128))
    monkeypatch.setenv(vllm_ops.PDL_ENV, "off")
    assert not vllm_ops.chained(torch.empty(1, 64))
    monkeypatch.delenv(vllm_ops.PDL_ENV)
    monkeypatch.setattr(vllm_ops.launch, "graph_dependent", lambda x: False)
    assert not vllm_ops.chained(torch.empty(1, 64))


def test_compiled_chain_only_where_our_kernels_launch_dependents(monkeypatch):
    # Read when vLLM builds a norm or SiluAndMul module: SQUEEZESERVE_PDL on (auto, one GPU a model) and a GPU
    # whose kernels call launch_dependents (Hopper).
    monkeypatch.delenv(vllm_ops.PDL_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not vllm_ops.compiled_chain()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for hopper in (True, False):
        monkeypatch.setattr(vllm_ops.launch, "launches_dependents", lambda device, hopper=hopper: hopper)
        assert vllm_ops.compiled_chain() is hopper
    monkeypatch.setattr(vllm_ops.launch, "launches_dependents", lambda device: True)
    monkeypatch.setattr(vllm_ops, "_tensor_parallel_size", lambda: 2)
    assert not vllm_ops.compiled_chain()
    monkeypatch.setattr(vllm_ops, "_tensor_parallel_size", lambda: 1)
    monkeypatch.setenv(vllm_ops.PDL_ENV, "off")
    assert not vllm_ops.compiled_chain()


def test_quant_linear_counts_its_calls():
    scheme = vllm_ops.WeightOnlyScheme(8, None, True, ())
    stacked, _ = _stacked_checkpoint([torch.randn(8, 16, dtype=torch.float16)], scheme)
    before = vllm_ops.call_counts().get("quant_matmul", 0)
    vllm_ops.quant_linear(
        torch.randn(2, 16, dtype=torch.float16),
        stacked["weight_packed"],
        stacked["weight_scale"],
        None,
        scheme,
    )
    assert vllm_ops.call_counts()["quant_matmul"] == before + 1


def test_warm_prefill_runs_each_prefill_size_without_touching_the_layer(device):
    # At load, on the GPU, each quantized layer runs its prefill kernels once on zeros (compiles at load, not
    # mid-serving): the layer's tensors stay bit for bit, and the serving-call probe does not count them.
    scheme = vllm_ops.WeightOnlyScheme(4, 32, False, ())
    stacked, _ = _stacked_checkpoint([torch.randn(64, 96, dtype=torch.float16)], scheme)
    layer = _loaded_layer({name: t.to(device) for name, t in stacked.items()}, 64, 96)
    before = {name: t.clone() for name, t in layer.named_parameters()}
    calls = vllm_ops.call_counts().get("quant_matmul", 0)
    # (one row count of each path: the interpreter takes seconds a row count; the test below checks the rows)
    vllm_ops.warm_prefill(layer, scheme, torch.float16, rows=(1, 17, 65, 129, 257, 2049))
    assert all(torch.equal(t, before[name]) for name, t in layer.named_parameters())
    assert vllm_ops.call_counts().get("quant_matmul", 0) == calls


# (run in a process of its own with compiled kernels: launch.capture replays the GPU's dispatch on CPU tensors
# that stand for the GPU's, nothing computed)
_WARM_COVERAGE = """
import json
import types
import torch
from squeezeserve.kernels import vllm_ops
from squeezeserve.kernels.ops import launch
from squeezeserve.kernels.ops import quant_matmul as qm

def weights(n, k, g, zeros, dtype):
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    sc = torch.zeros(n, k // g, dtype=dtype)
    owned = vllm_ops.owned_shape(n, k, g, zeros)  # (the layers the vLLM method repacks: their own dispatch)
    if owned:  # (its zero points as quant_layout.to_owned_zeros lays them out)
        zp = torch.zeros(n, -(-k // g // 8), dtype=torch.int32) if zeros else None
    else:
        zp = torch.zeros((n + 7) // 8, k // g, dtype=torch.int32) if zeros else None
    return qw, sc, zp, owned

def key(kern, a, kw):
    return repr((kern.__name__, launch.specialization_key(a, kw)))

def keys(n, k, g, zeros, dtype, rows, pdl):
    qw, sc, zp, owned = weights(n, k, g, zeros, dtype)
    first = {}
    with launch.capture(sms=132, wgmma=True) as launches:
        for m in rows:
            if owned:
                qm._quant_matmul_owned(torch.empty(m, k, dtype=dtype), qw, sc, zp, g, pdl)
            else:
                qm._quant_matmul(torch.empty(m, k, dtype=dtype), qw, sc, zp, g, 4, pdl)
            for kern, _, a, kw in launches:
                first.setdefault(key(kern, a, kw), m)
            launches.clear()
    return first

def warmed(n, k, g, zeros, dtype):
    # what the method's warm-up at load launches, for a layer after one of our kernels (pdl)
    qw, sc, zp, owned = weights(n, k, g, zeros, dtype)
    layer = types.SimpleNamespace(input_size_per_partition=k, weight_packed=qw, weight_scale=sc,
                                  weight_zero_point=zp, owned_words=owned)
    with launch.capture(sms=132, wgmma=True) as launches:
        vllm_ops.warm_prefill(layer, vllm_ops.WeightOnlyScheme(4, g, not zeros, ()), dtype, pdl=True)
        return {key(kern, a, kw) for kern, _, a, kw in launches}

CASES = {  # the 8B model's qkv, o, gate_up and down, g128 and g32 with zero points; the bundled model's
    "6144x4096 g128": (6144, 4096, 128, False, torch.bfloat16, 4112),
    "4096x4096 g128": (4096, 4096, 128, False, torch.bfloat16, 4112),
    "28672x4096 g32 zp": (28672, 4096, 32, True, torch.bfloat16, 4112),
    "4096x14336 g128": (4096, 14336, 128, False, torch.bfloat16, 4112),
    "28672x4096 g128": (28672, 4096, 128, False, torch.bfloat16, 4112),
    "4096x14336 g32 zp": (4096, 14336, 32, True, torch.bfloat16, 4112),
    "576x1536 g32 zp fp16": (576, 1536, 32, True, torch.float16, 4112),
}
for case, (n, k, g, zeros, dtype, most) in CASES.items():
    every = keys(n, k, g, zeros, dtype, range(1, most + 1), False)
    # as programmatic dependents: the decode rows (past PDL_MAX_M the launches are those without)
    dependent = keys(n, k, g, zeros, dtype, range(1, qm.PDL_MAX_M + 2), True)
    pdl_keys = set(dependent) - set(every)
    every |= {key: dependent[key] for key in pdl_keys}
    missing = sorted(every[key] for key in set(every) - warmed(n, k, g, zeros, dtype))
    print(json.dumps({"case": case, "keys": len(every), "pdl_keys": len(pdl_keys), "missing_rows": missing}))
"""


def test_warm_rows_reach_every_kernel_that_any_row_count_launches(run_compiled):
    # The row counts a layer warms at load launch every compiled kernel (each launch key) that any row count
    # up to past the rules' bounds launches at these shapes: none is left to compile in the middle of
    # serving. (To 4112 rows: past the Gluon GEMM's rows, 4096 where K = 4096 in groups of 128, dequantize +
    # cuBLAS, whose products launch.capture does not compute; before it skipped them the replay computed
    # them on the CPU and stopped at 640 rows, over 600 s on a 2-core AMD EPYC.)
    # With the decode rows launched as programmatic dependents too (the projections after our kernels,
    # vllm_ops.follows_our_kernel): other compiled kernels, where the Gluon decode runs, which the warm-up
    # launches as well.
    results = run_compiled(["-c", _WARM_COVERAGE])
    assert len(results) == 7
    for case, result in results.items():
        assert result["keys"] >= 8, (case, result)
        assert result["missing_rows"] == [], (case, result["missing_rows"])
        if "28672" in case or "14336" in case:
            assert result["pdl_keys"] >= 1, (case, result)


_SILU_AND_MUL_WARM = """
import json
import torch
from squeezeserve.kernels import functional, vllm_ops
from squeezeserve.kernels.ops import launch, swiglu
from squeezeserve.kernels.ops import quant_matmul as qm

def keys(run):
    with launch.capture(sms=132, wgmma=True) as launches:
        run()
        return {repr((k.__name__, launch.specialization_key(a, kw))) for k, _, a, kw in launches}

# the 8B model's MLP width, the bundled model's (fp16), a 4096-wide one, and a narrow one (many row tilings)
WIDTHS = ((14336, torch.bfloat16), (1536, torch.float16), (4096, torch.bfloat16), (64, torch.bfloat16))
for d, dtype in WIDTHS:
    every = {}
    with launch.capture(sms=132, wgmma=True) as launches:
        for rows in range(1, swiglu.BIG_GRID + 100):
            functional.silu_and_mul(torch.empty(rows, 2 * d, dtype=dtype))
            if rows <= qm.PDL_MAX_M:  # (as vLLM's decode graphs launch it on Hopper: vllm_ops.chained)
                swiglu.silu_and_mul_dependent(torch.empty(rows, 2 * d, dtype=dtype))
            for k, _, a, kw in launches:
                every.setdefault(repr((k.__name__, launch.specialization_key(a, kw))), rows)
            launches.clear()
    warmed = keys(lambda: vllm_ops.warm_silu_and_mul(torch.empty(7, 2 * d, dtype=dtype)))
    again = keys(lambda: vllm_ops.warm_silu_and_mul(torch.empty(9, 2 * d, dtype=dtype)))
    print(json.dumps({"case": d, "keys": len(every), "warmed": len(warmed), "again": len(again),
                      "missing_rows": sorted(every[k] for k in set(every) - warmed)}))
"""


def test_silu_and_mul_warms_every_kernel_that_any_row_count_launches(run_compiled):
    # vLLM's first eager call at a width runs silu_and_mul at swiglu.warm_rows: every launch key any row
    # count reaches (past BIG_GRID rows every count takes the one-row tiles), once per width and dtype; on
    # Hopper launched plainly and, up to PDL_MAX_M rows, as a programmatic dependent (vLLM's decode graphs).
    results = run_compiled(["-c", _SILU_AND_MUL_WARM])
    assert len(results) == 4
    for case, result in results.items():
        assert result["keys"] >= 6 and result["warmed"] == result["keys"], (case, result)
        assert result["missing_rows"] == [] and result["again"] == 0, (case, result)


_NORM_WARM = """
import json
import torch
from squeezeserve.kernels import vllm_ops
from squeezeserve.kernels.ops import launch, rmsnorm
from squeezeserve.kernels.ops import quant_matmul as qm

def keys(run, rows_list):
    first = {}
    with launch.capture(sms=132, wgmma=True) as launches:
        for rows in rows_list:
            run(rows)
            for k, _, a, kw in launches:
                first.setdefault(repr((k.__name__, launch.specialization_key(a, kw))), rows)
            launches.clear()
    return first

for n, dtype in ((4096, torch.bfloat16), (576, torch.float16)):  # the 8B model's width, the bundled model's
    w = torch.empty(n, dtype=dtype)
    for fused in (False, True):  # (vLLM's eager model's rounding, its compiled model's)
        def both(rows):
            x = torch.empty(rows, n, dtype=dtype)
            rmsnorm.rmsnorm_dependent(x, w, 1e-6, fused)
            rmsnorm.add_rmsnorm_dependent(x, x.clone(), w, 1e-6, fused)
        every = keys(both, range(1, qm.PDL_MAX_M + 1))  # (the rows they launch at: vllm_ops.chained)
        def warm(rows):
            vllm_ops.warm_dependent_norm(torch.empty(rows, n, dtype=dtype), w, 1e-6, fused)
        warmed, again = keys(warm, [3]), keys(warm, [5])
        missing = sorted(every[k] for k in set(every) - set(warmed))
        print(json.dumps({"case": f"{n} {fused}", "keys": len(every), "warmed": len(warmed),
                          "again": len(again), "missing_rows": missing}))

import os
os.environ[vllm_ops.PDL_ENV] = "off"  # (never launched then: nothing to compile)
vllm_ops._NORMS_WARMED.clear()
off = keys(lambda rows: vllm_ops.warm_dependent_norm(torch.empty(rows, 4096, dtype=torch.bfloat16),
                                                     torch.empty(4096, dtype=torch.bfloat16), 1e-6), [3])
print(json.dumps({"case": "off", "warmed": len(off)}))
"""


def test_norms_launched_as_dependents_warm_every_kernel_any_row_count_launches(run_compiled):
    # On Hopper vLLM's decode graphs launch our norms as programmatic dependents (other kernels than the
    # eager calls') up to PDL_MAX_M rows: the first eager call at a width runs them at rmsnorm.warm_rows up
    # to there, which reach every launch key that any of those row counts reaches, once per width and dtype.
    # Each rounding (vLLM's eager model's, its compiled model's through the chain ops) its own kernels.
    results = run_compiled(["-c", _NORM_WARM])
    assert len(results) == 5 and results.pop("off")["warmed"] == 0  # (SQUEEZESERVE_PDL=off: none)
    for case, result in results.items():
        assert result["keys"] >= 4 and result["warmed"] == result["keys"], (case, result)
        assert result["missing_rows"] == [] and result["again"] == 0, (case, result)


# --- on vLLM's CPU backend: the weights unpacked once at load -------------------------------------------


def _loaded_layer(stacked: dict[str, torch.Tensor], n_out: int, k_in: int) -> torch.nn.Module:
    """A linear layer as our method leaves it after vLLM's loader: the stacked checkpoint tensors as frozen
    parameters, and the partition sizes ``create_weights`` sets."""
    layer = torch.nn.Module()
    for name, tensor in stacked.items():
        layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    layer.output_size_per_partition, layer.input_size_per_partition = n_out, k_in
    return layer


CPU_CASES = [
    (*CASES[0], "int4"),
    (*CASES[1], "int4"),
    (*CASES[2], "int8"),
    # group-wise int8 and an int4 group torch does not take: dequantized once
    (vllm_ops.WeightOnlyScheme(8, 32, True, ()), [40, 24], 96, "dense"),
    (vllm_ops.WeightOnlyScheme(4, 48, False, ()), [32, 32], 96, "dense"),
]


@pytest.mark.parametrize(("scheme", "widths", "k_in", "form"), CPU_CASES)
def test_prepare_cpu_keeps_a_packed_form_that_equals_dequantize_then_matmul(scheme, widths, k_in, form):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16
    shards = [(torch.randn(n, k_in, generator=gen) * 0.05).to(dtype) for n in widths]
    stacked, dense = _stacked_checkpoint(shards, scheme)
    layer = _loaded_layer(stacked, sum(widths), k_in)
    vllm_ops.prepare_cpu(layer, scheme)
    assert layer.cpu_form == form
    assert not hasattr(layer, "weight_packed") and not hasattr(layer, "weight_zero_point")
    x = torch.randn(2, 3, k_in, generator=gen).to(dtype)
    bias = torch.randn(sum(widths), generator=gen).to(dtype)
    before = vllm_ops.call_counts()
    y = vllm_ops.cpu_linear(layer, x, bias)
    after = vllm_ops.call_counts()
    assert after[f"cpu_{form}_matmul"] == before.get(f"cpu_{form}_matmul", 0) + 1
    assert after.get("quant_matmul", 0) == before.get("quant_matmul", 0)  # not the per-call reference
    expected = x.float() @ dense.float().T + bias.float()
    assert y.shape == (2, 3, sum(widths)) and y.dtype == dtype
    # fp16 values multiplied on both sides: the error is the fp16 rounding of x @ W.T and of + bias (|y| up
    # to 4.2, where an fp16 ulp is 2e-3); measured max 1.1e-3 (int8, dense) to 1.9e-3 (int4, which adds the
    # offset -z * s per group instead of subtracting z before scaling). A wrong nibble or group is O(|y|).
    torch.testing.assert_close(y.float(), expected, rtol=2e-3, atol=2e-3)


# --- RMSNorm: rounding of the path it replaces -------------------------------------------------------


def _fused_reference(x, residual, weight, eps):
    """vLLM's IR ops ``rms_norm`` / ``fused_add_rms_norm`` (vllm/ir/ops/layernorm.py) as Inductor compiles
    them: its fp16/bf16 casts inside one kernel become fp32 (``emulate_precision_casts`` off), so the sum
    x + residual and the normalised row stay fp32 and only the stored outputs are rounded."""
    h = x.float() if residual is None else x.float() + residual.float()
    y = (weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
    return y if residual is None else (y, h.to(x.dtype))


def _hf_reference(x, residual, weight, eps):
    """vLLM's eager CUDA kernels round like Hugging Face: the sum, then the normalised row."""
    if residual is None:
        return reference.rmsnorm(x, weight, eps)
    return reference.add_rmsnorm(x, residual, weight, eps)


def _dtypes(device: str) -> list[torch.dtype]:
    # Triton's interpreter truncates to bf16 instead of rounding to nearest: bf16 is checked on a GPU only.
    return [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float16]


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "fused_add_rms_norm"])
@pytest.mark.parametrize(
    ("compiled", "chain"), [(False, False), (True, False), (True, True)], ids=["eager", "compiled", "chain"]
)
@pytest.mark.parametrize("path", PATHS)
def test_rms_norm_rounds_like_the_vllm_path_it_replaces(path, compiled, chain, residual, device):
    on, context = _path(path, device)
    for dtype in _dtypes(on):
        gen = torch.Generator().manual_seed(0)
        # A residual stream 16x wider than the update: most sums x + residual are not representable in
        # the activation dtype, so rounding them or not changes a large share of the outputs.
        x = (torch.randn(8, 320, generator=gen) * 4).to(dtype).to(on)
        res = (torch.randn(8, 320, generator=gen) * 64).to(dtype).to(on) if residual else None
        weight = (1 + 0.1 * torch.randn(320, generator=gen)).to(dtype).to(on)
        with context:
            out = vllm_ops.rms_norm(x, res, weight, 1e-6, compiled, chain)
        matching, other = (_fused_reference, _hf_reference) if compiled else (_hf_reference, _fused_reference)
        expected, wrong = matching(x, res, weight, 1e-6), other(x, res, weight, 1e-6)
        y, y_expected, y_wrong = (out[0], expected[0], wrong[0]) if residual else (out, expected, wrong)
        if residual:
            assert torch.equal(out[1], expected[1])  # the new residual is the rounded sum on both paths
        # Bit-equal on the reference path and in the interpreter (same fp32 formula); on a GPU rsqrt and
        # the reduction order can move a value across a rounding boundary: at most 1% of the outputs, by
        # one unit in the last place. The other rounding scheme differs in 25-35% of them (measured).
        differs = (y != y_expected).float().mean().item()
        assert differs <= (0.0 if on == "cpu" else 0.01), f"{dtype}: {differs:.2%} differ"
        assert (y != y_wrong).float().mean().item() > 0.1
        torch.testing.assert_close(y.float(), y_expected.float(), rtol=2**-7, atol=0)


def test_fused_rounding_op_schema_fake_and_autograd(check, device):
    x, res = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)
    weight = torch.randn(64, device=device, requires_grad=True)
    check.opcheck(torch.ops.squeezeserve.add_rmsnorm, (x.requires_grad_(), res, weight, 1e-6, True))
    check.opcheck(torch.ops.squeezeserve.rmsnorm, (x, weight, 1e-6, True))


def test_row_parallel_slices_must_hold_whole_words_and_groups():
    """Tensor parallelism splits o_proj / down_proj along the input: each rank keeps whole groups."""
    grouped = vllm_ops.WeightOnlyScheme(4, 32, False, ())
    vllm_ops.check_input_partition(grouped, 288, 576)  # SmolLM2 o_proj at TP=2: 9 groups per rank
    vllm_ops.check_input_partition(grouped, 576, 576)  # not split
    with pytest.raises(ValueError, match="group size 32"):
        vllm_ops.check_input_partition(grouped, 144 + 8, 576)
    per_channel = vllm_ops.WeightOnlyScheme(8, None, True, ())
    vllm_ops.check_input_partition(per_channel, 100, 400)  # one scale per output row: any whole word
    with pytest.raises(ValueError, match="multiple of 4"):
        vllm_ops.check_input_partition(per_channel, 101, 404)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_shards_sum_to_the_whole_layer(tp):
    """What vLLM's loader gives each rank of a row-parallel layer (packed columns, group scales and zero
    points cut along the input dim): the ranks' partial products, all-reduced, equal the whole layer."""
    scheme = vllm_ops.WeightOnlyScheme(4, 32, False, ())
    gen = torch.Generator().manual_seed(0)
    k_in, n_out = 256, 48
    weight = (torch.randn(n_out, k_in, generator=gen) * 0.05).to(torch.float16)
    whole, dense = _stacked_checkpoint([weight], scheme)
    x = torch.randn(3, k_in, generator=gen).to(torch.float16)
    part, per_word = k_in // tp, 32 // scheme.bits
    vllm_ops.check_input_partition(scheme, part, k_in)
    total = torch.zeros(3, n_out)
    for rank in range(tp):
        groups = slice(rank * part // 32, (rank + 1) * part // 32)
        total += vllm_ops.quant_linear(
            x[:, rank * part : (rank + 1) * part],
            whole["weight_packed"][:, rank * part // per_word : (rank + 1) * part // per_word],
            whole["weight_scale"][:, groups],
            whole["weight_zero_point"][:, groups],
            scheme,
        ).float()
    torch.testing.assert_close(total, x.float() @ dense.float().T, rtol=4e-3, atol=4e-3)


def test_owned_words_only_where_the_gluon_decode_serves(device, monkeypatch):
    # Layers go to the owned order only on Hopper with the Gluon kernel, for the weights owned_shape takes;
    # a CPU layer, int8, or a small weight keeps its packed words.
    scheme = vllm_ops.WeightOnlyScheme(4, 128, True, ())
    layer = _loaded_layer({"weight_packed": torch.zeros(64, 32, dtype=torch.int32, device=device),
                           "weight_scale": torch.zeros(64, 2, device=device)}, 64, 256)  # fmt: skip
    assert not vllm_ops.owned_words(layer, scheme)  # (a small weight, or no Hopper here)
    monkeypatch.setattr(vllm_ops, "wgmma", lambda device: True)
    monkeypatch.setattr(vllm_ops.quant_matmul, "gluon_module", lambda: object())
    monkeypatch.setattr(vllm_ops, "owned_shape", lambda *a: True)
    assert vllm_ops.owned_words(layer, scheme) == (device != "cpu")
    assert not vllm_ops.owned_words(layer, vllm_ops.WeightOnlyScheme(8, 128, True, ()))


def test_owned_shapes_are_the_8b_models_wide_layers():
    # The 8B model's gate_up (28672 x 4096) and down (4096 x 14336) go to owned words, g32 with zero points
    # too (thirty-second session: packed words took the slower decode there); its qkv and o (under 2^25
    # values, where packed words' FMA kernel leads at one row), the bundled model's layers, and groups the
    # Gluon decode does not take keep packed words.
    owned = vllm_ops.owned_shape
    for group, zeros in ((128, False), (128, True), (32, False), (32, True)):
        assert owned(28672, 4096, group, zeros) and owned(4096, 14336, group, zeros)
        for n, k in ((6144, 4096), (4096, 4096), (3072, 576), (576, 1536)):
            assert not owned(n, k, group, zeros), (n, k, group, zeros)
    assert not owned(28672, 4096, 64, False) and not owned(28672, 4096, 16, False)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quant_linear_on_owned_words_is_quant_linear(symmetric, device):
    # A loaded layer made owned (its words, and its zero points where it has them) gives the products of
    # its checkpoint's tensors.
    scheme = vllm_ops.WeightOnlyScheme(4, 32, symmetric, ())
    t = quant_layout.pack_weight(torch.randn(100, 256) / 16, 4, 32, symmetric=symmetric)
    t = {name: v.to(device) for name, v in t.items() if name != "weight_shape"}
    t["weight_scale"] = t["weight_scale"].half()
    x = torch.randn(5, 256, dtype=torch.float16, device=device)
    want = vllm_ops.quant_linear(x, t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), scheme)
    layer = _loaded_layer(dict(t), 100, 256)
    vllm_ops.own_weights(layer)
    assert layer.owned_words and layer.weight_packed.shape == t["weight_packed"].shape
    zero = getattr(layer, "weight_zero_point", None)
    assert (zero is None) == symmetric and (symmetric or zero.shape == (100, 1))
    got = vllm_ops.quant_linear(x, layer.weight_packed, layer.weight_scale, zero, scheme, owned=True)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
