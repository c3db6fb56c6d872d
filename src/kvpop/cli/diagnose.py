"""``kvpop diagnose noisy-oracle``: its parser and checks; the measurement is :mod:`kvpop.train.diagnose`.

kvpop diagnose noisy-oracle --budget 512 --docs 4 --sigmas 0 0.5 1 2 --out results/diagnostics
"""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = "Diagnostics that explain a scorer's gap to the oracle: how good must scores be to beat a window?"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop diagnose noisy-oracle", description=DESCRIPTION)
    p.add_argument("what", choices=["noisy-oracle"])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window-fraction", type=float, default=0.5)
    p.add_argument("--docs", type=int, default=4, help="validation windows of the training corpora")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 2.0])
    p.add_argument("--model", default=None)
    p.add_argument(
        "--scorer",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a learned scorer to place on the plot (repeatable; default: the shipped ones on the "
        "embedded model, none on another model; 'none' for none)",
    )
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.scorer is None:
        if args.model:
            scorers = {}
        else:
            from ..checkpoint import DEFAULT_SCORERS  # torch: the parser and its refusals load none

            scorers = {f"kvpop ({k})": str(v) for k, v in DEFAULT_SCORERS.items()}
    elif args.scorer == ["none"]:
        scorers = {}
    else:
        bad = [x for x in args.scorer if "=" not in x]
        if bad:
            p.error(f"--scorer expects NAME=PATH, got {bad[0]!r}")
        scorers = dict(x.split("=", 1) for x in args.scorer)
        missing = [v for v in scorers.values() if not Path(v).is_file()]
        if missing:
            p.error(f"--scorer: no scorer checkpoint at {missing[0]}")
    from ..train.diagnose import run  # the measurement (torch, the model code), once the arguments are checked

    return run(args, scorers)
