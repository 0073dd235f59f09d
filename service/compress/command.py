"""``squeezeserve compress``: turn a dense checkpoint into a compressed one (see ``pipeline.py``)."""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)

# Kept equal to options.METHODS (that module imports torch).
METHODS = ("int8", "int4", "fp8", "prune", "distill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="dense checkpoint directory or Hugging Face id")
    parser.add_argument(
        "--method",
        required=True,
        help="int8 (W8A16 per-channel), int4 (W4A16 group-wise), fp8 (E4M3 W8A8 dynamic), "
        "prune (dense, needs --sparsity, or --structure and --ratio: a smaller dense model), "
        "distill (fine-tune --model towards --teacher)",
    )
    parser.add_argument(
        "--out", required=True, help="output checkpoint directory (must not exist or be empty)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--algorithm", help="int8/int4: gptq (calibrated; int4 default) or rtn (int8 default)"
    )
    parser.add_argument("--group-size", type=int, help="int4: input columns per scale (default 32)")
    symmetry = parser.add_mutually_exclusive_group()
    symmetry.add_argument(
        "--symmetric", dest="symmetric", action="store_true", default=None, help="int4: no zero point"
    )
    symmetry.add_argument(
        "--asymmetric", dest="symmetric", action="store_false", help="int4: per-group zero point (default)"
    )
    parser.add_argument(
        "--actorder",
        action=argparse.BooleanOptionalAction,
        help="GPTQ: sweep columns by decreasing Hessian diagonal (compressed-tensors actorder 'weight'; "
        "same checkpoint format, no g_idx; default on)",
    )
    parser.add_argument(
        "--scale-search",
        action=argparse.BooleanOptionalAction,
        help="GPTQ: search each group's scale and zero point for the least Hessian-weighted error "
        "(default on; off: min/max)",
    )
    parser.add_argument(
        "--damp", type=float, default=0.01, help="GPTQ damping, fraction of the mean Hessian diagonal"
    )
    parser.add_argument("--sparsity", help="prune first: a fraction (0.5) or N:M (2:4)")
    parser.add_argument("--prune-method", default="wanda", help="magnitude or wanda (calibrated; default)")
    parser.add_argument(
        "--calibration",
        help="UTF-8 text file for GPTQ, Wanda and recovery (or sample:wikitext-2-calibration, shipped)",
    )
    parser.add_argument(
        "--calibration-samples", type=int, default=128, help="calibration windows (default 128)"
    )
    parser.add_argument(
        "--calibration-seq-len", type=int, default=512, help="tokens per window (default 512)"
    )
    parser.add_argument(
        "--recover-steps", type=int, default=0, help="fine-tune steps after pruning (mask kept)"
    )
    parser.add_argument("--recover-lr", type=float, default=2e-5, help="recovery learning rate (AdamW)")
    parser.add_argument("--recover-batch-size", type=int, default=4, help="windows per recovery step")
    structured = parser.add_argument_group("structured pruning and distillation")
    structured.add_argument(
        "--structure",
        choices=("mlp-width", "heads", "layers"),
        help="--method prune: remove whole MLP neurons, query heads (per KV group) or decoder layers, "
        "scored on calibration activations; writes a smaller plain checkpoint",
    )
    structured.add_argument("--ratio", type=float, help="structured pruning: fraction removed (0 < R < 1)")
    structured.add_argument(
        "--recover-loss",
        choices=("kd", "lm"),
        help="recovery loss: kd (forward KL to the unpruned model; default after --structure and for "
        "--method distill) or lm (next-token cross-entropy; default after --sparsity)",
    )
    structured.add_argument(
        "--temperature", type=float, default=1.0, help="kd: softmax temperature (loss scaled by T^2)"
    )
    structured.add_argument(
        "--kd-lm-weight", type=float, default=0.0, help="kd: weight of the LM loss mixed in (0..1)"
    )
    structured.add_argument("--teacher", help="--method distill: teacher checkpoint (e.g. the baseline)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to compress: cpu (default) or cuda[:N]")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's, one per core); on a machine other jobs keep busy, 1 can "
        "be several times faster",
    )


def run(args: argparse.Namespace) -> int:
    if args.method not in METHODS:
        print(f"error: unknown method {args.method!r}: choose one of {', '.join(METHODS)}", file=sys.stderr)
        return 2
    from squeezeserve.service.compress.options import build_options
    from squeezeserve.service.compress.pipeline import compress
    from squeezeserve.service.compress.summary import format_summary

    if not set_threads(args.threads):
        return 2
    try:
        options = build_options(
            method=args.method,
            algorithm=args.algorithm,
            group_size=args.group_size,
            symmetric=args.symmetric,
            actorder=args.actorder,
            scale_search=args.scale_search,
            damp=args.damp,
            sparsity=args.sparsity,
            prune_method=args.prune_method,
            calibration=args.calibration,
            calibration_samples=args.calibration_samples,
            calibration_seq_len=args.calibration_seq_len,
            recover_steps=args.recover_steps,
            recover_lr=args.recover_lr,
            recover_batch_size=args.recover_batch_size,
            seed=args.seed,
            structure=args.structure,
            ratio=args.ratio,
            recover_loss=args.recover_loss,
            temperature=args.temperature,
            kd_lm_weight=args.kd_lm_weight,
            teacher=args.teacher,
        )
        result = compress(args.model, args.out, options, overwrite=args.overwrite, device=args.device)
    except (ValueError, FileNotFoundError, FileExistsError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(result))
    return 0


def set_threads(threads: int | None) -> bool:
    """Apply ``--threads`` (None: torch's default); False, after saying why, for a value below 1."""
    if threads is not None and threads < 1:
        print(f"error: --threads must be at least 1, got {threads}", file=sys.stderr)
        return False
    if threads:
        import torch

        torch.set_num_threads(threads)
    return True
