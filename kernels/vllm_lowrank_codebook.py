"""Low-rank and weight-shared Linears inside vLLM 0.26: linear methods of our ``squeezeserve`` quantization
method (``vllm_ops.register_quantization``) for checkpoints whose ``quantization_config`` says
``quant_method: squeezeserve`` (``checkpoint_format.read_format``; vLLM hands them to our method by that
name, no ``--quantization`` flag needed).

vLLM merges Linears that read one input: ``qkv_proj`` holds q, k and v (shard ids "q", "k", "v"),
``gate_up_proj`` gate and up (0, 1). The checkpoint keeps them apart (``...q_proj.weight_u``); vLLM's model
loader renames each tensor to the merged layer and calls the parameter's ``weight_loader(param, tensor,
shard_id)``. Our parameters carry loaders (:func:`load_shard`) that place a shard where :class:`Layout` says.

- **Low-rank**: each shard is factored (``weight_u`` [n, r], ``weight_v`` [r, K]) or, where the compressor
  kept it dense (a rank that would not pay), a plain ``weight`` [n, K]. The merged layer stacks the shards'
  V along the rank dim (one GEMM ``t = x V^T`` for every factored shard), keeps each shard's U in rows of
  one [sum n, max r] parameter, and dense shards in one ``weight``; :func:`lowrank_linear` computes the
  first GEMM once, then each shard's ``t_i U_i^T`` (or ``x W^T``), in output order. A single factored layer
  is exactly two GEMMs. Not fused into one kernel: at the ranks that pay (r < N K / (N + K)) the two GEMMs
  read fewer bytes than the dense one, and fusing them would need the rank-r intermediate in shared memory.
- **Codebook**: per-output-row tensors (``weight_indices``, ``weight_codebook``) stack along the output dim
  exactly like packed integer weights; :func:`codebook_linear` runs ``squeezeserve::codebook_matmul``.

Tensor parallelism: column-parallel layers (qkv, gate_up) give each rank a run of every shard's output rows
(U rows, codebook rows; V and the input are whole); row-parallel layers (o_proj, down_proj) split the input
dim: each rank keeps its columns of V (U whole; vLLM all-reduces the partial outputs, and U (V_r x_r) sums
to U V x) or its index words and, for group codebooks, its groups (a per-channel codebook is replicated).

Everything but the two vLLM classes is plain torch, tested on CPU without vLLM
(tests/kernels/test_vllm_lowrank_codebook.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from squeezeserve.kernels.checkpoint_format import CodebookFormat, LowRankFormat
from squeezeserve.kernels.ops import codebook_matmul as _codebook_ops  # noqa: F401 (registers codebook_linear's op)

# vLLM's shard ids of a merged layer, in output order.
SHARD_IDS = {"q": 0, "k": 1, "v": 2}


def shard_index(shard_id: int | str | None) -> int:
    if shard_id is None:
        return 0
    if isinstance(shard_id, str):
        if shard_id not in SHARD_IDS:
            raise ValueError(f"unknown merged-layer shard id {shard_id!r}: expected q, k, v or an index")
        return SHARD_IDS[shard_id]
    return int(shard_id)


@dataclass(frozen=True)
class Layout:
    """Where a rank's part of each shard of one (merged) layer lives.

    ``sizes``: each shard's output rows on this rank (vLLM's ``output_partition_sizes``); ``ranks``: each
    shard's rank, None for a dense shard (low-rank only; codebook layers: all None);
    ``k_part`` / ``k_full``: the input width on this rank / in the checkpoint; ``tp_rank``, ``tp_size``."""

    sizes: tuple[int, ...]
    ranks: tuple[int | None, ...]
    k_part: int
    k_full: int
    tp_rank: int = 0
    tp_size: int = 1

    def rows_of(self, shard: int, kinds: str = "all") -> tuple[int, int]:
        """(start, size) of ``shard`` among the rows of the shards of its kind (``factored``, ``dense`` or
        ``all``) on this rank."""
        members = [i for i in range(len(self.sizes)) if kinds == "all" or self._kind(i) == kinds]
        start = sum(self.sizes[i] for i in members[: members.index(shard)])
        return start, self.sizes[shard]

    def rank_offset(self, shard: int) -> int:
        return sum(r for i, r in enumerate(self.ranks[:shard]) if r is not None)

    def _kind(self, shard: int) -> str:
        return "dense" if self.ranks[shard] is None else "factored"

    def checkpoint_rows(self, shard: int, full_rows: int) -> slice:
        """This rank's rows of the shard's checkpoint tensor (``full_rows`` rows). KV heads fewer than ranks
        are replicated: ``replicas`` consecutive ranks load the same rows (vLLM's QKVParallelLinear)."""
        size = self.sizes[shard]
        replicas = max(1, size * self.tp_size // full_rows)
        start = (self.tp_rank // replicas) * size
        return slice(start, start + size)

    def checkpoint_columns(self) -> slice:
        """This rank's input columns (all of them unless the layer is row-parallel)."""
        if self.k_part == self.k_full:
            return slice(0, self.k_full)
        return slice(self.tp_rank * self.k_part, (self.tp_rank + 1) * self.k_part)


def merged_shards(prefix: str, mapping: dict[str, list[str]]) -> list[str]:
    """The checkpoint Linears behind vLLM layer ``prefix`` (``...qkv_proj`` -> q_proj, k_proj, v_proj)."""
    parent, _, leaf = prefix.rpartition(".")
    names = mapping.get(leaf, [leaf])
    return [f"{parent}.{name}" if parent else name for name in names]


def lowrank_layout(
    fmt: LowRankFormat,
    shards: list[str],
    sizes: list[int],
    k_part: int,
    k_full: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Layout:
    """The layout of the layer merging checkpoint Linears ``shards``, their ranks from ``fmt``."""
    if len(shards) != len(sizes):
        raise ValueError(f"{len(shards)} checkpoint Linears {shards} for {len(sizes)} output partitions")
    ranks = tuple(fmt.ranks.get(name) for name in shards)
    for name, rank in zip(shards, ranks, strict=True):
        if rank is not None and rank > k_full:
            raise ValueError(f"{name}: rank {rank} exceeds its input width {k_full}")
    return Layout(tuple(sizes), ranks, k_part, k_full, tp_rank, tp_size)


def lowrank_shapes(layout: Layout) -> dict[str, tuple[int, int]]:
    """Parameter shapes on this rank: ``weight_u`` [factored rows, max rank], ``weight_v`` [sum of ranks,
    K part], ``weight`` [dense rows, K part]; a kind absent from the layer has no parameter."""
    factored = [i for i, r in enumerate(layout.ranks) if r is not None]
    dense = [i for i, r in enumerate(layout.ranks) if r is None]
    shapes = {}
    if factored:
        max_rank = max(layout.ranks[i] for i in factored)  # type: ignore[type-var]
        shapes["weight_u"] = (sum(layout.sizes[i] for i in factored), max_rank)
        shapes["weight_v"] = (sum(layout.ranks[i] for i in factored), layout.k_part)  # type: ignore[misc]
    if dense:
        shapes["weight"] = (sum(layout.sizes[i] for i in dense), layout.k_part)
    return shapes


def load_lowrank(param: torch.Tensor, name: str, loaded: torch.Tensor, shard_id: Any, layout: Layout) -> None:
    """Copy this rank's part of shard ``shard_id``'s checkpoint tensor ``name`` (weight_u, weight_v or
    weight) into the merged parameter."""
    shard = shard_index(shard_id)
    rank = layout.ranks[shard]
    if (name == "weight") != (rank is None):
        kind = "dense" if rank is None else f"factored (rank {rank})"
        raise ValueError(
            f"shard {shard_id!r} is {kind} in quantization_config but the checkpoint gives {name}"
        )
    columns = layout.checkpoint_columns()
    if name == "weight_v":
        start = layout.rank_offset(shard)
        param[start : start + rank].copy_(loaded[:, columns])
        return
    start, size = layout.rows_of(shard, "dense" if name == "weight" else "factored")
    rows = loaded[layout.checkpoint_rows(shard, loaded.shape[0])]
    if name == "weight":
        param[start : start + size].copy_(rows[:, columns])
    else:
        param[start : start + size, :rank].copy_(rows)


def lowrank_linear(
    x: torch.Tensor,
    layout: Layout,
    weight_u: torch.Tensor | None,
    weight_v: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = [U_i (V_i x) or W_i x for each shard i] (+ bias), shards in output order."""
    t = None if weight_v is None else torch.nn.functional.linear(x, weight_v)
    dense = None if weight is None else torch.nn.functional.linear(x, weight)
    if len(layout.ranks) == 1:
        y = dense if t is None else torch.nn.functional.linear(t, weight_u)
    else:
        parts = []
        for shard, rank in enumerate(layout.ranks):
            if rank is None:
                start, size = layout.rows_of(shard, "dense")
                parts.append(dense[..., start : start + size])
            else:
                start, size = layout.rows_of(shard, "factored")
                offset = layout.rank_offset(shard)
                u = weight_u[start : start + size, :rank]
                parts.append(torch.nn.functional.linear(t[..., offset : offset + rank], u))
        y = torch.cat(parts, dim=-1)
    return y + bias if bias is not None else y


# --- codebooks ------------------------------------------------------------------------------------------


def codebook_shapes(fmt: CodebookFormat, layout: Layout) -> dict[str, tuple[int, ...]]:
    """``weight_indices`` [rows, words of K part], ``weight_codebook`` [rows, groups of K part * 2^bits]."""
    from squeezeserve.kernels import codebook_layout

    per_word = codebook_layout.indices_per_word(fmt.bits)
    check_codebook_partition(fmt, layout.k_part, layout.k_full)
    groups = codebook_layout.groups_for(layout.k_part, fmt.group_size)
    rows = sum(layout.sizes)
    return {
        "weight_indices": (rows, math.ceil(layout.k_part / per_word)),
        "weight_codebook": (rows, groups << fmt.bits),
        "weight_shape": (2,),
    }


def check_codebook_partition(fmt: CodebookFormat, k_part: int, k_full: int) -> None:
    """A row-parallel rank must hold whole index words and whole codebook groups."""
    if k_part == k_full:
        return
    per_word = 32 // fmt.bits
    if k_part % per_word or (fmt.group_size and k_part % fmt.group_size):
        raise ValueError(
            f"tensor parallelism splits an input dim of {k_full} into {k_part} a rank: {fmt.bits}-bit "
            f"indices pack {per_word} a word"
            + (f" and codebooks cover {fmt.group_size} columns" if fmt.group_size else "")
            + "; choose a tensor-parallel size that splits them evenly"
        )


def load_codebook(
    param: torch.Tensor, name: str, loaded: torch.Tensor, shard_id: Any, fmt: CodebookFormat, layout: Layout
) -> None:
    """Copy this rank's part of shard ``shard_id``'s ``weight_indices`` / ``weight_codebook`` rows into the
    merged parameter (``weight_shape`` is informational and ignored)."""
    if name == "weight_shape":
        return
    shard = shard_index(shard_id)
    start, size = layout.rows_of(shard)
    rows = loaded[layout.checkpoint_rows(shard, loaded.shape[0])]
    if layout.k_part != layout.k_full:
        if name == "weight_indices":
            words = layout.k_part // (32 // fmt.bits)
            rows = rows[:, layout.tp_rank * words : (layout.tp_rank + 1) * words]
        elif fmt.group_size:  # per-channel codebooks are whole on every rank
            width = (layout.k_part // fmt.group_size) << fmt.bits
            rows = rows[:, layout.tp_rank * width : (layout.tp_rank + 1) * width]
    param[start : start + size].copy_(rows)


def codebook_linear(
    x: torch.Tensor,
    weight_indices: torch.Tensor,
    weight_codebook: torch.Tensor,
    fmt: CodebookFormat,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T (+ bias), W looked up by ``squeezeserve::codebook_matmul`` (opaque to torch.compile, so
    the tile choice by row count runs on every call; see ``quant_matmul_opaque``). Traced by vLLM's
    torch.compile: nothing here may import (the op is registered with this module's import)."""
    y = torch.ops.squeezeserve.codebook_matmul_opaque(
        x, weight_indices, weight_codebook, fmt.group_size or 0, fmt.bits
    )
    return y + bias if bias is not None else y


# --- vLLM linear methods -----------------------------------------------------------------------------


def _rank_info(layer: torch.nn.Module) -> tuple[int, int]:
    tp_rank = getattr(layer, "tp_rank", None)
    tp_size = getattr(layer, "tp_size", None)
    if tp_rank is None or tp_size is None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    return tp_rank, tp_size


def _register(layer: torch.nn.Module, shapes: dict, dtypes: dict, loader: Any) -> None:
    for name, shape in shapes.items():
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtypes[name]), requires_grad=False)
        param.weight_loader = functools.partial(_load_named, name=name, loader=loader)
        layer.register_parameter(name, param)


def _load_named(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None, *, name: str, loader: Any
) -> None:
    """vLLM's ``weight_loader(param, tensor[, shard_id])`` -> ``loader(param, name, tensor, shard_id)``."""
    loader(param.data, name, loaded, shard_id)


@functools.cache
def lowrank_method_class() -> type:
    from vllm.model_executor.layers.linear import LinearMethodBase

    class SqueezeserveLowRankMethod(LinearMethodBase):
        """U (V x) per shard: :func:`lowrank_linear` over :func:`load_lowrank`'s parameters."""

        def __init__(self, fmt: LowRankFormat, shards: list[str]) -> None:
            self.fmt, self.shards = fmt, shards

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs) -> None:  # fmt: skip
            tp_rank, tp_size = _rank_info(layer)
            sizes = list(output_partition_sizes)
            layout = lowrank_layout(
                self.fmt, self.shards, sizes, input_size_per_partition, input_size, tp_rank, tp_size
            )
            layer.squeeze_layout = layout
            shapes = lowrank_shapes(layout)
            loader = functools.partial(load_lowrank, layout=layout)
            _register(layer, shapes, dict.fromkeys(shapes, params_dtype), loader)
            layer.input_size_per_partition = input_size_per_partition
            layer.output_size_per_partition = sum(sizes)

        def apply(self, layer, x, bias=None):
            return lowrank_linear(
                x, layer.squeeze_layout, getattr(layer, "weight_u", None), getattr(layer, "weight_v", None),
                getattr(layer, "weight", None), bias,
            )  # fmt: skip

    return SqueezeserveLowRankMethod


@functools.cache
def codebook_method_class() -> type:
    from vllm.model_executor.layers.linear import LinearMethodBase

    class SqueezeserveCodebookMethod(LinearMethodBase):
        """x @ W.T with W looked up in codebooks by ``squeezeserve::codebook_matmul``."""

        def __init__(self, fmt: CodebookFormat) -> None:
            self.fmt = fmt

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs) -> None:  # fmt: skip
            tp_rank, tp_size = _rank_info(layer)
            sizes = list(output_partition_sizes)
            layout = Layout(
                tuple(sizes), (None,) * len(sizes), input_size_per_partition, input_size, tp_rank, tp_size
            )
            shapes = codebook_shapes(self.fmt, layout)
            dtypes = {
                "weight_indices": torch.int32,
                "weight_codebook": torch.float16,
                "weight_shape": torch.int64,
            }
            loader = functools.partial(load_codebook, fmt=self.fmt, layout=layout)
            _register(layer, shapes, dtypes, loader)
            layer.input_size_per_partition = input_size_per_partition
            layer.output_size_per_partition = sum(sizes)

        def apply(self, layer, x, bias=None):
            return codebook_linear(x, layer.weight_indices, layer.weight_codebook, self.fmt, bias)

    return SqueezeserveCodebookMethod


def linear_method(fmt: LowRankFormat | CodebookFormat, prefix: str, mapping: dict[str, list[str]]) -> Any:
    """Our linear method for vLLM layer ``prefix``, or None where every shard is dense (vLLM's own
    unquantized method then serves it)."""
    if isinstance(fmt, CodebookFormat):
        return codebook_method_class()(fmt)
    shards = merged_shards(prefix, mapping)
    if all(name not in fmt.ranks for name in shards):
        return None
    return lowrank_method_class()(fmt, shards)
