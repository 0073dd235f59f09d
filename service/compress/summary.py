"""The console summary of a compression run."""

from __future__ import annotations

from squeezeserve.service.compress.pipeline import CompressResult


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_summary(result: CompressResult) -> str:
    record = result.record
    size = record["size_bytes"]
    ratio = size["after"] / max(size["before"], 1)
    lines = [
        f"wrote {result.out} ({record['method']}, {record['wall_seconds']:.1f} s)",
        f"size: {_mib(size['before'])} -> {_mib(size['after'])} ({ratio:.2f}x)",
        f"sparsity of the decoder linears: {record['sparsity']:.1%}",
    ]
    recovery = record.get("recovery")
    if recovery:
        trained = recovery.get("trained", "weights")
        lines.append(
            f"recovery ({recovery['loss']}, {trained}): {recovery['steps']} steps in "
            f"{recovery['seconds']:.1f} s, loss {recovery['first_loss']:.4g} -> {recovery['last_loss']:.4g}"
        )
    errors = [layer for layer in result.layers if layer.relative_error is not None]
    if errors:
        lines.append("per-layer relative quantization error ||W - Q(W)|| / ||W||:")
        width = max(len(layer.name) for layer in result.layers)
        for layer in result.layers:
            error = "-" if layer.relative_error is None else f"{layer.relative_error:.4f}"
            lines.append(f"  {layer.name:<{width}}  {error:>8}  sparsity {layer.sparsity:.1%}")
        worst = max(errors, key=lambda layer: layer.relative_error or 0.0)
        mean = sum(layer.relative_error or 0.0 for layer in errors) / len(errors)
        lines.append(f"mean error {mean:.4f}; worst {worst.name} {worst.relative_error:.4f}")
    return "\n".join(lines)
