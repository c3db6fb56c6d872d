"""Which future-attention target keeps a needle? The oracle under the real cache with two targets.

kvpop's target for an exiting token is the *mean* attention it receives from every query after the
protected window. A needle in a retrieval task is read by a handful of queries (the question's), so its
mean over thousands of queries is tiny and even the oracle, which knows the whole future, may evict it.
This study runs the oracle policy with the *maximum* attention a token receives after the window instead
(per KV head, over its query heads: the same grouping as the mean target), or with the power mean of
``--power P`` (``--target power``: the shipped scorer's training target at P = 8), on the RULER or
HumanEval cases of ``kvpop eval tasks`` folders, and compares it with their oracle (the mean target) and dense.

    python research/oracle_targets.py --like results/qwen/tasks-ruler --out results/qwen/oracle-targets
    python research/oracle_targets.py --like results/qwen/tasks-humaneval-oracle --task humaneval \
        --humaneval-split test --budgets 110 --target power --power 8 --out results/qwen/oracle-targets-humaneval

Writes OUT/records.jsonl (one line per case, budget and target, resumable), OUT/summary.json and
OUT/oracle_targets.png (``-oracle-powerP`` before the suffix for the power target).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def max_future_attention(q: torch.Tensor, k: torch.Tensor, window: int, scale: float, block: int = 256):
    """``log max_{g in G(h)} max_{d >= t + window} p[g, d, t]`` as ``[1, kv_heads, S]`` (``-inf`` where no
    query lies after the window): the max counterpart of :func:`kvpop.targets.future_attention`."""
    from kvpop.targets import row_lse

    _, hq, S, _ = q.shape
    hk = k.shape[1]
    g = hq // hk
    qf, kf = q.float(), k.float().repeat_interleave(g, dim=1)
    lse = row_lse(qf, kf, scale=scale)  # [1, hq, S]
    best = torch.full((1, hq, S), -math.inf)
    t = torch.arange(S)
    for d0 in range(0, S, block):
        d1 = min(S, d0 + block)
        logp = (qf[:, :, d0:d1] @ kf.transpose(-1, -2)) * scale - lse[:, :, d0:d1, None]  # [1, hq, blk, S]
        d = torch.arange(d0, d1)[:, None]
        logp = logp.masked_fill(~(d >= t[None, :] + window), -math.inf)
        best = torch.maximum(best, logp.amax(dim=2))
    return best.view(1, hk, g, S).amax(dim=2)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--like", type=Path, nargs="+", required=True, help="`kvpop eval tasks` folders with dense and oracle rows"
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task", default="niah_single", help="a RULER task or humaneval")
    p.add_argument("--humaneval-split", default="test", choices=("all", "train", "validation", "test"))
    p.add_argument("--target", default="max", choices=("max", "power"), help="the oracle's target")
    p.add_argument("--power", type=float, default=8.0, help="the power mean's exponent (--target power)")
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 512])
    args = p.parse_args(argv)

    import kvpop
    from kvpop.capture import capturing
    from kvpop.config import resolve_eviction
    from kvpop.evaluate import humaneval, ruler
    from kvpop.evaluate.core import build_cache, decoder_and_head, oracle_targets_multi
    from kvpop.evaluate.store import load_dirs, unit_key
    from kvpop.evaluate.suite import SuiteConfig, build_cases, generate_batch

    fp, units, _ = load_dirs(args.like)
    recs = {u["key"]: u for u in units}
    model, tokenizer = kvpop.load_model(fp["model"])
    cfg = SuiteConfig(tasks=(args.task,), cases=args.cases, humaneval_split=args.humaneval_split)
    cases = build_cases(tokenizer, cfg)[args.task]
    name = "oracle-max" if args.target == "max" else f"oracle-power{args.power:g}"
    limits = humaneval.SandboxLimits(timeout_s=cfg.timeout_s)
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "records.jsonl"
    done = {json.loads(line)["key"] for line in out_file.read_text().splitlines()} if out_file.exists() else set()
    sinks = fp.get("sinks", 4)
    for case in cases:
        dense = recs.get(unit_key(case.item_id, "dense", None))
        left = [b for b in args.budgets if f"{case.item_id}|{name}|{b}" not in done]
        if dense is None or not left:
            continue
        t0 = time.perf_counter()
        seq = torch.cat([case.ids, torch.tensor(dense["new_ids"], dtype=torch.long)]).view(1, -1)
        windows = sorted({resolve_eviction(b, sinks=sinks).window for b in left})
        if args.target == "max":  # window=None: keep the queries and keys only (no mean target is computed)
            dec, _ = decoder_and_head(model)
            with torch.no_grad(), capturing(model, window=None, keep_queries=True) as state:
                (dec or model)(input_ids=seq, use_cache=False)
            caps = state.result()
            targets = {
                w: [max_future_attention(c.queries, c.keys, w, c.queries.shape[-1] ** -0.5) for c in caps]
                for w in windows
            }
            del caps, state
        else:
            targets = oracle_targets_multi(model, seq, windows, power=args.power)
        n_new = len(dense["new_ids"])
        for b in left:
            cache = build_cache(model, "oracle", b, sinks=sinks, oracle=targets)
            new = generate_batch(model, tokenizer, [case.ids], max(1, min(case.max_new_tokens, n_new)), cache)[0]
            text = tokenizer.decode(new, skip_special_tokens=True)
            if case.task == "humaneval":
                scored = humaneval.score_completion(case.payload, text, limits)
            else:
                scored = ruler.score_answer(case.payload, text)
            rec = {
                "key": f"{case.item_id}|{name}|{b}",
                "item_id": case.item_id,
                "budget": b,
                "window": cache.eviction.window,
                "target": name,
                "dense_score": dense["score"],
                "new_tokens": len(new),
                **scored,
                "wall_s": time.perf_counter() - t0,
            }
            with out_file.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{case.item_id} B={b}: {name} {rec['score']} ({rec.get('answer', '')!r:.60})")

    fp, units, _ = load_dirs(args.like)  # the folders' oracle rows may have finished meanwhile
    recs = {u["key"]: u for u in units}
    rows = [r for r in map(json.loads, out_file.read_text().splitlines()) if r.get("target", "oracle-max") == name]
    for r in rows:
        r["oracle_mean_score"] = (recs.get(unit_key(r["item_id"], "oracle", r["budget"])) or {}).get("score")
    summary = {"like": [str(d) for d in args.like], "task": args.task, "target": name, "budgets": {}}
    for b in args.budgets:
        rs = [r for r in rows if r["budget"] == b]
        paired = [r for r in rs if r["oracle_mean_score"] is not None]

        summary["budgets"][str(b)] = {
            "n": len(rs),
            "dense": _mean([r["dense_score"] for r in rs]),
            "oracle_target": _mean([r["score"] for r in rs]),
            "oracle_mean": _mean([r["oracle_mean_score"] for r in paired]),
            "n_paired": len(paired),
        }
    suffix = "" if name == "oracle-max" else f"-{name}"  # the max target's files keep their first names
    (args.out / f"summary{suffix}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = list(summary["budgets"])
    for i, (label, key) in enumerate(
        [("dense", "dense"), ("oracle, mean target", "oracle_mean"), (name, "oracle_target")]
    ):
        vals = [summary["budgets"][b][key] or 0.0 for b in labels]
        ax.bar([x + 0.27 * (i - 1) for x in range(len(labels))], vals, width=0.27, label=label)
    ax.set_xticks(range(len(labels)), [f"B={b}" for b in labels])
    ax.set_ylabel(f"{args.task} score")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title(f"The oracle's target: mean vs {name}")
    fig.tight_layout()
    fig.savefig(args.out / f"oracle_targets{suffix}.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
