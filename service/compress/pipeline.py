"""One compression run: load, (prune, recover), quantize / factor / weight-share (then recover those
formats' own parameters: format_recovery.py), write atomically, record.

The output is built in a hidden temporary sibling of ``out`` and renamed into place only once every file
is written, so a failed or interrupted run leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from squeezeserve.kernels.checkpoint_format import codebook_config, lowrank_config
from squeezeserve.service.compress.calibration import (
    Calibration,
    calibration_batches,
    decoder_layers,
    layerwise,
    linear_modules,
    shared_input_groups,
)
from squeezeserve.service.compress.formats import (
    codebook_tensors_for,
    compressed_tensors_for,
    copy_side_files,
    lowrank_tensors_for,
    quantization_config,
    write_config,
)
from squeezeserve.service.compress.gptq import apply_mask, gptq_quantize
from squeezeserve.service.compress.options import CompressOptions
from squeezeserve.service.compress.prune import enforce_mask, prune_mask, prune_scores
from squeezeserve.service.compress.quantize import (
    QuantizedWeight,
    QuantScheme,
    package,
    quantize_rtn,
    relative_error,
)
from squeezeserve.service.compress.structured import write_config_updates
from squeezeserve.service.models.size import checkpoint_bytes
from squeezeserve.service.paths import atomic_directory

log = logging.getLogger(__name__)

RECORD = "squeeze.json"
Config = dict[str, Any] | None


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]
    relative_error: float | None  # ||W - W'||_F / ||W||_F (quantization only)
    sparsity: float


@dataclass
class CompressResult:
    out: Path
    record: dict[str, Any]
    layers: list[LayerReport] = field(default_factory=list)


def resolve_source(model: str) -> Path:
    """A local checkpoint dir, or a Hugging Face id resolved through the local cache / hub."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model checkpoint: it has no config.json")
        return path
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} not found: give a checkpoint directory or an org/name id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:  # the hub raises many types; all mean "cannot get it"
        raise FileNotFoundError(f"could not fetch {model!r} from the Hugging Face hub: {exc}") from exc


def check_memory(source: Path, options: CompressOptions) -> None:
    """Refuse early when the float32 working copy (plus optimizer state when recovering) cannot fit."""
    weight_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    # Checkpoints are mostly 16-bit: the float32 copy is twice the file size; AdamW adds 2 more copies of
    # the trained weights plus their gradients.
    need = weight_bytes * 2 * (4 if options.recover_steps else 1.5)
    if options.recover_steps and options.recover_loss == "kd":
        need += weight_bytes * 2  # the float32 teacher
    available = _available_memory()
    if available is not None and need > available:
        raise MemoryError(
            f"compressing {source} needs about {need / 2**30:.1f} GiB of memory; {available / 2**30:.1f} GiB "
            "is available"
        )


