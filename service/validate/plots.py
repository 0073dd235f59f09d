"""PNG plots: latency vs concurrency for both sides, and the accuracy/KL summary (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

_PANELS = (
    ("ttft_p50_ms", "TTFT p50 (ms)"),
    ("tpot_p50_ms", "TPOT p50 (ms)"),
    ("e2e_p50_ms", "E2E p50 (ms)"),
    ("output_throughput", "output tokens/s"),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_plot(latency: dict, out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (key, label) in zip(axes.flat, _PANELS, strict=True):
        for side, marker in (("baseline", "o"), ("candidate", "s")):
            rows = [r for r in latency[side] if r.get(key) is not None]
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], marker=marker, label=side)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    path = out / "latency_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_plot(accuracy: dict, kl_per_token: list[float] | None, out: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    ppl = [accuracy["baseline"]["perplexity"], accuracy["candidate"]["perplexity"]]
    bars = left.bar(["baseline", "candidate"], ppl, color=["tab:blue", "tab:orange"])
    left.bar_label(bars, fmt="%.3f")
    left.set_title(f"perplexity (ln ratio {accuracy['fidelity']['ln_ppl_ratio']:+.4f})")
    fid = accuracy["fidelity"]
    if kl_per_token:
        right.hist(kl_per_token, bins=50, color="tab:orange", log=True)
        right.axvline(fid["kl_mean"], color="k", linestyle="--", label=f"mean {fid['kl_mean']:.4f}")
        right.axvline(fid["kl_p99"], color="r", linestyle=":", label=f"p99 {fid['kl_p99']:.4f}")
        right.legend()
        right.set_title(f"per-token KL, top-1 agreement {fid['top1_agreement']:.3f}")
        right.set_xlabel("KL(baseline || candidate), nats")
    else:
        right.axis("off")
        right.text(
            0.5,
            0.5,
            f"KL unavailable over HTTP\ntop-1 agreement {fid['top1_agreement']:.3f}",
            ha="center",
            va="center",
        )
    fig.tight_layout()
    path = out / "accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
