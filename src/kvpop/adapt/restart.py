"""Continue an adaptation run from one of its adapter bundles (``kvpop adapt --from-bundle DIR``).

A run's ``train_state.pt`` (weights, optimizer moments, scheduler, step) is what a resume reads. When
it is gone (a lost machine, a copied bundle) but a bundle the run wrote at step ``s`` is kept, the
run can go on from ``s``: the LoRA weights come from the bundle, the learning-rate schedule and the
data stream continue at step ``s`` (step ``j`` always reads the same sequences), and only the AdamW
moments start again from zero, which the run records (``restarts`` in its state and summary). The
bundle must have been written by a run with the same settings (mask, LoRA shape, the starting scorer,
the trained-for windows and lam, sequence length and batch): anything else is refused before the
model loads. The run's validation baseline (the un-adapted model, about an hour at 24 windows of
4,096 tokens on one core) is taken from the bundle's ``summary.json`` when that was written for the
same validation windows and budgets (``scripts/ship_adapter.py`` writes one), else recomputed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bundle import ADAPTER_FILES, base_fingerprint, check_adapter_bundle, set_adapter_weights
from ..checkpoint import fingerprint_diff, read_tensors
from .config import AdaptConfig

__all__ = ["BundleStart", "bundle_start", "load_bundle_weights"]

SUMMARY_FILE = "summary.json"
# the settings that choose the validation windows and budgets: a stored baseline is reused only if equal
BASELINE_KEYS = (
    "val_docs",
    "seq_len",
    "corpora",
    "docs_from",
    "budgets",
    "budget_range",
    "val_budgets",
    "sinks",
    "seed",
)


@dataclass
class BundleStart:
    """Where a run restarted from a bundle begins: the bundle, its step, and a reusable baseline."""

    path: Path
    step: int
    baseline: dict | None
    seconds_before: float | None = None  # training seconds of the bundle's steps (its summary.json), if known

    def record(self) -> dict:
        """What the run's state and summary keep about this restart (the seconds before it: the restarted
        run's history starts at the bundle's step, and its wall time should not)."""
        return {
            "from_bundle": str(self.path),
            "step": self.step,
            "optimizer": "AdamW moments reset to zero",
            "baseline": "from the bundle's summary.json" if self.baseline is not None else "recomputed",
            "train_seconds_before": self.seconds_before,
        }


def bundle_start(cfg: AdaptConfig) -> BundleStart:
    """Check ``cfg.from_bundle`` against the run ``cfg`` describes (no model needed) and return the
    start; raises ``ValueError`` naming the first setting that differs."""
    path = Path(cfg.from_bundle)
    header = check_adapter_bundle(path)
    meta = header.get("meta") or {}
    where = f"--from-bundle {path}"
    if meta.get("kind") != "kvpop-adapt":
        raise ValueError(f"{where} was not written by kvpop adapt (meta kind {meta.get('kind')!r})")
    if cfg.full_finetune:
        raise ValueError("--from-bundle continues a LoRA run; a full fine-tune writes a model folder, not a bundle")
    want = {
        "mask": cfg.mask,
        "joint": bool(cfg.joint and cfg.mask == "kvpop"),
        "adapter": {
            "lora_r": cfg.lora_r,
            "lora_alpha": cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_r,
            "lora_targets": list(cfg.lora_targets),
        },
        "trained_for": cfg.trained_for(),
        "corpora": list(cfg.corpora) if not cfg.docs_from else ["user:" + str(cfg.docs_from)],
        "scorer_sha256": cfg.scorer_sha256(),
    }
    have = {
        **{k: meta.get(k) for k in want if k != "scorer_sha256"},
        "scorer_sha256": (meta.get("trained_from") or {}).get("scorer_sha256"),
    }
    for key, value in want.items():
        if have[key] != value:
            raise ValueError(
                f"{where} comes from a run with other settings: {key} is {have[key]!r} there, "
                f"{value!r} here; continue it with the settings it was trained with"
            )
    step = meta.get("steps")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{where} records no step count (meta steps {step!r})")
    if step >= cfg.steps:
        raise ValueError(f"{where} is at step {step}; --steps {cfg.steps} leaves nothing to train")
    if meta.get("tokens_seen") != step * cfg.batch_size * cfg.seq_len:
        raise ValueError(
            f"{where} saw {meta.get('tokens_seen')} tokens in {step} steps, not {step} x batch "
            f"{cfg.batch_size} x seq_len {cfg.seq_len}: another --batch-size or --seq-len"
        )
    summary = _read_summary(path)
    return BundleStart(path, step, _stored_baseline(summary, cfg), _stored_seconds(summary, step))


def _read_summary(path: Path) -> dict | None:
    f = path / SUMMARY_FILE
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None


def _stored_seconds(summary: dict | None, step: int) -> float | None:
    """The bundle's training seconds, only if its summary was written for this very step (a summary
    copied beside a later checkpoint's LoRA would under-count)."""
    seconds = (summary or {}).get("train_seconds")
    if summary is None or summary.get("shipped_step") != step or not isinstance(seconds, (int, float)):
        return None
    return float(seconds)


def _stored_baseline(summary: dict | None, cfg: AdaptConfig) -> dict | None:
    if not cfg.val_docs or summary is None:
        return None
    saved, now = summary.get("config") or {}, json.loads(json.dumps(vars(cfg), default=list))
    if not summary.get("baseline") or any(saved.get(k) != now.get(k) for k in BASELINE_KEYS):
        return None
    return summary["baseline"]


def load_bundle_weights(model, start: BundleStart) -> int:
    """Copy the bundle's LoRA weights into ``model`` (a peft model with a fresh adapter of the same
    shape) and check that every trainable weight now equals the bundle's. Returns how many were set."""
    diff = fingerprint_diff(check_adapter_bundle(start.path).get("fingerprint") or {}, base_fingerprint(model))
    if diff:
        raise ValueError(
            f"--from-bundle {start.path} was trained on another base model ({', '.join(sorted(diff))} differ)"
        )
    tensors = read_tensors(start.path / ADAPTER_FILES[1])
    unexpected = set_adapter_weights(model, tensors)
    if unexpected:
        raise ValueError(f"--from-bundle {start.path}: weights this model has no place for ({unexpected[:3]} ...)")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, param in trained:  # peft names the active adapter inside the parameter name; the file does not
        key = name.replace(f".{model.active_adapter}.", ".")
        if key not in tensors or not torch.equal(param.detach().cpu(), tensors[key].to(param.dtype)):
            raise ValueError(f"--from-bundle {start.path}: the model's {name} did not receive the bundle's weight")
    if len(trained) != len(tensors):
        raise ValueError(
            f"--from-bundle {start.path} holds {len(tensors)} LoRA tensors, this model trains {len(trained)}"
        )
    return len(trained)
