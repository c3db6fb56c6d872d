"""What kvpop's command lines share: argument types, the model's position limit,
and the frame of a training command (``kvpop train``, ``kvpop adapt``).

The generate and info commands (:mod:`kvpop.cli.generate`) and each subcommand's own parser
(:mod:`kvpop.cli.train`, :mod:`kvpop.cli.adapt`, :mod:`kvpop.cli.eval`) import from here, so no
subcommand imports the top-level command; the policy names are :mod:`kvpop.names`'. Importing this module
loads no torch, transformers or model code (they load inside the functions that use them), so a parser
built from it answers ``--help`` and a bad argument at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..files import json_safe

__all__ = [
    "RUN_INT_FIELDS",
    "add_run_arguments",
    "budget_range_arg",
    "config_kwargs",
    "ints",
    "model_position_limit",
    "run_training_command",
]


# the integer settings of a training run that kvpop train and kvpop adapt both take (as --seq-len, ...)
RUN_INT_FIELDS = (
    "seq_len",
    "batch_size",
    "sinks",
    "steps",
    "seed",
    "val_docs",
    "val_every",
    "ckpt_every",
    "stop_after",
)


def ints(text: str) -> tuple[int, ...]:
    """``"512,1024"`` -> ``(512, 1024)``."""
    return tuple(int(x) for x in text.split(",") if x)


def budget_range_arg(text: str) -> tuple[int, int]:
    """``LO,HI`` of ``--budget-range`` (kvpop train and kvpop adapt)."""
    lo_hi = ints(text)
    if len(lo_hi) != 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two budgets), got {text!r}")
    return lo_hi


def add_run_arguments(
    p: argparse.ArgumentParser,
    defaults,
    *,
    texts: str,
    corpora: tuple[str, ...],
    range_help: str,
    int_fields: tuple[str, ...],
    float_fields: tuple[str, ...],
) -> None:
    """The arguments ``kvpop train`` and ``kvpop adapt`` share: the model, the data (``texts``: what the
    command does with them, e.g. "train on"), the budgets, validation budgets, the numeric fields of
    ``defaults`` (a config) in :data:`RUN_INT_FIELDS` and named in ``int_fields`` / ``float_fields``, the
    device and progress."""
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument(
        "--corpora",
        default=",".join(corpora),
        help="comma-separated training corpora (kvpop.data; default keeps paul_graham and python_code "
        "out, for the out-of-domain evaluation)",
    )
    p.add_argument("--docs-from", default=None, help=f"{texts} your own texts: a folder of .txt or a .jsonl")
    p.add_argument(
        "--budgets",
        type=ints,
        default=defaults.budgets,
        help="comma-separated budgets B; one is drawn per step (default 512)",
    )
    p.add_argument("--budget", type=int, default=None, help="a single budget (same as --budgets B)")
    p.add_argument(
        "--budget-range",
        type=budget_range_arg,
        default=None,
        metavar="LO,HI",
        help="draw B log-uniformly from [LO, HI] at every step instead of --budgets " + range_help,
    )
    p.add_argument(
        "--val-budgets",
        type=ints,
        default=(),
        help="budgets of the validation probe (default: --budgets, or three spanning --budget-range)",
    )
    for name in (*RUN_INT_FIELDS, *int_fields):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in float_fields:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    p.add_argument("--weighting", choices=["uniform", "mass"], default=defaults.weighting)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the model and scorer move there)")
    p.add_argument("--check-sync", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true")


def config_kwargs(args: argparse.Namespace, cls) -> dict:
    """The fields of the config class ``cls`` (:meth:`kvpop.train.config.RunSettings.field_names`) from
    parsed arguments, with ``--corpora`` split and ``--no-progress`` turned around."""
    kw = {k: v for k, v in vars(args).items() if k in cls.field_names()}
    kw["corpora"] = tuple(c for c in args.corpora.split(",") if c)
    kw["progress"] = not args.no_progress
    return kw


def model_position_limit(name_or_path: str | os.PathLike | None) -> tuple[int, Path] | None:
    """``(max_position_embeddings, config.json)`` of a model, read from its config without loading its weights
    (a folder's own config.json, a GGUF's converted copy in the kvpop cache), so a budget past the limit is
    refused before the load; ``None`` where no config is there yet (a GGUF not converted) or it is unreadable:
    the load reports a broken model, and the cache refuses the budget after it."""
    path = None if name_or_path is None else Path(name_or_path).expanduser()
    if path is not None and path.is_dir():
        config = path / "config.json"
    else:  # a GGUF: the embedded default, an embedded model by name, or a file
        from .. import models

        try:
            if path is None:
                gguf = models.default_gguf_path()
            elif path.is_file():
                gguf = path
            elif (embedded := models.embedded_model(os.fspath(name_or_path))) is not None:
                gguf = models.embedded_gguf_path(embedded)
            else:
                return None
            config = models.gguf_cache_folder(gguf) / "config.json"
        except (OSError, models.ModelLoadError):
            return None
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    limit = meta.get("max_position_embeddings", (meta.get("text_config") or {}).get("max_position_embeddings"))
    return (limit, config) if isinstance(limit, int) and not isinstance(limit, bool) else None


def run_training_command(
    prog: str,
    argv: list[str] | None,
    parser: argparse.ArgumentParser,
    make_config: Callable,
    run: Callable[..., dict],
    report: Callable[[dict], dict],
    config_errors: tuple[type[Exception], ...] = (TypeError, ValueError),
) -> int:
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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
