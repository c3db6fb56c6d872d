"""What the two evaluation command lines share: ``kvpop eval`` (:mod:`kvpop.cli.eval`) and ``kvpop eval tasks``
(:mod:`kvpop.evaluate.suite`): the eviction settings every policy gets, the scorer checkpoints, unavailable
policies, the progress and plot switches, and the given arguments as a config's fields.

Plain ``argparse``: importing this module loads no torch, so both parsers answer ``--help`` and a bad
argument at once.
"""

from __future__ import annotations

import argparse

__all__ = ["add_eviction_arguments", "add_run_switches", "add_scorer_argument", "given_fields"]


def add_eviction_arguments(p: argparse.ArgumentParser) -> None:
    """``--sinks``, ``--window``, ``--window-fraction``, ``--lam``: one setting for every policy (unset: each
    policy's own, as a cache resolves it)."""
    p.add_argument("--sinks", type=int, help="sink tokens (default 4)")
    p.add_argument(
        "--window",
        type=int,
        help="one protected window for every policy (default: each policy's own; StreamingLLM: always the whole "
        "budget)",
    )
    p.add_argument(
        "--window-fraction",
        type=float,
        help="window = fraction * B for every window-based policy, the same for all (default: each "
        "policy's own, as a cache resolves it: B / 2, or a learned scorer's trained fraction)",
    )
    p.add_argument(
        "--lam",
        type=float,
        help="recency tilt r(t) + lam * t for every policy (default: a learned scorer's trained lam, else 0)",
    )


def add_scorer_argument(p: argparse.ArgumentParser) -> None:
    """``--scorer PATH`` (repeatable): a scorer checkpoint for the learned policy of its kind."""
    p.add_argument(
        "--scorer",
        action="append",
        metavar="PATH",
        help="a scorer checkpoint to evaluate instead of the shipped one (repeatable, one per kind); its kind, "
        "read from the file, decides whether it is policy kvpop-mlstm (mlstm) or kvpop-mlp (mlp)",
    )


def add_run_switches(p: argparse.ArgumentParser) -> None:
    """``--max-minutes``, ``--no-progress``, ``--no-plots``."""
    p.add_argument("--max-minutes", type=float, help="stop starting new units after this long (rerun to continue)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")


def given_fields(args: argparse.Namespace, fields: dict[str, str]) -> dict:
    """The arguments given (not None) among ``fields`` (argument dest -> config field), under their field
    names; a list becomes a tuple."""
    out = {}
    for name, key in fields.items():
        v = getattr(args, name, None)
        if v is not None:
            out[key] = tuple(v) if isinstance(v, list) else v
    return out
