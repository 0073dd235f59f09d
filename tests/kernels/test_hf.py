import pytest
import torch

from squeezeserve.kernels.hf import patch_model
from squeezeserve.kernels.modules import RMSNorm, SwiGLUMLP
from squeezeserve.kernels.registry import triton_on_cpu


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_patched_llama_is_bit_identical_on_cpu(dtype):
    model = _tiny_llama(dtype)
    input_ids = torch.randint(0, 320, (2, 11))
    with torch.no_grad(), triton_on_cpu(False):  # production CPU path: the references
        logits_before = model(input_ids).logits
        generated_before = model.generate(input_ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        counts = patch_model(model)
        logits_after = model(input_ids).logits
        generated_after = model.generate(input_ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    # 2 layers x (input + post-attention norm) + the final norm; one MLP per layer.
    assert counts == {"rmsnorm": 5, "swiglu_mlp": 2}
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 5
    assert sum(isinstance(m, SwiGLUMLP) for m in model.modules()) == 2
    assert torch.equal(logits_after, logits_before)
    assert torch.equal(generated_after, generated_before)
    assert patch_model(model) == {"rmsnorm": 0, "swiglu_mlp": 0}  # idempotent


def test_patch_keeps_state_dict_keys():
    model = _tiny_llama(torch.float32)
    keys = set(model.state_dict())
    patch_model(model)
    assert set(model.state_dict()) == keys
