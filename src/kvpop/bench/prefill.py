"""``kvpop bench prefill``: prompt throughput, dense against kvpop's exact chunked prefill.

The same real-text prompt is prefilled ``--repeats`` times per policy, alternating policies in
one process so that machine noise hits all of them alike; the median is reported. Each policy
first prefills ``--warmup`` tokens untimed (kernels, thread pool and allocator warm; ``warmup_s``),
so the first timed round is not the first call. Only the last position's logits are formed
(``logits_to_keep=1``, as ``generate()``'s prefill does): the vocabulary projection of every
position costs every policy the same and would only pull the ratios towards 1.

    kvpop bench prefill --length 4096 --out results/bench_prefill     # writes .json and .png
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..compat import cache_kwargs
from ..evaluate.plotting import pyplot, save_figure
from ..models import load_model_quietly
from .common import cache_for_spec, median, text_ids, write_json


def plot(result: dict, out: Path) -> Path:
    """Prompt tokens/s per policy, each bar labelled with its speed relative to dense."""
    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows)), 3.8))
    bars = ax.bar([r["policy"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
    ax.bar_label(bars, [f"{r['throughput_vs_dense']:.2f}x" if r["throughput_vs_dense"] else "" for r in rows])
    ax.set_ylabel("prompt tokens/s")
    ax.margins(y=0.12)
    ax.set_title(f"prefill of {result['length']:,} tokens, {result['threads']} threads (median of {result['repeats']})")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    return save_figure(fig, out)


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpop bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policies",
        default="dense,knorm@512,kvpop-mlp@512,h2o@512",
        help="comma-separated: dense, NAME@B, NAME@B/C (prefill in pieces of C tokens; default min(window, 256))",
    )
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--warmup", type=int, default=1024, help="tokens prefilled once per policy before timing, untimed (0: none)"
    )
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/bench_prefill")
    args = p.parse_args(argv)

    model, tok = load_model_quietly(args.model)
    ids = text_ids(tok, args.length)
    specs = args.policies.split(",")
    times: dict[str, list[float]] = {s: [] for s in specs}
    warmup: dict[str, float] = {}
    for spec in specs if args.warmup else ():
        t0 = time.perf_counter()
        model(ids[:, : args.warmup], **cache_kwargs(cache_for_spec(model, spec)), logits_to_keep=1)
        warmup[spec] = time.perf_counter() - t0
    for _ in range(args.repeats):
        for spec in specs:
            cache = cache_for_spec(model, spec)
            t0 = time.perf_counter()
            model(ids, **cache_kwargs(cache), logits_to_keep=1)
            times[spec].append(time.perf_counter() - t0)
    dense = median(times["dense"]) if "dense" in times else None
    rows = []
    for spec in specs:
        tps = args.length / median(times[spec])
        rows.append(
            {
                "policy": spec,
                "tokens_per_s": tps,
                "seconds": times[spec],
                "warmup_s": warmup.get(spec),
                "throughput_vs_dense": (dense / median(times[spec])) if dense else None,
            }
        )
        print(f"{spec:>16}: {tps:.0f} tok/s" + (f"  ({rows[-1]['throughput_vs_dense']:.2f}x dense)" if dense else ""))
    result = {
        "length": args.length,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "options": vars(args),
        "rows": rows,
    }
    write_json(result, Path(args.out).with_suffix(".json"))
    plot(result, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
