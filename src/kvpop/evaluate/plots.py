"""PNG plots of ``results.json``: the task's primary metric vs compression, one line per policy."""

from __future__ import annotations

from pathlib import Path

PRIMARY = {"lm": "retention", "continuation": "retention", "needle": "accuracy", "agreement": "match_rate"}
LABEL = {
    "retention": "retention (ppl_dense / ppl_policy)",
    "accuracy": "passkey accuracy",
    "match_rate": "greedy token match rate vs dense",
}


def plot_results(results: dict, out: str | Path) -> list[Path]:
    """One PNG per task (``<task>.png``), a panel per domain; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out)
    written = []
    records = results["records"]
    for task in sorted({r["task"] for r in records}):
        metric = PRIMARY[task]
        recs = [r for r in records if r["task"] == task]
        domains = sorted({r["domain"] for r in recs})
        fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 4), squeeze=False)
        for ax, dom in zip(axes[0], domains):
            by_policy: dict[str, list] = {}
            for r in recs:
                if r["domain"] == dom and r["metrics"].get(metric) is not None:
                    by_policy.setdefault(r["policy"], []).append(
                        (r["compression"] or 0.0, r["metrics"][metric])
                    )
            for policy, pts in sorted(by_policy.items()):
                pts.sort()
                xs, ys = zip(*pts)
                if policy == "dense" and len(set(xs)) == 1:  # one dense point: draw it as a reference line
                    ax.axhline(ys[0], color="k", ls="--", lw=1, label="dense")
                    continue
                ax.plot(xs, ys, marker="o", label=policy)
            ax.set_title(f"{task} — {dom}")
            ax.set_xlabel("compression (1 - B / L)")
            ax.set_ylabel(LABEL[metric])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{task}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
