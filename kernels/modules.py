"""nn.Modules over the squeezeserve ops: RMSNorm, the SwiGLU MLP, and the weight-only QuantLinear."""

from __future__ import annotations

import math

import torch
from torch import nn

from squeezeserve.kernels import functional, quant_layout


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
