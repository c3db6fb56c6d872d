"""Validation of any adapter bundle on the validation windows of a `kvpop adapt` run.

`kvpop adapt` validates its own checkpoints only every `--val-every` steps; this script gives an
intermediate checkpoint (or a bundle from another run, e.g. the one that ships) the same
measurement, so bundles can be compared on validation before one is committed: the run's
`AdaptProbe` (its validation windows, budgets and base-model dense outputs), the bundle's LoRA
and the bundle's own scorer, windows and lam resolved from that scorer. Prints and writes JSON.

    OMP_NUM_THREADS=1 python scripts/validate_bundle.py runs/adapt/mlp-4096 BUNDLE --out OUT.json

Split over cores: one process per shard of the windows, then one report pooled from them (the same
numbers as one unsharded pass, to the last bit):

    OMP_NUM_THREADS=1 python scripts/validate_bundle.py RUN BUNDLE --shard 1/2 --out OUT-1.json  # and 2/2
    python scripts/validate_bundle.py --merge OUT-1.json OUT-2.json --out OUT.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="a kvpop adapt output folder (its train_state.pt holds the run's settings)")
    ap.add_argument("bundle", nargs="?", help="the adapter bundle to validate (LoRA + scorer)")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--docs", type=int, default=None, help="fewer validation windows (a smoke test; default the run's)")
    ap.add_argument("--shard", default=None, metavar="I/N", help="validate windows j with j %% N == I-1 only")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="pool the reports of the shards of one validation into --out (no run, no bundle)",
    )
    args = ap.parse_args()
    if args.merge is not None:
        merge(args)
        return
    if args.run is None or args.bundle is None:
        ap.error("give RUN and BUNDLE (or --merge JSON ...)")
    from kvpop.validate import parse_shard

    try:
        shard = None if args.shard is None else parse_shard(args.shard)
    except ValueError as exc:
        ap.error(f"--shard: {exc}")
    state = Path(args.run) / "train_state.pt"
    bundle = Path(args.bundle)
    if not state.is_file():
        raise SystemExit(f"run: no train_state.pt in {args.run}")
    from kvpop.bundle import ADAPTER_META_FILE, SCORER_FILE, load_adapter_bundle

    if not (bundle / ADAPTER_META_FILE).is_file():
        raise SystemExit(f"bundle: {bundle} is not an adapter bundle (no {ADAPTER_META_FILE})")

    import kvpop
    from kvpop.adapt.config import AdaptConfig
    from kvpop.adapt.quality import AdaptProbe
    from kvpop.files import write_json

    torch.set_num_threads(1)
    blob = torch.load(state, map_location="cpu", weights_only=True)
    # the windows and lam come from the bundle's scorer (what a cache built on the bundle resolves)
    cfg = AdaptConfig.from_saved(
        blob["config"],
        scorer=str(bundle / SCORER_FILE),
        window=None,
        window_fraction=None,
        lam=None,
        out=str(Path(args.out).parent),
    )
    t0 = time.time()
    model, tok = kvpop.load_model(cfg.model, progress=False)  # the run's base model (None: the embedded one)
    model, scorer, _ = load_adapter_bundle(model, bundle, merge=False)
    probe = AdaptProbe(model, tok, cfg, n_docs=args.docs, shard=shard)
    q = probe(scorer)
    res = {
        "run": str(args.run),
        "bundle": str(bundle),
        "validation": q,
        "baseline": blob.get("baseline"),
        "shard": args.shard,
        "budgets": list(cfg.validation_budgets()),
        "windows": {str(b): cfg.eviction(b).window for b in cfg.validation_budgets()},
        "lam": cfg.trained_for()["lam"],
        "wall_s": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    print(probe.describe(q), f"({res['wall_s']} s)")


def merge(args) -> None:
    """One report from the shards' reports: same run, bundle and settings, disjoint windows."""
    import json

    from kvpop.adapt.quality import merge_validations
    from kvpop.files import write_json
    from kvpop.validate import parse_shard

    parts = [json.loads(Path(f).read_text(encoding="utf-8")) for f in args.merge]
    try:
        shards = sorted(parse_shard(r.get("shard") or "") for r in parts)
    except ValueError:
        raise SystemExit("--merge: every report must come from a --shard I/N run") from None
    n = shards[0][1]
    if shards != [(i, n) for i in range(1, n + 1)]:
        raise SystemExit(
            f"--merge: the shards {', '.join(f'{i}/{k}' for i, k in shards)} are not 1/{n} .. {n}/{n}, each once"
        )
    same = ("run", "bundle", "budgets", "windows", "lam")
    for f, r in zip(args.merge[1:], parts[1:], strict=True):
        diff = [k for k in same if r.get(k) != parts[0].get(k)]
        if diff:
            raise SystemExit(f"--merge: {f} differs from {args.merge[0]} in {', '.join(diff)}")
    try:
        q = merge_validations([r["validation"] for r in parts])
    except ValueError as exc:
        raise SystemExit(f"--merge: {exc}") from None
    res = {
        **{k: parts[0].get(k) for k in ("run", "bundle")},
        "validation": q,
        "baseline": parts[0].get("baseline"),
        "shard": None,
        "merged_from": [str(f) for f in args.merge],
        **{k: parts[0].get(k) for k in ("budgets", "windows", "lam")},
        "wall_s": round(sum(r.get("wall_s") or 0 for r in parts), 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    print(
        ", ".join(
            f"B={b} retention {q[str(b)]['retention']:.4f} continuation {q[str(b)]['continuation']['retention']:.4f}"
            for b in res["budgets"]
        ),
        f"({len(q[str(res['budgets'][0])]['per_doc'])} windows from {len(parts)} shards; {res['wall_s']} CPU s)",
    )


if __name__ == "__main__":
    main()
