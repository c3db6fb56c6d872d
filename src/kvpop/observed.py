"""Observed attention: what a token received while it sat in the protected window.

Every token is seen by exactly ``window`` queries while protected (itself and the next
``window - 1``). The cache (``kvpop.cache``) accumulates, per token, the attention those queries
paid it, normalised over each query's sinks + window only (so the statistic does not depend on
earlier eviction decisions), averaged over the query heads of the KV group, and summed over the
last ``o`` of those queries for each observation window ``o``: ``o = window`` is H2O's
statistic, ``o = 32`` SnapKV's, ``o = 1`` TOVA's. The learned scorers may read the same numbers.

This module computes them from a whole sequence's queries and keys, as a training capture needs
them: :func:`observed_attention` block by block in ``O(S * (window + block))`` memory, and
:func:`observed_attention_reference`, the plain per-query definition (the test oracle).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["observed_attention", "observed_attention_reference", "observed_counts", "observed_features"]


def _windows(window: int, obs_windows: Sequence[int | None]) -> list[int]:
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for o in obs_windows:
        if o is not None and o < 1:
            raise ValueError(f"observation windows must be >= 1 or None (= the whole window), got {o}")
        out.append(window if o is None else min(int(o), window))
    return out


def observed_counts(window: int, obs_windows: Sequence[int | None]) -> list[int]:
    """How many queries each statistic sums over (``min(o, window)``; None = the whole window)."""
    return _windows(window, obs_windows)


def observed_features(stats: Tensor, window: int, obs_windows: Sequence[int | None], eps: float = 1e-6) -> Tensor:
    """Scorer inputs from summed statistics ``[..., n]``: the log of the mean attention per query."""
    counts = torch.tensor(observed_counts(window, obs_windows), dtype=torch.float32, device=stats.device)
    return torch.log(stats.float() / counts + eps)


@torch.no_grad()
def observed_attention(
    query: Tensor,
    key: Tensor,
    window: int,
    sinks: int,
    obs_windows: Sequence[int | None] = (None,),
    scale: float | None = None,
    block: int = 256,
) -> Tensor:
    """Observed-attention statistics of every key, ``[b, kv_heads, S, len(obs_windows)]`` (float32).

    ``query [b, q_heads, S, d]``, ``key [b, kv_heads, S, d]`` post-RoPE, one unpadded sequence per
    row. Sink keys (``t < sinks``) get 0: they never leave, nothing scores them.
    """
    obs = _windows(window, obs_windows)
    b, hq, S, d = query.shape
    hk = key.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hk})")
    g = hq // hk
    scale = d**-0.5 if scale is None else float(scale)
    out = torch.zeros(b, hk, S, len(obs), dtype=torch.float32, device=query.device)
    qg = query.float().view(b, hk, g, S, d)
    kf = key.float()
    dev = query.device
    s = min(sinks, S)
    for a in range(0, S, block):
        e = min(S, a + block)
        lo = max(s, a - window + 1)
        kidx = torch.cat([torch.arange(s, device=dev), torch.arange(lo, e, device=dev)])
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, a:e], kf[:, :, kidx]) * scale
        dq = torch.arange(a, e, device=dev).view(-1, 1)
        kj = kidx.view(1, -1)
        local = (kj <= dq) & ((kj < sinks) | (kj > dq - window))
        p = torch.softmax(logits.masked_fill(~local, float("-inf")), -1).mean(2)  # [b, hk, q, k]
        age = dq - kj
        for i, o in enumerate(obs):
            counted = local & (kj >= sinks) & (age >= window - o)
            out[:, :, :, i].index_add_(2, kidx, (p * counted).sum(2))
    return out


@torch.no_grad()
def observed_attention_reference(
    query: Tensor, key: Tensor, window: int, sinks: int, obs_windows: Sequence[int | None] = (None,),
    scale: float | None = None,
) -> Tensor:
    """The definition, one query at a time (float64; for tests)."""
    obs = _windows(window, obs_windows)
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
