"""Write an 8B-class Llama config (no weights) for ``vllm serve --load-format dummy`` (run 2).

Llama-3-8B's shapes (hidden 4096, MLP 14336, 32 layers, 32 heads, 8 KV heads) with the bundled model's
tokenizer and its 49152-token vocabulary (7.2B parameters instead of 8.0B: a smaller embedding and LM
head). ``--w4a16`` adds the compressed-tensors config ``squeezeserve compress`` writes for symmetric int4,
group 128, so vLLM creates the packed int4 parameters (its dummy loader leaves their integer codes
uninitialised and fills the scales with small random values: fine for timing, not for text).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--tokenizer", type=Path, required=True, help="checkpoint dir to take the tokenizer from"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--w4a16", action="store_true", help="add a compressed-tensors W4A16 (group 128) config"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_config = json.loads((args.tokenizer / "config.json").read_text())
    config = dict(LLAMA_8B, vocab_size=tokenizer_config["vocab_size"])
    if args.w4a16:
        import torch

        from squeezeserve.kernels.checkpoint_format import QuantScheme
        from squeezeserve.service.compress.formats import quantization_config

        scheme = QuantScheme(kind="int", bits=4, group_size=128, symmetric=True, scale_dtype=torch.bfloat16)
        config["quantization_config"] = quantization_config(scheme)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy2(args.tokenizer / name, args.out / name)
    print(f"wrote {args.out}: {'W4A16 ' if args.w4a16 else ''}Llama {config['num_hidden_layers']} layers")


if __name__ == "__main__":
    main()