def check_device(device: str) -> None:
    """Refuse a device string torch does not know, or a GPU this machine does not have."""
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown --device {device!r}: give cpu, cuda or cuda:N") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here (torch {torch.__version__})")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: compression runs on cpu or cuda")


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def scheme_for(options: CompressOptions, scale_dtype: torch.dtype) -> QuantScheme | None:
    if options.method == "int8":
        return QuantScheme("int", 8, None, True, scale_dtype)
    if options.method == "int4":
        return QuantScheme("int", 4, options.group_size, options.symmetric, scale_dtype)
    if options.method == "fp8":
        return QuantScheme("float", 8, None, True, torch.float32)
    return None


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear inside the decoder layers (the LM head and embeddings stay as they are)."""
    targets = {}
    for index, layer in enumerate(decoder_layers(model)):
        targets.update(linear_modules(layer, prefix=f"model.layers.{index}."))
    return targets


def prune(
    model: nn.Module, options: CompressOptions, calibration: Calibration | None
) -> dict[str, torch.Tensor]:
    """Prune every target Linear in place; returns the keep-masks."""
    masks: dict[str, torch.Tensor] = {}
    sparsity = options.sparsity
    assert sparsity is not None

    def prune_layer(_index: int, linears: dict[str, nn.Linear], grams: dict[str, torch.Tensor]) -> None:
        for name, module in linears.items():
            scores = prune_scores(module.weight, options.prune_method, grams.get(name))
            masks[name] = prune_mask(scores, sparsity)
            module.weight.data = enforce_mask(module.weight.data, masks[name])

    if options.prune_method == "wanda":
        assert calibration is not None
        layerwise(model, calibration.input_ids, prune_layer, desc=f"pruning {sparsity} (wanda)")
    else:
        targets = target_linears(model)
        for name, module in tqdm(targets.items(), desc=f"pruning {sparsity} (magnitude)", unit="linear"):
            prune_layer(0, {name: module}, {})
    return masks


def quantize(
    model: nn.Module,
    scheme: QuantScheme,
    options: CompressOptions,
    masks: dict[str, torch.Tensor],
    calibration: Calibration | None,
) -> tuple[dict[str, QuantizedWeight], dict[str, float]]:
    """Quantize every target Linear; returns the quantized weights and each one's relative error."""
    quantized: dict[str, QuantizedWeight] = {}
    errors: dict[str, float] = {}
    targets = target_linears(model)
    for name, module in targets.items():
        scheme.check_shape(name, module.in_features)

    def record(name: str, module: nn.Linear, q: QuantizedWeight) -> None:
        quantized[name] = q
        dequantized = q.dequantize()
        errors[name] = relative_error(module.weight.data, dequantized)
        # Later layers calibrate on what the quantized model computes.
        module.weight.data = dequantized.to(module.weight.dtype)

    def quantize_layer(_index: int, linears: dict[str, nn.Linear], grams: dict[str, torch.Tensor]) -> None:
        if options.algorithm == "gptq":
            for names in shared_input_groups(grams):
                # Rows of GPTQ are independent given H: linears fed the same input (q/k/v, gate/up) are
                # quantized as one stacked matrix, one column sweep instead of several.
                weight = torch.cat([linears[n].weight.data for n in names])
                mask = None
                if any(n in masks for n in names):
                    mask = torch.cat(
                        [masks.get(n, torch.ones_like(linears[n].weight, dtype=torch.bool)) for n in names]
                    )
                stacked = gptq_quantize(
                    weight,
                    grams[names[0]],
                    scheme,
                    mask=mask,
                    damp=options.damp,
                    actorder=options.actorder,
                    search=options.scale_search,
                )
                start = 0
                for n in names:
                    rows = linears[n].out_features
                    record(n, linears[n], stacked.rows(start, start + rows))
                    start += rows
            return
        for name, module in linears.items():
            mask = masks.get(name)
            q = quantize_rtn(module.weight.data, scheme)
            if mask is not None and scheme.kind == "int":
                q = _masked_rtn(q, module.weight.data, mask)
            record(name, module, q)

    if options.algorithm == "gptq":
        assert calibration is not None
        layerwise(model, calibration.input_ids, quantize_layer, desc=f"GPTQ {options.method}")
    else:
        for name, module in tqdm(targets.items(), desc=f"RTN {options.method}", unit="linear"):
            quantize_layer(0, {name: module}, {})
    return quantized, errors


def _masked_rtn(q: QuantizedWeight, weight: torch.Tensor, mask: torch.Tensor) -> QuantizedWeight:
    """RTN codes with the pruning pattern enforced (pruned: 0, kept: never 0)."""
    out, in_features = weight.shape
    width = q.scheme.group_width(in_features)
    zero = None if q.zero_point is None else q.zero_point.to(torch.float32).repeat_interleave(width, dim=1)
    codes = apply_mask(q.codes.to(torch.float32), weight.to(torch.float32), zero, mask, q.scheme)
    zero_groups = None if q.zero_point is None else q.zero_point.to(torch.float32)
    return package(codes, q.scale.to(torch.float32), zero_groups, q.scheme)


@dataclass
class Compressed:
    """What ``compress_weights`` made of the target Linears."""

    tensors: dict[str, dict[str, torch.Tensor]]  # each compressed Linear's checkpoint tensors (for .weight)
    errors: dict[str, float]  # each one's ||W - W'||_F / ||W||_F against the source
    config: Config  # quantization_config (None: a plain checkpoint)
    record: dict[str, Any] = field(default_factory=dict)  # what squeeze.json adds (ranks, recovery)


