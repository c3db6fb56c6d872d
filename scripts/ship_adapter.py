"""Install an adapter bundle (kvpop adapt) as the embedded model's shipped default, with a summary.

    python scripts/ship_adapter.py runs/adapt/kvpop --which best --command "kvpop adapt ..." \
        --report results/adapt/results.json

Copies DIR/<which>/ (``best``: the bundle with the best validation retention; ``adapter``: the
last checkpoint), or ``--bundle PATH`` (a snapshot of an intermediate checkpoint of DIR's run), to
src/kvpop/assets/adapters/smollm2-135m-instruct-kvpop/ (replacing the old one only after the copy
is complete) and writes summary.json beside the bundle's files: the training command, its wall
time up to the shipped step, tokens seen, the validation history (with ``--validation``, the
JSON of scripts/validate_bundle.py for the shipped bundle and the one it replaces) and, with
--report, the test-split comparison from ``kvpop compare-adapted``. A run still in progress has
no summary.json yet; its train_state.pt supplies the same fields.

    python scripts/ship_adapter.py runs/adapt/mlp-4096 --bundle runs/adapt/mlp-4096-step32 \
        --validation runs/validate/mlp-4096-step32.json runs/validate/shipped.json \
        --report runs/compare-step32/results.json --command "..."
"""

import argparse
import json
import os
import shutil
from pathlib import Path

from kvpop.checkpoint import DEFAULT_ADAPTER
from kvpop.files import write_json

BUNDLE_FILES = ("adapter_config.json", "adapter_model.safetensors", "kvpop_adapter.json", "scorer.safetensors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", help="a kvpop adapt output folder")
    p.add_argument("--which", choices=("best", "adapter"), default="best")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument(
        "--bundle", default=None, help="ship this bundle folder (a checkpoint of RUN) instead of RUN/<which>"
    )
    p.add_argument("--validation", nargs="*", default=[], help="validate_bundle.py JSON files to record")
    p.add_argument(
        "--seconds-before",
        type=float,
        default=None,
        help="training seconds before the run's last --from-bundle restart (when it did not record them)",
    )
    p.add_argument("--report", default=None, help="results.json of kvpop compare-adapted on the test splits")
    p.add_argument(
        "--note",
        default=None,
        help="recorded as summary.json's note: say here what is estimated (e.g. --seconds-before) and why",
    )
    args = p.parse_args()
    run = Path(args.run)
    src = Path(args.bundle) if args.bundle else run / args.which
    summary = _summary(run)
    missing = [f for f in BUNDLE_FILES if not (src / f).is_file()]
    if missing:
        raise SystemExit(f"{src} lacks {', '.join(missing)} (a kvpop adapt --mask kvpop bundle has all four)")
    meta = json.loads((src / "kvpop_adapter.json").read_text())
    step = (meta.get("meta") or {}).get("steps")
    shipped = {
        "command": args.command,
        "train_seconds": _train_seconds(summary, step, args.seconds_before),
        "tokens_seen": (meta.get("meta") or {}).get("tokens_seen", summary.get("tokens_seen")),
        "peak_rss_mib": summary.get("peak_rss_mib"),
        "best": summary.get("best"),
        "shipped_step": step,
        "trained_for": summary.get("trained_for") or (meta.get("meta") or {}).get("trained_for"),
        "baseline": summary.get("baseline"),
        "validation": [h["val"] for h in summary.get("history", []) if "val" in h],
        "config": summary.get("config"),
    }
    if args.note:
        shipped["note"] = args.note
    if args.validation:
        shipped["bundle_validation"] = [json.loads(Path(f).read_text()) for f in args.validation]
    if args.report:
        rep = json.loads(Path(args.report).read_text())
        shipped["test_report"] = {"settings": rep["settings"], "aggregate": rep["aggregate"]}
    tmp = DEFAULT_ADAPTER.with_name(f".{DEFAULT_ADAPTER.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
    for f in BUNDLE_FILES:
        shutil.copyfile(src / f, tmp / f)
    write_json(tmp / "summary.json", shipped)  # strict JSON: a run with no validation yet has best null
    if DEFAULT_ADAPTER.exists():
        shutil.rmtree(DEFAULT_ADAPTER)
    os.replace(tmp, DEFAULT_ADAPTER)
    print(f"shipped {src} -> {DEFAULT_ADAPTER}")


def _summary(run: Path) -> dict:
    """RUN/summary.json, or (a run still in progress) the same fields from RUN/train_state.pt."""
    if (run / "summary.json").is_file():
        return json.loads((run / "summary.json").read_text())
    import torch

    state = torch.load(run / "train_state.pt", map_location="cpu", weights_only=True)
    return {
        "history": state.get("history", []),
        "baseline": state.get("baseline"),
        "best": state.get("best"),
        "config": state.get("config"),
        "restarts": state.get("restarts"),
        "tokens_seen": None,
        "seconds_this_process": None,
    }


def _train_seconds(summary: dict, step: int | None, before: float | None = None) -> float | None:
    """The shipped wall time: the per-step times up to ``step`` (a resumed run's history holds every
    step since its start, so this counts the sessions before the last resume too, which
    ``seconds_this_process`` does not); a summary without per-step times falls back to that."""
    seconds = _seconds_to(summary, step, before)
    return summary.get("seconds_this_process") if seconds is None else seconds


def _seconds_to(summary: dict, step: int | None, before: float | None = None) -> float | None:
    """Training seconds up to ``step``: the per-step times in the history, plus the steps before the
    run's last restart from a bundle (its history starts there): ``before`` if given, else what the
    restart recorded."""
    steps = [h for h in summary.get("history", []) if "seconds" in h and (step is None or h["step"] <= step)]
    if not steps:
        return None
    restarts = [r for r in summary.get("restarts") or [] if step is None or r.get("step", 0) < step]
    if before is None and restarts:
        before = restarts[-1].get("train_seconds_before")
        if before is None:
            raise SystemExit(
                f"the run restarted from {restarts[-1].get('from_bundle')} at step "
                f"{restarts[-1].get('step')} without recording that bundle's training seconds: "
                "pass --seconds-before (its summary.json's train_seconds)"
            )
    return round(sum(h["seconds"] for h in steps) + (before or 0.0), 1)


if __name__ == "__main__":
    main()
