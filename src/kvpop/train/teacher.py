"""Teacher labels for the boundary loss (spec sections 2 and 5).

The teacher runs the online window-exit rule of section 2 per KV head with the *true* log
targets as scores and the static priority ``priority[t] = target[t] + lam * t``:

* tokens ``t < sinks`` are sinks: never compete, never evicted;
* token ``t >= sinks`` leaves the protected window at query step ``q = t + window`` (so the
  first token to compete is ``t = sinks``, at ``q = sinks + window``);
* the long-range set holds at most ``budget_k`` tokens.  The exiting token takes a free slot if
  there is one; otherwise it replaces the lowest-priority member iff its priority is *strictly*
  greater; otherwise it is dropped.

Tie rule (the cache implementation must use the same)
-----------------------------------------------------
Tokens are totally ordered by ``(priority, -t)``: higher priority ranks higher, and among equal
priorities the *older* token (smaller ``t``) ranks higher.  Consequences:

* the exiting token (always the newest competitor) loses ties: kept iff
  ``priority(t_new) > priority(t_bnd)`` (strict);
* the member evicted (and reported as ``t_bnd``) is the lowest in that order: the lowest
  priority, and among members sharing it, the one with the largest position ``t``.

Because the priority is static, the set after token ``t`` has competed is exactly the top
``budget_k`` of ``{sinks .. t}`` in this order (an evicted token could never re-enter), which
``kvpop.rule.kept_mask_static`` uses.

Steps with a free slot (set not yet full) have ``y = +1`` trivially, ``t_bnd = -1`` and
``valid = False``: there is no boundary to compare against, so they are excluded from the
boundary loss.  With ``budget_k = 0`` every step has ``y = -1``, ``t_bnd = -1``, ``valid = False``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..rule import boundary_walk
from ..validate import check_int

__all__ = ["TeacherLabels", "finish_labels", "label_steps", "static_priority", "teacher_labels", "validate_labels_args"]


@dataclass
class TeacherLabels:
    """Teacher decisions at the sampled query steps.

    Attributes:
        q: LongTensor ``[Q]``: query steps ``q`` (the token ``q - window`` leaves the window).
        t_new: LongTensor ``[batch, kv_heads, Q]``: the exiting token, ``q - window``.
        t_bnd: LongTensor ``[batch, kv_heads, Q]``: lowest-ranked member of the teacher's
            long-range set *before* the decision; ``-1`` when the set is not full.
        y: float32 ``[batch, kv_heads, Q]``: ``+1`` if the teacher keeps ``t_new``, else ``-1``.
        valid: BoolTensor ``[batch, kv_heads, Q]``: the step carries a boundary decision: set
            full (``t_bnd >= 0``), both priorities finite, and (if ``min_future`` is given)
            ``S - q >= min_future``.
    """

    q: Tensor
    t_new: Tensor
    t_bnd: Tensor
    y: Tensor
    valid: Tensor

    def to(self, device) -> TeacherLabels:
        return TeacherLabels(*(getattr(self, f).to(device) for f in ("q", "t_new", "t_bnd", "y", "valid")))


def static_priority(target: Tensor, lam: float = 0.0) -> Tensor:
    """``target + lam * t`` in float64 (the teacher's static priority)."""
    if not isinstance(target, Tensor) or target.ndim != 3:
        raise ValueError("target must be a tensor [batch, kv_heads, S]")
    if not target.is_floating_point():
        raise ValueError(f"target must be floating point; got {target.dtype}")
    lam = float(lam)
    if not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be a finite float >= 0; got {lam}")
    p = target.detach().to("cpu", torch.float64)
    if bool(torch.isnan(p).any()):
        raise ValueError("target contains NaN")
    if lam != 0.0:
        p = p + lam * torch.arange(p.shape[-1], dtype=torch.float64)
    return p


def validate_labels_args(target: Tensor, window, budget_k, sinks, lam) -> tuple[Tensor, int, int, int]:
    window = check_int("window", window, 0, optional=False)
    budget_k = check_int("budget_k", budget_k, 0, optional=False)
    sinks = check_int("sinks", sinks, 0, optional=False)
    return static_priority(target, lam), window, budget_k, sinks


def label_steps(S: int, window: int, sinks: int, query_steps, min_future) -> tuple[np.ndarray, np.ndarray]:
    """(all query steps, selected column indices into them)."""
    q_all = np.arange(sinks + window, S, dtype=np.int64)
    if query_steps is None:
        sel = np.arange(q_all.size, dtype=np.int64)
    else:
        qs = np.asarray(
            query_steps.detach().cpu().numpy() if isinstance(query_steps, Tensor) else list(query_steps),
            dtype=np.int64,
        ).reshape(-1)
        if qs.size and (qs.min() < sinks + window or qs.max() > S - 1):
            raise ValueError(f"query_steps must lie in [sinks + window, S - 1] = [{sinks + window}, {S - 1}]")
        sel = qs - (sinks + window)
    if min_future is not None:
        check_int("min_future", min_future, 0, optional=False)
    return q_all, sel


def finish_labels(q_all, sel, t_bnd, y, prio, window, min_future) -> TeacherLabels:
    """Assemble outputs from full-length [R, Q] numpy arrays."""
    B, H, S = prio.shape
    q = q_all[sel]
    t_new = q - window
    t_bnd = t_bnd[:, sel]
    y = y[:, sel]
    p = prio.reshape(B * H, S).numpy()
    full = t_bnd >= 0
    valid = full & np.isfinite(p[:, t_new])
    pb = np.take_along_axis(p, np.where(full, t_bnd, 0), axis=1)
    valid &= np.isfinite(pb)
    if min_future is not None:
        valid &= (S - q >= int(min_future))[None, :]
    Q = q.size
    shape = (B, H, Q)
    return TeacherLabels(
        q=torch.from_numpy(q.copy()),
        t_new=torch.from_numpy(t_new.copy()).view(1, 1, Q).expand(shape).contiguous(),
        t_bnd=torch.from_numpy(np.ascontiguousarray(t_bnd)).view(shape),
        y=torch.from_numpy(np.ascontiguousarray(y)).to(torch.float32).view(shape),
        valid=torch.from_numpy(np.ascontiguousarray(valid)).view(shape),
    )


def teacher_labels(
    target: Tensor,
    window: int,
    budget_k: int,
    sinks: int,
    lam: float = 0.0,
    query_steps: Sequence[int] | Tensor | None = None,
    min_future: int | None = None,
) -> TeacherLabels:
    """Run the teacher's window-exit rule with a static priority and label every exit step.

    Args:
        target: log targets ``[batch, kv_heads, S]`` (``-inf`` where undefined; see
            ``kvpop.targets.future_attention``).  NaN is an error.
        window: protected window ``w``.
        budget_k: long-range slots ``k``.
        sinks: number of sink tokens ``s``.
        lam: recency tilt, priority ``target[t] + lam * t`` (float64).
        query_steps: optional query steps ``q`` to return (each in ``[sinks + window, S - 1]``);
            default all of them, ``q = sinks + window .. S - 1``.  The simulation always runs over
            every step.
        min_future: if given, steps with fewer than ``min_future`` queries after the window for
            ``t_new`` (``S - q < min_future``) are marked invalid (the spec's choice is
            ``min_future = window``).

    Returns:
        ``TeacherLabels`` (see its doc); tie rule and not-full steps: see the module doc.

    Cost: a stable sort per head (``O(S log S)``) and one heap walk per head (``O(S log k)``,
    pure Python on integer ranks).  Stack layers into the batch dim to label them in one call.
    """
    prio, window, budget_k, sinks = validate_labels_args(target, window, budget_k, sinks, lam)
    B, H, S = prio.shape
    q_all, sel = label_steps(S, window, sinks, query_steps, min_future)
    comp = prio.reshape(B * H, S)[:, sinks : sinks + q_all.size].numpy()  # competitors t = sinks .. S-1-w
    t_bnd, y = boundary_walk(comp, budget_k)
    t_bnd = np.where(t_bnd >= 0, t_bnd + sinks, -1)
    return finish_labels(q_all, sel, t_bnd, y, prio, window, min_future)
