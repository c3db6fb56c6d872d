"""Install a trained scorer as the package's shipped default, with a summary beside it.

    python scripts/ship_scorer.py runs/final/mlstm --command "kvpop train ..." --unique-tokens 516096 \
        [--capture-command "..." --capture-wall-seconds S]

Copies DIR/best.safetensors (the checkpoint with the best validation retention under the real
cache) to src/kvpop/assets/scorers/<model>-<kind>.safetensors (``<model>`` the embedded model's
name, ``--model``, else the run's model, else the default; a model whose licence does not let
kvpop ship trained artefacts is refused) and writes
<same>.summary.json: the training command, tokens seen (and unique tokens), wall time, the
validation retention history and the boundary-decision diagnostics.

``--beside-default`` ships it beside the model's default instead, as
``<model>-<kind>-b<lo>-<hi>.safetensors`` (``lo..hi`` its training budget range): a cache whose budget lies
outside the default's training range reads it (``kvpop.checkpoint.scorer_for_budget``).

A run trained with ``--val-docs 0`` (chosen afterwards by ``kvpop eval --split validation``
against the scorer that ships) has no best checkpoint: ``--checkpoint scorer.safetensors`` ships
its last one, and ``--validation FILE`` records the report it was chosen on.
"""

import argparse
import json
import shutil
from pathlib import Path

from kvpop.checkpoint import ASSETS, read_header
from kvpop.files import atomic_writes
from kvpop.models import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", help="a kvpop train output folder")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument(
        "--unique-tokens", type=int, required=True, help="distinct training tokens (store sequences x length)"
    )
    p.add_argument("--capture-command", default="", help="the command that filled the capture store")
    p.add_argument("--capture-wall-seconds", type=float, default=None)
    p.add_argument(
        "--checkpoint",
        default="best.safetensors",
        help="the file of DIR to ship (scorer.safetensors: the last checkpoint of a run without validation)",
    )
    p.add_argument("--validation", default=None, help="the validation report the scorer was chosen on (recorded)")
    p.add_argument("--note", default="", help="recorded as is (how it was chosen, what is estimated)")
    p.add_argument(
        "--model",
        default=None,
        help="the embedded model it was trained for (default: the run's --model, else the default model)",
    )
    p.add_argument(
        "--beside-default",
        action="store_true",
        help="ship it as the model's scorer for budgets outside its default's range (<model>-<kind>-b<lo>-<hi>)",
    )
    args = p.parse_args()
    run = Path(args.run)
    summary = json.loads((run / "summary.json").read_text())
    kind = summary["config"]["scorer"]
    name = args.model or summary["config"].get("model") or DEFAULT_MODEL.name
    model = embedded_model(name)
    if model is None:
        raise SystemExit(
            f"ship_scorer: --model {name!r} is not an embedded model "
            f"({', '.join(m.name for m in EMBEDDED_MODELS)}); only their scorers ship with kvpop"
        )
    if not model.ships_artefacts:
        raise SystemExit(
            f"ship_scorer: kvpop ships nothing trained on {model.title} ({model.licence}); see docs/models.md"
        )
    dest = ASSETS / f"{model.name}-{kind}.safetensors"
    if args.beside_default:
        budget_range = (summary.get("trained_for") or {}).get("budget_range")
        if not budget_range:
            raise SystemExit("ship_scorer: --beside-default needs a run trained with --budget-range")
        if not dest.is_file():
            raise SystemExit(f"ship_scorer: --beside-default: there is no default {dest.name} to ship it beside")
        dest = ASSETS / f"{model.name}-{kind}-b{budget_range[0]}-{budget_range[1]}.safetensors"
    best = run / args.checkpoint
    if not best.is_file():
        raise SystemExit(
            f"ship_scorer: {best} does not exist (a run without validation has no best.safetensors: "
            "pass --checkpoint scorer.safetensors)"
        )
    meta = read_header(best).get("meta", {})
    shipped = {
        "command": args.command,
        "capture_command": args.capture_command,
        "capture_wall_seconds": args.capture_wall_seconds,
        "train_seconds": summary["seconds_this_process"],
        "tokens_seen": summary["tokens_seen"],
        "unique_tokens": args.unique_tokens,
        "best": summary["best"] if args.checkpoint == "best.safetensors" else None,  # no validation chose it
        "trained_for": summary["trained_for"],
        "corpora": meta.get("corpora"),
        "validation_retention": [{"step": h["step"], **h["val"]} for h in summary["history"] if "val" in h],
        "validation_decisions": {
            b: {k: v for k, v in blk.items() if k not in ("per_head_accuracy",)}
            for b, blk in (summary.get("validation_decisions") or {}).items()
        },
        "shipped_checkpoint": args.checkpoint,
        "step": meta.get("step", meta.get("steps")),
        "validation_report": args.validation,
        "note": args.note,
        "config": summary["config"],
    }
    # both files at once, each whole: a killed ship leaves the old scorer and its summary as they were
    atomic_writes(
        [
            (dest, lambda tmp: shutil.copyfile(best, tmp)),
            (dest.with_suffix(".summary.json"), lambda tmp: Path(tmp).write_text(json.dumps(shipped, indent=1) + "\n")),
        ]
    )
    print(f"shipped {best} -> {dest}")


if __name__ == "__main__":
    main()
