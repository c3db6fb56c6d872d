"""The window-exit rule (method.md section 2): the one place that decides keep or evict.

Tokens leave the protected window in order and compete, by a priority frozen at exit time,
for ``k`` long-range slots. Ties are broken by age: of two tokens with equal priority the
older (smaller index) ranks higher, so an exiting token loses a tie against the weakest held
token ("strictly greater wins"). With static priorities this makes the long-range set after
any number of exits exactly the top-``k`` of all exited tokens under the order
``(priority, -index)`` — which is what lets a chunk of exits be decided at once and what the
teacher (``kvpop.train.teacher``) reproduces offline.

All functions work on tensors ``[batch, kv_heads, ...]`` and never loop over heads (but for
the teacher's :func:`boundary_walk`, a heap per row). Indices are *logical* token indices of a
row (padding excluded); ``-1`` marks an empty slot or an absent candidate.

Online kernels (a cache deciding as tokens arrive): :func:`decide_one`, :func:`decide_one_full`,
:func:`decide_chunk`, :func:`commit_order`. Whole sequences with static priorities known in
advance (training): :func:`leave_steps`, :func:`boundary_walk`, :func:`kept_mask_static`.
The plain references the tests hold them to live in ``kvpop.testing.rule``.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch
from torch import Tensor

from .validate import check_int

NEVER = torch.iinfo(torch.int64).max  # "leave step" of a token that is still held


def ranks_above(prio_a: torch.Tensor, idx_a: torch.Tensor, prio_b: torch.Tensor, idx_b: torch.Tensor) -> torch.Tensor:
    """True where token a ranks strictly above token b: higher priority, or equal and older."""
    return (prio_a > prio_b) | ((prio_a == prio_b) & (idx_a < idx_b))


def decide_one(
    lr_prio: torch.Tensor, lr_idx: torch.Tensor, ex_prio: torch.Tensor, ex_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One exit per (row, head): which long-range slot the exiting token takes, if any.

    Args: ``lr_prio``/``lr_idx`` ``[b, h, k]`` (idx -1 = free slot); ``ex_prio``/``ex_idx``
    ``[b, h]`` (idx -1 = no exit in this row).
    Returns ``(slot [b, h] long, accept [b, h] bool)``: if accept, the token in ``slot`` (if
    any) is evicted and the exiting token takes its place; else the exiting token is evicted.
    """
    b, h, k = lr_idx.shape
    if k == 0:
        zeros = torch.zeros(b, h, dtype=torch.long, device=lr_idx.device)
        return zeros, torch.zeros(b, h, dtype=torch.bool, device=lr_idx.device)
    free = lr_idx < 0
    has_free = free.any(-1)
    first_free = free.to(torch.int8).argmax(-1)
    held_prio = lr_prio.masked_fill(free, float("inf"))
    min_prio = held_prio.min(-1).values
    weakest_candidates = (held_prio == min_prio.unsqueeze(-1)) & ~free
    # among equal minimum priority the newest ranks lowest
    weakest = torch.where(weakest_candidates, lr_idx, torch.full_like(lr_idx, -1)).argmax(-1)
    weakest_idx = lr_idx.gather(-1, weakest.unsqueeze(-1)).squeeze(-1)
    wins = ranks_above(ex_prio, ex_idx, min_prio, weakest_idx)
    slot = torch.where(has_free, first_free, weakest)
    accept = (has_free | wins) & (ex_idx >= 0)
    return slot, accept


