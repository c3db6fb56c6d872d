"""The data-scaling curve of the learned scorers (issue #23): retention under the real KVpopCache on the
validation windows against the number of distinct training tokens, for both scorer kinds.

Every point trains on the first N sequences of one capture store (``--cycle N``), for the same number
of steps, with the same recipe, over the same budget range; only the amount of distinct data changes.
Runs are resumable (a finished run is skipped), and two workers split the queue (one per core).

  # fill the store first (see docs/research-log.md, the data-scaling section), then:
  python research/scaling_curve.py run --store runs/capture/smollm2-8192 --out runs/scaling --workers 2
  python research/scaling_curve.py report --out runs/scaling --json results/scaling/curve.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

SIZES = (8, 16, 32, 64, 128, 168)  # sequences of 8,192 tokens: 66k .. 1.38M (168: what this machine's disk held)
KINDS = ("mlp", "mlstm")
RECIPE = [
    "--budget-range",
    "128,2048",
    "--windows-per-sequence",
    "3",
    "--seq-len",
    "8192",
    "--hidden",
    "128",
    "--lam",
    "0.0005",
    "--val-docs",
    "24",
    "--val-seq-len",
    "4096",
    "--ckpt-every",
    "41",
    "--no-progress",
]


def run_name(kind: str, n: int) -> str:
    return f"{kind}-{n:03d}"


def command(kind: str, n: int, args) -> list[str]:
    out = Path(args.out) / run_name(kind, n)
    val_every = args.ship_val_every if n == max(args.sizes) else args.steps  # the largest runs are what ships
    return [
        sys.executable,
        "-m",
        "kvpop.train",
        "--kind",
        kind,
        "--out",
        str(out),
        "--store",
        args.store,
        "--cycle",
        str(n),
        "--steps",
        str(args.steps),
        "--val-every",
        str(val_every),
        "--val-cache",
        str(Path(args.out) / "val-cache"),
        *RECIPE,
    ]


def run(args) -> None:
    queue = [(k, n) for n in sorted(args.sizes, reverse=True) for k in args.kinds]  # the long runs first
    queue = [(k, n) for k, n in queue if not (Path(args.out) / run_name(k, n) / "summary.json").is_file()]
    lock = threading.Lock()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def worker(w: int) -> None:
        while True:
            with lock:
                if not queue:
                    return
                kind, n = queue.pop(0)
            out = Path(args.out) / run_name(kind, n)
            out.mkdir(parents=True, exist_ok=True)
            cmd = command(kind, n, args)
            print(f"[worker {w}] {' '.join(cmd)}", flush=True)
            t0 = time.time()
            with open(out / "train.log", "a") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"[worker {w}] {run_name(kind, n)}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
            wall = out / "wall_seconds.txt"  # summed over resumed segments
            before = int(wall.read_text()) if wall.is_file() else 0
            wall.write_text(f"{before + round(time.time() - t0)}\n")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def distinct_tokens(store: str, n: int) -> int:
    """Tokens of the first ``n`` stored sequences that no earlier sequence holds (a corpus stream starts a
    second pass over its documents when it runs out; those windows repeat text already seen)."""
    from kvpop import data
    from kvpop.models import load_model

    meta = json.loads((Path(store) / "store.json").read_text())["data"]
    _, tok = load_model(progress=False)
    seen: set[tuple] = set()
    new = 0
    stream = data.training_windows(tok, meta["corpora"], meta["seq_len"], meta["split"], meta["seed"])
    for _, (_, ids) in zip(range(n), stream, strict=False):
        for a in range(0, ids.numel(), 64):  # 64-token shingles: overlapping windows share them
            key = tuple(ids[a : a + 64].tolist())
            if key not in seen:
                seen.add(key)
                new += len(key)
    return new


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    store = None
    for path in sorted(Path(args.out).glob("*/summary.json")):
        s = json.loads(path.read_text())
        cfg = s["config"]
        store = store or cfg["store"]
        val = next(h["val"] for h in reversed(s["history"]) if "val" in h)
        budgets = [k for k in val if k.isdigit()]
        wall = path.parent / "wall_seconds.txt"
        rows.append(
            {
                "kind": cfg["scorer"],
                "sequences": cfg["cycle"],
                "tokens_captured": cfg["cycle"] * cfg["seq_len"],
                "steps": s["steps"],
                "tokens_seen": s["tokens_seen"],
                "wall_seconds": int(wall.read_text()) if wall.is_file() else None,
                "best": s["best"],
                "final": {
                    b: {
                        k: val[b][k]
                        for k in (
                            "retention",
                            "continuation",
                            "streaming",
                            "streaming_continuation",
                            "wins_vs_streaming",
                            "continuation_wins_vs_streaming",
                            "docs",
                        )
                    }
                    for b in budgets
                },
                "final_mean": val["mean_retention"],
            }
        )
    if not rows:
        raise SystemExit(f"no finished runs under {args.out}")
    sizes = sorted({r["sequences"] for r in rows})
    distinct = {n: distinct_tokens(store, n) for n in sizes} if store else {}
    for r in rows:
        r["tokens_distinct"] = distinct.get(r["sequences"])
    out = {"recipe": RECIPE, "store": store, "runs": sorted(rows, key=lambda r: (r["kind"], r["sequences"]))}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, task, skey in ((axes[0], "retention", "streaming"), (axes[1], "continuation", "streaming_continuation")):
        for kind, style in (("mlp", "--"), ("mlstm", "-")):
            rs = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["sequences"])
            if not rs:
                continue
            for b in rs[0]["final"]:
                xs = [r["tokens_distinct"] or r["tokens_captured"] for r in rs]
                ax.plot(xs, [r["final"][b][task] for r in rs], style, marker="o", label=f"kvpop-{kind} B={b}")
        ref = rows[0]["final"]
        for b in ref:
            ax.axhline(ref[b][skey], color="gray", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("distinct training tokens")
        ax.set_ylabel(f"{'lm' if task == 'retention' else task} retention (validation)")
        ax.set_title(f"{'lm' if task == 'retention' else 'continuation'} (dotted: StreamingLLM)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(args.json).with_suffix(".png"), dpi=120)
    for r in out["runs"]:
        parts = ", ".join(
            f"B={b} {v['retention']:.4f}/{v['continuation']:.4f} (streaming {v['streaming']:.4f}, wins "
            f"{v['wins_vs_streaming']}/{v['docs']})"
            for b, v in r["final"].items()
        )
        print(f"{r['kind']:5s} {r['sequences']:4d} seq {r['tokens_distinct'] or r['tokens_captured']:>9,} tok: {parts}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--store", required=True)
    r.add_argument("--out", default="runs/scaling")
    r.add_argument("--sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=SIZES)
    r.add_argument("--kinds", type=lambda t: tuple(t.split(",")), default=KINDS)
    r.add_argument("--steps", type=int, default=246)
    r.add_argument("--ship-val-every", type=int, default=82, help="validation interval of the largest runs")
    r.add_argument("--workers", type=int, default=2)
    q = sub.add_parser("report")
    q.add_argument("--out", default="runs/scaling")
    q.add_argument("--json", default="results/scaling/curve.json")
    args = p.parse_args(argv)
    run(args) if args.cmd == "run" else report(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
