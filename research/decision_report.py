"""Boundary-decision diagnostics of trained scorers: accuracy next to the trivial baselines, and
per-layer / per-head accuracy as a heatmap, to see where a scorer fails (issue: diagnostics).

    python research/decision_report.py runs/final/mlstm/summary.json runs/final/mlp/summary.json --out results/diagnostics

Reads the ``validation_decisions`` block that ``kvpop train`` writes to ``summary.json`` (validation
split only). Position-only scores are among the baselines: a recency score (newest first) always
admits the exiting token (``always_keep``, which is StreamingLLM's decision), an age score (oldest
first) always rejects it (``always_evict``).
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("summaries", nargs="+", help="summary.json files of kvpop train runs")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    panels = []
    for path in args.summaries:
        summary = json.loads(Path(path).read_text())
        kind = summary["config"]["scorer"]
        for budget, block in summary["validation_decisions"].items():
            name = f"{kind} B={budget}"
            report[name] = {
                "summary": path,
                "decisions": block["decisions"],
                "accuracy": block["accuracy"],
                "mass_weighted_accuracy": block["mass_weighted_accuracy"],
                "rank_correlation": block["rank_correlation"],
                "baselines": block["baselines"],
                "worst_heads": sorted(
                    (
                        (acc, layer, head)
                        for layer, row in enumerate(block["per_head_accuracy"])
                        for head, acc in enumerate(row)
                    )
                )[:5],
            }
            panels.append((name, block["per_head_accuracy"]))
            base = ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in block["baselines"].items())
            print(
                f"{name}: accuracy {block['accuracy']:.3f} (mass-weighted {block['mass_weighted_accuracy']:.3f}), "
                f"rank corr {block['rank_correlation']:.3f}; baselines: {base}"
            )
    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 * len(panels) + 1, 6), squeeze=False)
    for ax, (name, grid) in zip(axes[0], panels):
        im = ax.imshow(grid, aspect="auto", vmin=0.5, vmax=1.0, cmap="viridis")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(len(grid[0])))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="boundary decision accuracy")
    fig.savefig(out / "decisions_per_head.png", dpi=120)
    (out / "decisions.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'decisions.json'} and {out / 'decisions_per_head.png'}")


if __name__ == "__main__":
    main()
