"""squeezeserve's ops inside vLLM 0.26: out-of-tree custom ops and a weight-only quantization method.

vLLM loads this through our ``vllm.general_plugins`` entry point (``service/worker/vllm_plugin.py``), in
every process that builds a model. What it installs:

- ``SiluAndMul`` -> ``torch.ops.squeezeserve.silu_and_mul``; ``RMSNorm`` (plain and with the fused
  residual add) -> ``torch.ops.squeezeserve.rmsnorm`` / ``add_rmsnorm``. Both through
  ``CustomOp.register_oot``: ``CustomOp.__new__`` instantiates our subclass wherever a model builds the
  stock class. vLLM calls ``forward_cuda`` when custom ops are enabled (eager, ``custom_ops=['all']``) and
  ``forward_native`` when they are not (its torch.compile default), so both run our op. In 0.26 the stock
  ``RMSNorm.forward_native`` calls the vLLM IR ops ``ir.ops.rms_norm`` / ``fused_add_rms_norm``; replacing
  the module keeps the IR priority (set per engine from ``--ir-op-priority``) out of the A/B: with ours on,
  no IR op is left in the model. Our ops are ``triton_op``s, so torch.compile traces the Triton kernels
  into vLLM's compiled graph and CUDA graphs capture them. RMSNorm rounds like the vLLM path it replaces
  (:func:`rms_norm`), so greedy outputs with our ops match vLLM's own in both modes.
- The ``squeezeserve`` quantization method (``register_quantization_config``): serves compressed-tensors
  ``pack-quantized`` int4/int8 weight-only checkpoints (``squeezeserve compress``) through
  ``torch.ops.squeezeserve.quant_matmul``, reading the checkpoint's packed layout as stored (no repacking).
  It is chosen with ``--quantization squeezeserve``; without it vLLM's own compressed-tensors path
  (Marlin/Machete) serves the same checkpoint. On vLLM's CPU backend the method instead unpacks the
  weights once at load into the packed forms torch has CPU matmuls for (:func:`prepare_cpu`, the layouts
  of ``cpu_packed.py`` that our embedded worker runs); the GPU path is untouched. Low-rank and codebook
  checkpoints (``quant_method: squeezeserve``) come to it by name; their linear methods are in
  ``vllm_lowrank_codebook.py``.

Every eager call of a replacement is counted per process (:func:`call_counts`); with
``SQUEEZESERVE_VLLM_PROBE=<file>`` the 1st, 2nd, 4th, 8th ... call of each op at each row count appends a
line ``pid=<pid> op=<op> call=<n> shape=<shape> dtype=<dtype>`` (so the file also tells how often eager
steps of each size ran, to a factor of two). Under torch.compile the compiled graph
launches our Triton kernels without running this Python: there a profiler trace is the proof
(tests/gpu/vllm_ab.py counts the kernels by name).

Everything that does not need vLLM (scheme parsing, the linear's arithmetic, the merged-layer check) is a
plain function here so it is tested on CPU without vLLM; the vLLM classes are built only by
:func:`register_custom_ops` and :func:`register_quantization`.
"""

from __future__ import annotations

import collections
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from squeezeserve.kernels import functional, quant_layout
from squeezeserve.kernels.ops import launch, quant_matmul, rmsnorm, swiglu
from squeezeserve.kernels.ops.launch import wgmma
from squeezeserve.kernels.ops.quant_matmul import quant_matmul_eager
from squeezeserve.kernels.registry import eager

QUANT_METHOD_NAME = "squeezeserve"
PROBE_ENV = "SQUEEZESERVE_VLLM_PROBE"
CUSTOM_OPS = ("silu_and_mul", "rms_norm")

_calls: collections.Counter[str] = collections.Counter()
_calls_by_rows: collections.Counter[tuple[str, int]] = collections.Counter()
# The ops of CUSTOM_OPS this process registered in vLLM (register_custom_ops).
_REGISTERED: set[str] = set()


def call_counts() -> dict[str, int]:
    """Python-level calls of each replacement in this process (eager calls plus compile-time traces)."""
    return dict(_calls)


def _note(op: str, x: torch.Tensor) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces the model's forward with fullgraph=True: no side effects here (a file write would
        # break the graph). Compiled runs are proven by the kernels a profiler sees launched.
        return
    _calls[op] += 1
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    rows = math.prod(x.shape[:-1])
    _calls_by_rows[op, rows] += 1
    n = _calls_by_rows[op, rows]
    if n & (n - 1) == 0:
        with open(path, "a") as f:
            f.write(f"pid={os.getpid()} op={op} call={n} shape={tuple(x.shape)} dtype={x.dtype}\n")


def rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    compiled: bool,
    chain: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's RMSNorm (``residual``: the fused add, returning (y, x + residual)) through our ops.

    Rounding follows the path replaced. Eager vLLM runs its CUDA kernels, which round x + residual and the
    normalised row to the activation dtype as Hugging Face does (our default). Compiled vLLM runs its IR
    ops fused by Inductor, which keeps both in fp32 and rounds only y and the new residual: ``compiled``
    selects our kernel's ``fused_rounding`` for that. ``chain`` (compiled only, :func:`compiled_chain`):
    through the opaque op that launches as a programmatic dependent in CUDA graphs."""
    if residual is None:
        _note("rms_norm", x)
        if compiled:
            if chain:
                return torch.ops.squeezeserve.rms_norm_chain(x, weight, eps)
            return torch.ops.squeezeserve.rmsnorm(x, weight, eps, True)
        warm_dependent_norm(x, weight, eps)
        if chained(x):  # (PDL_AFTER)
            return rmsnorm.rmsnorm_dependent(x, weight, eps)
        return functional.rmsnorm(x, weight, eps)
    _note("fused_add_rms_norm", x)
    if compiled:
        if chain:
            return torch.ops.squeezeserve.fused_add_rms_norm_chain(x, residual, weight, eps)
        return torch.ops.squeezeserve.add_rmsnorm(x, residual, weight, eps, True)
    warm_dependent_norm(x, weight, eps)
    if chained(x):
        return rmsnorm.add_rmsnorm_dependent(x, residual, weight, eps)
    return functional.add_rmsnorm(x, residual, weight, eps)


# --- the quantization scheme, parsed from the checkpoint's compressed-tensors config ------------------


@dataclass(frozen=True)
class WeightOnlyScheme:
    """A pack-quantized weight-only scheme: ``bits`` in {4, 8}, ``group_size`` None for per channel."""

    bits: int
    group_size: int | None
    symmetric: bool
    ignore: tuple[str, ...]

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    def group_size_for(self, in_features: int) -> int:
        """The group size quant_matmul takes: per channel is one group as wide as the input."""
        return in_features if self.group_size is None else self.group_size


def parse_scheme(quant_config: dict[str, Any]) -> WeightOnlyScheme:
    """The ``quantization_config`` block of a checkpoint's config.json -> our scheme; anything we do not
    serve (fp8, activation quantization, several groups, act-order) is refused with the reason."""
    from squeezeserve.kernels.checkpoint_format import PACK_QUANTIZED, read_quantization

    parsed = read_quantization({"quantization_config": quant_config})
    scheme = parsed.scheme
    if scheme.kind != "int":
        raise ValueError(
            f"the squeezeserve quantization method serves integer weight-only checkpoints, not {scheme.kind} "
            "(serve fp8 checkpoints with vLLM's own compressed-tensors path)"
        )
    group = next(iter(quant_config["config_groups"].values()))
    fmt = group.get("format") or quant_config.get("format")
    if fmt != PACK_QUANTIZED:
        raise ValueError(f"expected compressed-tensors format {PACK_QUANTIZED!r}, got {fmt!r}")
    if scheme.bits not in (4, 8):
        raise ValueError(f"quant_matmul serves 4- and 8-bit weights, the checkpoint has {scheme.bits}")
    return WeightOnlyScheme(scheme.bits, scheme.group_size, scheme.symmetric, parsed.ignore)


def check_partition(scheme: WeightOnlyScheme, output_partition_sizes: list[int]) -> None:
    """vLLM loads merged layers (qkv_proj, gate_up_proj) by stacking each shard's tensors along the output
    dim. Packed weights and scales are per output row, so stacking them is the packed form of the stacked
    weight. Zero points are packed along the output dim: stacking is exact only when every shard fills
    whole int32 words."""
    per_word = 32 // scheme.bits
    if not scheme.symmetric and any(n % per_word for n in output_partition_sizes):
        raise ValueError(
            f"asymmetric {scheme.bits}-bit zero points are packed {per_word} outputs per int32: every merged "
            f"shard must be a multiple of {per_word}, got {output_partition_sizes}"
        )


def check_input_partition(scheme: WeightOnlyScheme, input_size_per_partition: int, input_size: int) -> None:
    """Row-parallel layers (o_proj, down_proj under tensor parallelism) split the input dim: each rank's
    slice must hold whole int32 words of packed weights and whole quantization groups, or a rank's scales
    would belong to columns another rank holds."""
    if input_size_per_partition == input_size:
        return
    per_word = 32 // scheme.bits
    group = scheme.group_size or input_size
    if input_size_per_partition % per_word or (scheme.group_size and input_size_per_partition % group):
        raise ValueError(
            f"tensor parallelism splits an input dim of {input_size} into {input_size_per_partition} a rank: "
            f"that must be a multiple of {per_word} (int32 packing) and of the group size {group}; "
            "choose a tensor-parallel size that divides the groups evenly"
        )


def quant_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    scheme: WeightOnlyScheme,
    bias: torch.Tensor | None = None,
    owned: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """y = x @ dequantize(W).T (+ bias), W in compressed-tensors' pack-quantized layout, or with ``owned`` its
    int4 words in quant_layout.to_owned_order's order and its zero points as to_owned_zeros lays them out
    (:func:`owned_words`). ``pdl``: x comes straight from a kernel of ours launched as a programmatic
    dependent (:func:`follows_our_kernel`)."""
    _note("quant_matmul", x)
    group = scheme.group_size_for(x.shape[-1])
    if owned:
        args = (x, weight_packed, weight_scale, weight_zero_point, group)
        body, opaque = quant_matmul.quant_matmul_owned_eager, torch.ops.squeezeserve.quant_matmul_owned
    else:
        args = (x, weight_packed, weight_scale, weight_zero_point, group, scheme.bits)
        body, opaque = quant_matmul_eager, torch.ops.squeezeserve.quant_matmul_opaque
    y = None
    if not torch.compiler.is_compiling():
        now = (*args, quant_matmul.dependent(pdl, x))
        y = body.plans.replayed(*now)  # (its plan replayed in C++: no Python layer)
        if y is None and eager(*args[:4]):
            # Nothing traces (vLLM's eager prompt forwards, decode graph captures): the op's body without
            # torch's dispatcher, with launch plans.
            y = body(*now)
    if y is None:
        # The opaque op: vLLM compiles one graph for all batch sizes, and a traced-through quant_matmul would
        # keep the kernel choice of the size it was traced at.
        y = opaque(*args, pdl)
    return y + bias if bias is not None else y


# Programmatic dependent launch (PDL) in vLLM's decode graphs (launch.graph_dependent; compiled, through the
# opaque ops of compiled_chain). Our kernels call launch_dependents first on Hopper
# (launch.launches_dependents), our norms and SwiGLU launch as programmatic dependents of the kernel before
# them there (rmsnorm.rmsnorm_dependent, swiglu.silu_and_mul_dependent: a decoder layer's norms follow our
# down_proj and o_proj GEMMs, its SwiGLU our gate_up), and the projections whose input comes from one of
# those launch as its dependent (quant_matmul.PDL_MAX_M): qkv_proj after input_layernorm's RMSNorm (with the
# residual add from the second layer on), gate_up_proj after post_attention_layernorm's add-RMSNorm,
# down_proj after act_fn's SiluAndMul; each maps to the op of ours that must replace vLLM's for that. Not
# o_proj (after attention, vLLM's kernel). A GEMM then loads its weights while the GEMM two kernels before
# it drains. SQUEEZESERVE_PDL=off launches the projections as before.
PDL_AFTER = {"qkv_proj": "rms_norm", "gate_up_proj": "rms_norm", "down_proj": "silu_and_mul"}
PDL_ENV = "SQUEEZESERVE_PDL"


def pdl_enabled() -> bool:
    """SQUEEZESERVE_PDL: ``auto`` (the default: as :data:`PDL_AFTER` says, on one GPU a model; with tensor
    parallelism the norms follow all-reduces, not our GEMMs, and that was not measured) or ``off`` (no kernel
    of ours launches as a programmatic dependent in vLLM)."""
    mode = os.environ.get(PDL_ENV, "auto")
    if mode not in ("auto", "off"):
        raise ValueError(f"{PDL_ENV} must be auto or off, got {mode!r}")
    return mode == "auto" and _tensor_parallel_size() == 1


def _tensor_parallel_size() -> int:
    """vLLM's tensor-parallel size in this process (1 before its groups exist, or without vLLM)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return 1
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def chained(x: torch.Tensor) -> bool:
    """Whether a serving call of our norms or SiluAndMul on ``x`` launches as a programmatic dependent of the
    kernel before it: while a CUDA graph captures it on Hopper (launch.graph_dependent), at decode row counts
    (up to quant_matmul.PDL_MAX_M: there the GEMMs around it are decode kernels, which call
    launch_dependents and launch as dependents themselves; past it they are prefill kernels, which do
    neither, and a dependent launch after such a kernel cost 0.5-1.5 us on the H100, NOTES.md, twenty-fifth
    session), with SQUEEZESERVE_PDL on (:func:`pdl_enabled`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows <= quant_matmul.PDL_MAX_M and launch.graph_dependent(x) and pdl_enabled()


def compiled_chain() -> bool:
    """Whether vLLM's compiled model (torch.compile) launches the chain of :data:`PDL_AFTER` in its CUDA
    graphs: :func:`pdl_enabled`, on a GPU whose kernels call launch_dependents. Our norms and SiluAndMul
    then compile to the opaque ``*_chain`` ops (Inductor would launch a traced kernel plainly), whose Python
    runs while vLLM captures its graphs. Read once, when the module is built (Dynamo reads the attribute)."""
    if not (pdl_enabled() and torch.cuda.is_available()):
        return False
    return launch.launches_dependents(torch.device("cuda", torch.cuda.current_device()))


def follows_our_kernel(prefix: str) -> bool:
    """Whether the linear layer at ``prefix`` (vLLM's module path, e.g. ``model.layers.0.mlp.down_proj``)
    takes its input straight from a kernel of ours launched as a programmatic dependent (:data:`PDL_AFTER`;
    that op of ours registered in vLLM in this process; not with SQUEEZESERVE_PDL=off)."""
    op = PDL_AFTER.get(prefix.rsplit(".", 1)[-1])
    return pdl_enabled() and op is not None and op in _REGISTERED


# Rows of a weight put in the owned order at a time at load (the order's transient is 8 bytes a value).
OWNED_CHUNK_ROWS = 1024
OWNED_MIN_WEIGHT = 1 << 25  # (owned_shape)


def owned_words(layer: torch.nn.Module, scheme: WeightOnlyScheme) -> bool:
    """Whether a loaded layer's int4 words go to quant_layout.to_owned_order at load (and its zero points to
    to_owned_zeros): on Hopper where the Gluon kernel runs, K and the groups multiples of 32, for the
    weights :func:`owned_shape` takes."""
    qweight = layer.weight_packed
    k_in = layer.input_size_per_partition
    group = scheme.group_size_for(k_in)
    zeros = getattr(layer, "weight_zero_point", None) is not None
    return (
        scheme.bits == 4
        and qweight.is_cuda
        and wgmma(qweight.device)
        and quant_matmul.gluon_module() is not None
        and k_in % quant_layout.OWNED_BLOCK == 0
        and group % quant_layout.OWNED_BLOCK == 0
        and owned_shape(qweight.shape[0], k_in, group, zeros)
    )


def owned_shape(n_out: int, k_in: int, group: int, zeros: bool) -> bool:
    """The weights owned words serve faster: weights of at least OWNED_MIN_WEIGHT values in the groups the
    Gluon decode takes. H100, bench_quant_matmul.py --owned (NOTES.md, twentieth session),
    owned / packed at 1-8192 rows, g128: 28672 x 4096-like N 14336 K 4096 0.98-1.15x (the Gluon decode on
    both from 2 rows), N 4096 K 14336 1.0-1.1x (where packed words take the FMA and Triton kernels to 16
    rows), but 4096^2 0.70-0.92x at 1-16 rows (the FMA kernel's 6.4-9.1 us against the Gluon decode's
    9.1-9.9). g32 with zero points too since the thirty-second session (it had waited for the packed decode's
    threshold, 2^26 values): 2-64 rows, us owned / packed, 4096 x 14336 19.3-28.3 / 21.7-34.3, 14336 x 4096
    18.7-27.1 / 21.3-33.9 (Marlin 21.7-38.4 and 18.2-32.7;
    tests/benchmarks/results/bench_quant_matmul_h100_2026-11-27_item1_g32.log); ahead to 1536 rows, and at
    2048-4096 (dequantize + cuBLAS on both) 0.99-1.02x since the dequantize kernel's 4 x 2048 tile
    (quant_matmul.DEQUANT_TILE; 1.01-1.05x before:
    tests/benchmarks/results/dequantize_probe_h100_2026-11-28*.log)."""
    return quant_matmul.gluon_decode_group(group) and n_out * k_in >= OWNED_MIN_WEIGHT


def to_owned(qweight: torch.Tensor) -> torch.Tensor:
    """quant_layout.to_owned_order, OWNED_CHUNK_ROWS rows at a time (a bounded transient at load)."""
    owned = torch.empty_like(qweight)
    for start in range(0, qweight.shape[0], OWNED_CHUNK_ROWS):
        owned[start : start + OWNED_CHUNK_ROWS] = quant_layout.to_owned_order(
            qweight[start : start + OWNED_CHUNK_ROWS]
        )
    return owned


def own_weights(layer: torch.nn.Module) -> None:
    """A loaded layer's words to quant_layout.to_owned_order (:func:`to_owned`) and its zero points, where it
    has them, to to_owned_zeros (N words of a few groups' nibbles each: no chunks needed); quant_linear then
    takes it with ``owned``."""
    layer.weight_packed = torch.nn.Parameter(to_owned(layer.weight_packed.data), requires_grad=False)
    zero = getattr(layer, "weight_zero_point", None)
    if zero is not None:
        owned_zero = quant_layout.to_owned_zeros(zero.data, layer.weight_packed.shape[0])
        layer.weight_zero_point = torch.nn.Parameter(owned_zero, requires_grad=False)
    layer.owned_words = True


# Row counts whose kernels a layer compiles at load rather than in the middle of serving: a compile in a
# running server stalls every sequence in flight (vLLM's JIT monitor logged one in synth run 23, and the Gluon
# GEMM in runs 45-46). Each kernel of quant_matmul compiles on its first call with a given launch key
# (launch.specialization_key: its tiling's constexprs, and whether each int argument, such as the row count,
# is 1 or a multiple of 16). These row counts reach every key that the row counts to 4112 reach at the 8B
# model's shapes and the bundled model's, g128 and g32 with zero points (the Gluon GEMM to
# GLUON_PREFILL_MAX_M_SLICED rows at the 8B model's g128 weights with K = 4096: 3329 / 3344 rows, qkv's tiling
# with whole waves before stream-K; 4097 the dequantize kernel past it), on packed words and, for the layers
# the method repacks (owned_shape), on owned words (9 rows: their Gluon decode's 16-row tile, which packed g32
# words with zero points leave to the Triton kernels below 17 rows), on an H100's or H200's 132 SMs (replayed
# under launch.capture, in tests/kernels/test_vllm_ops.py; the bounds that count SMs move on other GPUs):
# both sides of each bound of the rules (the Gluon decode's tiles, the row split, the Gluon prefill's 128- and
# 256-row tiles and stream-K, the Triton GEMM's K splits,
# dequantize + cuBLAS past 2048 or 4096, whose kernels take no row count; 641 / 656 rows: past the 128-row
# tiles of GLUON_THIRD_TILE_MAX_M; 1025 / 1040: 4096-wide outputs' first, 1281 / 1296 qkv's, tilings with
# whole waves before stream-K, gluon_tiles' GLUON_DP_LAST_WAVE), a multiple of 16 and not. Decode sizes are
# among them: vLLM captures its graph sizes, but the row split runs a prompt batch's tail (up to 64
# rows) eagerly, and --enforce-eager captures nothing. (The fixed rows before the nineteenth session, 127 /
# 128 / 255 / 256 / 511 / 512 / 2048, missed the Gluon prefill's keys first reached at 513 rows of 4096^2 and
# 577 of 4096 x 14336, and every decode key: NOTES.md.)
PREFILL_WARM_ROWS = (1, 2, 3, 9, 16, 17, 32, 33, 48, 65, 80, 127, 128, 129, 144, 255, 256, 257, 272, 321, 336,
                     511, 512, 513, 528, 577, 592, 641, 656, 1025, 1040, 1281, 1296, 2048, 2049, 3329, 3344,
                     4096, 4097)  # fmt: skip


def warm_prefill(
    layer: torch.nn.Module,
    scheme: WeightOnlyScheme,
    dtype: torch.dtype,
    rows: tuple = PREFILL_WARM_ROWS,
    pdl: bool = False,
) -> None:
    """Run the layer's kernels once on zeros at each of ``rows`` row counts (each distinct kernel compiles
    once per process); with ``pdl`` the decode rows also as programmatic dependents (PDL_MAX_M: another
    compiled kernel, which vLLM first launches while it captures its graphs). Not through quant_linear: the
    op probe (_note) counts serving calls only."""
    k_in = layer.input_size_per_partition
    weight = (layer.weight_packed, layer.weight_scale, getattr(layer, "weight_zero_point", None))
    group = scheme.group_size_for(k_in)
    owned = getattr(layer, "owned_words", False)
    for m in rows:
        x = torch.zeros(m, k_in, dtype=dtype, device=layer.weight_packed.device)
        if owned:
            torch.ops.squeezeserve.quant_matmul_owned(x, *weight, group)
        else:
            torch.ops.squeezeserve.quant_matmul_opaque(x, *weight, group, scheme.bits)
        if pdl and m <= quant_matmul.PDL_MAX_M:  # (the bodies: the ops take pdl only while capturing)
            if owned:
                quant_matmul.quant_matmul_owned_eager(x, *weight, group, True)
            else:
                quant_matmul_eager(x, *weight, group, scheme.bits, True)
    if layer.weight_packed.shape[0] < quant_matmul.TRITON_PREFILL_MIN_N_ANY and not owned:
        quant_matmul.dequantize(*weight, k_in, group, scheme.bits, dtype)


_SILU_AND_MUL_WARMED: set = set()


def warm_silu_and_mul(x: torch.Tensor) -> None:
    """On the first eager GPU call at each width, dtype and device, run silu_and_mul once on zeros at each of
    swiglu.warm_rows (every kernel any row count compiles, compiled now). vLLM's JIT monitor logged the
    forward compiling mid-serving in synth run 47 (a prompt batch's row count its warm-up had not run).
    Nothing while torch.compile traces or a CUDA graph captures (vLLM's first call, its profile run, is
    neither; under launch.capture, CPU tensors stand for a GPU's)."""
    if torch.compiler.is_compiling() or not (x.is_cuda or launch.capturing()):
        return
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    key = (x.shape[-1], x.dtype, x.device)
    if key in _SILU_AND_MUL_WARMED:
        return
    _SILU_AND_MUL_WARMED.add(key)
    # (its own kernels, launched in vLLM's decode graphs: compiled only where they will run)
    dependent = launch.launches_dependents(x.device) and pdl_enabled()
    for rows in swiglu.warm_rows(x.shape[-1] // 2):
        zeros = torch.zeros(rows, x.shape[-1], dtype=x.dtype, device=x.device)
        functional.silu_and_mul(zeros)
        if dependent and rows <= quant_matmul.PDL_MAX_M:  # (:func:`chained`)
            swiglu.silu_and_mul_dependent(zeros)


_NORMS_WARMED: set = set()


def warm_dependent_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fused_rounding: bool = False
) -> None:
    """On the first eager GPU call at each width, dtype and device, on Hopper, run the norms launched as
    programmatic dependents (rmsnorm.rmsnorm_dependent and add_rmsnorm_dependent: their own kernels, first
    launched while vLLM captures its decode graphs) once on zeros at each of rmsnorm.warm_rows up to
    quant_matmul.PDL_MAX_M (the rows they launch at, :func:`chained`), rounding as
    ``fused_rounding`` says (the compiled model's: :func:`rms_norm`). Nothing while torch.compile traces or
    a CUDA graph captures. (Every eager norm call passes here: the set first.)"""
    if torch.compiler.is_compiling():
        return
    key = (x.shape[-1], x.dtype, x.device, fused_rounding)
    if key in _NORMS_WARMED or not (x.is_cuda or launch.capturing()):
        return
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    _NORMS_WARMED.add(key)
    if not (launch.launches_dependents(x.device) and pdl_enabled()):
        return
    for rows in (r for r in rmsnorm.warm_rows(x.shape[-1]) if r <= quant_matmul.PDL_MAX_M):  # (chained)
        zeros = torch.zeros(rows, x.shape[-1], dtype=x.dtype, device=x.device)
        rmsnorm.rmsnorm_dependent(zeros, weight, eps, fused_rounding)
        rmsnorm.add_rmsnorm_dependent(zeros, zeros.clone(), weight, eps, fused_rounding)


# --- compiled: the chain's norms and SiluAndMul as opaque ops (compiled_chain) ----------------------------
# Traced through (triton_op), Inductor launches our kernels from its own wrapper, plainly. These run Python
# on each call: while a CUDA graph captures one (vLLM's decode graphs, and its piecewise graphs of prompts up
# to its capture size), on Hopper, the kernel launches as a programmatic dependent of the kernel before
# (unless SQUEEZESERVE_PDL=off: a compile cache of its own, vllm_plugin.compile_cache_root, but checked here
# too); otherwise as the traced op would (its launch plans). Serving only: no autograd.


@torch.library.custom_op("squeezeserve::rms_norm_chain", mutates_args=())
def rms_norm_chain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x, weight, eps, fused_rounding=True)``, opaque; a programmatic dependent in CUDA graphs."""
    warm_dependent_norm(x, weight, eps, True)
    if chained(x):
        return rmsnorm.rmsnorm_dependent(x, weight, eps, True)
    return rmsnorm.rmsnorm_eager(x, weight, eps, True)


@rms_norm_chain.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


@torch.library.custom_op("squeezeserve::fused_add_rms_norm_chain", mutates_args=())
def fused_add_rms_norm_chain(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm(x, residual, weight, eps, fused_rounding=True)``, opaque; a programmatic dependent in
    CUDA graphs."""
    warm_dependent_norm(x, weight, eps, True)
    if chained(x):
        return rmsnorm.add_rmsnorm_dependent(x, residual, weight, eps, True)
    return rmsnorm.add_rmsnorm_eager(x, residual, weight, eps, True)


@fused_add_rms_norm_chain.register_fake
def _(x, residual, weight, eps):
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    return y, torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("squeezeserve::silu_and_mul_chain", mutates_args=())
def silu_and_mul_chain(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(x)``, opaque; a programmatic dependent in CUDA graphs."""
    warm_silu_and_mul(x)
    if chained(x):
        return swiglu.silu_and_mul_dependent(x)
    return functional.silu_and_mul(x)


@silu_and_mul_chain.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# --- on vLLM's CPU backend: the packed CPU forms torch has matmuls for -------------------------------------


def _frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def prepare_cpu(layer: torch.nn.Module, scheme: WeightOnlyScheme) -> None:
    """Replace a loaded layer's packed checkpoint tensors by the form :func:`cpu_linear` runs on CPU.

    The reference path (``quant_matmul`` on CPU tensors) unpacks and dequantizes the whole weight on every
    call: on the bundled model vLLM's CPU backend decoded at 2.9 (int8) / 2.1 (int4) tok/s through it,
    27.5 / 46.2 through these forms, bf16 31.0 (one core of an AVX-512 EPYC, tests/benchmarks/VLLM_CPU.md).
    The weight is unpacked once, here, at load:

    - per-channel symmetric int8 and int4 in groups torch takes -> ``cpu_packed``'s layouts (the worker's
      static decoder runs the same ones): ``weight_int8`` int8 [N, K] + ``weight_int8_scale`` [N], or
      ``weight_int4`` uint8 [N, K / 2] + ``weight_int4_scale_zero`` [G, N, 2] in the model dtype. They take
      the packed words' memory (1 and 0.5 bytes a weight);
    - any other format (group-wise int8, other int4 groups) has no torch CPU op: dequantized once into
      ``weight_dense`` [N, K] in the model dtype. The trade-off: it holds what the unquantized layer holds
      (2 bytes a weight in bf16: 2x the int8 checkpoint's, 4x the int4's), where the reference held the
      packed words plus one layer's dense weight transiently per call; it runs at the dense model's speed
      instead of a dequantization per call. The speed is taken on the assumption that a host serving the
      checkpoint on vLLM's CPU backend can hold the unquantized model's weights.

    The checkpoint's ``weight_packed`` and ``weight_zero_point`` are dropped (nothing reads them on CPU);
    ``weight_scale`` stays (small)."""
    from squeezeserve.kernels import quant_layout
    from squeezeserve.kernels.cpu_packed import Int4Linear, Int8Linear, packed_linear

    n_out, k_in = layer.output_size_per_partition, layer.input_size_per_partition
    dtype = layer.weight_scale.dtype
    group = scheme.group_size_for(k_in)
    zero_packed = getattr(layer, "weight_zero_point", None)
    q = quant_layout.unpack_int32(layer.weight_packed.data, scheme.bits, (n_out, k_in))
    zero = None
    if zero_packed is not None:
        shape = (n_out, layer.weight_scale.shape[1])
        zero = quant_layout.unpack_int32(zero_packed.data, scheme.bits, shape, packed_dim=0)
    packed = packed_linear(q, layer.weight_scale.data, zero, scheme.bits, group)
    if isinstance(packed, Int8Linear):
        layer.weight_int8, layer.weight_int8_scale = _frozen(packed.q), _frozen(packed.scale.to(dtype))
        layer.cpu_form = "int8"
    elif isinstance(packed, Int4Linear):
        layer.weight_int4 = _frozen(packed.packed)
        layer.weight_int4_scale_zero = _frozen(packed.scale_zero.to(dtype))
        layer.int4_group, layer.cpu_form = group, "int4"
    else:
        dense = quant_layout.dequantize(
            layer.weight_packed.data, layer.weight_scale.data, zero_packed, (n_out, k_in), group, scheme.bits
        )
        layer.weight_dense = _frozen(dense.to(dtype))
        layer.cpu_form = "dense"
    del layer.weight_packed
    if zero_packed is not None:
        del layer.weight_zero_point


def cpu_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W.T (+ bias) from the form :func:`prepare_cpu` left on ``layer``. Plain aten ops on the
    layer's parameters: vLLM's torch.compile traces them into its graph for every batch size."""
    from squeezeserve.kernels.cpu_packed import int4_matmul, int8_matmul

    form = layer.cpu_form
    _note(f"cpu_{form}_matmul", x)
    if form == "int8":
        y = int8_matmul(x, layer.weight_int8, layer.weight_int8_scale)
    elif form == "int4":
        sz = layer.weight_int4_scale_zero.to(x.dtype)
        y = int4_matmul(x, layer.weight_int4, sz, layer.int4_group, layer.weight_int4.shape[0])
    else:
        y = torch.nn.functional.linear(x, layer.weight_dense.to(x.dtype))
    return y + bias if bias is not None else y


# --- vLLM registration ----------------------------------------------------------------------------------


def _register_silu_and_mul() -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul

    class SqueezeSiluAndMul(SiluAndMul):
        """silu(x[..., :d]) * x[..., d:] through squeezeserve::silu_and_mul."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.chain = compiled_chain()

        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            _note("silu_and_mul", x)
            if torch.compiler.is_compiling():
                return silu_and_mul_chain(x) if self.chain else functional.silu_and_mul(x)
            warm_silu_and_mul(x)
            if chained(x):
                return swiglu.silu_and_mul_dependent(x)
            return functional.silu_and_mul(x)

        def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_native(x)

    CustomOp.register_oot(name="SiluAndMul")(SqueezeSiluAndMul)
    _REGISTERED.add("silu_and_mul")


def _register_rms_norm() -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    class SqueezeRMSNorm(RMSNorm):
        """RMSNorm and the fused residual add through squeezeserve::rmsnorm / add_rmsnorm. Shapes ours do not
        cover (a weightless norm, a variance over part of the row) keep vLLM's implementation."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.chain = compiled_chain()

        def forward_native(
            self, x: torch.Tensor, residual: torch.Tensor | None = None
        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            if not self.has_weight or self.variance_size_override is not None:
                return super().forward_native(x, residual)
            compiled = torch.compiler.is_compiling()
            return rms_norm(x, residual, self.weight, self.variance_epsilon, compiled, self.chain)

        def forward_cuda(
            self, x: torch.Tensor, residual: torch.Tensor | None = None
        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            return self.forward_native(x, residual)

    CustomOp.register_oot(name="RMSNorm")(SqueezeRMSNorm)
    _REGISTERED.add("rms_norm")


_CUSTOM_OP_REGISTRARS = {"silu_and_mul": _register_silu_and_mul, "rms_norm": _register_rms_norm}
_OOT_NAMES = {"silu_and_mul": "SiluAndMul", "rms_norm": "RMSNorm"}


def register_custom_ops(ops: tuple[str, ...] = CUSTOM_OPS) -> list[str]:
    """Replace vLLM's ops named in ``ops`` (a subset of :data:`CUSTOM_OPS`) with ours; idempotent per
    process (vLLM may load plugins more than once). Returns the ops registered by this call."""
    from vllm.model_executor.custom_op import op_registry_oot

    unknown = set(ops) - set(CUSTOM_OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}: choose from {CUSTOM_OPS}")
    done = []
    for op in ops:
        if _OOT_NAMES[op] not in op_registry_oot:
            _CUSTOM_OP_REGISTRARS[op]()
            done.append(op)
    return done


def register_quantization() -> bool:
    """Register the ``squeezeserve`` quantization method; False when it already was (idempotent)."""
    from vllm.model_executor.layers.quantization import (
        _CUSTOMIZED_METHOD_TO_QUANT_CONFIG,
        register_quantization_config,
    )

    if QUANT_METHOD_NAME in _CUSTOMIZED_METHOD_TO_QUANT_CONFIG:
        return False
    register_quantization_config(QUANT_METHOD_NAME)(_quantization_config_class())
    return True


def _rebuild_quantization_config(scheme: Any, state: dict[str, Any]) -> Any:
    """Unpickles a ``SqueezeserveConfig`` by name: the class is built at run time (vLLM is imported only
    then), so pickle cannot find it as a module attribute. vLLM pickles the engine config, quantization
    config included, whenever it spawns its engine core: always on CPU, where it forces spawn."""
    config = _quantization_config_class()(scheme)
    config.__dict__.update(state)
    return config


@functools.cache
def _quantization_config_class() -> type:
    """The ``squeezeserve`` QuantizationConfig class; one per process, so the class vLLM registered and the
    class an unpickled config comes back as are the same."""
    from vllm.model_executor.layers.linear import (
        LinearBase,
        LinearMethodBase,
        UnquantizedLinearMethod,
        register_weight_loader_v2_supported_method,
    )
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.parameter import (
        BasevLLMParameter,
        ChannelQuantScaleParameter,
        GroupQuantScaleParameter,
        PackedvLLMParameter,
    )

    from squeezeserve.kernels.checkpoint_format import CodebookFormat, LowRankFormat, read_format
    from squeezeserve.kernels.vllm_lowrank_codebook import linear_method

    @register_weight_loader_v2_supported_method
    class SqueezeserveLinearMethod(LinearMethodBase):
        """Holds the checkpoint's tensors under their checkpoint names, in their checkpoint layout (vLLM's
        own parameter classes shard and stack them like its compressed-tensors method does)."""

        def __init__(self, scheme: WeightOnlyScheme, pdl: bool = False) -> None:
            self.scheme = scheme
            self.pdl = pdl  # follows_our_kernel(the layer's prefix)

        def create_weights(
            self,
            layer: torch.nn.Module,
            input_size_per_partition: int,
            output_partition_sizes: list[int],
            input_size: int,
            output_size: int,
            params_dtype: torch.dtype,
            **extra_weight_attrs: Any,
        ) -> None:
            scheme = self.scheme
            check_partition(scheme, output_partition_sizes)
            check_input_partition(scheme, input_size_per_partition, input_size)
            weight_loader = extra_weight_attrs["weight_loader"]
            n_out, k_in = sum(output_partition_sizes), input_size_per_partition
            per_word = 32 // scheme.bits
            groups = scheme.groups(k_in)
            packed = PackedvLLMParameter(
                data=torch.empty(n_out, math.ceil(k_in / per_word), dtype=torch.int32),
                input_dim=1, output_dim=0, packed_dim=1, packed_factor=per_word, weight_loader=weight_loader,
            )  # fmt: skip
            scale_data = torch.empty(n_out, groups, dtype=params_dtype)
            if scheme.group_size is None:
                scale = ChannelQuantScaleParameter(data=scale_data, output_dim=0, weight_loader=weight_loader)
            else:
                scale = GroupQuantScaleParameter(
                    data=scale_data, output_dim=0, input_dim=1, weight_loader=weight_loader
                )
            shape = BasevLLMParameter(data=torch.empty(2, dtype=torch.int64), weight_loader=weight_loader)
            layer.register_parameter("weight_packed", packed)
            layer.register_parameter("weight_scale", scale)
            layer.register_parameter("weight_shape", shape)
            if not scheme.symmetric:
                zero = PackedvLLMParameter(
                    data=torch.zeros(math.ceil(n_out / per_word), groups, dtype=torch.int32),
                    input_dim=1, output_dim=0, packed_dim=0, packed_factor=per_word,
                    weight_loader=weight_loader,
                )  # fmt: skip
                layer.register_parameter("weight_zero_point", zero)
            layer.input_size_per_partition = k_in
            layer.output_size_per_partition = n_out

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # Plain frozen tensors from here on: the vLLM parameter subclasses only matter for loading.
            for name in ("weight_packed", "weight_scale", "weight_zero_point"):
                param = getattr(layer, name, None)
                if param is not None:
                    setattr(layer, name, torch.nn.Parameter(param.data.contiguous(), requires_grad=False))
            if layer.weight_packed.device.type == "cpu":
                prepare_cpu(layer, self.scheme)
                return
            if owned_words(layer, self.scheme):
                own_weights(layer)
            warm_prefill(layer, self.scheme, layer.weight_scale.dtype, pdl=self.pdl)

        def apply(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            if hasattr(layer, "cpu_form"):
                return cpu_linear(layer, x, bias)
            zero = getattr(layer, "weight_zero_point", None)
            owned = getattr(layer, "owned_words", False)
            weights = (layer.weight_packed, layer.weight_scale, zero)
            return quant_linear(x, *weights, self.scheme, bias, owned, self.pdl)

    class SqueezeserveConfig(QuantizationConfig):
        """``--quantization squeezeserve`` over a compressed-tensors pack-quantized checkpoint."""

        def __init__(self, scheme: WeightOnlyScheme | LowRankFormat | CodebookFormat) -> None:
            super().__init__()
            self.scheme = scheme

        def __reduce__(self) -> tuple:
            return _rebuild_quantization_config, (self.scheme, self.__dict__)

        def get_name(self) -> str:
            return QUANT_METHOD_NAME

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.float16, torch.bfloat16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 80  # tl.dot on fp16/bf16 tensor cores

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []  # the scheme is config.json's quantization_config

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> SqueezeserveConfig:
            fmt = read_format({"quantization_config": config})
            return cls(fmt if isinstance(fmt, LowRankFormat | CodebookFormat) else parse_scheme(config))

        @classmethod
        def override_quantization_method(
            cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
        ) -> str | None:
            # Only on request: a compressed-tensors checkpoint stays vLLM's unless the user names us.
            if user_quant == QUANT_METHOD_NAME and hf_quant_cfg.get("quant_method") == "compressed-tensors":
                return QUANT_METHOD_NAME
            return None

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethodBase | None:
            if not isinstance(layer, LinearBase):
                return None
            if should_ignore_layer(
                prefix, ignore=self.scheme.ignore, fused_mapping=self.packed_modules_mapping
            ):
                return UnquantizedLinearMethod()
            if isinstance(self.scheme, LowRankFormat | CodebookFormat):
                method = linear_method(self.scheme, prefix, self.packed_modules_mapping)
                return UnquantizedLinearMethod() if method is None else method
            return SqueezeserveLinearMethod(self.scheme, follows_our_kernel(prefix))

    return SqueezeserveConfig
