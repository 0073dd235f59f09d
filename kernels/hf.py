"""Make a loaded Hugging Face Llama-family model run its norms and MLP activation through our ops.

``patch_model(model)`` swaps, in place, every RMSNorm module (a module whose class name ends in
"RMSNorm" with a ``weight`` and ``variance_epsilon``) for :class:`~squeezeserve.kernels.modules.RMSNorm`
and every SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj`` with a SiLU ``act_fn``) for
:class:`~squeezeserve.kernels.modules.SwiGLUMLP`. Parameters are shared, not copied, so state-dict keys
and memory are unchanged. On CPU the ops run the references, which repeat Hugging Face's operations in
the same order: logits and greedy generations are bit-identical to the unpatched model.
"""

from __future__ import annotations

from torch import nn

from squeezeserve.kernels.modules import RMSNorm, SwiGLUMLP


def _is_rmsnorm(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and module.weight.dim() == 1
        and hasattr(module, "variance_epsilon")
    )


def _is_silu(module: nn.Module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _is_swiglu_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and _is_silu(
        getattr(module, "act_fn", None) or nn.Identity()
    )


def _replacement(module: nn.Module) -> tuple[str, nn.Module] | None:
    if isinstance(module, RMSNorm | SwiGLUMLP):
        return None
    if _is_rmsnorm(module):
        norm = RMSNorm(module.weight.shape[0], module.variance_epsilon)
        norm.weight = module.weight
        return "rmsnorm", norm
    if _is_swiglu_mlp(module):
        return "swiglu_mlp", SwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj)
    return None


def patch_model(model: nn.Module) -> dict[str, int]:
    """Replace RMSNorms and SwiGLU MLPs in ``model`` (in place); returns {"rmsnorm": n, "swiglu_mlp": m}."""
    counts = {"rmsnorm": 0, "swiglu_mlp": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            found = _replacement(child)
            if found is not None:
                kind, new = found
                setattr(parent, name, new)
                counts[kind] += 1
    return counts
