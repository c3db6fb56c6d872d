"""Validation of any adapter bundle on the validation windows of a `kvpop adapt` run.

`kvpop adapt` validates its own checkpoints only every `--val-every` steps; this script gives an
intermediate checkpoint (or a bundle from another run, e.g. the one that ships) the same
measurement, so bundles can be compared on validation before one is committed: the run's
`AdaptProbe` (its validation windows, budgets and base-model dense outputs), the bundle's LoRA
and the bundle's own scorer, windows and lam resolved from that scorer. Prints and writes JSON.

    OMP_NUM_THREADS=1 python scripts/validate_bundle.py runs/adapt/mlp-4096 BUNDLE --out OUT.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a kvpop adapt output folder (its train_state.pt holds the run's settings)")
    ap.add_argument("bundle", help="the adapter bundle to validate (LoRA + scorer)")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--docs", type=int, default=None, help="fewer validation windows (a smoke test; default the run's)")
    args = ap.parse_args()
    state = Path(args.run) / "train_state.pt"
    bundle = Path(args.bundle)
    if not state.is_file():
        raise SystemExit(f"run: no train_state.pt in {args.run}")
    from kvpop.adapters import ADAPTER_META_FILE, SCORER_FILE, load_adapter_bundle

    if not (bundle / ADAPTER_META_FILE).is_file():
        raise SystemExit(f"bundle: {bundle} is not an adapter bundle (no {ADAPTER_META_FILE})")

    import kvpop
    from kvpop.adapt.config import AdaptConfig
    from kvpop.adapt.quality import AdaptProbe
    from kvpop.files import write_json

    torch.set_num_threads(1)
    blob = torch.load(state, map_location="cpu", weights_only=False)
    # the windows and lam come from the bundle's scorer (what a cache built on the bundle resolves)
    cfg = AdaptConfig.from_saved(blob["config"], scorer=str(bundle / SCORER_FILE), window=None,
                                 window_fraction=None, lam=None, out=str(Path(args.out).parent))
    t0 = time.time()
    model, tok = kvpop.load_model(cfg.model, progress=False)  # the run's base model (None: the embedded one)
    model, scorer, _ = load_adapter_bundle(model, bundle, merge=False)
    probe = AdaptProbe(model, tok, cfg, n_docs=args.docs)
    q = probe(scorer)
    res = {"run": str(args.run), "bundle": str(bundle), "validation": q, "baseline": blob.get("baseline"),
           "budgets": list(cfg.validation_budgets()),
           "windows": {str(b): cfg.eviction(b).window for b in cfg.validation_budgets()},
           "lam": cfg.lam_value(), "wall_s": round(time.time() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    print(probe.describe(q), f"({res['wall_s']} s)")


if __name__ == "__main__":
    main()
