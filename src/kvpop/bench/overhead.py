"""``kvpop bench overhead``: one decode step of every policy next to the floor and dense, in one run.

What a bounded cache can win on decode is set by bytes moved: the weights plus ``B`` slots of KV.
The **floor** is the model with a plain static cache of ``B`` slots (transformers' ``StaticCache``:
no scoring, no eviction, attention over ``B`` slots); **dense** holds the whole context. Every
cache is prefilled to ``--context`` tokens of the same text (the floor to just under ``B``), then
all of them take turns: ``--rounds`` rounds of ``--steps`` single-token steps each, so slow drifts
of a noisy machine hit every row alike, and each row's median step is divided by the floor's and
by dense's medians from the same run. ``overhead_share = 1 - floor / step`` is the part of a
step beyond the floor (the scorer, the rule, the writes and the cache's attention path);
``phase_ms`` splits the eager paths where they run in phases (``score``: a heuristic's scoring;
``fused``: the steady step's rule, writes and attention, with a learned policy's scoring inside).
Every policy with long-range slots also runs with ``compile=True`` (``name+compile``); its first
step's time (``first_step_s``) includes the compiling.

    kvpop bench overhead --budget 512 --context 8000 --out results/bench_overhead
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from ..cache import make_cache
from ..compat import cache_kwargs
from ..evaluate.plotting import pyplot, save_figure
from ..models import load_model_quietly
from ..policies import POLICIES, get_policy, policy_names
from ..policies.learned import policy_for_scorer
from .common import median, step_row, text_ids, write_json


def _plot(result: dict, out: Path) -> Path:
    plt = pyplot()
    rows = [r for r in result["rows"] if r["name"] not in ("floor", "dense")]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    names = [r["name"] for r in rows]
    ax.barh(names, [r["step_ms"] for r in rows], color=["tab:orange" if "compile" in n else "tab:blue" for n in names])
    floor, dense = result["floor_ms"], result["dense_ms"]
    ax.axvline(floor, color="k", ls="--", label=f"floor: static cache of B={result['budget']} ({floor:.1f} ms)")
    ax.axvline(1.1 * floor, color="k", ls=":", label="1.10 x floor")
    ax.axvline(dense, color="tab:red", ls="--", label=f"dense at {result['context']} tokens ({dense:.1f} ms)")
    for i, r in enumerate(rows):
        ax.text(r["step_ms"], i, f" {r['vs_floor']:.2f}x floor", va="center", fontsize=8)
    ax.set_xlabel(f"median decode step (ms), {result['threads']} thread(s)")
    ax.set_title(f"Decode step at {result['context']} tokens, B = {result['budget']} (one run, interleaved)")
    ax.set_xlim(0, max(dense, max(r["step_ms"] for r in rows)) * 1.25)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = out.with_suffix(".png")
    save_figure(fig, path, dpi=110)
    return path


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpop bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=None, help="comma list (default: every policy that can generate)")
    p.add_argument(
        "--compile",
        default="all",
        help="policies also run with compile=True: a comma list, 'all' (every policy of --policies "
        "with long-range slots; StreamingLLM has none, so nothing to compile) or '' for none",
    )
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--steps", type=int, default=8, help="steps per row per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument(
        "--scorer",
        default=None,
        help="a scorer checkpoint for the learned policy of its kind (e.g. one trained for --model)",
    )
    p.add_argument("--out", default="results/bench_overhead")
    args = p.parse_args(argv)
    try:  # a readable scorer checkpoint, before the model loads
        scored = policy_for_scorer(args.scorer) if args.scorer is not None else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--scorer {args.scorer}: {exc}") from None
    names = [n for n in (args.policies or ",".join(policy_names(dense=False, teacher_forced=False))).split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if args.compile == "all":
        compiled = [n for n in names if n not in unknown and get_policy(n).uses_long_range]
    else:
        compiled = [n for n in args.compile.split(",") if n]
    unknown += [n for n in compiled if n not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {sorted(POLICIES)}")
    total_steps = args.steps * args.rounds
    if args.budget <= total_steps + 2:
        raise SystemExit(
            f"--budget must exceed --steps x --rounds + 2 = {total_steps + 2} (the floor's static cache fills)"
        )
    torch.set_num_threads(args.threads)
    model, tok = load_model_quietly(args.model)
    limit = model.config.max_position_embeddings
    if args.context + total_steps + 1 > limit:
        raise SystemExit(
            f"--context + steps x rounds needs {args.context + total_steps + 1} positions; the model has {limit}"
        )
    ids = text_ids(tok, args.context + total_steps + 1)

    def prefill(cache, length: int) -> None:
        for start in range(0, length, 1024):
            model(ids[:, start : min(length, start + 1024)], **cache_kwargs(cache), logits_to_keep=1)

    rows: dict[str, dict] = {}
    floor_len = args.budget - total_steps - 1
    floor = StaticCache(config=model.config, max_cache_len=args.budget)
    prefill(floor, floor_len)
    rows["floor"] = {"cache": floor, "pos": floor_len}
    dense = DynamicCache(config=model.config)
    prefill(dense, args.context)
    rows["dense"] = {"cache": dense, "pos": args.context}
    for name in names + [f"{n}+compile" for n in compiled]:
        base = name.removesuffix("+compile")
        try:
            extra = {"path": args.scorer} if base == scored else {}
            cache = make_cache(model, base, budget=args.budget, compile=name.endswith("+compile"), **extra)
        except (FileNotFoundError, ValueError) as exc:  # e.g. no shipped scorer of that kind, or not for this model
            print(f"skip {name}: {exc}")
            continue
        prefill(cache, args.context)
        t0 = time.perf_counter()
        model(
            ids[:, args.context : args.context + 1], **cache_kwargs(cache)
        )  # the first steady step (compiles, if asked)
        first = time.perf_counter() - t0
        for layer in cache.layers:
            layer.timer = {}
        rows[name] = {"cache": cache, "pos": args.context + 1, "first_s": first}
    for r in rows.values():
        r["times"] = []
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for r in rows.values():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                model(ids[:, r["pos"] : r["pos"] + 1], **cache_kwargs(r["cache"]))
                r["times"].append(time.perf_counter() - t0)
                r["pos"] += 1
    floor_ms = 1000 * median(rows["floor"]["times"])
    dense_ms = 1000 * median(rows["dense"]["times"])
    out_rows = []
    for name, r in rows.items():
        step = 1000 * median(r["times"])
        row = step_row(name, step, floor_ms, dense_ms, len(r["times"]))
        if "first_s" in r:
            row["first_step_s"] = r["first_s"]
            phases: dict[str, float] = {}
            for layer in r["cache"].layers:
                for k, v in (layer.timer or {}).items():
                    phases[k] = phases.get(k, 0.0) + v
            if phases:
                n = len(r["times"])
                row["phase_ms"] = {k: 1000 * v / n for k, v in sorted(phases.items())}
        out_rows.append(row)
        print(
            f"{name:>16}: {step:6.1f} ms  {row['vs_floor']:.2f}x floor  {row['vs_dense']:.2f}x dense  "
            f"overhead {row['overhead_share']:+.1%}"
        )
    result = {
        "budget": args.budget,
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "floor_ms": floor_ms,
        "dense_ms": dense_ms,
        "options": vars(args),
        "rows": out_rows,
    }
    out = Path(args.out)
    write_json(result, out.with_suffix(".json"))
    print(f"wrote {out.with_suffix('.json')} and {_plot(result, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
