"""Install a trained scorer as the package's shipped default, with a summary beside it.

    python scripts/ship_scorer.py runs/final/mlstm --command "kvpop train ..." --unique-tokens 516096 \
        [--capture-command "..." --capture-wall-seconds S]

Copies DIR/best.safetensors (the checkpoint with the best validation retention under the real
cache) to src/kvpop/assets/scorers/smollm2-135m-instruct-<kind>.safetensors and writes
<same>.summary.json: the training command, tokens seen (and unique tokens), wall time, the
validation retention history and the boundary-decision diagnostics.
"""

import argparse
import json
import shutil
from pathlib import Path

from kvpop.checkpoint import DEFAULT_SCORERS, read_header


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", help="a kvpop train output folder")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument("--unique-tokens", type=int, required=True, help="distinct training tokens (store sequences x length)")
    p.add_argument("--capture-command", default="", help="the command that filled the capture store")
    p.add_argument("--capture-wall-seconds", type=float, default=None)
    args = p.parse_args()
    run = Path(args.run)
    summary = json.loads((run / "summary.json").read_text())
    kind = summary["config"]["scorer"]
    dest = DEFAULT_SCORERS[kind]
    best = run / "best.safetensors"
    meta = read_header(best).get("meta", {})
    shipped = {
        "command": args.command,
        "capture_command": args.capture_command,
        "capture_wall_seconds": args.capture_wall_seconds,
        "train_seconds": summary["seconds_this_process"],
        "tokens_seen": summary["tokens_seen"],
        "unique_tokens": args.unique_tokens,
        "best": summary["best"],
        "trained_for": summary["trained_for"],
        "corpora": meta.get("corpora"),
        "validation_retention": [{"step": h["step"], **h["val"]} for h in summary["history"] if "val" in h],
        "validation_decisions": {
            b: {k: v for k, v in blk.items() if k not in ("per_head_accuracy",)}
            for b, blk in summary["validation_decisions"].items()
        },
        "config": summary["config"],
    }
    shutil.copyfile(best, dest)
    dest.with_suffix(".summary.json").write_text(json.dumps(shipped, indent=1) + "\n")
    print(f"shipped {best} -> {dest}")


if __name__ == "__main__":
    main()