def decide_one_full(
    lr_prio: torch.Tensor, lr_idx: torch.Tensor, ex_prio: torch.Tensor, ex_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decide_one` when every long-range slot is held (the decode steady state).

    Same arguments and result as :func:`decide_one`, under two preconditions the caller
    guarantees: no slot is free (``lr_idx >= 0``, ``k >= 1``) and the exiting token exists and is
    newer than every held token (always true for the window-exit rule). It skips the free-slot
    search and the empty-slot masking; the decision itself is :func:`ranks_above` against the
    weakest held token, exactly as in :func:`decide_one`.
    """
    min_prio = lr_prio.amin(-1)
    # among equal minimum priority the newest ranks lowest: the largest index, found with its slot in one pass
    weakest_idx, weakest = torch.where(lr_prio == min_prio.unsqueeze(-1), lr_idx, -1).max(-1)
    return weakest, ranks_above(ex_prio, ex_idx, min_prio, weakest_idx)


def candidates(lr_prio, lr_idx, ex_prio, ex_idx, window):
    """Held tokens then exits, as one candidate list: priority, index, presence, kind, arrival step."""
    k = lr_idx.shape[-1]
    prio = torch.cat([lr_prio, ex_prio], -1).float()
    idx = torch.cat([lr_idx, ex_idx], -1)
    valid = idx >= 0
    is_exit = torch.zeros_like(valid)
    is_exit[..., k:] = True
    arrival = torch.where(is_exit, idx + window, torch.full_like(idx, -1))  # held tokens arrived before the chunk
    return prio, idx, valid, is_exit, arrival


def decide_chunk(
    lr_prio: torch.Tensor, lr_idx: torch.Tensor, ex_prio: torch.Tensor, ex_idx: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many exits at once: the step at which each candidate leaves the cache.

    Candidates are the held long-range tokens (``lr_* [b, h, k]``) and the tokens exiting the
    window during this chunk (``ex_* [b, h, X]``, in exit order; token ``e`` exits at step
    ``e + window``). Returns ``(lr_leave [b, h, k], ex_leave [b, h, X])``: the first step at
    which the token is no longer held (``NEVER`` if still held after the chunk; for an exiting
    token that loses at once, its exit step). Empty/absent entries get ``-1``.

    How: a candidate leaves when the ``k``-th candidate ranked above it has arrived. One sort of
    the candidates ranks them; the held ones above each candidate are a suffix count in that
    order, the exits above it are counted in arrival order by an ``[M, X]`` comparison (M = k + X).
    ``kvpop.testing.rule`` holds the pairwise count and the exit-by-exit replay of
    :func:`decide_one` that the tests compare this with.
    """
    k = lr_idx.shape[-1]
    prio, idx, valid, is_exit, arrival = candidates(lr_prio, lr_idx, ex_prio, ex_idx, window)
    if k == 0:
        leave = arrival
    else:
        # total order, worst first: invalid entries, then priority ascending, equal priorities newest first
        key_prio = torch.where(valid, prio, torch.full_like(prio, -math.inf))
        order = torch.sort(idx, dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, torch.sort(key_prio.gather(-1, order), dim=-1, stable=True).indices)
        order = order.gather(-1, torch.sort(valid.gather(-1, order).to(torch.int8), dim=-1, stable=True).indices)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=idx.device).expand_as(order)
        )
        # held candidates ranked above each candidate: suffix counts in sorted order
        old_sorted = (~is_exit & valid).gather(-1, order).long()
        above_sorted = old_sorted.flip(-1).cumsum(-1).flip(-1) - old_sorted
        old_above = torch.empty_like(above_sorted).scatter_(-1, order, above_sorted)
        # exits ranked above each candidate, counted in arrival (= exit) order
        ex_rank = rank[..., k:]
        beats = (ex_rank.unsqueeze(-2) > rank.unsqueeze(-1)) & valid[..., k:].unsqueeze(-2)  # [b, h, M, X]
        # counts up to X: int16 where they fit (half the memory traffic of int32, twice as fast here)
        count = torch.int16 if beats.shape[-1] < 2**15 else torch.int32
        arrived = beats.cumsum(-1, dtype=count)
        need = (k - old_above).clamp(min=0)
        reached = arrived >= need.unsqueeze(-1).clamp(max=torch.iinfo(count).max).to(count)
        first = reached.to(torch.int8).argmax(-1)  # first exit step at which k better candidates are held
        kth = arrival[..., k:].gather(-1, first)
        # the counts only grow: reached at some exit step iff at the last one
        ever = arrived[..., -1] >= need if arrived.shape[-1] else torch.zeros_like(need, dtype=torch.bool)
        kth = torch.where(ever, kth, torch.full_like(kth, NEVER))
        kth = torch.where(need == 0, torch.full_like(kth, -1), kth)
        leave = torch.maximum(kth, arrival)
    leave = torch.where(valid, leave, torch.full_like(leave, -1))
    return leave[..., :k], leave[..., k:]


def commit_order(lr_leave: torch.Tensor, ex_leave: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After a chunk decided by :func:`decide_chunk`: which candidates hold the ``k`` long-range slots.

    Returns ``(order [b, h, k], kept [b, h, k])``: ``order`` indexes the candidate list (the ``k``
    held tokens, then the chunk's exits), the survivors (``leave == NEVER``) first in candidate
    order; ``kept`` is False where fewer than ``k`` survive (those slots become empty).
    """
    k = lr_leave.shape[-1]
    keep = torch.cat([lr_leave == NEVER, ex_leave == NEVER], dim=-1)  # [b, h, k + X]
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :k]
    return order, keep.gather(-1, order)


# --- whole sequences at once: static priorities known in advance (training, the teacher) ---


def _kth_smallest_prefix(x: Tensor, hi: Tensor, kth: int) -> Tensor:
    """Per row ``r`` and query ``j``: the ``kth``-smallest (0-based) value of ``x[r, :hi[r, j]]``.

    ``x`` ``[R, n]`` holds distinct values in ``[0, n)``; queries with ``hi <= kth`` return
    garbage (the caller masks them). A wavelet matrix, built and queried level by level.
    """
    R, n = x.shape
    dev = x.device
    ar = torch.arange(n, device=dev).expand(R, n)
    zero = torch.zeros(R, 1, dtype=torch.long, device=dev)
    lo = torch.zeros_like(hi)
    k = torch.full_like(hi, kth)
    res = torch.zeros_like(hi)
    cur = x
    for b in reversed(range(max(1, (n - 1).bit_length()))):
        bit = (cur >> b) & 1
        r0 = torch.cat([zero, (1 - bit).cumsum(1)], 1)  # r0[:, i]: zeros among cur[:, :i]
        nz = r0[:, n:]  # [R, 1] zeros at this level
        # stable partition for the next level: zeros first, then ones
        dest = torch.where(bit == 0, r0[:, :n], nz + ar - r0[:, :n])
        cur = torch.empty_like(cur).scatter_(1, dest, cur)
        # descend: into the zeros if enough of them lie in [lo, hi), else into the ones
        r0_lo, r0_hi = r0.gather(1, lo), r0.gather(1, hi)
        z = r0_hi - r0_lo
        left = k < z
        lo = torch.where(left, r0_lo, nz + lo - r0_lo)
        hi = torch.where(left, r0_hi, nz + hi - r0_hi)
        k = torch.where(left, k, k - z)
        res = res | ((~left).long() << b)
    return res


def leave_steps(priority: Tensor, sinks: int, window: int, k: int) -> Tensor:
    """First query step at which each token is no longer held: LongTensor ``[b, h, S]``.

    ``priority`` ``[b, h, S]`` is the static priority of each token (frozen at its exit; e.g.
    ``score + lam * t``). Tokens ``t < sinks`` and tokens still held after step ``S - 1`` get
    ``NEVER``; with ``k = 0`` every competitor leaves at ``t + window``. Ties: of equal priority,
    the older token ranks higher. Key ``t`` is visible to query ``q`` iff ``t <= q < leave[t]``
    (``kvpop.mask.visibility``). ``O(S log S)`` per head, no loop over tokens.

    How leave steps are computed. Competitor ``t >= sinks`` exits at ``e_t = t + window``. It
    leaves at its exit if ``k`` tokens ranked above it exited before, else at the exit of the
    ``k``-th token ranked above it, in index order: with ``u_k(t)`` the ``k``-th smallest index
    among the tokens ranked above ``t``, ``leave[t] = max(t, u_k(t)) + window`` (``NEVER`` if
    fewer than ``k`` rank above it, or if that step is past the sequence). ``u_k`` for all tokens
    at once is a prefix order statistic over the tokens listed best first, answered by a wavelet
    matrix over the token indices: ``ceil(log2 S)`` levels, each a cumulative sum, a scatter and a
    few gathers over ``[rows, S]`` tensors, no Python loop over tokens or heads.
    """
    if not isinstance(priority, Tensor) or priority.ndim != 3:
        raise ValueError("priority must be a tensor [batch, heads, S]")
    sinks = check_int("sinks", sinks, 0, optional=False)
    window = check_int("window", window, 0, optional=False)
    k = check_int("k", k, 0, optional=False)
    b, h, S = priority.shape
    dev = priority.device
    leave = torch.full((b, h, S), NEVER, dtype=torch.long, device=dev)
    n = S - sinks  # competitors
    if n <= 0 or k >= n:
        return leave
    j = torch.arange(n, device=dev)
    if k == 0:
        comp = (j + sinks + window).expand(b, h, n)
    else:
        p = priority[..., sinks:]
        if p.is_floating_point() and bool(torch.isnan(p).any()):
            raise ValueError("priority contains NaN")
        R = b * h
        # competitors best first; a stable descending sort keeps the older of equal priorities first
        order = torch.sort(p.reshape(R, n), dim=1, descending=True, stable=True).indices
        above = torch.empty_like(order).scatter_(1, order, j.expand(R, n))  # how many rank above each token
        uk = _kth_smallest_prefix(order, above, k - 1)
        comp = torch.maximum(uk, j) + (sinks + window)
        comp = torch.where(above >= k, comp, NEVER).view(b, h, n)
    leave[..., sinks:] = torch.where(comp < S, comp, NEVER)
    return leave


def _ranks(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, rank in ascending order of ``(priority, -t)`` (0 = worst), ``[R, n]``.

    Reversing the row and sorting stably puts, among equal priorities, the larger ``t`` first
    (i.e. lower), exactly the tie rule.
    """
    R, n = p.shape
    order_rev = np.argsort(p[:, ::-1], axis=1, kind="stable")
    order = (n - 1) - order_rev  # original indices, worst first
    ranks = np.empty((R, n), dtype=np.int64)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(n, dtype=np.int64), (R, n)), axis=1)
    return ranks, order


def boundary_walk(priority: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule over competitors that exit in order, one row at a time: ``(bnd, keep)``, ``[R, n]`` each.

    ``priority [R, n]`` (float64) holds each row's competitors in exit order. ``bnd[r, j]`` is the
    position (in that order) of the lowest-ranked long-range token when competitor ``j`` exits
    (``-1`` while a slot is free, and always with ``k = 0``); ``keep[r, j]`` is ``1`` if ``j`` takes a
    slot, else ``-1``. A heap of integer ranks per row: ``O(n log n)`` for the sort, ``O(n log k)``
    for the walk (plain Python; the teacher of the boundary loss calls it on whole sequences).
    """
    R, n = priority.shape
    bnd = np.full((R, n), -1, dtype=np.int64)
    keep = np.full((R, n), -1, dtype=np.int8)
    if n == 0 or k == 0:
        return bnd, keep
    ranks, of_rank = _ranks(priority)
    fill = min(k, n)
    for r in range(R):
        rk, tok = ranks[r].tolist(), of_rank[r].tolist()
        heap = rk[:fill]  # free slots: kept, no boundary
        heapq.heapify(heap)
        yb, bb = [1] * n, [-1] * n
        for j in range(fill, n):
            x, mn = rk[j], heap[0]
            bb[j] = tok[mn]
            if x > mn:
                heapq.heapreplace(heap, x)
            else:
                yb[j] = -1
        keep[r], bnd[r] = yb, bb
    return bnd, keep


def kept_mask_static(priority: Tensor, window: int, budget_k: int, sinks: int) -> Tensor:
    """Tokens held after all ``S`` tokens were processed by the rule: BoolTensor ``[b, h, S]``.

    ``priority`` ``[b, h, S]`` is the static priority itself (e.g. ``target + lam * t``; see
    ``static_priority``).  Held: sinks ``t < sinks``, the last ``window`` tokens
    ``t >= S - window``, and the top ``budget_k`` competitors ``sinks <= t < S - window`` in the
    order ``(priority, -t)`` (module doc).  Same device as ``priority``.
    """
    if not isinstance(priority, Tensor) or priority.ndim != 3:
        raise ValueError("priority must be a tensor [batch, kv_heads, S]")
    if bool(torch.isnan(priority).any()):
        raise ValueError("priority contains NaN")
    window = check_int("window", window, 0, optional=False)
    budget_k = check_int("budget_k", budget_k, 0, optional=False)
    sinks = check_int("sinks", sinks, 0, optional=False)
    B, H, S = priority.shape
    t = torch.arange(S, device=priority.device)
    kept = (t < sinks) | (t >= S - window)
    kept = kept.view(1, 1, S).expand(B, H, S).clone()
    n = S - window - sinks
    if n > 0 and budget_k > 0:
        comp = priority[..., sinks : S - window]
        # descending stable sort: ties keep the original (older first) order
        order = torch.sort(comp, dim=-1, descending=True, stable=True).indices[..., :budget_k]
        kept[..., sinks : S - window].scatter_(-1, order, True)
    return kept
