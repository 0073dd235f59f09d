"""What a compression run does, validated before any weight is touched."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from squeezeserve.service.compress.prune import PRUNE_METHODS, Sparsity, parse_sparsity
from squeezeserve.service.datasets import resolve

METHODS = ("int8", "int4", "fp8", "prune")
ALGORITHMS = ("gptq", "rtn")
DEFAULT_GROUP_SIZE = 32
DEFAULT_DAMP = 0.01


@dataclass(frozen=True)
class CompressOptions:
    method: str
    algorithm: str  # gptq | rtn (fp8 and prune: rtn, meaning "no calibration for quantization")
    group_size: int | None  # int4 only
    symmetric: bool
    actorder: bool  # GPTQ: sweep columns by decreasing Hessian diagonal (compressed-tensors "weight")
    scale_search: bool  # GPTQ: group scale/zero point searched (Hessian-diagonal-weighted), not min/max
    damp: float  # GPTQ: damping, as a fraction of the mean Hessian diagonal
    sparsity: Sparsity | None
    prune_method: str
    calibration: str | None
    calibration_samples: int
    calibration_seq_len: int
    recover_steps: int
    recover_lr: float
    recover_batch_size: int
    seed: int

    @property
    def needs_calibration(self) -> bool:
        return (
            self.algorithm == "gptq"
            or (self.sparsity is not None and self.prune_method == "wanda")
            or self.recover_steps > 0
        )

    def record(self) -> dict[str, Any]:
        record = asdict(self)
        record["sparsity"] = None if self.sparsity is None else str(self.sparsity)
        return record


def build_options(
    method: str,
    algorithm: str | None = None,
    group_size: int | None = None,
    symmetric: bool | None = None,
    actorder: bool | None = None,
    scale_search: bool | None = None,
    damp: float = DEFAULT_DAMP,
    sparsity: str | None = None,
    prune_method: str = "wanda",
    calibration: str | None = None,
    calibration_samples: int = 128,
    calibration_seq_len: int = 512,
    recover_steps: int = 0,
    recover_lr: float = 2e-5,
    recover_batch_size: int = 4,
    seed: int = 0,
) -> CompressOptions:
    """Fill in defaults and refuse impossible combinations with a sentence saying why."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if prune_method not in PRUNE_METHODS:
        raise ValueError(f"unknown prune method {prune_method!r}: choose one of {', '.join(PRUNE_METHODS)}")
    parsed = parse_sparsity(sparsity) if sparsity is not None else None
    if method == "prune" and parsed is None:
        raise ValueError("--method prune needs --sparsity (e.g. 0.5 or 2:4)")
    if method == "fp8" and parsed is not None:
        raise ValueError(
            "fp8 does not combine with --sparsity: vLLM 0.26 has no sparse FP8 kernel, and pruning only "
            "pays with int8/int4 (ours) or as a dense checkpoint (--method prune)"
        )
    if algorithm is not None and method in ("fp8", "prune"):
        raise ValueError(f"--algorithm applies to int8/int4, not {method}")
    if algorithm is None:
        algorithm = "gptq" if method == "int4" else "rtn"
    gptq = algorithm == "gptq"
    if not gptq and (actorder or scale_search or damp != DEFAULT_DAMP):
        raise ValueError("--actorder, --scale-search and --damp apply to GPTQ (--algorithm gptq) only")
    if gptq and not 0 < damp < 1:
        raise ValueError(f"--damp is a fraction of the mean Hessian diagonal: 0 < damp < 1, got {damp}")
    actorder = gptq if actorder is None else actorder
    scale_search = gptq if scale_search is None else scale_search
    if group_size is not None and method != "int4":
        raise ValueError(f"--group-size applies to int4 only ({method} is per-channel)")
    if method == "int4":
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        if group_size < 1:
            raise ValueError(f"--group-size must be positive, got {group_size}")
    if symmetric is not None and method != "int4":
        raise ValueError(f"--symmetric/--asymmetric apply to int4 only ({method} is symmetric)")
    if symmetric is None:
        symmetric = method != "int4"
    if recover_steps < 0:
        raise ValueError(f"--recover-steps must be >= 0, got {recover_steps}")
    if recover_steps and parsed is None:
        raise ValueError("--recover-steps fine-tunes a pruned model: give --sparsity too")
    if parsed is None and sparsity is None:
        prune_method = "none"
    options = CompressOptions(
        method=method,
        algorithm=algorithm,
        group_size=group_size,
        symmetric=symmetric,
        actorder=actorder,
        scale_search=scale_search,
        damp=damp,
        sparsity=parsed,
        prune_method=prune_method,
        calibration=_calibration_path(calibration),
        calibration_samples=calibration_samples,
        calibration_seq_len=calibration_seq_len,
        recover_steps=recover_steps,
        recover_lr=recover_lr,
        recover_batch_size=recover_batch_size,
        seed=seed,
    )
    if options.needs_calibration and not calibration:
        why = "GPTQ" if algorithm == "gptq" else ("Wanda" if prune_method == "wanda" else "recovery")
        raise ValueError(
            f"{why} needs calibration text: give --calibration FILE or sample:wikitext-2-calibration "
            "(or --algorithm rtn / --prune-method magnitude)"
        )
    return options


def _calibration_path(calibration: str | None) -> str | None:
    """``--calibration`` as a file path (``sample:NAME`` is a text shipped with the package)."""
    if calibration is None:
        return None
    try:
        return resolve(calibration)
    except KeyError as exc:
        raise ValueError(f"--calibration: {exc.args[0]}") from None
