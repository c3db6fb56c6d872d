"""Collect the sweep's runs (runs/sweep/*/summary.json) into a markdown table and a JSON file.

python research/sweep_table.py [runs/sweep runs/final ...] [--json results/sweep.json]
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="*", default=["runs/sweep"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for summ in [f for folder in args.folders for f in sorted(Path(folder).glob("*/summary.json"))]:
        s = json.loads(summ.read_text())
        cfg = s["config"]
        val = next((h["val"] for h in reversed(s["history"]) if "val" in h), None)
        if val is None:
            continue
        row = {
            "run": f"{summ.parent.parent.name}/{summ.parent.name}",
            "kind": cfg["scorer"],
            "budgets": cfg["budgets"],
            "window_fraction": cfg["window_fraction"],
            "observed": cfg["observed"],
            "position_free": cfg["position_free"],
            "tilt": cfg["tilt"],
            "loss": cfg["loss"],
            "weighting": cfg["weighting"],
            "hidden": cfg["hidden"],
            "lam": cfg["lam"],
            "steps": s["steps"],
            "tokens_seen": s["tokens_seen"],
            "seconds": round(s["seconds_this_process"]),
            "mean_retention": val["mean_retention"],
        }
        for b in cfg["budgets"]:
            v = val[str(b)]
            row[f"B{b}"] = {
                "retention": v["retention"],
                "streaming": v["streaming"],
                "wins": v["wins_vs_streaming"],
                "docs": v["docs"],
                "kl": v["kl"],
                "per_doc": [d["retention"] for d in v["per_doc"]],
            }
        dec = s.get("validation_decisions", {})
        if dec:
            d = dec[str(cfg["budgets"][0])]
            row["decision_accuracy"] = d["accuracy"]
            row["mass_weighted_accuracy"] = d["mass_weighted_accuracy"]
            row["rank_correlation"] = d["rank_correlation"]
            row["always_evict"] = d["baselines"]["always_evict"]["accuracy"]
            row["always_keep"] = d["baselines"]["always_keep"]["accuracy"]
        rows.append(row)
    # paired with the run named "base" (same validation windows): mean difference at B = 512, windows improved
    base = next((r for r in rows if r["run"].endswith("/base")), None)
    for r in rows:
        if (
            base is not None
            and r is not base
            and "B512" in r
            and len(r["B512"]["per_doc"]) == len(base["B512"]["per_doc"])
        ):
            d = [a - b for a, b in zip(r["B512"]["per_doc"], base["B512"]["per_doc"])]
            r["vs_base_512"] = {"mean_difference": sum(d) / len(d), "better": sum(x > 0 for x in d), "docs": len(d)}
    print(
        "| run | kind | budgets | window | inputs | loss | retention (streaming) per budget | vs base at 512 (windows better) | wins vs streaming | decision acc (mass-weighted) | always-evict / always-keep acc | train s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        inputs = (
            "k,v"
            + (" +obs" if r["observed"] else "")
            + (" pos-free" if r["position_free"] else " rope")
            + (" +tilt" if r["tilt"] else "")
            + f" h{r['hidden']}"
            + (f" lam {r['lam']}" if r["lam"] else "")
        )
        ret = ", ".join(f"{b}: {r[f'B{b}']['retention']:.4f} ({r[f'B{b}']['streaming']:.4f})" for b in r["budgets"])
        wins = ", ".join(f"{r[f'B{b}']['wins']}/{r[f'B{b}']['docs']}" for b in r["budgets"])
        acc = f"{r.get('decision_accuracy', float('nan')):.3f} ({r.get('mass_weighted_accuracy', float('nan')):.3f})"
        floor = f"{r.get('always_evict', float('nan')):.3f} / {r.get('always_keep', float('nan')):.3f}"
        vb = r.get("vs_base_512")
        vs = f"{vb['mean_difference']:+.4f} ({vb['better']}/{vb['docs']})" if vb else "-"
        print(
            f"| {r['run']} | {r['kind']} | {r['budgets']} | {r['window_fraction']} | {inputs} | {r['loss']}/{r['weighting']} "
            f"| {ret} | {vs} | {wins} | {acc} | {floor} | {r['seconds']} |"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
