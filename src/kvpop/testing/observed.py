"""Plain definitions of the observed-attention statistics (oracles for ``kvpop.observed`` and the
cache's chunk statistics): one query at a time, or one masked sum per observation window."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..observed import observed_windows

__all__ = ["observed_attention_reference", "observed_sums_reference"]


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
