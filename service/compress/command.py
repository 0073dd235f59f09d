"""``squeezeserve compress``: turn a dense checkpoint into a compressed one (see ``pipeline.py``)."""

from __future__ import annotations

import argparse
import logging
import sys

from squeezeserve.service.compress.options import (
    ALGORITHMS,
    CODEBOOK_BITS,
    DEFAULTS,
    METHODS,
    PRUNE_METHODS,
    RECOVER_LOSSES,
    STRUCTURES,
)

log = logging.getLogger(__name__)

# Flags whose value goes to build_options under the same name (defaults: options.DEFAULTS, or decided there).
OPTION_FLAGS = (
    "method",
    "algorithm",
    "group_size",
    "symmetric",
    "actorder",
    "scale_search",
    "damp",
    "sparsity",
    "prune_method",
    "calibration",
    "calibration_samples",
    "calibration_seq_len",
    "recover_steps",
    "recover_lr",
    "recover_batch_size",
    "seed",
    "structure",
    "ratio",
    "recover_loss",
    "temperature",
    "kd_lm_weight",
    "teacher",
    "rank_ratio",
    "bits",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="dense checkpoint directory or Hugging Face id")
    parser.add_argument(
        "--method",
        required=True,
        metavar="{" + ",".join(METHODS) + "}",  # checked by build_options, which says why a choice is wrong
        help="int8 (W8A16 per-channel), int4 (W4A16 group-wise), fp8 (E4M3 W8A8 dynamic), "
        "prune (dense, needs --sparsity, or --structure and --ratio: a smaller dense model), "
        "distill (fine-tune --model towards --teacher), lowrank (W = U V, needs --rank-ratio), "
        "codebook (2^--bits shared values per output channel or group)",
    )
    parser.add_argument(
        "--out", required=True, help="output checkpoint directory (must not exist or be empty)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        help="int8/int4: gptq (calibrated; int4 default) or rtn (int8 default); lowrank: svdllm (whitened "
        "by the inputs' covariance, default), asvd (scaled by per-channel activation statistics) or svd; "
        "codebook: gptq (default) or kmeans",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        help=f"int4: input columns per scale (default {DEFAULTS.group_size}); codebook: input columns per "
        "codebook, a multiple of 16 (default: one codebook per output channel)",
    )
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
        "--damp",
        type=float,
        default=DEFAULTS.damp,
        help="GPTQ damping, fraction of the mean Hessian diagonal (default %(default)s)",
    )
    parser.add_argument("--sparsity", help="prune first: a fraction (0.5) or N:M (2:4)")
    parser.add_argument(
        "--prune-method",
        metavar="{" + ",".join(PRUNE_METHODS) + "}",
        default=DEFAULTS.prune_method,
        help="wanda is calibrated (default %(default)s)",
    )
    parser.add_argument(
        "--calibration",
        help="UTF-8 text file for GPTQ, Wanda and recovery (or sample:wikitext-2-calibration, shipped)",
    )
    parser.add_argument(
        "--calibration-samples",
        type=int,
        default=DEFAULTS.calibration_samples,
        help="calibration windows (default %(default)s)",
    )
    parser.add_argument(
        "--calibration-seq-len",
        type=int,
        default=DEFAULTS.calibration_seq_len,
        help="tokens per window (default %(default)s)",
    )
    parser.add_argument(
        "--recover-steps",
        type=int,
        default=DEFAULTS.recover_steps,
        help="fine-tune steps after pruning (mask kept), or after --method lowrank|codebook (their factors "
        "or codebook values train; default %(default)s)",
    )
    parser.add_argument(
        "--recover-lr",
        type=float,
        help=f"recovery learning rate (AdamW; default {DEFAULTS.recover_lr} after pruning, "
        f"{DEFAULTS.format_recover_lr} for lowrank / codebook)",
    )
    parser.add_argument(
        "--recover-batch-size",
        type=int,
        default=DEFAULTS.recover_batch_size,
        help="windows per recovery step (default %(default)s)",
    )
    structured = parser.add_argument_group("structured pruning and distillation")
    structured.add_argument(
        "--structure",
        choices=STRUCTURES,
        help="--method prune: remove whole MLP neurons, query heads (per KV group) or decoder layers, "
        "scored on calibration activations; writes a smaller plain checkpoint",
    )
    structured.add_argument("--ratio", type=float, help="structured pruning: fraction removed (0 < R < 1)")
    structured.add_argument(
        "--recover-loss",
        choices=RECOVER_LOSSES,
        help="recovery loss: kd (forward KL to the source model; default after --structure, for --method "
        "distill and for lowrank / codebook) or lm (next-token cross-entropy; default after --sparsity)",
    )
    structured.add_argument(
        "--temperature",
        type=float,
        default=DEFAULTS.temperature,
        help="kd: softmax temperature (loss scaled by T^2)",
    )
    structured.add_argument(
        "--kd-lm-weight",
        type=float,
        default=DEFAULTS.kd_lm_weight,
        help="kd: weight of the LM loss mixed in (0..1)",
    )
    structured.add_argument("--teacher", help="--method distill: teacher checkpoint (e.g. the baseline)")
    shared = parser.add_argument_group("low-rank factorization and weight sharing")
    shared.add_argument(
        "--rank-ratio",
        type=float,
        help="--method lowrank: parameters kept, as a fraction of the decoder Linears' (0 < F < 1); ranks "
        "per layer are chosen to meet it",
    )
    shared.add_argument(
        "--bits",
        type=int,
        choices=CODEBOOK_BITS,
        help=f"--method codebook: index bits, 2^bits values per codebook (default {DEFAULTS.codebook_bits})",
    )
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--device", default="cpu", help="where to compress: cpu (default) or cuda[:N]")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's, one per core); on a machine other jobs keep busy, 1 can "
        "be several times faster",
    )


def run(args: argparse.Namespace) -> int:
    from squeezeserve.service.compress.options import build_options
    from squeezeserve.service.compress.pipeline import compress
    from squeezeserve.service.compress.summary import format_summary

    if not set_threads(args.threads):
        return 2
    try:
        options = build_options(**{name: getattr(args, name) for name in OPTION_FLAGS})
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
