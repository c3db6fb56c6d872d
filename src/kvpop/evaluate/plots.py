"""PNG plots of ``results.json`` (matplotlib, Agg).

- ``lm.png`` / ``continuation.png``: retention vs compression, one line per policy with its 95%
  bootstrap band; rows: all tokens, long-dependency tokens; columns: domains.
- ``needle.png``: accuracy vs compression; ``needle_heatmap.png``: length x depth, one panel per
  policy and budget (green: found).
- ``multikey.png``: accuracy vs prompt length, one panel per compression.
- ``agreement.png``: greedy match rate vs compression.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .plotting import pyplot, save_figure
from .report import PRIMARY

LABEL = {
    "retention": "retention (ppl_dense / ppl_policy)",
    "accuracy": "accuracy",
    "match_rate": "greedy token match rate vs dense",
}


def _colors(policies):
    plt = pyplot()
    cmap = plt.get_cmap("tab10")
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


def _curve(ax, recs, getter, colors, order):
    """One line (+ band) per policy over compression; dense drawn as a dashed reference."""
    by_policy: dict[str, list] = {}
    for r in recs:
        y, ci = getter(r)
        if y is None:
            continue
        by_policy.setdefault(r["policy"], []).append((r["compression"] or 0.0, y, ci, r["budget"]))
    for policy in sorted(by_policy, key=lambda p: order.index(p) if p in order else len(order)):
        pts = sorted(by_policy[policy], key=lambda t: t[0])
        if policy == "dense":
            ax.axhline(pts[0][1], color="k", ls="--", lw=1, label="dense")
            continue
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", ms=4, label=policy, color=colors.get(policy))
        if all(p[2] for p in pts) and len(pts) > 1:
            ax.fill_between(xs, [p[2][0] for p in pts], [p[2][1] for p in pts], alpha=0.12, color=colors.get(policy))
        elif len(pts) == 1 and pts[0][2]:
            y, (lo, hi) = pts[0][1], pts[0][2]
            ax.errorbar(xs, [y], yerr=[[max(0.0, y - lo)], [max(0.0, hi - y)]], color=colors.get(policy), capsize=3)
    ax.set_xlabel("compression (1 - B / L)")
    ax.grid(alpha=0.3)


def _doc_plot(task, recs, out, colors, order):
    plt = pyplot()
    domains = sorted({r["domain"] for r in recs})
    fig, axes = plt.subplots(2, len(domains), figsize=(5.5 * len(domains), 8), squeeze=False)
    for j, dom in enumerate(domains):
        rs = [r for r in recs if r["domain"] == dom]
        n = rs[0]["n_items"]
        _curve(
            axes[0][j],
            rs,
            lambda r: (r["metrics"].get("retention"), (r.get("ci") or {}).get("retention")),
            colors,
            order,
        )
        axes[0][j].set_title(f"{task}: all tokens — {dom} ({n} docs)")
        _curve(
            axes[1][j],
            rs,
            lambda r: (
                (r.get("longdep") or {}).get("retention"),
                ((r.get("longdep") or {}).get("ci") or {}).get("retention"),
            ),
            colors,
            order,
        )
        axes[1][j].set_title(f"{task}: long-dependency tokens — {dom}")
        thr = next(((r.get("longdep") or {}).get("threshold") for r in rs if r.get("longdep")), None)
        if thr is not None:
            axes[1][j].text(
                0.01,
                0.01,
                f"tokens where sinks + the last B - sinks tokens lose > {thr:g} nats vs dense;\n"
                f"streaming sees exactly that context, so its retention is below ~e^-{thr:g} by construction",
                transform=axes[1][j].transAxes,
                fontsize=7,
                va="bottom",
                alpha=0.8,
            )
        for i in range(2):
            axes[i][j].set_ylabel(LABEL["retention"])
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{task}.png"
    save_figure(fig, path, dpi=90)
    return path


def _simple_plot(task, recs, out, colors, order, name=None):
    plt = pyplot()
    metric = PRIMARY[task]
    domains = sorted({r["domain"] for r in recs})
    fig, axes = plt.subplots(1, len(domains), figsize=(5.5 * len(domains), 4), squeeze=False)
    for ax, dom in zip(axes[0], domains):
        rs = [r for r in recs if r["domain"] == dom]
        _curve(ax, rs, lambda r: (r["metrics"].get(metric), (r.get("ci") or {}).get(metric)), colors, order)
        ax.set_title(f"{task} — {dom} ({rs[0]['n_items']} cases)")
        ax.set_ylabel(LABEL[metric])
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / (name or f"{task}.png")
    save_figure(fig, path, dpi=90)
    return path


def _multikey_plot(recs, out, colors, order):
    plt = pyplot()
    budgets = sorted({r["budget"] for r in recs if r["budget"] is not None}, reverse=True)
    comps = {r["budget"]: r["compression"] for r in recs}
    fig, axes = plt.subplots(1, max(1, len(budgets)), figsize=(5 * max(1, len(budgets)), 4), squeeze=False)
    dense = [r for r in recs if r["policy"] == "dense"]
    for ax, b in zip(axes[0], budgets or [None]):
        rs = [r for r in recs if r["budget"] == b and r["policy"] != "dense"] + dense
        for r in sorted(rs, key=lambda r: order.index(r["policy"]) if r["policy"] in order else len(order)):
            pts = sorted((int(L), v["accuracy"]) for L, v in r["by_length"].items())
            kw = {"color": "k", "ls": "--"} if r["policy"] == "dense" else {"color": colors.get(r["policy"])}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=r["policy"], **kw)
        ax.set_title(f"multi-key recall, compression {comps.get(b, 0):.4g} (B={b})")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "multikey.png"
    save_figure(fig, path, dpi=90)
    return path


def _needle_heatmap(recs, out, order):
    plt = pyplot()
    budgets = sorted({r["budget"] for r in recs if r["budget"] is not None}, reverse=True)
    policies = [p for p in order if any(r["policy"] == p for r in recs)]
    policies += sorted({r["policy"] for r in recs} - set(policies))
    cases = [c for r in recs for c in r.get("cases", [])]
    lengths = sorted({c["length"] for c in cases})
    depths = sorted({c["depth"] for c in cases})
    if not lengths or not depths:
        return None
    rows = [None] if not budgets else budgets
    fig, axes = plt.subplots(
        len(rows), len(policies), figsize=(1.6 * len(policies) + 1, 1.5 * len(rows) + 1), squeeze=False
    )
    comps = {r["budget"]: r["compression"] for r in recs}
    for i, b in enumerate(rows):
        for j, p in enumerate(policies):
            ax = axes[i][j]
            r = next((r for r in recs if r["policy"] == p and (r["budget"] == b or r["budget"] is None)), None)
            grid = np.full((len(lengths), len(depths)), np.nan)
            for c in (r or {}).get("cases", []):
                grid[lengths.index(c["length"]), depths.index(c["depth"])] = 1.0 if c["correct"] else 0.0
            ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=6)
            ax.set_yticks(range(len(lengths)), [str(L) for L in lengths], fontsize=6)
            if i == 0:
                ax.set_title(p, fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{comps.get(b, 0):.4g} (B={b})\nlength", fontsize=7)
            if i == len(rows) - 1:
                ax.set_xlabel("depth", fontsize=7)
    fig.suptitle("passkey found (green) by prompt length x depth, per policy and compression", fontsize=9)
    fig.tight_layout()
    path = out / "needle_heatmap.png"
    save_figure(fig, path, dpi=90)
    return path


def plot_results(results: dict, out: str | Path) -> list[Path]:
    """Writes the PNGs listed in the module docstring for the tasks present; returns their paths."""
    out = Path(out)
    records = results["records"]
    order = list(results.get("policies") or [])
    colors = _colors([p for p in order if p != "dense"])
    written = []
    for task in ("lm", "continuation", "needle", "multikey", "agreement"):
        recs = [r for r in records if r["task"] == task]
        if not recs:
            continue
        if task in ("lm", "continuation"):
            written.append(_doc_plot(task, recs, out, colors, order))
        elif task == "multikey":
            written.append(_multikey_plot(recs, out, colors, order))
            written.append(_simple_plot(task, recs, out, colors, order, name="multikey_vs_compression.png"))
        else:
            written.append(_simple_plot(task, recs, out, colors, order))
            if task == "needle":
                h = _needle_heatmap(recs, out, order)
                if h is not None:
                    written.append(h)
    return written
