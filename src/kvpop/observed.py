"""Observed attention: what a token received while it sat in the protected window.

Every token is seen by exactly ``window`` queries while protected (itself and the next
``window - 1``). The cache (``kvpop.cache``) accumulates, per token, the attention those queries
paid it, normalised over each query's sinks + window only (so the statistic does not depend on
earlier eviction decisions), averaged over the query heads of the KV group, and summed over the
last ``o`` of those queries for each observation window ``o``: ``o = window`` is H2O's
statistic, ``o = 32`` SnapKV's, ``o = 1`` TOVA's. The learned scorers may read the same numbers.

This module holds the statistic in each shape it is needed in: from a whole sequence's queries and
keys, as a training capture needs them (:func:`observed_attention`, block by block in
``O(S * (window + block))`` memory); and as a cache accumulates them, for a prefill chunk of
queries (:func:`observed_sums`) and for one decode query (:func:`ring_contrib`). The plain
per-query definitions the tests hold them to are in ``kvpop.testing.observed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "observed_attention",
    "observed_attention_windows",
    "observed_counts",
    "observed_features",
    "observed_sums",
    "observed_windows",
    "ring_contrib",
]


def observed_windows(window: int, obs_windows: Sequence[int | None]) -> list[int]:
    """Each observation window as a query count at protected ``window`` (None = the whole window)."""
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
    return observed_windows(window, obs_windows)


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
    return observed_attention_windows(query, key, [window], sinks, obs_windows, scale=scale, block=block)[window]


@torch.no_grad()
def observed_attention_windows(
    query: Tensor,
    key: Tensor,
    windows: Sequence[int],
    sinks: int,
    obs_windows: Sequence[int | None] = (None,),
    scale: float | None = None,
    block: int = 128,
) -> dict[int, Tensor]:
    """:func:`observed_attention` for several protected windows, ``{window: statistics}``, block by
    block over the queries in ``O(S * (max window + block))`` memory.

    Each query block is exponentiated once against its sinks and the keys of the largest window,
    and laid out by age (``[query, d - t]``). A window's softmax differs from another's only by its
    normaliser ``Z_w(d)`` (the sinks + the keys younger than ``w``): one cumulative sum over the
    ages gives every window's. Observation window ``o`` of window ``w`` is then the slice of ages
    ``w - o .. w - 1``, weighted by ``1 / Z_w(d)`` and added to its keys ``t = d - age``.
    """
    ws = sorted({int(w) for w in windows})
    obs = {w: observed_windows(w, obs_windows) for w in ws}
    b, hq, S, d = query.shape
    hk = key.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hk})")
    g = hq // hk
    scale = d**-0.5 if scale is None else float(scale)
    out = {w: torch.zeros(b, hk, S, len(obs[w]), dtype=torch.float32, device=query.device) for w in ws}
    qg = query.float().view(b, hk, g, S, d)
    kf = key.float()
    dev = query.device
    s = min(sinks, S)
    w_max = ws[-1]
    ages = torch.arange(w_max, device=dev)
    for a in range(0, S, block):
        e = min(S, a + block)
        bq = e - a
        lo = max(s, a - w_max + 1)  # the non-sink keys any query of the block may see: lo .. e - 1
        dq = torch.arange(a, e, device=dev)
        logits = (
            torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, a:e], torch.cat([kf[:, :, :s], kf[:, :, lo:e]], 2)) * scale
        )
        n = e - lo
        x = logits.new_full((b, hk, g, bq, 1 + n), float("-inf"))  # column 0: no key (its exp is 0)
        x[..., 1:] = logits[..., s:]
        age = dq.view(-1, 1) - torch.arange(lo, e, device=dev).view(1, -1)  # [bq, n]
        x[..., 1:].masked_fill_((age < 0) | (age >= w_max), float("-inf"))
        x_s = logits[..., :s].masked_fill(torch.arange(s, device=dev).view(1, -1) > dq.view(-1, 1), float("-inf"))
        top = x.amax(-1, keepdim=True)
        if s:
            top = torch.maximum(top, x_s.amax(-1, keepdim=True))  # finite: every query sees itself
        z_s = torch.exp(x_s - top).sum(-1)  # [b, hk, g, bq] (0 without sinks)
        ex = torch.exp(x.sub_(top))
        col = (dq.view(-1, 1) - ages.view(1, -1) - lo + 1).clamp_min(0)  # [bq, w_max]: key d - age, or none
        by_age = ex.gather(-1, col.view(1, 1, 1, bq, w_max).expand(b, hk, g, bq, w_max))
        z_all = by_age.cumsum(-1)  # sum over ages 0..a of every query's window keys
        for w in ws:
            r = 1.0 / ((z_s + z_all[..., w - 1]).clamp_min(1e-30) * g)  # window w's normaliser, mean over g
            for i, o in enumerate(obs[w]):
                part = (by_age[..., w - o : w] * r.unsqueeze(-1)).sum(2)  # [b, hk, bq, o]
                t = (dq.view(-1, 1) - ages[w - o : w].view(1, -1)).clamp_min(0)  # its keys (none: part is 0)
                out[w][:, :, :, i].index_add_(2, t.view(-1), part.reshape(b, hk, bq * o))
    if s:
        for w in ws:
            out[w][:, :, :s] = 0  # sinks never leave: nothing scores them
    return out


# --- the same sums, as a cache accumulates them while it runs (kvpop.step) ---------------------------


def observed_sums(p_mean, key_idx, n_real, valid, window: int, obs_windows) -> torch.Tensor:
    """Per key, the attention it got from the chunk's queries that are at least ``window - o`` newer,
    for each observation window ``o``: ``[b, h, n + c, n_obs]``.

    ``p_mean [b, h, c, n + c]`` is zero for padding queries and wherever a query does not observe the
    key (the key is not in the query's window: older by ``window`` or more, newer, or an empty slot).
    So the queries that count for window ``o`` are a band of at most ``o`` consecutive queries, the
    last ``o`` steps before the key leaves the window: the whole window is one column sum, and a
    narrow window gathers its ``o`` rows (instead of a suffix sum over all ``c`` queries per key).
    A row's real queries are consecutive tokens after its left padding, so a key's band starts at
    chunk position ``first_real - n_real + key_idx + window - o``.
    ``kvpop.testing.observed.observed_sums_reference`` is the direct form; a test holds them together.
    """
    b, c = p_mean.shape[0], p_mean.shape[2]
    first_real = c - valid.long().sum(1)  # chunk position of each row's first real query
    out = []
    for o in obs_windows:
        thr = window - o
        if thr <= 0:  # every query that observes the key counts
            out.append(p_mean.sum(2))
            continue
        start = (first_real - n_real).view(b, 1, 1) + key_idx + thr  # [b, h, nk]
        rows = start.unsqueeze(2) + torch.arange(o, device=p_mean.device).view(1, 1, o, 1)  # [b, h, o, nk]
        inside = (rows >= 0) & (rows < c)
        out.append((p_mean.gather(2, rows.clamp(0, c - 1)) * inside).sum(2))
    return torch.stack(out, -1)


def ring_contrib(p_ring: Tensor, age: Tensor, window: int, obs_windows: Sequence[int]) -> Tensor:
    """One decode query's part of the window's statistics, ``[b, h, w, n_obs]``: its attention to each
    ring slot ``p_ring [b, h, w]`` counts for observation window ``o`` when the slot's token is at
    least ``window - o`` older (``age [b, h, w]``)."""
    thr = torch.tensor([window - o for o in obs_windows], device=p_ring.device)
    return (age.unsqueeze(-1) >= thr) * p_ring.unsqueeze(-1)
