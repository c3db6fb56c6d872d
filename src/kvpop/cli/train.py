"""``kvpop train``: argument parsing over :class:`TrainConfig` (also ``python -m kvpop.train`` under torchrun)."""

from __future__ import annotations

import argparse

from ..train.config import TRAIN_CORPORA, TrainConfig
from .options import add_run_arguments, config_kwargs, ints, run_training_command


def _observed(text: str) -> tuple[int | None, ...]:
    if text in ("", "none"):
        return ()
    return tuple(None if x in ("all", "window") else int(x) for x in text.split(","))


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(
        prog="kvpop train",
        description="Train a KVpop scorer with the LLM frozen. Resumes if --out holds a checkpoint of the same run; "
        "runs under torchrun too (one process per core: OMP_NUM_THREADS=1 each).",
    )
    d = TrainConfig()
    p.add_argument("--kind", dest="scorer", choices=["mlp", "mlstm"], default=d.scorer, help="scorer kind")
    p.add_argument("--out", required=True, help="output folder (checkpoints, summary.json); an existing run resumes")
    add_run_arguments(
        p,
        d,
        texts="train on",
        corpora=TRAIN_CORPORA,
        range_help="(one scorer for every budget in between; the window is the captured one nearest "
        "--window-fraction of B)",
        int_fields=("hidden", "dk", "dv", "cycle"),
        float_fields=("lam", "tau", "lr", "weight_decay"),
    )
    p.add_argument(
        "--windows-per-octave",
        type=int,
        default=d.windows_per_octave,
        help="--budget-range: target windows captured per doubling of the window (default 2)",
    )
    p.add_argument(
        "--windows-per-sequence",
        type=int,
        default=d.windows_per_sequence,
        help="--budget-range: targets for only this many windows of the grid per sequence (0: all); a "
        "smaller store, budgets still log-uniform over the sequences",
    )
    p.add_argument(
        "--data-seed",
        type=int,
        default=None,
        help="seed of the training text's order and windows (default --seed); another --seed with the "
        "same --data-seed reuses the capture store (a seed control without a new capture)",
    )
    p.add_argument("--val-seq-len", type=int, default=None, help="tokens per validation window (default --seq-len)")
    p.add_argument(
        "--val-cache",
        default=None,
        help="folder that keeps the validation baseline (dense, StreamingLLM) for later runs of a sweep",
    )
    p.add_argument("--window", type=int, default=None, help="protected window (default: --window-fraction of B)")
    p.add_argument("--window-fraction", type=float, default=d.window_fraction)
    p.add_argument(
        "--lam-scale",
        type=float,
        default=None,
        help="the recency tilt scales with the budget, lam = LAM_SCALE / B at each step (and in caches "
        "built from the scorer); with --lam as well, never below --lam",
    )
    p.add_argument(
        "--observed",
        type=_observed,
        default=d.observed,
        help="observed-attention inputs: comma-separated observation windows, 'all' = the whole window, "
        "'none' = keys and values only (default all,32,1)",
    )
    p.add_argument(
        "--no-position-free",
        dest="position_free",
        action="store_false",
        help="feed post-RoPE keys (default: undo RoPE)",
    )
    p.add_argument("--no-tilt", dest="tilt", action="store_false", help="no learned per-head recency tilt")
    p.add_argument(
        "--cross-heads",
        action="store_true",
        help="MLP: each KV head's network reads the exiting token's keys, values and observed attention "
        "in every KV head of its layer (default: its own head's only)",
    )
    p.add_argument("--extra-windows", type=ints, default=(), help="also capture targets for these windows (store)")
    p.add_argument(
        "--target-power",
        type=float,
        default=d.target_power,
        help="power mean of a token's future attention that the scorer learns to rank by: 1 (default) is the "
        "mean; larger (e.g. 8) ranks tokens a few later queries read sharply, like a needle, above ones many "
        "read faintly",
    )
    p.add_argument(
        "--target-span",
        type=int,
        default=d.target_span,
        help="each token's target becomes the largest within this many tokens either side, so a fact's "
        "tokens (a number's digits) are kept or dropped together (default 0: each token its own)",
    )
    p.add_argument("--loss", choices=["boundary", "mse"], default=d.loss)
    p.add_argument("--store", default=None, help="capture store folder: captures are kept there and reused")
    p.add_argument("--capture-only", action="store_true", help="fill --store for --steps x --batch-size sequences")
    return p


def config_from_args(args) -> TrainConfig:
    return TrainConfig(**config_kwargs(args, TrainConfig))


def main(argv: list[str] | None = None) -> int:
    return run_training_command("kvpop train", argv, build_parser(), config_from_args, _train, _report)


def _train(cfg: TrainConfig) -> dict:
    """The loop, imported once a checked run starts: it loads the model code, which parsing does not need."""
    from ..train.loop import train

    return train(cfg)


def _report(summary: dict) -> dict:
    if "best" not in summary:  # --capture-only
        return summary
    return {"best": summary["best"], "tokens_seen": summary["tokens_seen"], "seconds": summary["seconds_this_process"]}
