"""What kvpop's command lines share: argument types, the quiet model load, the policy a scorer
checkpoint serves, and the frame of a training command (``kvpop train``, ``kvpop adapt``).

The top-level ``kvpop`` command (:mod:`kvpop.cli`) and each subcommand's own parser
(:mod:`kvpop.train.cli`, :mod:`kvpop.adapt.cli`, :mod:`kvpop.evaluate.cli`, the benchmarks)
import from here, so no subcommand imports the top-level command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch.distributed as dist
from transformers.utils import logging as hf_logging

from . import models
from .checkpoint import scorer_kind
from .files import json_safe
from .policies import KIND_TO_POLICY

__all__ = ["budget_range_arg", "ints", "load_model_quietly", "policy_for_scorer", "run_training_command"]


def ints(text: str) -> tuple[int, ...]:
    """``"512,1024"`` -> ``(512, 1024)``."""
    return tuple(int(x) for x in text.split(",") if x)


def budget_range_arg(text: str) -> tuple[int, int]:
    """``LO,HI`` of ``--budget-range`` (kvpop train and kvpop adapt)."""
    lo_hi = ints(text)
    if len(lo_hi) != 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two budgets), got {text!r}")
    return lo_hi


def load_model_quietly(name_or_path=None, adapter=None, merge: bool = False):
    """``kvpop.load_model`` for the command line: kvpop's one-time conversion messages, but not
    transformers' per-load "Loading weights" bar (noise on every run)."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return models.load_model(name_or_path, progress=True, adapter=adapter, merge=merge)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def policy_for_scorer(path: str, policy: str | None = None) -> str:
    """The learned policy a scorer checkpoint belongs to (its kind, read from the file's header)."""
    name = KIND_TO_POLICY[scorer_kind(path)]
    if policy is not None and policy != name:
        raise ValueError(f"--scorer {path} is a {scorer_kind(path)} scorer (policy {name}); it cannot serve --policy {policy}")
    return name


def run_training_command(prog: str, argv: list[str] | None, parser: argparse.ArgumentParser,
                         make_config: Callable, run: Callable[..., dict], report: Callable[[dict], dict],
                         config_errors: tuple[type[Exception], ...] = (TypeError, ValueError)) -> int:  # fmt: skip
    """Parse ``argv``, build and validate the config (bad input: one line, exit 2, before any model
    loads), ``run`` it (a ``ValueError`` or ``OSError`` -- another run's folder, an unwritable
    ``--out``, a full disk -- is one line and exit 2 too), print ``report(summary)`` as JSON on rank
    0, and end the process group under ``torchrun``."""
    args = parser.parse_args(argv)
    try:
        cfg = make_config(args)
        cfg.validate()
    except config_errors as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg)
    except (ValueError, OSError) as exc:  # OSError: an unwritable --out, a full disk (the last checkpoint kept)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(json_safe(report(summary)), indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
