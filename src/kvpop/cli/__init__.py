"""``kvpop`` command line: thin argument parsing over the library's modules.

The parser, the dispatch to subcommands and every check that the argument values alone decide load no
torch, transformers or model code (those load inside the command functions), so ``kvpop --help``, every
subcommand's ``--help`` and a bad argument answer at once, and a bad argument is refused before any model
loads.

* :mod:`.generate` -- ``kvpop info`` and ``kvpop generate`` (``--compare``: :mod:`.compare`);
* :mod:`.train`, :mod:`.adapt`, :mod:`.eval` -- ``kvpop train``, ``kvpop adapt``, ``kvpop eval``;
* :mod:`.options` -- what the command lines share.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import generate

__all__ = ["build_parser", "main"]

BENCHMARKS = ("targets", "generate", "overhead", "prefill", "gpu", "vllm")
SUBCOMMANDS = ("train", "eval", "diagnose", "adapt", "compare-adapted", "serve")  # each parses its own options


def _subcommand_main(name: str) -> Callable[[list[str]], int]:
    """The main of a subcommand that parses its own options, imported only when it runs: each loads its
    own dependencies, which neither the top-level parser nor the other subcommands need."""
    if name == "train":
        from .train import main
    elif name == "adapt":
        from .adapt import main
    elif name == "eval":
        from .eval import main
    elif name == "diagnose":
        from .diagnose import main
    elif name == "compare-adapted":
        from .compare_adapted import main
    else:
        from ..serving.vllm.serve import main
    return main


def _benchmark_main(name: str) -> Callable[[list[str]], int | None]:
    """The main of ``kvpop bench NAME``, imported only when it is named (the benchmarks load torch when they run;
    ``kvpop bench generate --help`` answers without it)."""
    if name == "targets":
        from ..bench.targets import main
    elif name == "generate":
        from ..bench.generate import main
    elif name == "overhead":
        from ..bench.overhead import main
    elif name == "prefill":
        from ..bench.prefill import main
    elif name == "gpu":
        from ..bench.gpu import main
    else:
        from ..bench.vllm import main
    return main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop", description="Fixed-size KV cache by learned eviction (KVpop).")
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parsers(sub)  # info, generate
    pb = sub.add_parser("bench", help="benchmarks (write JSON); `kvpop bench NAME --help` for a benchmark's options")
    pb.add_argument("what", choices=list(BENCHMARKS))
    sub.add_parser("train", help="train a KVpop scorer (see `kvpop train --help`)", add_help=False)
    sub.add_parser(
        "adapt", help="adapt the LLM to the bounded cache with LoRA (see `kvpop adapt --help`)", add_help=False
    )
    sub.add_parser(
        "compare-adapted",
        add_help=False,
        help="retention of the adapted model vs the base model under kvpop and StreamingLLM(+) on the "
        "test splits (see `kvpop compare-adapted --help`)",
    )
    sub.add_parser(
        "diagnose", help="diagnostics of the learned scorer (see `kvpop diagnose noisy-oracle --help`)", add_help=False
    )
    sub.add_parser("eval", help="evaluate policies and budgets (see `kvpop eval --help`)", add_help=False)
    sub.add_parser(
        "serve",
        add_help=False,
        help="vLLM's OpenAI-compatible server with kvpop layers (needs kvpop[vllm]; see `kvpop serve --help`)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:  # the subcommand parses (and --help) its own options
        return _subcommand_main(argv[0])(argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return _benchmark_main(argv[1])(argv[2:]) or 0
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            return generate.cmd_info(args)
        if args.command == "generate":
            return generate.cmd_generate(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"kvpop: error: {exc}", file=sys.stderr)
        return 2
    return 1
