"""How the embedded engine runs the model: two decoders behind one small interface.

The engine (``engine.py``) owns the sequences and sampling; a decoder owns the weights and the KV cache of
the batch, whose rows are the engine's sequences in order:

- ``prefill(prompt, all_logits)`` runs one prompt and holds its cache aside; it returns its logits
  ([len(prompt), vocab] or the last row, [1, vocab]);
- ``join(n)`` adds that prompt to the batch as ``n`` rows (``n`` choices share the prompt's cache);
- ``step(tokens, lengths)`` feeds one token per row (row r has ``lengths[r]`` tokens cached) and returns
  [rows, vocab] logits;
- ``retire(keep)`` keeps only the rows at those indices, in that order; ``reset()`` drops everything;
- ``warm_up()`` compiles what the decoder compiles before the first request (the engine thread calls it).

:class:`TransformersDecoder` calls the Hugging Face model with a left-padded ``DynamicCache`` (any
architecture). :class:`StaticDecoder` is our own Llama decoder for the CPU: fused q/k/v and gate/up
projections, a preallocated KV cache (one slot per row, right-padded: each row's tokens start at slot
position 0, so no copies when rows join or grow), grouped-query attention without repeating K/V, RoPE
from a precomputed table, norms and SwiGLU through our ops. A decode step is a few dozen tensor ops per
layer with no per-step allocation of the cache and none of transformers' generic plumbing.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from squeezeserve.kernels import functional, reference
from squeezeserve.kernels.cpu_packed import Int4Linear, Int8Linear, packed_linear

DecoderChoice = Literal["auto", "static", "transformers"]
DECODER_CHOICES: tuple[str, ...] = ("auto", "static", "transformers")
CompileChoice = Literal["auto", "on", "off"]
COMPILE_CHOICES: tuple[str, ...] = ("auto", "on", "off")
CACHE_BLOCK = 256  # the static cache grows its length in steps of this many positions


class TransformersDecoder:
    """The Hugging Face model with a left-padded DynamicCache (what the engine did before StaticDecoder)."""

    name = "transformers"

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = model.device
        self._cache: DynamicCache | None = None
        self._rows = 0
        self._pending: DynamicCache | None = None

    def prefill(self, prompt: list[int], all_logits: bool) -> torch.Tensor:
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=0 if all_logits else 1
        )
        self._pending = cache
        return out.logits[0]

    def join(self, n: int) -> None:
        cache, self._pending = self._pending, None
        if n > 1:
            cache.batch_repeat_interleave(n)
        if self._cache is None or not self._rows:
            self._cache, self._rows = cache, n
            return
        batch_len, new_len = self._cache.get_seq_length(), cache.get_seq_length()
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat(_left_pad([mine.keys, theirs.keys], [batch_len, new_len]), dim=0)
            mine.values = torch.cat(_left_pad([mine.values, theirs.values], [batch_len, new_len]), dim=0)
        self._rows += n

    def step(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        cache_len = self._cache.get_seq_length()
        input_ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)
        lens = torch.tensor(lengths, dtype=torch.long, device=self.device)
        mask = None
        if any(n != cache_len for n in lengths):
            # row r's real tokens are its last lengths[r] cache slots, plus the token being fed now
            mask = (
                torch.arange(cache_len + 1, device=self.device)[None, :] >= (cache_len - lens)[:, None]
            ).long()
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=lens[:, None], past_key_values=self._cache,
            use_cache=True,
        )  # fmt: skip
        return out.logits[:, -1]

    def retire(self, keep: list[int], lengths: list[int]) -> None:
        if not keep:
            self.reset()
            return
        index = torch.tensor(keep, dtype=torch.long)
        longest = max(lengths)
        for layer in self._cache.layers:
            trim = layer.keys.shape[-2] - longest
            layer.keys = layer.keys[index, :, trim:]
            layer.values = layer.values[index, :, trim:]
        self._rows = len(keep)

    def reset(self) -> None:
        self._cache, self._rows, self._pending = None, 0, None

    def warm_up(self) -> float:
        """Nothing to compile; the interface's no-op."""
        return 0.0


