"""Average of several trained MLP scorers, as ONE wider MLP scorer (an ensemble at no extra machinery).

The mean of N per-head MLPs ``f_i(x) = w2_i . silu(W1_i x + b1_i) + b2_i`` is itself an MLP of width
``sum(hidden_i)``: stack the first layers, scale each second layer by its weight, and add the biases.
The learned recency tilts ``lam_i * t`` average linearly too, so the merged stack scores every token
with exactly ``sum_i a_i * score_i`` (``a_i`` the weights, summing to 1) and runs through every path
a single MLP runs through (cache, compiled decode, vLLM), with no loop over members.

Scorers trained on different text make partly independent ranking errors; averaging their scores
is the cheapest way to cancel some of them (``research/average_scorers.py`` makes a checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from . import TILT_SCALE, ScorerStack

__all__ = ["average_scorers"]

# fields that define what a scorer reads and how its score is used: they must agree between members
_SHARED = (
    "num_layers",
    "kv_heads",
    "head_dim",
    "input_norm",
    "eps",
    "position_free",
    "observed",
    "tilt",
    "cross_heads",
)


def average_scorers(stacks: Sequence[ScorerStack], weights: Sequence[float] | None = None) -> ScorerStack:
    """One ``kind="mlp"`` stack whose scores are the weighted mean of ``stacks``' scores.

    ``weights`` (default equal) must be positive; they are normalised to sum to 1. Every member must be an
    MLP scorer reading the same inputs (shapes, ``position_free``, ``observed``, ``tilt``, ``cross_heads``)
    with the same RoPE frequencies; anything else is a ``ValueError`` naming the field.
    """
    stacks = list(stacks)
    if len(stacks) < 2:
        raise ValueError(f"stacks: need at least 2 scorers to average, got {len(stacks)}")
    if weights is None:
        weights = [1.0] * len(stacks)
    weights = [float(w) for w in weights]
    if len(weights) != len(stacks):
        raise ValueError(f"weights: {len(weights)} weights for {len(stacks)} scorers")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {weights}")
    total = sum(weights)
    weights = [w / total for w in weights]
    first = stacks[0].config
    for i, s in enumerate(stacks):
        if s.config.kind != "mlp":
            raise ValueError(f"stacks[{i}] is a {s.config.kind!r} scorer; only MLP scorers average into one MLP")
        for name in _SHARED:
            if getattr(s.config, name) != getattr(first, name):
                raise ValueError(
                    f"stacks[{i}].config.{name} is {getattr(s.config, name)!r}, "
                    f"stacks[0] has {getattr(first, name)!r}: the scorers read different inputs"
                )
        if first.position_free and not torch.equal(s.rope_inv_freq, stacks[0].rope_inv_freq):
            raise ValueError(f"stacks[{i}] undoes a different RoPE than stacks[0] (rope_inv_freq differs)")
        if first.position_free and s.config.rope_scaling != first.rope_scaling:
            raise ValueError(
                f"stacks[{i}].config.rope_scaling is {s.config.rope_scaling}, stacks[0] has {first.rope_scaling}"
            )
    config = dataclasses.replace(first, hidden=sum(s.config.hidden for s in stacks), seed=0)
    merged = ScorerStack(config)
    with torch.no_grad():
        for layer_idx, layer in enumerate(merged):
            members = [s[layer_idx] for s in stacks]
            layer.w1.copy_(torch.cat([m.w1 for m in members], dim=2))
            layer.b1.copy_(torch.cat([m.b1 for m in members], dim=1))
            layer.w2.copy_(torch.cat([m.w2 * a for m, a in zip(members, weights)], dim=1))
            layer.b2.copy_(sum(m.b2 * a for m, a in zip(members, weights)))
        if config.position_free:
            merged.rope_inv_freq.copy_(stacks[0].rope_inv_freq)
        if config.tilt:
            lam = sum(s.tilt() * a for s, a in zip(stacks, weights))  # softplus(theta) / TILT_SCALE, averaged
            merged.tilt_theta.copy_(_inverse_softplus(lam * TILT_SCALE))
    return merged.eval()


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (y > 0), computed stably: x = y + log(-expm1(-y))."""
    y = y.double()
    return (y + torch.log(-torch.expm1(-y))).float()
