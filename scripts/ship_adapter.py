"""Install an adapter bundle (kvpop adapt) as the embedded model's shipped default, with a summary.

    python scripts/ship_adapter.py runs/adapt/kvpop --which best --command "kvpop adapt ..." \
        --report results/adapt/results.json

Copies DIR/<which>/ (``best``: the bundle with the best validation retention; ``adapter``: the
last checkpoint) to src/kvpop/assets/adapters/smollm2-135m-instruct-kvpop/ (replacing the old one
only after the copy is complete) and writes summary.json beside the bundle's files: the
training command, its wall time, tokens seen, the validation history and, with --report, the
test-split comparison from ``kvpop compare-adapted``.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

from kvpop.checkpoint import DEFAULT_ADAPTER

BUNDLE_FILES = ("adapter_config.json", "adapter_model.safetensors", "kvpop_adapter.json", "scorer.safetensors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", help="a kvpop adapt output folder")
    p.add_argument("--which", choices=("best", "adapter"), default="best")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument("--report", default=None, help="results.json of kvpop compare-adapted on the test splits")
    args = p.parse_args()
    run = Path(args.run)
    src = run / args.which
    summary = json.loads((run / "summary.json").read_text())
    missing = [f for f in BUNDLE_FILES if not (src / f).is_file()]
    if missing:
        raise SystemExit(f"{src} lacks {', '.join(missing)} (a kvpop adapt --mask kvpop bundle has all four)")
    meta = json.loads((src / "kvpop_adapter.json").read_text())
    shipped = {
        "command": args.command,
        "train_seconds": summary.get("seconds_this_process"),
        "tokens_seen": summary.get("tokens_seen"),
        "peak_rss_mib": summary.get("peak_rss_mib"),
        "best": summary.get("best"),
        "shipped_step": (meta.get("meta") or {}).get("step"),
        "trained_for": summary.get("trained_for"),
        "baseline": summary.get("baseline"),
        "validation": [h["val"] for h in summary.get("history", []) if "val" in h],
        "config": summary.get("config"),
    }
    if args.report:
        rep = json.loads(Path(args.report).read_text())
        shipped["test_report"] = {"settings": rep["settings"], "aggregate": rep["aggregate"]}
    tmp = DEFAULT_ADAPTER.with_name(f".{DEFAULT_ADAPTER.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
    for f in BUNDLE_FILES:
        shutil.copyfile(src / f, tmp / f)
    (tmp / "summary.json").write_text(json.dumps(shipped, indent=1, default=str) + "\n")
    if DEFAULT_ADAPTER.exists():
        shutil.rmtree(DEFAULT_ADAPTER)
    os.replace(tmp, DEFAULT_ADAPTER)
    print(f"shipped {src} -> {DEFAULT_ADAPTER}")


if __name__ == "__main__":
    main()
