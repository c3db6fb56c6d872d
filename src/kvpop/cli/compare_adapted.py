"""``kvpop compare-adapted``: its parser; the report itself is :mod:`kvpop.adapt.report`."""

from __future__ import annotations

import argparse

from ..adapt.config import ROW_ORDER


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpop compare-adapted",
        description="Retention (against the BASE model's dense outputs) of the adapted model under kvpop, the base "
        "model under kvpop, StreamingLLM+ and StreamingLLM, and the adapted models dense, on the test documents of "
        "the evaluation corpora. Resumable (rerun the same command) and splittable (--shard i/n per process).",
    )
    p.add_argument("--bundle", required=True, help="kvpop adapter bundle with its scorer (kvpop adapt --mask kvpop)")
    p.add_argument(
        "--streaming-bundle",
        default=None,
        help="the StreamingLLM+ control (kvpop adapt --mask streaming); without it, StreamingLLM+ is the "
        "kvpop bundle's adapter under the window mask",
    )
    p.add_argument(
        "--base-scorer",
        default=None,
        help="scorer for the base-model kvpop row (default: the scorer the bundle started from)",
    )
    p.add_argument("--model", default=None, help="the base model (default: embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output folder (records/, results.json, table.md, adapt.png)")
    p.add_argument(
        "--compression",
        type=float,
        nargs="+",
        default=[0.75, 0.875],
        help="budgets as compression of --doc-tokens (default 0.75 0.875)",
    )
    p.add_argument("--doc-tokens", type=int, default=4096)
    p.add_argument("--docs", type=int, default=2, help="test documents per corpus")
    p.add_argument("--corpora", nargs="+", default=None, help="default: the evaluation corpora")
    p.add_argument(
        "--rows",
        nargs="+",
        choices=ROW_ORDER,
        default=None,
        metavar="ROW",
        help=f"run only these rows (default all): {', '.join(repr(r) for r in ROW_ORDER)}",
    )
    p.add_argument("--shard", default=None, help="i/n: this process takes documents i, i+n, ... (1-based)")
    p.add_argument(
        "--no-merge-lora",
        dest="merge",
        action="store_false",
        help="keep the LoRA adapters unmerged (slower; the merged weights are equal up to rounding)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..adapt.report import run  # the models and the evaluation harness (torch), once the arguments parsed

    return run(args)