def compress_weights(
    lm: nn.Module,
    options: CompressOptions,
    masks: dict[str, torch.Tensor],
    calibration: Calibration | None,
    dtype: torch.dtype,
    teacher: nn.Module | None = None,
) -> Compressed:
    """Quantize, factor or weight-share the target Linears as ``options.method`` says; a factored or
    weight-shared model then recovers (``format_recovery``) if ``options.recover_steps`` asks, with
    ``teacher`` for kd."""
    if options.method == "lowrank":
        from squeezeserve.service.compress.format_recovery import recover_factors
        from squeezeserve.service.compress.lowrank import lowrank

        assert options.rank_ratio is not None
        sources = _source_weights(lm, teacher) if options.recover_steps else {}
        factored = lowrank(lm, target_linears(lm), options.rank_ratio, options.algorithm, calibration)
        record: dict[str, Any] = {"lowrank": {"ranks": factored.ranks, "parameters": factored.parameters}}
        errors = factored.errors
        if options.recover_steps:
            assert calibration is not None
            record["recovery"] = recover_factors(lm, teacher, factored.factors, calibration, options)
            errors.update(_errors_against(lm, sources, factored.factors))
        tensors = {name: lowrank_tensors_for(name, u, v, dtype) for name, (u, v) in factored.factors.items()}
        ranks = {name: rank for name, rank in factored.ranks.items() if rank is not None}
        return Compressed(tensors, errors, lowrank_config(ranks), record)
    if options.method == "codebook":
        from squeezeserve.service.compress.codebook import share_weights
        from squeezeserve.service.compress.format_recovery import recover_codebooks

        assert calibration is not None and options.bits is not None
        sources = _source_weights(lm, teacher) if options.recover_steps else {}
        shared, errors = share_weights(lm, calibration.input_ids, options)
        record = {}
        if options.recover_steps:
            record["recovery"] = recover_codebooks(lm, teacher, shared, calibration, options)
            errors.update(_errors_against(lm, sources, shared))
        tensors = {name: codebook_tensors_for(name, q) for name, q in shared.items()}
        return Compressed(tensors, errors, codebook_config(options.bits, options.group_size), record)
    scheme = scheme_for(options, scale_dtype=dtype)
    if scheme is None:
        return Compressed({}, {}, None)
    quantized, errors = quantize(lm, scheme, options, masks, calibration)
    tensors = {name: compressed_tensors_for(name, q) for name, q in quantized.items()}
    return Compressed(tensors, errors, quantization_config(scheme, actorder=options.actorder))


def _source_weights(lm: nn.Module, teacher: nn.Module | None) -> dict[str, torch.Tensor]:
    """The target Linears' weights before compression, for the errors after recovery: the kd teacher's
    (the uncompressed source itself), else a copy on the CPU."""
    if teacher is not None:
        return {name: module.weight for name, module in target_linears(teacher).items()}
    return {name: module.weight.detach().cpu().clone() for name, module in target_linears(lm).items()}


def _errors_against(
    lm: nn.Module, sources: dict[str, torch.Tensor], names: Iterable[str]
) -> dict[str, float]:
    """Relative error of each named Linear's current weight against its source weight."""
    errors = {}
    for name in names:
        weight = lm.get_submodule(name).weight.data
        errors[name] = relative_error(sources[name].to(weight.device), weight)
    return errors


def versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {"python": platform.python_version()}
    for name in ("squeezeserve", "torch", "transformers", "compressed-tensors", "safetensors"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return found


def compress(
    model: str,
    out: str | Path,
    options: CompressOptions,
    overwrite: bool = False,
    device: str = "cpu",
) -> CompressResult:
    """Compress ``model`` (dir or hub id) into the checkpoint directory ``out``; see the module docstring.
    ``device``: where the model, calibration and GPTQ run (``cuda``: the same algorithms, in seconds)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    start = time.perf_counter()
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another --out or pass --overwrite")
    source = resolve_source(model)
    if out.resolve() == source.resolve():
        raise ValueError("--out must differ from --model: the source checkpoint is never overwritten")
    check_memory(source, options)
    check_device(device)
    torch.manual_seed(options.seed)

    tokenizer = AutoTokenizer.from_pretrained(source)
    source_config = json.loads((source / "config.json").read_text())
    if source_config.get("quantization_config"):
        hint = ""
        if options.method == "distill":
            hint = (
                " (a low-rank or codebook model recovers in its own run: --method lowrank|codebook "
                "--recover-steps N trains its factors or codebook values)"
            )
        raise ValueError(f"{source} is already quantized; compress a dense (float) checkpoint{hint}")
    calibration = None
    if options.needs_calibration:
        calibration = calibration_batches(
            options.calibration, tokenizer, options.calibration_samples, options.calibration_seq_len
        )
    lm = load_float32(source, device)
    save_dtype = _checkpoint_dtype(source_config)

    teacher = _teacher(lm, options, device)
    structured = None
    if options.structure is not None:
        structured = _structured(lm, options, calibration)
    masks = prune(lm, options, calibration) if options.sparsity is not None else {}
    recovery = None
    if options.recover_steps and not options.recovers_format:
        assert calibration is not None
        recovery = _recover(lm, teacher, masks, calibration, options)
        teacher = None  # GPTQ's memory, not the teacher's
    compressed = compress_weights(lm, options, masks, calibration, save_dtype, teacher)
    del teacher
    config = compressed.config

    with atomic_directory(out) as tmp:
        tensors = _checkpoint_tensors(lm, compressed.tensors, save_dtype)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_side_files(source, tmp)
        written = write_config(source, tmp, config)
        if structured is not None:
            write_config_updates(tmp, written, structured["config"])
        layers = _layer_reports(lm, compressed.errors)
        record = {
            "method": options.method,
            "options": options.record(),
            "source": str(source),
            "calibration": None
            if calibration is None
            else {
                "path": calibration.path,
                "sha256": calibration.sha256,
                "samples": int(calibration.input_ids.shape[0]),
                "seq_len": int(calibration.input_ids.shape[1]),
            },
            "quantization": None if config is None else {"format": config["format"]},
            "versions": versions(),
            "size_bytes": {"before": checkpoint_bytes(source), "after": 0},
            "sparsity": _overall_sparsity(layers),
            "layers": [vars(layer) | {"shape": list(layer.shape)} for layer in layers],
            "wall_seconds": 0.0,
        }
        if structured is not None:
            record["structured"] = structured
        if recovery is not None:
            record["recovery"] = recovery
        record.update(compressed.record)
        record["size_bytes"]["after"] = checkpoint_bytes(tmp)
        record["wall_seconds"] = round(time.perf_counter() - start, 2)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return CompressResult(out=out, record=record, layers=layers)


def load_float32(path: Path, device: str) -> nn.Module:
    """A dense checkpoint as a frozen float32 model on ``device`` (GPTQ's Cholesky factorisations and the
    fine-tune need float32)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, low_cpu_mem_usage=True).eval()
    lm.requires_grad_(False)
    return lm.to(device)


