"""Plain references of the window-exit rule (method.md section 2): the oracles the tests hold
every kernel of :mod:`kvpop.rule` (and the teacher built on it) to.

They are written for clarity, not speed: Python lists, one token or one exit at a time.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..rule import NEVER, candidates, decide_one, ranks_above
from ..train.teacher import TeacherLabels, finish_labels, label_steps, validate_labels_args

__all__ = ["decide_chunk_pairwise", "decide_chunk_sequential", "reference_rule", "teacher_labels_bruteforce"]


def reference_rule(priorities: list[float], sinks: int, window: int, k: int) -> tuple[list[set[int]], list[int]]:
    """Plain-Python token-by-token rule for one head (the oracle of every rule kernel).

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


def decide_chunk_pairwise(lr_prio, lr_idx, ex_prio, ex_idx, window):
    """:func:`kvpop.rule.decide_chunk` by counting, for every candidate, when its ``k``-th better
    candidate arrives: ``O(M^2)`` memory (M = k + X)."""
    k = lr_idx.shape[-1]
    prio, idx, valid, _, arrival = candidates(lr_prio, lr_idx, ex_prio, ex_idx, window)
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


def decide_chunk_sequential(lr_prio, lr_idx, ex_prio, ex_idx, window):
    """:func:`kvpop.rule.decide_chunk` by replaying the exits one by one with :func:`kvpop.rule.decide_one`."""
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


def teacher_labels_bruteforce(
    target: Tensor, window: int, budget_k: int, sinks: int, lam: float = 0.0, **steps
) -> TeacherLabels:
    """Literal O(S * k) simulation of the teacher's rule: :func:`kvpop.train.teacher.teacher_labels`'s outputs
    (``steps``: its ``query_steps`` and ``min_future``)."""
    prio, window, budget_k, sinks = validate_labels_args(target, window, budget_k, sinks, lam)
    B, H, S = prio.shape
    q_all, sel = label_steps(S, window, sinks, steps.get("query_steps"), steps.get("min_future"))
    Qa = q_all.size
    R = B * H
    p = prio.reshape(R, S).tolist()
    t_bnd = np.full((R, Qa), -1, dtype=np.int64)
    y = np.full((R, Qa), -1, dtype=np.int8)
    for r in range(R):
        pr = p[r]
        held: list[int] = []
        for j, q in enumerate(q_all.tolist()):
            t = q - window
            if len(held) < budget_k:
                held.append(t)
                y[r, j] = 1
                continue
            if budget_k == 0:
                continue
            # lowest priority; among equal priorities, the newest (largest t)
            worst = held[0]
            for u in held[1:]:
                if pr[u] < pr[worst] or (pr[u] == pr[worst] and u > worst):
                    worst = u
            t_bnd[r, j] = worst
            if pr[t] > pr[worst]:
                held.remove(worst)
                held.append(t)
                y[r, j] = 1
    return finish_labels(q_all, sel, t_bnd, y, prio, window, steps.get("min_future"))
