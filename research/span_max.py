"""Does keeping a fact whole fix multi-key needles? A prefill-only span maximum of the exit priorities.

The default learned policy holds each token of a multi-key needle in a fifth to a third of the KV heads,
but rarely a whole 7-digit value in one head (``research/multikey_kept.py``). This study raises every
exiting token's priority to the maximum over its neighbours within ``--radius`` tokens (among the
tokens that leave the window in the same prefill piece), so a head keeps a run of tokens together, and
runs ``kvpop eval tasks`` with that change. Only the prompt's prefill is affected (a decode step has one
exiting token); the records are labelled with the policy's own name, so give them a folder of their own.

    python research/span_max.py --radius 3 -- --model qwen2.5-coder-0.5b --tasks niah_multikey --cases 8 \\
        --budgets 512 --policies kvpop-mlp --out results/qwen/tasks-ruler-multikey-span3
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def span_max(prio: torch.Tensor, exits: torch.Tensor, radius: int) -> torch.Tensor:
    """``prio [b, h, c]``: each exiting token's priority raised to the maximum over the exiting tokens
    within ``radius`` places of it (``exits [b, c]``); the others unchanged."""
    b, h, c = prio.shape
    mask = exits.view(b, 1, c).expand(b, h, c)
    x = prio.masked_fill(~mask, -torch.inf).reshape(b * h, 1, c)
    pooled = F.max_pool1d(x, 2 * radius + 1, stride=1, padding=radius).view(b, h, c)
    return torch.where(mask, pooled, prio)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--radius", type=int, default=3)
    args = p.parse_args(ours)

    from kvpop import step
    from kvpop.cli.eval import main as eval_main

    chunk_scores = step._chunk_scores

    def patched(spec, kernels, layer_idx, st, ch, k_new, v_new, ring_obs):
        prio = chunk_scores(spec, kernels, layer_idx, st, ch, k_new, v_new, ring_obs)
        return span_max(prio, ch.ex_idx >= 0, args.radius) if prio.shape[-1] > 1 else prio

    step._chunk_scores = patched
    return eval_main(["tasks", *rest])


if __name__ == "__main__":
    raise SystemExit(main())
