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
queries (:func:`chunk_observed`) and for one decode query (:func:`ring_contrib`). The plain
per-query definitions the tests hold them to are in ``kvpop.testing.observed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "CHUNK_BLOCK",
    "chunk_observed",
    "observed_attention",
    "observed_attention_windows",
    "observed_counts",
    "observed_features",
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


CHUNK_BLOCK = 64  # queries per logits block of chunk_observed (32, 128 and 256 were slower per chunk)


def chunk_observed(
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
    """What a prefill chunk's queries add to the statistics of the ring's and the chunk's keys,
    ``[b, h, window + c, n_obs]``: the ring's slots in slot order, then the chunk's tokens.

    ``query [b, hq, c, d]`` (``c <= window``); ``keys [b, h, B + c, d]``: the cache's ``B`` slots
    (sinks, ring, long-range) then the chunk's keys; ``slot_index [b, sinks + window]`` the token
    each sink and ring slot holds (-1: none yet); ``n_real [b]`` tokens seen before the chunk;
    ``valid [b, c]`` False for left padding (None: every query is real). A query's statistic is
    normalised over its local keys only: the sinks and the ``window`` newest tokens, itself included.

    Why this layout: laid out oldest first (the ring's tokens by age, then the chunk's), the
    window keys of chunk query ``j`` are exactly columns ``j + 1 .. j + window``, a band. So the
    logits are formed block by block over the band's columns only, read as a strided view (no mask
    over the ``c`` columns a query does not observe), normalised over ``sinks + window`` columns,
    and summed per key by writing the band back on its diagonals. Observation window ``o`` counts a
    query when the key is at least ``window - o`` tokens older: band offsets ``0 .. o - 1``.
    ``kvpop.testing.observed.chunk_observed_reference`` is the masked form over every column.
    """
    b, hq, c, d = query.shape
    h = keys.shape[1]
    g = hq // h
    s, w = sinks, window
    n = keys.shape[2] - c  # B
    cols = w + c
    dev = query.device
    first_real = 0 if valid is None else (c - valid.long().sum(1)).view(b, 1)  # each row's first real query
    # column p holds token n_real - w + p - first_real: the ring's tokens oldest first, then the chunk's
    # (chunk position p - w); a column older than the ring's oldest token (or a sink) holds nothing.
    # Each ring slot's column comes from the token it holds (slot_index), read here and written back below.
    p = torch.arange(cols, device=dev).view(1, cols)
    in_chunk = p >= w + first_real
    ring_t = slot_index[:, s : s + w]
    ring_p = ring_t - (n_real.view(b, 1) - w - first_real)
    ring_ok = (ring_t >= s) & (ring_p >= 0) & (ring_p < cols)
    at = torch.where(ring_ok, ring_p, cols)  # column cols: a spare one for the empty ring slots
    src = torch.where(in_chunk, n + p - w, 0)
    src = torch.cat([src.expand(b, cols), src.new_zeros(b, 1)], 1).scatter_(
        1, at, torch.arange(s, s + w, device=dev).expand(b, w)
    )[:, :cols]
    in_ring = torch.zeros(b, cols + 1, dtype=torch.bool, device=dev).scatter_(1, at, ring_ok)[:, :cols]
    k_band = keys.gather(2, src.view(b, 1, cols, 1).expand(b, h, cols, d)).float()
    q_scaled = query.float().view(b, h, g, c, d) * scaling  # scale the queries, not the larger logits
    x = q_scaled.new_empty(b, h, g, c, s + w)  # each query's sinks, then its band
    if s:
        x[..., :s] = torch.matmul(q_scaled, keys[:, :, None, :s].float().transpose(-1, -2))
    for j0 in range(0, c, CHUNK_BLOCK):
        j1 = min(c, j0 + CHUNK_BLOCK)
        r = j1 - j0
        # the group's query heads as rows of one matmul per KV head (larger products than one per query head)
        full = torch.matmul(
            q_scaled[:, :, :, j0:j1].reshape(b, h, g * r, d), k_band[:, :, j0 + 1 : j1 + w].transpose(-1, -2)
        ).view(b, h, g, r, w + r - 1)
        # w + r - 1 columns; row i's band starts at column i (a step of one row and one column)
        st = full.stride()
        x[..., j0:j1, s:] = full.as_strided((b, h, g, r, w), (*st[:3], st[3] + st[4], st[4]), full.storage_offset())
    # an additive 0 / -inf bias broadcast over the heads: empty columns and sink slots not filled yet
    col_bias = torch.where(in_chunk | in_ring, 0.0, -math.inf)  # [b, cols]
    bias = col_bias.as_strided((b, c, w), (cols, 1, 1), col_bias.storage_offset() + 1)  # query j: columns j + 1 ..
    if s:
        sink_bias = torch.where(slot_index[:, :s] >= 0, 0.0, -math.inf).view(b, 1, s).expand(b, c, s)
        bias = torch.cat([sink_bias, bias], dim=-1)
    x.add_(bias.reshape(b, 1, 1, c, s + w))
    # the sums are linear, so the mean over the group's query heads is taken on the (smaller) sum
    band_p = torch.softmax(x, dim=-1)[..., s:].sum(2)  # [b, h, c, w]: query j, band offset a
    if valid is not None:  # a padding query's row is NaN or counts nothing
        band_p = torch.where(valid.view(b, 1, c, 1), band_p.nan_to_num(0.0), 0.0)
    # per window: the band's first o offsets written back on their diagonals, summed over the queries
    diag = band_p.new_zeros(b, h, c, cols)
    on_diag = diag.as_strided((b, h, c, w), (h * c * cols, c * cols, cols + 1, 1), 1)
    by_window, done = {}, 0
    for o in sorted(set(obs_windows)):
        on_diag[..., done:o] = band_p[..., done:o]
        by_window[o], done = diag.sum(2), o  # [b, h, cols]
    sums = torch.stack([by_window[o] for o in obs_windows], -1) / g  # [b, h, cols, n_obs]: the group's mean
    # back to the cache's order: each ring slot from the column of the token it holds, then the chunk
    nobs = sums.shape[-1]
    ring = sums.gather(2, ring_p.clamp(0, cols - 1).view(b, 1, w, 1).expand(b, h, w, nobs))
    ring = torch.where(ring_ok.view(b, 1, w, 1), ring, 0.0)
    new = sums[:, :, w:]
    if valid is not None:  # a padding position's column is a ring token's: the padding itself got nothing
        new = torch.where(valid.view(b, 1, c, 1), new, 0.0)
    return torch.cat([ring, new], dim=2)


def ring_contrib(p_ring: Tensor, age: Tensor, window: int, obs_windows: Sequence[int]) -> Tensor:
    """One decode query's part of the window's statistics, ``[b, h, w, n_obs]``: its attention to each
    ring slot ``p_ring [b, h, w]`` counts for observation window ``o`` when the slot's token is at
    least ``window - o`` older (``age [b, h, w]``)."""
    thr = torch.tensor([window - o for o in obs_windows], device=p_ring.device)
    return (age.unsqueeze(-1) >= thr) * p_ring.unsqueeze(-1)
