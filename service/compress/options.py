"""What a compression run does, validated before any weight is touched: the one definition of the
compress options, their choices and defaults (``command.py`` builds its flags from it). No torch here, so
``squeezeserve --help`` stays quick.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from squeezeserve.service.datasets import resolve

if TYPE_CHECKING:
    from squeezeserve.service.compress.prune import Sparsity

METHODS = ("int8", "int4", "fp8", "prune", "distill", "lowrank", "codebook")
RECOVER_LOSSES = ("kd", "lm")
STRUCTURES = ("mlp-width", "heads", "layers")
ALGORITHMS = ("gptq", "rtn", "svdllm", "asvd", "svd", "kmeans")
# Which --algorithm each method takes, its default first (methods not listed take none).
METHOD_ALGORITHMS = {
    "int8": ("rtn", "gptq"),
    "int4": ("gptq", "rtn"),
    "lowrank": ("svdllm", "asvd", "svd"),
    "codebook": ("gptq", "kmeans"),
}
CODEBOOK_BITS = (3, 4)
# Methods whose --recover-steps train their own format's parameters after compressing (format_recovery.py).
FORMAT_RECOVERY_METHODS = ("lowrank", "codebook")
PRUNE_METHODS = ("magnitude", "wanda")


@dataclass(frozen=True)
class Defaults:
    """What an option is when the user does not say (method-dependent ones are decided in build_options)."""

    group_size: int = 32  # int4
    damp: float = 0.01  # GPTQ, fraction of the mean Hessian diagonal
    prune_method: str = "wanda"
    calibration_samples: int = 128
    calibration_seq_len: int = 512
    recover_steps: int = 0
    recover_lr: float = 2e-5  # dense weights after pruning
    # Factors and codebook values: a codebook value stands for hundreds of weights, and 12 kd steps on the
    # bundled model's 4-bit codebooks cut the held-out KL most at 3e-4, then 1e-4, then 3e-5 (0.315 ->
    # 0.274 / 0.279 / 0.287; 1e-3: 0.419, worse; CPU probe, NOTES.md); longer runs take the middle one.
    format_recover_lr: float = 1e-4
    recover_batch_size: int = 4
    seed: int = 0
    temperature: float = 1.0  # kd: softmax temperature
    kd_lm_weight: float = 0.0  # kd: share of the LM loss
    codebook_bits: int = 4


DEFAULTS = Defaults()
DEFAULT_GROUP_SIZE = DEFAULTS.group_size


@dataclass(frozen=True)
class CompressOptions:
    method: str
    algorithm: str  # see METHOD_ALGORITHMS (fp8, prune, distill: rtn, meaning "no calibration")
    group_size: int | None  # int4; codebook (None: one codebook per output channel)
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
    # Structured pruning (structured.py) and distillation (distill.py).
    structure: str | None = None  # mlp-width | heads | layers
    ratio: float | None = None  # fraction of the structure removed
    recover_loss: str = "lm"  # kd (teacher: the unpruned source, or --teacher) | lm
    temperature: float = 1.0  # kd softmax temperature
    kd_lm_weight: float = 0.0  # kd: weight of the LM loss mixed into the KL
    teacher: str | None = None  # --method distill: the teacher checkpoint
    # Low-rank factorization (lowrank.py) and weight sharing (codebook.py).
    rank_ratio: float | None = None  # lowrank: parameters kept, as a fraction of the decoder Linears'
    bits: int | None = None  # codebook: index bits (2^bits shared values per codebook)

    @property
    def needs_calibration(self) -> bool:
        return (
            self.algorithm in ("gptq", "svdllm", "asvd", "kmeans")
            or (self.sparsity is not None and self.prune_method == "wanda")
            or self.recover_steps > 0
            or self.structure is not None
        )

    @property
    def recovers_format(self) -> bool:
        """Recovery trains the format's own parameters (low-rank factors, codebook values), after
        compression, not dense weights after pruning (format_recovery.py)."""
        return self.recover_steps > 0 and self.method in FORMAT_RECOVERY_METHODS

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
    damp: float = DEFAULTS.damp,
    sparsity: str | None = None,
    prune_method: str = DEFAULTS.prune_method,
    calibration: str | None = None,
    calibration_samples: int = DEFAULTS.calibration_samples,
    calibration_seq_len: int = DEFAULTS.calibration_seq_len,
    recover_steps: int = DEFAULTS.recover_steps,
    recover_lr: float | None = None,
    recover_batch_size: int = DEFAULTS.recover_batch_size,
    seed: int = DEFAULTS.seed,
    structure: str | None = None,
    ratio: float | None = None,
    recover_loss: str | None = None,
    temperature: float = DEFAULTS.temperature,
    kd_lm_weight: float = DEFAULTS.kd_lm_weight,
    teacher: str | None = None,
    rank_ratio: float | None = None,
    bits: int | None = None,
) -> CompressOptions:
    """Fill in defaults and refuse impossible combinations with a sentence saying why."""
    from squeezeserve.service.compress.prune import parse_sparsity

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if prune_method not in PRUNE_METHODS:
        raise ValueError(f"unknown prune method {prune_method!r}: choose one of {', '.join(PRUNE_METHODS)}")
    parsed = parse_sparsity(sparsity) if sparsity is not None else None
    recover_loss = _check_structured_and_distill(
        method, parsed, structure, ratio, recover_steps, recover_loss, temperature, kd_lm_weight, teacher
    )
    if method == "prune" and parsed is None and structure is None:
        raise ValueError(
            "--method prune needs --sparsity (e.g. 0.5 or 2:4) or --structure mlp-width|heads|layers "
            "--ratio R"
        )
    if method == "fp8" and parsed is not None:
        raise ValueError(
            "fp8 does not combine with --sparsity: vLLM 0.26 has no sparse FP8 kernel, and pruning only "
            "pays with int8/int4 (ours) or as a dense checkpoint (--method prune)"
        )
    algorithm = _check_algorithm(method, algorithm)
    rank_ratio, bits = _check_lowrank_and_codebook(method, rank_ratio, bits, group_size, parsed)
    gptq = algorithm == "gptq"
    if not gptq and (actorder or scale_search or damp != DEFAULTS.damp):
        raise ValueError("--actorder, --scale-search and --damp apply to GPTQ (--algorithm gptq) only")
    if gptq and not 0 < damp < 1:
        raise ValueError(f"--damp is a fraction of the mean Hessian diagonal: 0 < damp < 1, got {damp}")
    if scale_search and method == "codebook":
        raise ValueError("--scale-search searches integer group scales: codebooks have none")
    actorder = gptq if actorder is None else actorder
    scale_search = gptq and method != "codebook" if scale_search is None else scale_search
    if group_size is not None and method not in ("int4", "codebook"):
        raise ValueError(f"--group-size applies to int4 and codebook only ({method} is per-channel)")
    if method == "int4":
        group_size = DEFAULTS.group_size if group_size is None else group_size
        if group_size < 1:
            raise ValueError(f"--group-size must be positive, got {group_size}")
    if symmetric is not None and method != "int4":
        raise ValueError(f"--symmetric/--asymmetric apply to int4 only ({method} is symmetric)")
    if symmetric is None:
        symmetric = method != "int4"
    if recover_steps < 0:
        raise ValueError(f"--recover-steps must be >= 0, got {recover_steps}")
    recovers = method == "distill" or method in FORMAT_RECOVERY_METHODS
    if recover_steps and parsed is None and structure is None and not recovers:
        raise ValueError(
            "--recover-steps fine-tunes a pruned, factored or weight-shared model: give --sparsity or "
            "--structure, or use --method lowrank|codebook"
        )
    if parsed is None and sparsity is None:
        prune_method = "none"
    if recover_lr is None:
        recover_lr = DEFAULTS.format_recover_lr if method in FORMAT_RECOVERY_METHODS else DEFAULTS.recover_lr
    if recover_lr <= 0:
        raise ValueError(f"--recover-lr must be positive, got {recover_lr}")
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
        structure=structure,
        ratio=ratio,
        recover_loss=recover_loss,
        temperature=temperature,
        kd_lm_weight=kd_lm_weight,
        teacher=teacher,
        rank_ratio=rank_ratio,
        bits=bits,
    )
    if options.needs_calibration and not calibration:
        why = "GPTQ" if algorithm == "gptq" else ("Wanda" if prune_method == "wanda" else "recovery")
        why = "structured pruning" if structure is not None else why
        aware = {
            "svdllm": "whitened SVD",
            "asvd": "activation-aware SVD",
            "kmeans": "Hessian-weighted k-means",
        }
        why = aware.get(algorithm, why)
        raise ValueError(
            f"{why} needs calibration text: give --calibration FILE or sample:wikitext-2-calibration "
            "(or --algorithm rtn / --prune-method magnitude)"
        )
    return options


def _check_algorithm(method: str, algorithm: str | None) -> str:
    """The algorithm ``method`` runs: the given one if the method takes it, else its default (``rtn`` for
    the methods without a choice, meaning "no calibrated quantization")."""
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    choices = METHOD_ALGORITHMS.get(method)
    if choices is None:
        if algorithm is not None:
            raise ValueError(f"--algorithm applies to {', '.join(METHOD_ALGORITHMS)}, not {method}")
        return "rtn"
    if algorithm is None:
        return choices[0]
    if algorithm not in choices:
        raise ValueError(f"--method {method} takes --algorithm {' or '.join(choices)}, not {algorithm}")
    return algorithm


def _check_lowrank_and_codebook(
    method: str,
    rank_ratio: float | None,
    bits: int | None,
    group_size: int | None,
    sparsity: Sparsity | None,
) -> tuple[float | None, int | None]:
    """Refuse impossible low-rank / codebook flags; returns (rank_ratio, bits) with defaults filled in."""
    if rank_ratio is not None and method != "lowrank":
        raise ValueError(f"--rank-ratio applies to --method lowrank, not {method}")
    if bits is not None and method != "codebook":
        raise ValueError(f"--bits applies to --method codebook, not {method} (its width is fixed)")
    if method in ("lowrank", "codebook") and sparsity is not None:
        raise ValueError(f"--sparsity does not combine with --method {method}: prune in a run of its own")
    if method == "lowrank":
        if rank_ratio is None:
            raise ValueError("--method lowrank needs --rank-ratio F: the fraction of parameters kept")
        if not 0 < rank_ratio < 1:
            raise ValueError(f"--rank-ratio is the fraction of parameters kept: 0 < F < 1, got {rank_ratio}")
    if method == "codebook":
        bits = DEFAULTS.codebook_bits if bits is None else bits
        if bits not in CODEBOOK_BITS:
            choices = ", ".join(map(str, CODEBOOK_BITS))
            raise ValueError(f"--bits must be one of {choices} for codebooks, got {bits}")
        if group_size is not None and (group_size < 16 or group_size % 16):
            raise ValueError(
                "codebook --group-size must be a multiple of 16 (the kernel's narrowest K tile), "
                f"got {group_size}"
            )
    return rank_ratio, bits


def _calibration_path(calibration: str | None) -> str | None:
    """``--calibration`` as a file path (``sample:NAME`` is a text shipped with the package)."""
    if calibration is None:
        return None
    try:
        return resolve(calibration)
    except KeyError as exc:
        raise ValueError(f"--calibration: {exc.args[0]}") from None


def _check_structured_and_distill(
    method: str,
    sparsity: Sparsity | None,
    structure: str | None,
    ratio: float | None,
    recover_steps: int,
    recover_loss: str | None,
    temperature: float,
    kd_lm_weight: float,
    teacher: str | None,
) -> str:
    """Refuse impossible structured-pruning / distillation flags; returns the recovery loss (kd by default
    after structured pruning, for --method distill and for low-rank / codebook recovery; lm otherwise)."""
    from squeezeserve.service.compress.structured import check_ratio

    if structure is not None or ratio is not None:
        if method != "prune":
            raise ValueError(
                "--structure/--ratio write a smaller dense checkpoint: use them with --method prune "
                "(quantize it in a second run, or with `squeezeserve pipeline`)"
            )
        if structure is None or ratio is None:
            raise ValueError("structured pruning needs both --structure and --ratio")
        if sparsity is not None:
            raise ValueError("--structure and --sparsity are two kinds of pruning: give one")
        check_ratio(structure, ratio)
    if method == "distill":
        if teacher is None:
            raise ValueError("--method distill needs --teacher DIR (e.g. the unpruned baseline)")
        if recover_steps < 1:
            raise ValueError("--method distill needs --recover-steps N (N >= 1)")
    elif teacher is not None:
        raise ValueError("--teacher applies to --method distill (pruning runs distil from their source)")
    if recover_loss is None:
        kd = structure is not None or method == "distill" or method in FORMAT_RECOVERY_METHODS
        recover_loss = "kd" if kd else "lm"
    if recover_loss not in RECOVER_LOSSES:
        choices = ", ".join(RECOVER_LOSSES)
        raise ValueError(f"unknown --recover-loss {recover_loss!r}: choose one of {choices}")
    if temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {temperature}")
    if not 0.0 <= kd_lm_weight <= 1.0:
        raise ValueError(f"--kd-lm-weight is a mixing weight: 0 <= w <= 1, got {kd_lm_weight}")
    return recover_loss
