"""nn.Modules over the squeezeserve ops: RMSNorm, the SwiGLU MLP, and the compressed Linears: QuantLinear
(weight-only integer), LowRankLinear (W = U V) and CodebookLinear (weight sharing)."""

from __future__ import annotations

import math

import torch
from torch import nn

from squeezeserve.kernels import codebook_layout, functional, quant_layout


class RMSNorm(nn.Module):
    """Drop-in for Hugging Face's LlamaRMSNorm (same ``weight`` parameter and ``variance_epsilon``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.rmsnorm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class SwiGLUMLP(nn.Module):
    """Llama's MLP, ``down(silu(gate(x)) * up(x))``, with the activation as one fused op.

    Holds the given projection modules (nn.Linear or QuantLinear) under Llama's names, so a checkpoint's
    keys do not change.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(functional.swiglu(self.gate_proj(x), self.up_proj(x)))


class QuantLinear(nn.Module):
    """Weight-only quantized Linear holding compressed-tensors' pack-quantized buffers.

    Buffers (names as in the checkpoint, see ``kernels/quant_layout.py``): ``weight_packed`` int32
    [out, ceil(in / (32 / bits))], ``weight_scale`` [out, ceil(in / group_size)], ``weight_zero_point`` int32
    [ceil(out / (32 / bits)), ceil(in / group_size)] (asymmetric only), ``weight_shape`` int64 [2]; and
    ``bias`` [out] when ``bias=True``. ``forward(x)`` = quant_matmul(x, ...) (+ bias).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 4,
        group_size: int = 128,
        symmetric: bool = True,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        per_word = quant_layout.pack_factor(bits)
        if group_size < 1:
            raise ValueError(f"group_size must be positive, got {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        n_groups = math.ceil(in_features / group_size)
        kw = {"device": device}
        self.register_buffer(
            "weight_packed",
            torch.zeros(out_features, math.ceil(in_features / per_word), dtype=torch.int32, **kw),
        )
        self.register_buffer("weight_scale", torch.ones(out_features, n_groups, dtype=dtype, **kw))
        zero = (
            None
            if symmetric
            else torch.zeros(math.ceil(out_features / per_word), n_groups, dtype=torch.int32, **kw)
        )
        self.register_buffer("weight_zero_point", zero)
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **kw)) if bias else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int = 4, group_size: int = 128, symmetric: bool = True
    ) -> QuantLinear:
        """Round-to-nearest quantize an nn.Linear (``quant_layout.pack_weight``)."""
        weight = linear.weight.detach()
        module = cls(
            linear.in_features, linear.out_features, bits, group_size, symmetric,
            bias=linear.bias is not None, dtype=weight.dtype, device=weight.device,
        )  # fmt: skip
        module.load_packed(quant_layout.pack_weight(weight, bits, group_size, symmetric))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def load_packed(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy compressed-tensors' tensors (``weight_packed``, ``weight_scale``, ...) into the buffers."""
        for name in ("weight_packed", "weight_scale", "weight_zero_point"):
            buffer = getattr(self, name)
            if (buffer is None) != (name not in tensors):
                raise ValueError(
                    f"QuantLinear(symmetric={self.symmetric}) and the tensors disagree on {name}"
                )
            if buffer is not None:
                if tensors[name].shape != buffer.shape:
                    raise ValueError(
                        f"{name}: expected shape {tuple(buffer.shape)}, got {tuple(tensors[name].shape)}"
                    )
                buffer.copy_(tensors[name])

    def dequantized_weight(self) -> torch.Tensor:
        return quant_layout.dequantize(
            self.weight_packed, self.weight_scale, self.weight_zero_point,
            (self.out_features, self.in_features), self.group_size, self.bits,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = functional.quant_matmul(
            x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.group_size, self.bits
        )
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, symmetric={self.symmetric}, bias={self.bias is not None}"
        )


class LowRankLinear(nn.Module):
    """``y = U (V x)`` (+ bias): a Linear whose weight W [out, in] is stored as ``weight_u`` [out, rank] and
    ``weight_v`` [rank, in] (checkpoint names; ``kernels/checkpoint_format.py``). Two GEMMs of
    ``rank * (in + out)`` multiply-adds a token instead of ``in * out``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not 0 < rank <= min(in_features, out_features):
            raise ValueError(f"rank must be in 1..{min(in_features, out_features)}, got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        kw = {"dtype": dtype, "device": device}
        self.weight_u = nn.Parameter(torch.zeros(out_features, rank, **kw), requires_grad=False)
        self.weight_v = nn.Parameter(torch.zeros(rank, in_features, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nn.functional.linear(x, self.weight_v), self.weight_u, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class CodebookLinear(nn.Module):
    """Weight-shared Linear holding the codebook layout's buffers (``kernels/codebook_layout.py``):
    ``weight_indices`` int32 [out, ceil(in / (32 // bits))], ``weight_codebook`` [out, groups * 2**bits],
    ``weight_shape``; ``forward(x)`` = codebook_matmul(x, ...) (+ bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 4,
        group_size: int | None = None,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        per_word = codebook_layout.indices_per_word(bits)
        groups = codebook_layout.groups_for(in_features, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        kw = {"device": device}
        words = math.ceil(in_features / per_word)
        self.register_buffer("weight_indices", torch.zeros(out_features, words, dtype=torch.int32, **kw))
        codebook = torch.zeros(out_features, groups << bits, dtype=dtype, **kw)
        self.register_buffer("weight_codebook", codebook)
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **kw)) if bias else None

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's ``weight_indices`` and ``weight_codebook`` into the buffers."""
        for name in ("weight_indices", "weight_codebook"):
            buffer = getattr(self, name)
            if name not in tensors or tensors[name].shape != buffer.shape:
                got = tuple(tensors[name].shape) if name in tensors else "nothing"
                raise ValueError(f"{name}: expected shape {tuple(buffer.shape)}, got {got}")
            buffer.copy_(tensors[name])

    def dequantized_weight(self) -> torch.Tensor:
        return codebook_layout.dequantize(
            self.weight_indices, self.weight_codebook, self.in_features, self.group_size, self.bits
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = functional.codebook_matmul(
            x, self.weight_indices, self.weight_codebook, self.group_size or 0, self.bits
        )
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )
