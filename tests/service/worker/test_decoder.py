"""The static Llama decoder against transformers on the same weights, and the worker answering through it.

Small random-weight Llama configs (GQA, biases, tied and untied heads) keep this fast; the bundled model
is used only in the slow-marked test. Tolerances: float32 runs the same math in a different order (fused
projections, grouped attention without repeated K/V), so logits agree to ~1e-5; in bfloat16 every op
rounds to 8 mantissa bits, so the static decoder is held to the error transformers' own bfloat16 run has
against the float32 reference (twice it, plus a margin of one bf16 ulp at the logits' scale).
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from squeezeserve.kernels.modules import QuantLinear
from squeezeserve.service.worker.local import decoder as decoder_module
from squeezeserve.service.worker.local.decoder import (
    FP16_MAX,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    StaticDecoder,
    TransformersDecoder,
    fbgemm_fp16,
    make_decoder,
    onednn_bf16,
    static_unsupported,
)
from squeezeserve.service.worker.local.engine import Engine, Request
from squeezeserve.service.worker.local.sampling import SamplingParams


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    shape = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip
    config = LlamaConfig(**{**shape, **overrides})
    return LlamaForCausalLM(config).to(dtype).eval()


def run_script(decoder) -> list[torch.Tensor]:
    """Prefill two prompts (the first as 2 rows), decode rows of different lengths, retire one, go on."""
    out = []
    with torch.inference_mode():
        out.append(decoder.prefill([1, 5, 7, 9, 3, 4, 8], True).float())
        decoder.join(2)
        out.append(decoder.prefill([4, 2, 6], False).float())
        decoder.join(1)
        lengths, tokens = [7, 7, 3], [10, 11, 12]
        for step in range(4):
            out.append(decoder.step(tokens, lengths).float())
            lengths = [n + 1 for n in lengths]
            tokens = [(t * 7 + step) % 256 for t in tokens]
        decoder.retire([0, 2], [lengths[0], lengths[2]])
        lengths, tokens = [lengths[0], lengths[2]], [tokens[0], tokens[2]]
        for _ in range(3):
            out.append(decoder.step(tokens, lengths).float())
            lengths = [n + 1 for n in lengths]
        decoder.reset()
        out.append(decoder.prefill([9, 9, 9], False).float())  # after reset: a fresh batch
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 4},
    ],
    ids=["gqa", "biases", "tied", "mha"],
)
def test_static_logits_equal_transformers_in_float32(overrides) -> None:
    model = tiny_llama(**overrides)
    static, reference = run_script(StaticDecoder(model, 2)), run_script(TransformersDecoder(model))
    assert len(static) == len(reference)
    for got, want in zip(static, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_static_bfloat16_error_is_within_transformers_own_bfloat16_error() -> None:
    exact = run_script(TransformersDecoder(tiny_llama()))
    bf16 = tiny_llama(dtype=torch.bfloat16)
    static, reference = run_script(StaticDecoder(bf16, 4)), run_script(TransformersDecoder(bf16))
    for got, want, truth in zip(static, reference, exact, strict=True):
        ulp = truth.abs().max().item() * 2**-8
        assert (got - truth).abs().max() <= 2 * (want - truth).abs().max() + ulp


def greedy(model, prompt: list[int], tokens: int, decoder) -> list[int]:
    with torch.inference_mode():
        logits = decoder.prefill(prompt, False)
        decoder.join(1)
        out = [int(logits[-1].argmax())]
        for i in range(tokens - 1):
            out.append(int(decoder.step([out[-1]], [len(prompt) + i])[0].argmax()))
    return out


def test_greedy_tokens_equal_transformers_generate_in_float32() -> None:
    model = tiny_llama(seed=3)
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.inference_mode():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )
    assert greedy(model, prompt, 40, StaticDecoder(model, 1)) == expected[0, len(prompt) :].tolist()


def test_the_cache_grows_past_its_first_block_and_beyond_its_slots() -> None:
    model = tiny_llama(seed=5)
    static, reference = StaticDecoder(model, 1), TransformersDecoder(model)
    prompt = list(range(1, 250))
    with torch.inference_mode():
        for decoder in (static, reference):
            decoder.prefill(prompt, False)
            decoder.join(3)  # more rows than the one slot it was made with
        lengths = [len(prompt)] * 3
        for _ in range(12):  # crosses 256 positions
            got = static.step([1, 2, 3], lengths)
            want = reference.step([1, 2, 3], lengths)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            lengths = [n + 1 for n in lengths]
    assert static.capacity == 512 and static.slots >= 3


@pytest.mark.skipif(
    onednn_bf16() or not fbgemm_fp16(), reason="only CPUs without native bf16 take the FBGEMM fp16 path"
)
@pytest.mark.parametrize("rows", [1, 8, 37])
def test_dense_bfloat16_runs_fbgemm_fp16_and_matches_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    weight, bias = (torch.randn(96, 64) * 0.05).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(2, rows, 64).bfloat16()
    linear = DenseLinear(weight, bias)
    assert linear.fp16 is not None
    got, want = linear(x), torch.nn.functional.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # both accumulate exact products in fp32 and round once to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    wide = weight.clone()
    wide[0, 0] = 2 * FP16_MAX  # beyond fp16: stays on F.linear
    assert DenseLinear(wide, bias).fp16 is None
    assert DenseLinear(weight.float(), None).fp16 is None  # float32 keeps its precision


@pytest.mark.skipif(not fbgemm_fp16(), reason="needs FBGEMM (x86 builds of torch)")
def test_fbgemm_fp16_weight_is_released_with_its_linear() -> None:
    # float16 weights take the FBGEMM path on any CPU that has it; the compiled step's table holds the packed
    # weight only while its DenseLinear lives (a process loading model after model keeps none of them)
    linear = DenseLinear(torch.randn(32, 16).half(), None)
    assert linear.fp16 is not None and decoder_module._FP16_WEIGHTS[linear.fp16_handle] is linear.fp16
    handle = linear.fp16_handle
    del linear
    assert handle not in decoder_module._FP16_WEIGHTS


class CharTokenizer:  # token ids as text, one character per token
    def decode(self, ids, **_: object) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


async def serve(decoder) -> list[list[int]]:
    """Greedy tokens of three concurrent requests (one with n=2) through an Engine over ``decoder``."""
    engine = Engine(decoder, CharTokenizer(), eos_token_ids=set(), max_batch_size=4, max_waiting=8)
    engine.start()
    try:
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
        requests = []
        for i, prompt in enumerate(prompts):
            request = Request(
                [prompt], 2 if i == 1 else 1, SamplingParams(max_tokens=6 + 3 * i, temperature=0.0)
            )
            engine.submit(request)
            requests.append(request)
        results = []
        for request in requests:
            tokens: dict[int, list[int]] = {}
            done = 0
            while done < request.size:
                for event in await asyncio.wait_for(request.queue.get(), 60):
                    assert event.error is None
                    tokens.setdefault(event.index, []).extend(event.token_ids)
                    done += event.finish_reason is not None
            results += [tokens[k] for k in sorted(tokens)]
        return results
    finally:
        engine.stop()


def test_engine_serves_concurrent_requests_through_the_static_decoder_like_transformers() -> None:
    model = tiny_llama(seed=7)
    static = asyncio.run(serve(StaticDecoder(model, 4)))
    reference = asyncio.run(serve(TransformersDecoder(copy.deepcopy(model))))
    assert static == reference
    assert [len(t) for t in static] == [6, 9, 9, 12]


def test_decoder_choice_and_clear_errors() -> None:
    llama = tiny_llama()
    assert make_decoder(llama, "auto", 2).name == "static"
    assert make_decoder(llama, "transformers", 2).name == "transformers"
    llama.config.model_type = "mistral"
    assert static_unsupported(llama) == "model_type is 'mistral', not 'llama'"
    assert make_decoder(llama, "auto", 2).name == "transformers"
    with pytest.raises(ValueError, match="static decoder does not support this model: model_type"):
        make_decoder(llama, "static", 2)
    with pytest.raises(ValueError, match="decoder must be one of auto, static, transformers"):
        make_decoder(llama, "fast", 2)


def quantize_projections(model: LlamaForCausalLM, bits: int, group_size: int, symmetric: bool) -> None:
    """Every q/k/v/o/gate/up/down projection replaced, in place, by a round-to-nearest QuantLinear."""
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for name in names:
                linear = getattr(parent, name)
                group = linear.in_features if group_size == 0 else group_size
                setattr(parent, name, QuantLinear.from_linear(linear, bits, group, symmetric))


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric", "packed"),
    [
        (8, 0, True, Int8Linear),
        (4, 32, False, Int4Linear),
        (4, 32, True, Int4Linear),
        (8, 32, True, DenseLinear),
    ],
    ids=["int8-channel", "int4-asym", "int4-sym", "int8-group-dequantized"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_projections_stay_packed_and_match_transformers(
    bits, group_size, symmetric, packed, dtype
) -> None:
    model = tiny_llama(seed=11, attention_bias=True)
    quantize_projections(model, bits, group_size, symmetric)
    model.to(dtype)
    static = StaticDecoder(model, 4)
    assert isinstance(static.layers[0].qkv, packed) and isinstance(static.layers[1].down, packed)
    got, want = run_script(static), run_script(TransformersDecoder(model))
    # float32: the same integers and scales, summed in another order; bfloat16: torch's int4 layout keeps
    # the zero point as -z * s rounded to bf16 (compressed-tensors rounds (q - z) * s), so a few bf16 ulps
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item())


# -- the compiled decode step (--compile on) ----------------------------------------------------------
# The static decoder's compiled decode step (`--compile on`) against its eager step on the same weights.
#
# float32, so the two differ only by the order of floating-point operations (inductor's fused kernels, the
# attention written out instead of the flash-attention kernel): logits agree to 1e-5 and greedy tokens are
# equal. After `warm_up` nothing may recompile (`fail_on_recompile`): not rows joining or retiring, not a
# longer cache, not more rows than the slots it was made with.


@pytest.fixture(scope="module")
def compiled() -> tuple[StaticDecoder, StaticDecoder]:
    """(compiled, eager) decoders over one tiny GQA Llama with biases; compiled once for the module."""
    model = tiny_llama(seed=11, attention_bias=True, mlp_bias=True)
    decoder = StaticDecoder(model, 2, compile=True)
    assert decoder.warm_up() > 0
    return decoder, StaticDecoder(model, 2)


def test_compiled_step_logits_equal_eager_in_float32(compiled) -> None:
    decoder, eager = compiled
    with torch.compiler.set_stance("fail_on_recompile"):
        got = run_script(decoder)
    want = run_script(eager)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_compiled_greedy_tokens_equal_eager_past_the_first_cache_block(compiled) -> None:
    decoder, eager = compiled
    prompt = list(range(1, 240))
    with torch.compiler.set_stance("fail_on_recompile"):
        got = greedy(None, prompt, 30, decoder)  # 239 + 30 positions: the cache grows to 512
    decoder.reset()
    assert decoder.capacity == 512
    assert got == greedy(None, prompt, 30, eager)
    eager.reset()


def test_compiled_step_takes_more_rows_than_its_slots(compiled) -> None:
    decoder, eager = compiled
    outs = []
    with torch.inference_mode():
        for d in (decoder, eager):
            d.prefill([5, 6, 7], False)
            d.join(3)  # three rows, two slots: the cache grows its slot dim
            with torch.compiler.set_stance("fail_on_recompile" if d is decoder else "default"):
                outs.append(d.step([1, 2, 3], [3, 3, 3]))
            d.reset()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("projections", ["dense", "int4-packed"])
def test_compiled_bfloat16_step_runs_this_cpus_paths(projections: str) -> None:
    """bfloat16 models compile through the paths this CPU takes: the lm_head (and dense projections)
    through whichever path ``DenseLinear`` picks, oneDNN's reordered weight (AVX-512 BF16 / AMX; inductor's
    own lowering of it failed on a weight that is a graph input, not a constant) or FBGEMM's fp16 one; int4
    projections through torch's packed CPU op (the fastest decode, README). Logits stay within bfloat16
    rounding of the eager step's (inductor keeps fp32 between fused ops where eager rounds to bf16)."""
    model = tiny_llama(seed=5, num_hidden_layers=1)
    if projections == "int4-packed":
        quantize_projections(model, 4, 32, False)
    model.to(torch.bfloat16)
    decoder, eager = StaticDecoder(model, 2, compile=True), StaticDecoder(model, 2)
    head = decoder.lm_head
    path = "onednn" if head.packed is not None else "fp16" if head.fp16 is not None else "plain"
    assert path == ("onednn" if onednn_bf16() else "fp16" if fbgemm_fp16() else "plain")
    kind = Int4Linear if projections == "int4-packed" else DenseLinear
    assert isinstance(decoder.layers[0].qkv, kind) and isinstance(decoder.layers[0].down, kind)
    assert decoder.warm_up() > 0
    with torch.compiler.set_stance("fail_on_recompile"):
        got = run_script(decoder)
    # measured: at most 0.0039 apart (one bf16 ulp at logits up to 0.64); held to 4 ulps at the largest logit
    for g, w in zip(got, run_script(eager), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=4 * 2**-8 * w.abs().max().item())


# A fresh interpreter, as the CLI starts: the variable must be set before anything imports our kernels (doing
# so makes inductor fill it with its /tmp default). The model does not exist, so serve_local stops right
# after the load it attempts, and the child prints the variable.
SERVE_AND_PRINT = """
import os, sys
from squeezeserve.service.worker.command import serve_local
from squeezeserve.service.worker.settings import WorkerSettings
code = serve_local(WorkerSettings(model=sys.argv[1], compile=sys.argv[2]))
print(code, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
"""


@pytest.mark.parametrize(
    ("compile_choice", "user_dir", "want"),
    [("on", None, "{home}/inductor"), ("on", "/elsewhere", "/elsewhere"), ("off", None, None)],
)
def test_worker_with_compile_on_keeps_inductors_cache_in_squeezeserve_home_unless_set(
    tmp_path, compile_choice: str, user_dir: str | None, want: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["SQUEEZESERVE_HOME"] = str(tmp_path)
    if user_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = user_dir
    command = [sys.executable, "-c", SERVE_AND_PRINT, str(tmp_path / "no-model"), compile_choice]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert "cannot load model" in result.stderr
    code, cache = result.stdout.split()
    assert code == "1"
    if want is None:  # off: left to inductor (unset, or its own default once it looked)
        assert not cache.startswith(str(tmp_path))
    else:
        assert cache == want.format(home=tmp_path)


def test_compile_choice_and_errors() -> None:
    model = tiny_llama()
    assert make_decoder(model, "auto", 2, "auto").compiled is False
    assert make_decoder(model, "static", 2, "off").compiled is False
    with pytest.raises(ValueError, match="compile must be one of"):
        make_decoder(model, "auto", 2, "yes")
    with pytest.raises(ValueError, match="needs the static decoder"):
        make_decoder(model, "transformers", 2, "on")


def test_engine_warms_up_a_compiled_decoder_and_serves_what_eager_serves(compiled) -> None:
    decoder, eager = compiled
    assert asyncio.run(serve(decoder)) == asyncio.run(serve(eager))
