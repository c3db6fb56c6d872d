"""Plain definitions of the observed-attention statistics (oracles for ``kvpop.observed`` and the
cache's chunk statistics): one query at a time, or one masked sum per observation window."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..observed import observed_windows

__all__ = ["chunk_observed_reference", "observed_attention_reference", "observed_sums_reference"]


@torch.no_grad()
def observed_attention_reference(
    query: Tensor,
    key: Tensor,
    window: int,
    sinks: int,
    obs_windows: Sequence[int | None] = (None,),
    scale: float | None = None,
) -> Tensor:
    """The definition, one query at a time (float64; for tests)."""
    obs = observed_windows(window, obs_windows)
    b, hq, S, d = query.shape
    hk = key.shape[1]
    g = hq // hk
    scale = d**-0.5 if scale is None else float(scale)
    out = torch.zeros(b, hk, S, len(obs), dtype=torch.float64)
    q, k = query.double().cpu(), key.double().cpu()
    for dq in range(S):
        keys = [j for j in range(dq + 1) if j < sinks or j > dq - window]
        p = torch.softmax(torch.einsum("bgd,bgkd->bgk", q[:, :, dq], k.repeat_interleave(g, 1)[:, :, keys]) * scale, -1)
        p = p.view(b, hk, g, len(keys)).mean(2)
        for pos, j in enumerate(keys):
            if j < sinks:
                continue
            for i, o in enumerate(obs):
                if dq - j >= window - o:
                    out[:, :, j, i] += p[:, :, pos]
    return out.float()


def observed_sums_reference(p_mean, key_idx, n_real, valid, window: int, obs_windows) -> torch.Tensor:
    """The direct form of the chunk step's suffix sums (``kvpop.cache``): one masked sum over the queries per window."""
    c = p_mean.shape[2]
    new_idx = torch.where(valid, n_real.unsqueeze(1) + valid.long().cumsum(1) - 1, -1)
    age = new_idx.view(-1, 1, c, 1) - key_idx.unsqueeze(2)  # [b, h, c, nk]
    return torch.stack([(p_mean * (age >= window - o)).sum(dim=2) for o in obs_windows], -1)


@torch.no_grad()
def chunk_observed_reference(
    query: Tensor,
    keys: Tensor,
    slot_index: Tensor,
    n_real: Tensor,
    valid: Tensor | None,
    sinks: int,
    window: int,
    obs_windows: Sequence[int],
    scaling: float,
) -> Tensor:
    """:func:`kvpop.observed.chunk_observed` in its direct form: every query's logits over the sinks,
    the ring and the whole chunk, the keys outside its window masked, one masked sum per window."""
    b, hq, c, d = query.shape
    h = keys.shape[1]
    g = hq // h
    s, w = sinks, window
    n = keys.shape[2] - c
    valid = torch.ones(b, c, dtype=torch.bool, device=query.device) if valid is None else valid
    new_idx = torch.where(valid, n_real.unsqueeze(1) + valid.long().cumsum(1) - 1, -1)  # [b, c]
    local_keys = torch.cat([keys[:, :, : s + w], keys[:, :, n:]], dim=2).float()
    key_idx = torch.cat([slot_index[:, : s + w], new_idx], dim=1).view(b, 1, 1, 1, -1)
    logits = torch.einsum("bhgcd,bhkd->bhgck", query.float().view(b, h, g, c, d), local_keys) * scaling
    tq = new_idx.view(b, 1, 1, c, 1)
    local = (key_idx >= 0) & (key_idx <= tq) & ((key_idx < s) | (key_idx > tq - w))
    p = torch.softmax(logits.masked_fill(~local, -math.inf), dim=-1).nan_to_num(0.0)
    p_mean = p.mean(2)[..., s:] * valid.view(b, 1, c, 1)  # [b, h, c, w + c]
    key_idx = key_idx.view(b, 1, -1)[..., s:].expand(b, h, -1)
    return observed_sums_reference(p_mean, key_idx, n_real, valid, w, obs_windows)
