"""``kvpop bench generate``: decode latency, KV bytes and process memory as the context grows.

Each policy runs in its own subprocess (so its peak RSS is its own) and feeds one real text
(teacher forcing: the same tokens for every policy). At each checkpoint length L it records
the median latency of ``--decode-steps`` single-token steps, the KV bytes held, and the
process's current and peak RSS. ``--mode step`` feeds every token one at a time (a true long
generation, slow on CPU); ``--mode prefill`` (default) reaches each L by chunked prefill and
then times the decode steps there.

    kvpop bench generate --lengths 1024,2048,4096,8000 --out results/bench_generate
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# torch, the model code and the plots load inside the functions that run a benchmark, so the parser (`kvpop bench
# generate --help`, a bad argument) answers at once
DEFAULT_POLICIES = "dense,floor@512,streaming@512,kvpop-mlstm@512,kvpop-mlstm@512+compile,kvpop-mlp@512+compile"


def run_one(
    spec: str, lengths: list[int], decode_steps: int, mode: str, model_path: str | None, threads: int | None
) -> dict:
    import torch

    from .. import models
    from ..compat import cache_kwargs
    from .common import cache_for_spec, kv_bytes, median, parse_policy, peak_rss_bytes, rss_bytes, text_ids

    with torch.no_grad():
        if threads:
            torch.set_num_threads(threads)
        model, tok = models.load_model(model_path, progress=False)
        total = max(lengths) + decode_steps * len(lengths) + 1
        ids = text_ids(tok, total)
        cache = cache_for_spec(model, spec)
        pos = 0
        rows = []
        base_rss = rss_bytes()
        floor = spec.startswith("floor@")
        for length in lengths:
            if floor:
                # the floor's step does not depend on the context: B slots, refilled to just under B
                budget = parse_policy(spec)[1]
                if budget <= decode_steps + 1:
                    raise SystemExit(f"{spec}: the budget must exceed --decode-steps + 1")
                cache.reset()
                start = budget - decode_steps - 1
                model(ids[:, :start], **cache_kwargs(cache), logits_to_keep=1)
                pos = start
            elif mode == "prefill":
                # pieces of at most 1024 tokens, last-position logits only: the transient memory of a
                # long prefill (a [T, vocab] logits tensor) would otherwise dominate the peak RSS
                while pos < length:
                    end = min(length, pos + 1024)
                    model(ids[:, pos:end], **cache_kwargs(cache), logits_to_keep=1)
                    pos = end
            else:
                while pos < length:
                    model(ids[:, pos : pos + 1], **cache_kwargs(cache))
                    pos += 1
            lat = []
            for _ in range(decode_steps):
                t0 = time.perf_counter()
                model(ids[:, pos : pos + 1], **cache_kwargs(cache))
                lat.append(time.perf_counter() - t0)
                pos += 1
            if floor:
                pos = length  # the other policies' text position, for the next checkpoint's bookkeeping
            rows.append(
                {
                    "length": length,
                    "decode_ms_median": 1000 * median(lat),
                    "kv_bytes": kv_bytes(cache),
                    "rss_bytes": rss_bytes(),
                    "peak_rss_bytes": peak_rss_bytes(),
                    "rss_over_start_bytes": rss_bytes() - base_rss,
                }
            )
            print(json.dumps({"policy": spec, **rows[-1]}), file=sys.stderr)
        return {"policy": spec, "rows": rows}


def plot(results: dict, out: Path) -> Path:
    from ..evaluate.plotting import pyplot, save_figure
    from .common import median

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results["runs"]:
        xs = [row["length"] for row in r["rows"]]
        if r["policy"].startswith("floor@"):  # the physical floor: a line, at every context the same B slots
            ms = median([row["decode_ms_median"] for row in r["rows"]])
            axes[0].axhline(ms, color="k", ls="--", label=f"{r['policy']} (static cache of B slots)")
            axes[1].axhline(r["rows"][0]["kv_bytes"] / 2**20, color="k", ls="--", label=r["policy"])
            continue
        axes[0].plot(xs, [row["decode_ms_median"] for row in r["rows"]], marker="o", label=r["policy"])
        axes[1].plot(xs, [row["kv_bytes"] / 2**20 for row in r["rows"]], marker="o", label=r["policy"])
        axes[2].plot(xs, [row["peak_rss_bytes"] / 2**20 for row in r["rows"]], marker="o", label=r["policy"])
    for ax, title in zip(axes, ("decode step (ms, median)", "KV cache held (MiB)", "process peak RSS (MiB)")):
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"kvpop bench generate ({results['model']}, mode={results['mode']})")
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpop bench generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma list: dense or name@budget")
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--mode", choices=["prefill", "step"], default="prefill")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="results/bench_generate")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    from ..models import load_model_quietly
    from .common import parse_policy, write_json

    lengths = [int(x) for x in args.lengths.split(",")]
    if args._worker:
        print(json.dumps(run_one(args._worker, lengths, args.decode_steps, args.mode, args.model, args.threads)))
        return 0
    model, _ = load_model_quietly(args.model)  # validates the model and converts it once, up front
    limit = model.config.max_position_embeddings
    need = max(lengths) + args.decode_steps * len(lengths) + 1
    if need > limit:
        raise SystemExit(f"lengths need {need} positions but the model has max_position_embeddings={limit}")
    del model
    runs = []
    t0 = time.perf_counter()
    for spec in args.policies.split(","):
        cmd = [
            sys.executable,
            "-m",
            "kvpop.bench.generate",
            "--_worker",
            spec,
            "--lengths",
            args.lengths,
            "--decode-steps",
            str(args.decode_steps),
            "--mode",
            args.mode,
        ]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"{spec} failed:\n{res.stderr[-2000:]}")
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    dense = next((r for r in runs if r["policy"] == "dense"), None)
    floors = {parse_policy(r["policy"])[1]: r for r in runs if r["policy"].startswith("floor@")}
    table = []
    for r in runs:
        floor = floors.get(parse_policy(r["policy"])[1])
        for i, row in enumerate(r["rows"]):
            drow = (dense or r)["rows"][i]
            entry = {
                "policy": r["policy"],
                "length": row["length"],
                "latency_ratio_vs_dense": row["decode_ms_median"] / drow["decode_ms_median"],
                "kv_ratio_vs_dense": row["kv_bytes"] / drow["kv_bytes"],
                "peak_rss_ratio_vs_dense": row["peak_rss_bytes"] / drow["peak_rss_bytes"],
            }
            if floor is not None:
                entry["latency_ratio_vs_floor"] = row["decode_ms_median"] / floor["rows"][i]["decode_ms_median"]
            table.append(entry)
    results = {
        "model": args.model or "SmolLM2-135M-Instruct",
        "mode": args.mode,
        "decode_steps": args.decode_steps,
        "threads": args.threads or torch.get_num_threads(),
        "runs": runs,
        "ratios": table,
        "wall_seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    write_json(results, out.with_suffix(".json"))
    plot(results, out.with_suffix(".png"))
    for row in table:
        vs_floor = f" ({row['latency_ratio_vs_floor']:.2f}x floor)" if "latency_ratio_vs_floor" in row else ""
        print(
            f"{row['policy']:>20} L={row['length']:>5}  latency x{row['latency_ratio_vs_dense']:.2f}{vs_floor}  "
            f"KV x{row['kv_ratio_vs_dense']:.3f}  peak RSS x{row['peak_rss_ratio_vs_dense']:.2f}"
        )
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
