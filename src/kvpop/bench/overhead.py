"""``kvpop bench overhead``: the share of a decode step spent scoring and evicting, per policy.

Every policy gets the same budget and the same text, prefilled to ``--context`` tokens; then
``--steps`` single-token decode steps are timed as a whole (the model forward) while the cache
accumulates the seconds spent in its phases: ``score`` (gathering the exiting token and the
policy's scoring, including the mLSTM state update), ``evict`` (the rule and the in-place
buffer writes) and ``attend``.

    kvpop bench overhead --budget 512 --context 8000 --out results/bench_overhead
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .common import cache_for_spec, text_ids, write_json


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpop bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=None, help="comma list (default: every policy that can generate)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/bench_overhead")
    args = p.parse_args(argv)
    from .. import POLICIES, policy_names
    from ..cli import load_model_quietly

    names = [n for n in (args.policies or ",".join(policy_names(dense=False, teacher_forced=False))).split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {sorted(POLICIES)}")
    model, tok = load_model_quietly(args.model)
    limit = model.config.max_position_embeddings
    if args.context + args.steps + 1 > limit:
        raise SystemExit(f"--context + --steps needs {args.context + args.steps + 1} positions; the model has {limit}")
    ids = text_ids(tok, args.context + args.steps + 1)
    rows = []
    for name in names:
        try:
            cache = cache_for_spec(model, f"{name}@{args.budget}")
        except (FileNotFoundError, ValueError) as exc:  # e.g. no shipped scorer of that kind, or not for this model
            print(f"skip {name}: {exc}")
            continue
        model(ids[:, : args.context], cache=cache)
        for layer in cache.layers:
            layer.timer = {}
        t0 = time.perf_counter()
        for i in range(args.context, args.context + args.steps):
            model(ids[:, i : i + 1], cache=cache)
        total = time.perf_counter() - t0
        phases = {k: sum(layer.timer.get(k, 0.0) for layer in cache.layers) for k in ("score", "evict", "attend")}
        row = {
            "policy": name,
            "step_ms": 1000 * total / args.steps,
            **{f"{k}_ms": 1000 * v / args.steps for k, v in phases.items()},
            "score_evict_share": (phases["score"] + phases["evict"]) / total,
        }
        rows.append(row)
        print(f"{name:>10}: step {row['step_ms']:.1f} ms, score {row['score_ms']:.2f} ms, evict {row['evict_ms']:.2f} ms "
              f"-> scoring+eviction {row['score_evict_share']:.1%} of the step")
    write_json({"budget": args.budget, "context": args.context, "steps": args.steps,
                "threads": torch.get_num_threads(), "rows": rows}, Path(args.out).with_suffix(".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
