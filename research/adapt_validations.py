"""The validations of one or more `kvpop adapt` runs side by side (e.g. the arms of an experiment).

Reads each run's ``train_state.pt`` (its starting baseline and every validation in its history),
prints lm and continuation retention per budget with the per-window lm retentions, and writes
them as JSON (``--out``), so an experiment's record is committed as data, not as a log excerpt:

    python research/adapt_validations.py runs/joint/frozen runs/joint/moving --out results/adapt/joint.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvpop.files import write_json


def _row(q: dict) -> dict:
    """One validation: per budget (and ``dense``, the adapted model without eviction), lm / continuation
    retention and the per-window lm retentions."""
    out = {}
    for b, v in q.items():
        if not isinstance(v, dict) or "retention" not in v:
            continue
        out[b] = {
            "lm": v["retention"],
            "continuation": v.get("continuation", {}).get("retention"),
            "per_window_lm": [d["retention"] for d in v.get("per_doc", [])],
        }
    return out


def run_record(path: Path) -> dict:
    state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    cfg = state["config"]
    keep = ("joint", "lr", "scorer_lr", "steps", "seq_len", "budgets", "budget_range", "lora_r", "val_docs", "scorer")
    return {
        "run": str(path),
        "settings": {k: cfg.get(k) for k in keep},
        "steps_done": state["step"],
        "baseline": _row(state.get("baseline") or {}),
        "validations": [{"step": h["step"], **_row(h["val"])} for h in state["history"] if h.get("val")],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="kvpop adapt output folders")
    ap.add_argument("--out", help="JSON to write")
    args = ap.parse_args()
    records = [run_record(Path(r)) for r in args.runs]
    for rec in records:
        print(f"{rec['run']} ({rec['steps_done']} steps; {rec['settings']})")
        for name, row in [("start", rec["baseline"])] + [(f"step {v['step']}", v) for v in rec["validations"]]:
            cells = [
                f"{'B=' + b if b.isdigit() else b}: lm {r['lm']:.4f}"
                + (f" cont {r['continuation']:.4f}" if r["continuation"] is not None else "")
                + (f" [{' '.join(f'{x:.3f}' for x in r['per_window_lm'])}]" if r["per_window_lm"] else "")
                for b, r in row.items()
                if isinstance(r, dict)
            ]
            print(f"  {name:>8}  " + " | ".join(cells))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, records)


if __name__ == "__main__":
    main()
