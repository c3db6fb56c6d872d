"""The test-grid verdict for the learned scorers (issue #23): per task, domain and budget, each policy's
pooled retention, the share of the StreamingLLM-to-oracle gap it closes, and per-document wins and
losses of every learned policy against every other policy.

Reads the unit records of ``kvpop eval`` results (``results.json``); policies from other runs on the
same documents (matched by the document's sha1 and the budget) come in under a new name, e.g. the
scorer an earlier grid evaluated::

  python research/grid_report.py runs/grid/test/results.json \
      --extra "kvpop-mlp (516k, shipped before)=results/eval/results.json:kvpop-mlp" \
      --extra "kvpop adapted=runs/grid/adapted/results.json:adapted kvpop" \
      --json results/eval-2026-12/verdict.json

``--extra`` also reads ``kvpop compare-adapted`` results (its rows are the policies). Writes the JSON,
a markdown table next to it and a PNG of retention against budget.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

TASKS = {"lm": "all", "continuation": "cont"}  # task -> the sums key of a unit record
HEURISTICS = ("streaming", "tova", "h2o", "snapkv", "knorm", "random")


def _retention(s: dict) -> float:
    return math.exp((s["nll_dense"] - s["nll_policy"]) / s["n"])


def _eval_units(results: dict, rename: dict[str, str] | None = None):
    """(policy, task, domain, budget, doc) -> sums, from ``kvpop eval`` unit records."""
    out = {}
    for u in results["units"]:
        if u.get("kind") != "doc" or not u.get("sums"):
            continue
        pol = u["policy"] if rename is None else rename.get(u["policy"])
        if pol is None:
            continue
        for task, key in TASKS.items():
            if u["sums"].get(key):
                out[(pol, task, u["domain"], u["budget"], u["doc_sha1"])] = u["sums"][key]
    return out


def _adapted_units(results: dict, row: str, name: str, docs: dict):
    """The same from ``kvpop compare-adapted`` documents (matched to the grid's by corpus and index; both
    score the positions from B on, against the base model's dense outputs)."""
    out = {}
    for rec in results["documents"]:
        sha = docs.get((rec["corpus"], str(rec["doc"])))
        for task, field in (("lm", "sums"), ("continuation", "continuation")):
            for b, rows in (rec.get(field) or {}).items():
                if sha is not None and row in rows:
                    out[(name, task, rec["domain"], int(b), sha)] = rows[row]
    return out


def load(main: list[str], extras: list[str], rename: dict[str, str] | None = None):
    units: dict = {}
    docs: dict = {}
    for path in main:
        r = json.loads(Path(path).read_text())
        names = {u["policy"] for u in r["units"]}
        units.update(_eval_units(r, {p: (rename or {}).get(p, p) for p in names}))
        for u in r["units"]:
            if u.get("kind") == "doc":
                docs[(u["source"], str(u["item"]))] = u["doc_sha1"]
    for spec in extras:
        name, _, rest = spec.partition("=")
        path, _, pol = rest.rpartition(":")
        r = json.loads(Path(path).read_text())
        if "units" in r:
            units.update(_eval_units(r, {pol: name}))
        else:
            units.update(_adapted_units(r, pol, name, docs))
    return units


def verdict(units: dict, learned: list[str]) -> list[dict]:
    cells = defaultdict(lambda: defaultdict(dict))  # (task, domain, budget) -> policy -> doc -> sums
    for (pol, task, dom, b, doc), s in units.items():
        cells[(task, dom, b)][pol][doc] = s
    rows = []
    for (task, dom, b), pols in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        docs = sorted(set.intersection(*(set(d) for p, d in pols.items() if p != "dense")))
        if not docs:
            continue

        def pooled(p, pols=pols, docs=docs):
            tot = {k: sum(pols[p][d][k] for d in docs) for k in ("n", "nll_dense", "nll_policy")}
            return _retention(tot)

        ret = {p: pooled(p) for p in pols if p != "dense" and all(d in pols[p] for d in docs)}
        per_doc = {p: [_retention(pols[p][d]) for d in docs] for p in ret}
        row = {"task": task, "domain": dom, "budget": b, "docs": len(docs), "retention": ret, "learned": {}}
        for p in (q for q in learned if q in ret):
            gap = ret.get("oracle", math.nan) - ret.get("streaming", math.nan)
            wl = {}
            for q in ret:
                if q == p:
                    continue
                w = sum(a > c for a, c in zip(per_doc[p], per_doc[q]))
                lo = sum(a < c for a, c in zip(per_doc[p], per_doc[q]))
                wl[q] = [w, lo]
            beaten = [q for q in ret if q in HEURISTICS]
            row["learned"][p] = {
                "gap_closed": (ret[p] - ret["streaming"]) / gap if gap and math.isfinite(gap) else None,
                "wins_losses": wl,
                "beats_every_heuristic_on_mean": all(ret[p] > ret[q] for q in beaten),
                "min_share_of_docs_vs_heuristics": min((wl[q][0] / len(docs) for q in beaten), default=None),
            }
        rows.append(row)
    return rows


def markdown(rows: list[dict], learned: list[str]) -> str:
    out = []
    for task in TASKS:
        for dom in ("in_domain", "out_of_domain"):
            rs = [r for r in rows if r["task"] == task and r["domain"] == dom]
            if not rs:
                continue
            pols = list(dict.fromkeys(p for r in rs for p in r["retention"]))
            pols.sort(
                key=lambda p: (
                    p not in HEURISTICS + ("oracle",),
                    (HEURISTICS + ("oracle",)).index(p) if p in HEURISTICS + ("oracle",) else 0,
                    p,
                )
            )
            out.append(
                f"\n**{task}, {dom.replace('_', ' ')}** ({rs[0]['docs']} documents; pooled retention; for a "
                "learned policy: share of the StreamingLLM-to-oracle gap closed, and documents won-lost "
                "against the best heuristic at that budget)\n"
            )
            out.append("| policy | " + " | ".join(f"B = {r['budget']}" for r in rs) + " |")
            out.append("|---" * (len(rs) + 1) + "|")
            for p in pols:
                cells = []
                for r in rs:
                    v = r["retention"].get(p)
                    cell = "" if v is None else f"{v:.4f}"
                    if p in r["learned"]:
                        lr = r["learned"][p]
                        heur = [q for q in r["retention"] if q in HEURISTICS]
                        best = max(heur, key=lambda q: r["retention"][q])
                        w, lo = lr["wins_losses"][best]
                        gc = lr["gap_closed"]
                        cell += f" ({'' if gc is None else f'{100 * gc:.0f}%, '}{w}-{lo} vs {best})"
                    cells.append(cell)
                out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (t, d)
        for t in TASKS
        for d in ("in_domain", "out_of_domain")
        if any(r["task"] == t and r["domain"] == d for r in rows)
    ]  # only what was run (e.g. one 32k document)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    axes = axes[0]
    names = sorted({p for r in rows for p in r["retention"]})
    colors = {p: plt.cm.tab20(i % 20) for i, p in enumerate(names)}
    for ax, (task, dom) in zip(axes, panels, strict=True):
        rs = sorted((r for r in rows if r["task"] == task and r["domain"] == dom), key=lambda r: r["budget"])
        for p in names:
            pts = [(r["budget"], r["retention"][p]) for r in rs if p in r["retention"]]
            if pts:
                learned = p not in HEURISTICS + ("oracle",)
                ax.plot(
                    *zip(*pts, strict=True),
                    marker="o",
                    lw=2.2 if learned else 1,
                    ls="-" if learned else "--",
                    color=colors[p],
                    label=p,
                )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task}, {dom.replace('_', ' ')}")
        ax.set_xlabel("budget B (tokens per KV head)")
    axes[0].set_ylabel("retention (ppl_dense / ppl_policy)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="kvpop eval results.json")
    p.add_argument("--extra", action="append", default=[], help="NAME=RESULTS.json:POLICY_OR_ROW")
    p.add_argument("--rename", action="append", default=[], help="OLD=NEW: a policy of the main results, renamed")
    p.add_argument("--learned", default=None, help="comma-separated policies to judge (default: kvpop* and extras)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    units = load(args.results, args.extra, dict(r.split("=", 1) for r in args.rename))
    names = sorted({k[0] for k in units})
    learned = args.learned.split(",") if args.learned else [n for n in names if n.startswith("kvpop")]
    rows = verdict(units, learned)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sources": args.results, "extras": args.extra, "rows": rows}, indent=1))
    md = markdown(rows, learned)
    out.with_suffix(".md").write_text(md)
    plot(rows, out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