def _teacher(lm: nn.Module, options: CompressOptions, device: str) -> nn.Module | None:
    """The distillation teacher: --teacher for --method distill, else the source model before pruning or
    compression."""
    if options.method == "distill":
        assert options.teacher is not None
        return load_float32(resolve_source(options.teacher), device)
    if options.recover_steps and options.recover_loss == "kd":
        return copy.deepcopy(lm)
    return None


def _structured(lm: nn.Module, options: CompressOptions, calibration: Calibration | None) -> dict[str, Any]:
    from squeezeserve.service.compress.structured import parameter_count, structured_prune

    assert calibration is not None and options.structure is not None and options.ratio is not None
    before = parameter_count(lm)
    result = structured_prune(lm, options.structure, options.ratio, calibration.input_ids)
    result["parameters"] = {"before": before, "after": parameter_count(lm)}
    log.info("structured pruning: %s, parameters %s", result["config"], result["parameters"])
    return result


def _recover(
    lm: nn.Module,
    teacher: nn.Module | None,
    masks: dict[str, torch.Tensor],
    calibration: Calibration,
    options: CompressOptions,
) -> dict[str, Any]:
    """Fine-tune after pruning (distill.py); every decoder Linear trains unless unstructured masks say
    which were pruned. Returns what squeeze.json records."""
    from squeezeserve.service.compress.distill import distill, zero_masks

    if options.method == "distill":
        trained = zero_masks(target_linears(lm))
    elif masks:
        trained = dict(masks)
    else:
        trained = dict.fromkeys(target_linears(lm))
    start = time.perf_counter()
    losses = distill(lm, teacher, trained, calibration.input_ids, options)
    return {
        "loss": options.recover_loss,
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": round(time.perf_counter() - start, 2),
    }


def _checkpoint_dtype(config: dict[str, Any]) -> torch.dtype:
    name = str(config.get("dtype") or config.get("torch_dtype") or "float16").removeprefix("torch.")
    dtype = getattr(torch, name, torch.float16)
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def _checkpoint_tensors(
    lm: nn.Module, replacements: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The state dict in ``dtype``, each replaced Linear's ``weight`` swapped for its compressed tensors."""
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in lm.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and name in replacements:
            tensors.update(replacements[name])
        else:
            tensors[key] = tensor.detach().to(dtype).contiguous() if tensor.is_floating_point() else tensor
    return {key: tensor.cpu() for key, tensor in tensors.items()}


def _layer_reports(lm: nn.Module, errors: dict[str, float]) -> list[LayerReport]:
    reports = []
    for name, module in target_linears(lm).items():
        weight = module.weight.detach()
        zeros = float((weight == 0).float().mean())
        reports.append(LayerReport(name, tuple(weight.shape), errors.get(name), zeros))
    return reports


def _overall_sparsity(layers: list[LayerReport]) -> float:
    total = sum(layer.shape[0] * layer.shape[1] for layer in layers)
    return sum(layer.sparsity * layer.shape[0] * layer.shape[1] for layer in layers) / max(total, 1)
