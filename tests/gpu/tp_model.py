"""Cut the bundled model to a shape vLLM can shard over 2 GPUs, keeping its real weights.

SmolLM2-135M has 9 query heads in 3 KV groups: neither divides by 2 (vLLM refuses: "Total number of
attention heads (9) must be divisible by tensor parallel size (2)"). Dropping one KV group in every
layer (its 3 query heads, its K and V head, and o_proj's matching input columns) leaves 6 heads in 2 groups.
The cut model answers worse than the original (dropping group 0 keeps it the most fluent of the three
choices: "The capital of France is a country that is a bit of a continent") but it is one fixed set of real
weights, so greedy outputs at TP=1 and TP=2 can be compared token for token.

    python3 tests/gpu/tp_model.py --model /tmp/model/hf --out /tmp/model/hf-6heads
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--drop-group", type=int, default=0, help="which KV group to drop (default 0)")
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    keep_groups = groups - 1
    keep_q = heads // groups * keep_groups
    drop = args.drop_group % groups
    per_group = heads // groups
    q_rows = [h * head_dim + d for h in range(heads) if h // per_group != drop for d in range(head_dim)]
    kv_rows = [g * head_dim + d for g in range(groups) if g != drop for d in range(head_dim)]
    weights = load_file(args.model / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("q_proj.weight"):
            weights[name] = tensor[q_rows].contiguous()
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = tensor[kv_rows].contiguous()
        elif name.endswith("o_proj.weight"):
            weights[name] = tensor[:, q_rows].contiguous()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, args.out / "model.safetensors", metadata={"format": "pt"})
    config.update(num_attention_heads=keep_q, num_key_value_heads=keep_groups, head_dim=head_dim)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in args.model.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy2(path, args.out / path.name)
    print(f"wrote {args.out}: {keep_q} heads in {keep_groups} KV groups (was {heads} in {groups})")


if __name__ == "__main__":
    main()
