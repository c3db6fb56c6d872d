"""Scorer runs side by side on their validation windows: retention under the real cache per budget, on lm
and continuation, and per-window wins against a reference run (paired: the same windows).

    python research/validation_table.py --reference "shipped=results/design/kvpop-mlp-1M.summary.json@123" \
        "cross-heads 8 seq=runs/design/cross-008/summary.json" --json results/design/validation.json

Each argument is NAME=SUMMARY[@STEP]: a ``kvpop train`` summary.json (or a shipped scorer's summary), and the
validation step to read (default: the run's best). Prints a markdown table; ``--json`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpop.files import write_json


def validations(summary: dict) -> list[dict]:
    """Every validation a summary records (a run's history, or a shipped scorer's ``validation_retention``)."""
    if "validation_retention" in summary:
        return list(summary["validation_retention"])
    return [{"step": h["step"], **h["val"]} for h in summary.get("history", []) if "val" in h]


def pick(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition("=")
    if not rest:
        raise SystemExit(f"expected NAME=SUMMARY[@STEP], got {spec!r}")
    path, _, step = rest.partition("@")
    summary = json.loads(Path(path).read_text())
    vals = validations(summary)
    if not vals:
        raise SystemExit(f"{path} records no validation")
    want = int(step) if step else (summary.get("best") or {}).get("step")
    chosen = next((v for v in vals if v.get("step") == want), None)
    if chosen is None:
        raise SystemExit(f"{path} has no validation at step {want} (it has {[v.get('step') for v in vals]})")
    return name, chosen


def budgets_of(v: dict) -> list[str]:
    return sorted((k for k in v if k.isdigit()), key=int)


def compare(name: str, v: dict, ref: dict | None) -> dict:
    row: dict = {"name": name, "step": v.get("step"), "budgets": {}}
    for b in budgets_of(v):
        cell = v[b]
        out = {
            "lm": cell["retention"],
            "continuation": cell["continuation"],
            "streaming": cell["streaming"],
            "streaming_continuation": cell["streaming_continuation"],
            "docs": cell["docs"],
            "lm_wins_vs_streaming": cell["wins_vs_streaming"],
            "continuation_wins_vs_streaming": cell["continuation_wins_vs_streaming"],
        }
        if ref is not None and b in ref:
            mine, theirs = cell["per_doc"], ref[b]["per_doc"]
            if [d["corpus"] for d in mine] != [d["corpus"] for d in theirs]:
                raise SystemExit(f"{name} and the reference were validated on different windows at B = {b}")
            out["lm_better_than_reference"] = sum(a["retention"] > c["retention"] for a, c in zip(mine, theirs))
            out["continuation_better_than_reference"] = sum(
                a["continuation"] > c["continuation"] for a, c in zip(mine, theirs)
            )
        row["budgets"][b] = out
    row["mean_retention"] = v.get("mean_retention")
    return row


def markdown(rows: list[dict], ref_name: str | None) -> str:
    budgets = sorted({b for r in rows for b in r["budgets"]}, key=int)
    head = ["run"] + [f"B = {b}: lm / continuation" for b in budgets] + ["mean"]
    if ref_name:
        head.append(f"windows better than {ref_name}, lm / continuation, per budget")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['name']} (step {r['step']})"]
        for b in budgets:
            c = r["budgets"].get(b)
            cells.append("" if c is None else f"{c['lm']:.4f} / {c['continuation']:.4f}")
        cells.append(f"{r['mean_retention']:.4f}" if r["mean_retention"] is not None else "")
        if ref_name:
            wins = [r["budgets"][b] for b in budgets if "lm_better_than_reference" in r["budgets"].get(b, {})]
            cells.append(
                (
                    ", ".join(
                        f"{c['lm_better_than_reference']} / {c['continuation_better_than_reference']}" for c in wins
                    )
                    + f" of {wins[0]['docs']}"
                )
                if wins
                else "-"
            )
        lines.append("| " + " | ".join(cells) + " |")
    any_row = rows[0]["budgets"]
    lines.append(
        "| StreamingLLM | "
        + " | ".join(
            f"{any_row[b]['streaming']:.4f} / {any_row[b]['streaming_continuation']:.4f}" if b in any_row else ""
            for b in budgets
        )
        + " | |"
        + (" |" if ref_name else "")
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="NAME=SUMMARY[@STEP]")
    p.add_argument("--reference", default=None, help="NAME=SUMMARY[@STEP]: per-window wins are counted against it")
    p.add_argument("--json", default=None, help="write the table as JSON here")
    args = p.parse_args()
    ref_name, ref = pick(args.reference) if args.reference else (None, None)
    rows = ([compare(ref_name, ref, None)] if ref is not None else []) + [compare(*pick(s), ref) for s in args.runs]
    print(markdown(rows, ref_name))
    if args.json:
        write_json(args.json, {"reference": ref_name, "rows": rows})


if __name__ == "__main__":
    main()
