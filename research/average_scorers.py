"""Average trained MLP scorers into one checkpoint (``kvpop.scorers.average.average_scorers``).

    python research/average_scorers.py A.safetensors B.safetensors [--weights 0.5,0.5] --out AB.safetensors

The result is an ordinary ``kvpop-mlp`` checkpoint (hidden = the members' widths summed) whose score is
the weighted mean of the members' scores; use it anywhere a scorer goes (``--scorer AB.safetensors``).
Members must be trained for the same model and the same budget split (``trained_for``); its metadata
records the members, their weights and the union of their corpora.
"""

import argparse
import hashlib
from pathlib import Path

from kvpop.checkpoint import load_scorer, save_scorer
from kvpop.scorers.average import average_scorers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("members", nargs="+", help="MLP scorer checkpoints (.safetensors)")
    p.add_argument("--weights", default=None, help="comma-separated positive weights (default: equal)")
    p.add_argument("--out", required=True, help="the averaged checkpoint to write")
    args = p.parse_args()
    weights = None if args.weights is None else [float(w) for w in args.weights.split(",")]
    if len(args.members) < 2:
        raise SystemExit("average_scorers: give at least two members")
    stacks, metas = zip(*(load_scorer(m) for m in args.members))  # a missing or corrupt file fails here
    for name in ("fingerprint", "trained_for"):
        for m, meta in zip(args.members[1:], metas[1:]):
            if meta.get(name) != metas[0].get(name):
                raise SystemExit(f"average_scorers: {m} has a different {name} than {args.members[0]}")
    merged = average_scorers(stacks, weights)
    n = len(stacks)
    used = weights or [1.0] * n
    corpora = sorted({c for meta in metas for c in (meta.get("corpora") or [])})
    meta = {
        "trained_for": metas[0].get("trained_for"),
        "fingerprint": metas[0].get("fingerprint"),
        "corpora": corpora,
        "loss": metas[0].get("loss"),
        "weighting": metas[0].get("weighting"),
        "average_of": [
            {
                "path": str(m),
                "weight": w / sum(used),
                "sha256": hashlib.sha256(Path(m).read_bytes()).hexdigest()[:16],
                "steps": meta.get("steps"),
                "tokens_seen": meta.get("tokens_seen"),
                "corpora": meta.get("corpora"),
            }
            for m, w, meta in zip(args.members, used, metas)
        ],
        "tokens_seen": sum(meta.get("tokens_seen") or 0 for meta in metas),
    }
    save_scorer(merged, args.out, meta)
    print(f"averaged {n} scorers (hidden {merged.config.hidden}) -> {args.out}")


if __name__ == "__main__":
    main()