def _left_pad(tensors: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """Pad [B, H, T, D] tensors on the left of T to the longest length (the mask hides the zeros)."""
    longest = max(lengths)
    out = []
    for t, n in zip(tensors, lengths, strict=True):
        if n < longest:
            pad = t.new_zeros(t.shape[0], t.shape[1], longest - n, t.shape[3])
            t = torch.cat([pad, t], dim=2)
        out.append(t)
    return out


# -- the static Llama decoder ---------------------------------------------------------------------------

Linear = Callable[[torch.Tensor], torch.Tensor]


def _weight(module: nn.Module) -> torch.Tensor:
    """A projection's dense weight [out, in]: nn.Linear's, or a QuantLinear's dequantized."""
    if isinstance(module, nn.Linear):
        return module.weight.detach()
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight().to(module.weight_scale.dtype)
    raise TypeError(f"the static decoder cannot run a {type(module).__name__} projection")


def _bias(module: nn.Module, out_features: int, like: torch.Tensor) -> torch.Tensor:
    bias = getattr(module, "bias", None)
    return bias.detach() if bias is not None else like.new_zeros(out_features)


def onednn_bf16() -> bool:
    """oneDNN runs bfloat16 matmuls natively here (AVX-512 BF16 / AMX, or its AVX-512 emulation)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


PACKED_MAX_ROWS = 64  # decode batches; the reorder is tuned for skinny products
FP16_MAX = 65504.0


def fbgemm_fp16() -> bool:
    """torch has FBGEMM's fp16-weight linear (x86 builds): fp16 weights converted to fp32 in registers,
    fp32 activations and accumulation, AVX2 kernels."""
    return "fbgemm" in torch.backends.quantized.supported_engines


# FBGEMM's packed fp16 weights, for the compiled step: dynamo traces no ScriptObject argument, so the op
# below takes a handle into this table (a constant in the graph). An entry goes with its DenseLinear, so a
# process that loads models one after another (the test suite) does not keep every model's fp16 copy.
_FP16_WEIGHTS: dict[int, Any] = {}
_FP16_HANDLES = itertools.count()


@torch.library.custom_op("squeezeserve::fbgemm_fp16_linear", mutates_args=())
def fp16_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``quantized.linear_dynamic_fp16`` on the packed weight ``_FP16_WEIGHTS[handle]``; x fp32 [..., in]."""
    return torch.ops.quantized.linear_dynamic_fp16(x, _FP16_WEIGHTS[handle])


@fp16_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("squeezeserve::onednn_bf16_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a weight reordered by ``mkldnn._reorder_linear_weight``; opaque to inductor,
    whose own lowering of ``mkldnn._linear_pointwise`` takes only weights frozen into the graph as
    constants (it fails on the reordered weight passed in, as the compiled step passes it)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


class DenseLinear:
    """y = x @ W.T (+ b), W dense in the model's dtype.

    Three ways to run it, chosen once from the weight and the CPU:

    - bfloat16 weights where oneDNN has native bf16: reordered once into oneDNN's blocked layout; a decode
      step's skinny matmuls then run 1.5-3x faster than ``F.linear`` on the plain weight (measured on a
      Xeon with AMX: 3072x576 at M=1, 336 -> 221 us; the 49152x576 lm_head, 8.5 -> 2.9 ms), with the same
      result at decode shapes (fp32 accumulation either way);
    - bfloat16 or float16 weights on CPUs without it (AVX2: bf16 products are emulated): the weight kept
      as fp16 in FBGEMM's packed layout and run by ``quantized.linear_dynamic_fp16`` on the fp32-cast
      input, the result cast back. Measured on a 2-core AMD EPYC (AVX2), weights read from DRAM, against
      bf16 ``F.linear``: 3072x576 at 1 / 8 / 256 rows 378 -> 325 us, 1869 -> 517 us, 61.7 -> 6.4 ms; the
      lm_head at 1 and 8 rows 5.3 -> 3.1 ms, 23.8 -> 7.4 ms. fp16 holds every bf16 weight of magnitude
      6.1e-5 to 65504 exactly; smaller ones round to fp16's subnormal step (6e-8), far under bf16's own
      step at ordinary weights (1.2e-4 at 0.02). Products accumulate in fp32 as in ``F.linear``: one
      projection agrees with it within a bf16 ulp (tested); over the bundled model's 30 layers the
      logits drift apart by rounding (48 steps: at most 0.89 at logits up to 29.8, greedy tokens equal);
    - otherwise (float32, or a weight beyond fp16's range) ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.packed = None
        self.fp16 = None
        self.fp16_handle = -1
        if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
            return
        if weight.dtype == torch.bfloat16 and onednn_bf16():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        elif fbgemm_fp16() and weight.abs().max().item() <= FP16_MAX:
            fp32_bias = None if bias is None else bias.float()
            self.fp16 = torch.ops.quantized.linear_prepack_fp16(self.weight.float(), fp32_bias)
            self.fp16_handle = next(_FP16_HANDLES)
            _FP16_WEIGHTS[self.fp16_handle] = self.fp16

    def __del__(self) -> None:
        if _FP16_WEIGHTS is not None:  # None while the interpreter tears the module down
            _FP16_WEIGHTS.pop(getattr(self, "fp16_handle", -1), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp16 is not None:
            if torch.compiler.is_compiling():  # dynamo cannot trace the packed weight: an opaque op by handle
                return fp16_linear(x.float(), self.fp16_handle, self.weight.shape[0]).to(x.dtype)
            return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.fp16).to(x.dtype)
        if self.packed is not None and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]:
            if torch.compiler.is_compiling():
                return onednn_linear(x, self.packed, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)  # prefill: the plain weight serves wide matmuls well


def _packed(modules: list[nn.Module]) -> Int8Linear | Int4Linear | None:
    """Quantized projections fused into one packed CPU linear, or None when torch has no op for them
    (mixed formats, group-wise int8, int4 groups torch does not take, K not a multiple of the group, N not a
    multiple of 16: ``cpu_packed.packed_linear``)."""
    from squeezeserve.kernels import quant_layout
    from squeezeserve.kernels.modules import QuantLinear

    if not all(isinstance(m, QuantLinear) for m in modules):
        return None
    first = modules[0]
    layout = (first.bits, first.group_size, first.symmetric, first.in_features)
    if any((m.bits, m.group_size, m.symmetric, m.in_features) != layout for m in modules):
        return None
    k = first.in_features
    qs, scales, zeros = [], [], []
    for m in modules:
        qs.append(quant_layout.unpack_int32(m.weight_packed, m.bits, (m.out_features, k)))
        scales.append(m.weight_scale)
        if m.weight_zero_point is not None:
            groups = m.weight_scale.shape[1]
            zeros.append(quant_layout.unpack_int32(m.weight_zero_point, m.bits, (m.out_features, groups), 0))
    q, scale = torch.cat(qs), torch.cat(scales)
    zero = torch.cat(zeros) if zeros else None
    biases = [getattr(m, "bias", None) for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([_bias(m, m.out_features, scale) for m in modules])
    return packed_linear(q, scale, zero, first.bits, first.group_size, bias)


def fuse_linears(modules: list[nn.Module]) -> Linear:
    """One projection computing ``modules`` side by side: outputs concatenated in order. Quantized ones stay
    packed where torch has a CPU op for their format, else they are dequantized into a dense weight."""
    packed = _packed(modules)
    if packed is not None:
        return packed
    weights = [_weight(m) for m in modules]
    weight = torch.cat(weights, dim=0)
    has_bias = any(getattr(m, "bias", None) is not None for m in modules)
    bias = (
        torch.cat([_bias(m, w.shape[0], w) for m, w in zip(modules, weights, strict=True)])
        if has_bias
        else None
    )
    return DenseLinear(weight, bias)


def static_unsupported(model: Any) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (None when it can)."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        return f"model_type is {getattr(config, 'model_type', None)!r}, not 'llama'"
    if model.device.type != "cpu":
        return f"the model is on {model.device}, not the CPU"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp != 1"
    return None


class _Layer:
    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = fuse_linears([attn.o_proj])
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.down = fuse_linears([mlp.down_proj])
        self.ln1 = layer.input_layernorm.weight.detach()
        self.ln2 = layer.post_attention_layernorm.weight.detach()


class StaticDecoder:
    """A Llama decoder over a preallocated KV cache, for the embedded engine on CPU (see the module doc)."""

    name = "static"

    def __init__(self, model: Any, max_batch_size: int = 16, compile: bool = False) -> None:
        reason = static_unsupported(model)
        if reason:
            raise ValueError(f"the static decoder does not support this model: {reason}")
        config = model.config
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.eps = float(config.rms_norm_eps)
        self.scale = getattr(inner.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        self.max_positions = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.lm_head = fuse_linears([model.lm_head])
        # RoPE from the model's own rotary embedding (any non-dynamic rope type): [positions, head_dim]
        with torch.inference_mode():
            positions = torch.arange(self.max_positions)[None]
            dummy = torch.zeros(1, dtype=self.dtype)
            cos, sin = inner.rotary_emb(dummy, positions)
        cos, sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        half = self.head_dim // 2
        # rotate_half's sign folded into the table (exact): see _rope
        self.cos, self.signed_sin = cos.clone(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.slots = max(1, max_batch_size)
        self.capacity = 0  # positions per slot
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = 0
        self._pending_length = 0
        self._allocate(self.slots, CACHE_BLOCK)
        # torch.compile of the whole decode step: one graph for 1 row and one for 2+ rows, the caches'
        # capacity and slots dynamic in both (see _compiled_step); the prefill stays eager
        self.compiled = compile
        self._decode = torch.compile(self._step_math, fullgraph=True, dynamic=False) if compile else None

    # -- cache ----------------------------------------------------------------------------------------
    def _allocate(self, slots: int, capacity: int) -> None:
        """Grow the cache to at least ``slots`` x ``capacity`` positions, keeping what it holds."""
        capacity = min(max(capacity, self.capacity), self.max_positions)
        capacity = max(capacity, 1)
        slots = max(slots, self.slots if self.k else slots)
        if self.k and slots <= self.k[0].shape[0] and capacity <= self.capacity:
            return
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        # never inference tensors, wherever the cache grows: the compiled step's guards tell them apart
        with torch.inference_mode(False):
            new_k = [torch.zeros(shape, dtype=self.dtype) for _ in self.layers]
            new_v = [torch.zeros(shape, dtype=self.dtype) for _ in self.layers]
            if self.k:
                used = self.rows + 1  # the rows and a pending prefill
                old_slots = self.k[0].shape[0]
                used = min(used, old_slots)
                for dst, src in zip(new_k + new_v, self.k + self.v, strict=True):
                    dst[:used, :, : self.capacity] = src[:used]
        self.k, self.v, self.slots, self.capacity = new_k, new_v, slots, capacity

    def _ensure(self, slots: int, length: int) -> None:
        if length > self.max_positions:
            raise ValueError(f"{length} positions exceed the model's context of {self.max_positions}")
        need_capacity = self.capacity
        if length > self.capacity:
            need_capacity = math.ceil(length / CACHE_BLOCK) * CACHE_BLOCK
        if slots > self.slots or need_capacity > self.capacity:
            self._allocate(max(slots, self.slots), need_capacity)

    # -- the interface --------------------------------------------------------------------------------
    def prefill(self, prompt: list[int], all_logits: bool) -> torch.Tensor:
        length = len(prompt)
        slot = self.rows
        self._ensure(slot + 1, length)
        ids = torch.tensor(prompt, dtype=torch.long)
        x = F.embedding(ids, self.embed)[None]  # [1, S, hidden]
        cos, sin = self.cos[:length][None, :, None], self.signed_sin[:length][None, :, None]
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = self._norm(x, residual, layer.ln1)
            q, k, v = self._qkv(layer, h, cos, sin)  # [1, S, heads, D]
            self.k[i][slot, :, :length] = k[0].transpose(0, 1)
            self.v[i][slot, :, :length] = v[0].transpose(0, 1)
            keys = k.transpose(1, 2).repeat_interleave(self.group, dim=1)
            values = v.transpose(1, 2).repeat_interleave(self.group, dim=1)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=True, scale=self.scale
            )
            x = layer.o(out.transpose(1, 2).reshape(1, length, self.q_size))
            h, residual = self._norm(x, residual, layer.ln2)
            x = layer.down(functional.silu_and_mul(layer.gate_up(h)))
        h, _ = self._norm(x, residual, self.norm)
        h = h[0] if all_logits else h[0, -1:]
        self._pending_length = length
        return self.lm_head(h)

    def join(self, n: int) -> None:
        slot = self.rows
        self._ensure(slot + n, self._pending_length)
        if n > 1:
            length = self._pending_length
            for cache in self.k + self.v:
                cache[slot + 1 : slot + n, :, :length] = cache[slot : slot + 1, :, :length]
        self.rows += n

    def step(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        rows = len(tokens)
        if rows != self.rows:
            raise RuntimeError(f"step over {rows} rows, but the batch has {self.rows}")
        longest = max(lengths) + 1
        self._ensure(rows, longest)
        pos = torch.tensor(lengths, dtype=torch.long)
        if self._decode is not None:
            return self._compiled_step(torch.tensor(tokens, dtype=torch.long), pos)
        x = F.embedding(torch.tensor(tokens, dtype=torch.long), self.embed)[:, None]  # [B, 1, hidden]
        cos, sin = self.cos[pos][:, None, None], self.signed_sin[pos][:, None, None]  # [B, 1, 1, D]
        mask = None
        if rows > 1 and min(lengths) + 1 != longest:
            mask = (torch.arange(longest)[None, :] <= pos[:, None])[:, None, None]  # [B, 1, 1, T]
        batch = torch.arange(rows)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = self._norm(x, residual, layer.ln1)
            q, k, v = self._qkv(layer, h, cos, sin)  # [B, 1, heads, D]
            kc, vc = self.k[i], self.v[i]
            kc[batch, :, pos] = k[:, 0]
            vc[batch, :, pos] = v[:, 0]
            # grouped-query attention without repeating K/V: the group's query heads act as query positions
            q = q.view(rows, self.kv_heads, self.group, self.head_dim)
            out = F.scaled_dot_product_attention(
                q, kc[:rows, :, :longest], vc[:rows, :, :longest], attn_mask=mask, scale=self.scale
            )
            x = layer.o(out.reshape(rows, 1, self.q_size))
            h, residual = self._norm(x, residual, layer.ln2)
            x = layer.down(functional.silu_and_mul(layer.gate_up(h)))
        h, _ = self._norm(x, residual, self.norm)
        return self.lm_head(h[:, 0])

    def _compiled_step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The step through the compiled graph. It attends over the cache's whole capacity (the mask hides
        the slots past each row's position): a slice to the longest row would make dynamo guard on whether
        the slice is the whole cache, and recompile when it is. Marked dynamic, so that no step recompiles:
        the caches' slots and capacity, and the row count from 2 rows up (1 row is its own static graph:
        dynamo specialises size-1 dims)."""
        mask = (torch.arange(self.capacity)[None, :] <= pos[:, None])[:, None, None]  # [B, 1, 1, capacity]
        torch._dynamo.mark_dynamic(mask, 3)
        if ids.shape[0] > 1:
            for t in (ids, pos, mask):
                torch._dynamo.mark_dynamic(t, 0)
        for cache in self.k + self.v:
            torch._dynamo.maybe_mark_dynamic(cache, 0)
            torch._dynamo.maybe_mark_dynamic(cache, 2)
        return self._decode(ids, pos, mask, self.k, self.v)

    def _step_math(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """The decode step as one traceable function (what ``torch.compile`` captures): the eager step's
        math, with attention written out (q k^T, masked softmax, p v in fp32) so inductor fuses it instead
        of calling the flash-attention kernel, and the plain-PyTorch norms and SwiGLU of
        ``kernels/reference.py`` so it fuses them too."""
        rows = ids.shape[0]
        x = F.embedding(ids, self.embed)[:, None]  # [B, 1, hidden]
        cos, sin = self.cos[pos][:, None, None], self.signed_sin[pos][:, None, None]  # [B, 1, 1, D]
        batch = torch.arange(rows)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                h, residual = reference.rmsnorm(x, layer.ln1, self.eps), x
            else:
                h, residual = reference.add_rmsnorm(x, residual, layer.ln1, self.eps)
            q, k, v = self._qkv(layer, h, cos, sin)  # [B, 1, heads, D]
            kc, vc = k_caches[i], v_caches[i]
            kc[batch, :, pos] = k[:, 0]
            vc[batch, :, pos] = v[:, 0]
            q = q.view(rows, self.kv_heads, self.group, self.head_dim).float()
            keys, values = kc[:rows].float(), vc[:rows].float()
            scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # [B, kv_heads, group, T]
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out = torch.matmul(probs, values).to(x.dtype)
            x = layer.o(out.reshape(rows, 1, self.q_size))
            h, residual = reference.add_rmsnorm(x, residual, layer.ln2, self.eps)
            x = layer.down(reference.silu_and_mul(layer.gate_up(h)))
        h, _ = reference.add_rmsnorm(x, residual, self.norm, self.eps)
        return self.lm_head(h[:, 0])

    def warm_up(self) -> float:
        """Compile the decode graphs now (1 row, then 2 rows) instead of at the first requests; returns the
        seconds it took. Leaves the batch empty. No-op when not compiled."""
        if self._decode is None:
            return 0.0
        start = time.perf_counter()
        self.reset()
        with torch.inference_mode():
            for rows in (1, 2):
                self.prefill([0, 1], False)
                self.join(rows)
                for n in range(2, 4):  # two lengths: a recompile here would show in the warm-up, not later
                    self.step([0] * rows, [n] * rows)
                self.reset()
        return time.perf_counter() - start

    def retire(self, keep: list[int], lengths: list[int]) -> None:
        if not keep:
            self.reset()
            return
        if keep != list(range(len(keep))):
            index = torch.tensor(keep, dtype=torch.long)
            longest = max(lengths)
            for cache in self.k + self.v:
                cache[: len(keep), :, :longest] = cache[index, :, :longest]
        self.rows = len(keep)

    def reset(self) -> None:
        self.rows, self._pending_length = 0, 0

    # -- pieces ---------------------------------------------------------------------------------------
    def _norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return functional.rmsnorm(x, weight, self.eps), x
        return functional.add_rmsnorm(x, residual, weight, self.eps)

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = h.shape
        qkv = layer.qkv(h)
        qk_size = self.q_size + self.kv_size
        qk = _rope(qkv[..., :qk_size].view(b, s, self.heads + self.kv_heads, self.head_dim), cos, sin)
        v = qkv[..., qk_size:].view(b, s, self.kv_heads, self.head_dim)
        return qk[:, :, : self.heads], qk[:, :, self.heads :], v


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's rotary embedding, x * cos + rotate_half(x) * sin in x's dtype, with
    rotate_half(x) = cat(-x2, x1) written as x rolled by half times a sin table whose first half is
    negated: the same products (a sign moved between factors is exact), in 4 ops instead of 7. The
    decoder applies it to q and k in one call (their heads side by side)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def make_decoder(
    model: Any, choice: str, max_batch_size: int, compile: str = "off"
) -> TransformersDecoder | StaticDecoder:
    """The decoder ``choice`` names; ``auto`` is static for Llama models on CPU, transformers otherwise.
    ``compile`` (static decoder only): ``on`` compiles its decode step, ``auto`` and ``off`` do not (the
    README's CPU section has the measurements behind that default)."""
    if choice not in DECODER_CHOICES:
        raise ValueError(f"decoder must be one of {', '.join(DECODER_CHOICES)}, not {choice!r}")
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, not {compile!r}")
    if choice == "transformers" or (choice == "auto" and static_unsupported(model)):
        if compile == "on":
            raise ValueError("compile=on needs the static decoder (a Llama model on CPU)")
        return TransformersDecoder(model)
    return StaticDecoder(model, max_batch_size, compile=compile == "on")
