"""The window-exit rule (method.md section 2): the one place that decides keep or evict.

Tokens leave the protected window in order and compete, by a priority frozen at exit time,
for ``k`` long-range slots. Ties are broken by age: of two tokens with equal priority the
older (smaller index) ranks higher, so an exiting token loses a tie against the weakest held
token ("strictly greater wins"). With static priorities this makes the long-range set after
any number of exits exactly the top-``k`` of all exited tokens under the order
``(priority, -index)`` — which is what lets a chunk of exits be decided at once and what the
teacher (``kvpop.teacher``) reproduces offline.

All functions work on tensors ``[batch, kv_heads, ...]`` and never loop over heads. Indices
are *logical* token indices of a row (padding excluded); ``-1`` marks an empty slot or an
absent candidate.
"""

from __future__ import annotations

import math

import torch

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


def decide_chunk(
    lr_prio: torch.Tensor,
    lr_idx: torch.Tensor,
    ex_prio: torch.Tensor,
    ex_idx: torch.Tensor,
    window: int,
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many exits at once: the step at which each candidate leaves the cache.

    Candidates are the held long-range tokens (``lr_* [b, h, k]``) and the tokens exiting the
    window during this chunk (``ex_* [b, h, X]``, in exit order; token ``e`` exits at step
    ``e + window``). Returns ``(lr_leave [b, h, k], ex_leave [b, h, X])``: the first step at
    which the token is no longer held (``NEVER`` if still held after the chunk; for an exiting
    token that loses at once, its exit step). Empty/absent entries get ``-1``.

    ``method="pairwise"`` counts, for every candidate, when its ``k``-th better candidate
    arrives (O(M^2) memory, M = k + X); ``"sorted"`` gets the same count from one sort of the
    candidates and an ``[M, X]`` comparison against the exits only; ``"sequential"`` replays
    the exits one by one with :func:`decide_one`. All agree exactly; ``"auto"`` uses
    ``"sorted"`` for chunks and ``"sequential"`` for a single exit.
    """
    if method == "auto":
        method = "sorted" if ex_idx.shape[-1] > 1 else "sequential"
    if method == "sorted":
        return _decide_chunk_sorted(lr_prio, lr_idx, ex_prio, ex_idx, window)
    if method == "pairwise":
        return _decide_chunk_pairwise(lr_prio, lr_idx, ex_prio, ex_idx, window)
    if method == "sequential":
        return _decide_chunk_sequential(lr_prio, lr_idx, ex_prio, ex_idx, window)
    raise ValueError(f"method must be 'auto', 'pairwise' or 'sequential', got {method!r}")


def _candidates(lr_prio, lr_idx, ex_prio, ex_idx, window):
    """Held tokens then exits, as one candidate list: priority, index, presence, kind, arrival step."""
    k = lr_idx.shape[-1]
    prio = torch.cat([lr_prio, ex_prio], -1).float()
    idx = torch.cat([lr_idx, ex_idx], -1)
    valid = idx >= 0
    is_exit = torch.zeros_like(valid)
    is_exit[..., k:] = True
    arrival = torch.where(is_exit, idx + window, torch.full_like(idx, -1))  # held tokens arrived before the chunk
    return prio, idx, valid, is_exit, arrival


def _decide_chunk_pairwise(lr_prio, lr_idx, ex_prio, ex_idx, window):
    k = lr_idx.shape[-1]
    prio, idx, valid, _, arrival = _candidates(lr_prio, lr_idx, ex_prio, ex_idx, window)
    if k == 0:
        leave = arrival
    else:
        # better[y, x]: candidate y ranks above candidate x
        better = ranks_above(prio.unsqueeze(-1), idx.unsqueeze(-1), prio.unsqueeze(-2), idx.unsqueeze(-2))
        better &= valid.unsqueeze(-1) & valid.unsqueeze(-2)
        arrivals = torch.where(better, arrival.unsqueeze(-1), torch.full_like(better, NEVER, dtype=torch.long))
        m = idx.shape[-1]
        if m >= k:
            kth = arrivals.kthvalue(k, dim=-2).values
        else:
            kth = torch.full_like(idx, NEVER)
        leave = torch.maximum(kth, arrival)
    leave = torch.where(valid, leave, torch.full_like(leave, -1))
    return leave[..., :k], leave[..., k:]


def _decide_chunk_sorted(lr_prio, lr_idx, ex_prio, ex_idx, window):
    k = lr_idx.shape[-1]
    prio, idx, valid, is_exit, arrival = _candidates(lr_prio, lr_idx, ex_prio, ex_idx, window)
    if k == 0:
        leave = arrival
    else:
        # total order, worst first: invalid entries, then priority ascending, equal priorities newest first
        key_prio = torch.where(valid, prio, torch.full_like(prio, -math.inf))
        order = torch.sort(idx, dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, torch.sort(key_prio.gather(-1, order), dim=-1, stable=True).indices)
        order = order.gather(-1, torch.sort(valid.gather(-1, order).to(torch.int8), dim=-1, stable=True).indices)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=idx.device).expand_as(order))
        # held candidates ranked above each candidate: suffix counts in sorted order
        old_sorted = (~is_exit & valid).gather(-1, order).long()
        above_sorted = old_sorted.flip(-1).cumsum(-1).flip(-1) - old_sorted
        old_above = torch.empty_like(above_sorted).scatter_(-1, order, above_sorted)
        # exits ranked above each candidate, counted in arrival (= exit) order
        ex_rank = rank[..., k:]
        beats = (ex_rank.unsqueeze(-2) > rank.unsqueeze(-1)) & valid[..., k:].unsqueeze(-2)  # [b, h, M, X]
        arrived = beats.long().cumsum(-1)
        need = (k - old_above).clamp(min=0)
        reached = arrived >= need.unsqueeze(-1)
        first = reached.to(torch.int8).argmax(-1)  # first exit step at which k better candidates are held
        kth = arrival[..., k:].gather(-1, first)
        kth = torch.where(reached.any(-1), kth, torch.full_like(kth, NEVER))
        kth = torch.where(need == 0, torch.full_like(kth, -1), kth)
        leave = torch.maximum(kth, arrival)
    leave = torch.where(valid, leave, torch.full_like(leave, -1))
    return leave[..., :k], leave[..., k:]


def _decide_chunk_sequential(lr_prio, lr_idx, ex_prio, ex_idx, window):
    b, h, k = lr_idx.shape
    x = ex_idx.shape[-1]
    valid = torch.cat([lr_idx >= 0, ex_idx >= 0], -1)
    lr_prio = lr_prio.clone()
    lr_idx = lr_idx.clone()
    # which candidate (0..k-1 held at the start, k+i the i-th exit) sits in each slot
    owner = torch.arange(k, device=lr_idx.device).expand(b, h, k).clone()
    leave = torch.full((b, h, k + x), NEVER, dtype=torch.long, device=lr_idx.device)
    for i in range(x):
        e_idx, e_prio = ex_idx[..., i], ex_prio[..., i]
        step = e_idx + window
        slot, accept = decide_one(lr_prio, lr_idx, e_prio, e_idx)
        if k > 0:
            sel = slot.unsqueeze(-1)
            prev_idx = lr_idx.gather(-1, sel).squeeze(-1)
            prev_owner = owner.gather(-1, sel)
            evict = accept & (prev_idx >= 0)
            current = leave.gather(-1, prev_owner).squeeze(-1)
            leave.scatter_(-1, prev_owner, torch.where(evict, step, current).unsqueeze(-1))
            lr_idx.scatter_(-1, sel, torch.where(accept, e_idx, prev_idx).unsqueeze(-1))
            lr_prio.scatter_(-1, sel, torch.where(accept, e_prio, lr_prio.gather(-1, sel).squeeze(-1)).unsqueeze(-1))
            owner.scatter_(-1, sel, torch.where(accept.unsqueeze(-1), torch.full_like(prev_owner, k + i), prev_owner))
        lost = ~accept & (e_idx >= 0)
        leave[..., k + i] = torch.where(lost, step, leave[..., k + i])
    leave = torch.where(valid, leave, torch.full_like(leave, -1))
    return leave[..., :k], leave[..., k:]


def reference_rule(
    priorities: list[float], sinks: int, window: int, k: int
) -> tuple[list[set[int]], list[int]]:
    """Plain-Python token-by-token rule for one head (the test oracle for everything above).

    ``priorities[t]`` is the frozen priority of token ``t``. Returns, for each step ``t``, the
    set of token indices held after token ``t`` arrived, and the leave step of every token
    (``-1`` if still held at the end).
    """
    held_lr: list[int] = []
    leave = [-1] * len(priorities)
    states: list[set[int]] = []
    for t in range(len(priorities)):
        e = t - window
        if e >= sinks:
            key = lambda i: (priorities[i], -i)
            if len(held_lr) < k:
                held_lr.append(e)
            elif k > 0 and key(e) > min(key(i) for i in held_lr):
                worst = min(held_lr, key=key)
                held_lr.remove(worst)
                leave[worst] = t
                held_lr.append(e)
            else:
                leave[e] = t
        held = set(range(min(sinks, t + 1))) | set(range(max(sinks, t - window + 1), t + 1)) | set(held_lr)
        states.append(held)
    return states, leave
