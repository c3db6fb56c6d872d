"""Does a scorer's boundary loss follow its retention? (the joint-training diagnosis of issue #23)

For each scorer checkpoint given: the loss `kvpop adapt --joint` descends (its own
:func:`kvpop.adapt.loop.scorer_step`, gradients thrown away) on (a) the first ``--train`` sequences
of an adapt run's training stream and (b) its first ``--val`` validation windows, both captured on
the run's base model, at every budget of the run (windows and lam as the run resolved them).
Retention under the real cache of the same scorers comes from the runs themselves
(``research/adapt_validations.py``). Prints and writes JSON.

    OMP_NUM_THREADS=1 python research/scorer_loss_check.py --run runs/joint/frozen \
        --scorers src/kvpop/assets/scorers/smollm2-135m-instruct-mlp.safetensors runs/joint/frozen/adapter/scorer.safetensors \
        --out results/adapt/joint/loss-frozen-step16.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a kvpop adapt output folder (its settings and data streams)")
    ap.add_argument("--scorers", nargs="+", required=True, help="scorer checkpoints to compare")
    ap.add_argument("--train", type=int, default=16, help="training sequences (the first of the run's stream)")
    ap.add_argument("--val", type=int, default=4, help="validation windows (the first of the run's)")
    ap.add_argument("--out", required=True, help="JSON to write")
    args = ap.parse_args()
    state = Path(args.run) / "train_state.pt"
    if not state.is_file():
        raise SystemExit(f"run: no train_state.pt in {args.run}")
    for p in args.scorers:
        if not Path(p).is_file():
            raise SystemExit(f"scorers: no file {p}")

    import kvpop
    from kvpop.adapt.config import AdaptConfig
    from kvpop.adapt.loop import scorer_step
    from kvpop.checkpoint import load_scorer
    from kvpop.files import write_json
    from kvpop.train.data import SequenceSource, capture_example
    from kvpop.train.quality import VALIDATION_SEED

    torch.set_num_threads(1)
    cfg = AdaptConfig.from_saved(torch.load(state, map_location="cpu", weights_only=True)["config"])
    t0 = time.time()
    model, tok = kvpop.load_model(cfg.model, progress=False)  # the run's base model
    scorers = {p: load_scorer(p, model=model)[0] for p in args.scorers}
    # every observed-attention window any of them reads (one capture serves all)
    obs = tuple(dict.fromkeys(o for sc in scorers.values() for o in sc.config.observed))
    evs = {b: cfg.eviction(b) for b in cfg.budgets}
    windows = sorted({ev.window for ev in evs.values()})
    res = {
        "run": str(args.run),
        "budgets": list(cfg.budgets),
        "windows": {str(b): ev.window for b, ev in evs.items()},
        "lam": cfg.trained_for()["lam"],
        "scorers": {p: {} for p in args.scorers},
    }
    streams = (
        ("train", args.train, SequenceSource(cfg, tok, "train")),
        ("validation", args.val, SequenceSource(cfg, tok, "validation", seed=VALIDATION_SEED)),
    )
    for split, n, src in streams:
        per_seq = {p: {str(b): [] for b in cfg.budgets} for p in args.scorers}
        for j in range(n):
            corpus, ids = src.get(j)
            ex = capture_example(model, ids.view(1, -1), windows, cfg.sinks, obs, [corpus]).float(torch.device("cpu"))
            for p, sc in scorers.items():
                for b, ev in evs.items():
                    per_seq[p][str(b)].append(scorer_step(sc, ex, ev, cfg))
                    sc.zero_grad(set_to_none=True)
            print(f"{split} {j + 1}/{n} ({corpus}, {time.time() - t0:.0f} s)", flush=True)
        for p in args.scorers:
            res["scorers"][p][split] = {
                b: {"mean": sum(v) / len(v) if v else None, "per_sequence": v} for b, v in per_seq[p].items()
            }
    res["wall_s"] = round(time.time() - t0, 1)
    for p, r in res["scorers"].items():
        print(p, {s: {b: round(v["mean"], 4) for b, v in r[s].items()} for s in r})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
