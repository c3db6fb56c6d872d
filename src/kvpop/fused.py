"""A cache layer's decode step in the steady state, as pure functions of tensors.

Once every slot is held and every row's oldest window token leaves at each step (where a long
generation spends nearly all its steps), one single-token step of a layer is always the same:
read the exiting token, score it, let the rule decide (``rule.decide_one_full``), write the
buffers in place, attend over the ``B`` slots and, for policies that read observed attention,
update the window's statistics. :meth:`KVpopLayer._attend_decode` keeps the general form (warm-up,
rows without exits, any policy) as the reference; these functions are its steady state with the
per-step branching and bookkeeping removed, and with static shapes, so ``torch.compile`` can
fuse them (``KVpopCache(..., compile=True)``): one traced graph serves every layer, because the
scorer weights are arguments (``kvpop.scorers.decode``), not module attributes.

Tests hold both paths, eager and compiled, to the general one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from . import rule
from .scorers.decode import DecodeSpec, decode_scores

__all__ = ["COMPILE_ERROR", "StepSpec", "compiled", "exit_gather", "steady_learned", "steady_tail"]

COMPILE_ERROR: str | None = None  # set by the first failed compile: the process then runs these eagerly


@dataclass(frozen=True)
class StepSpec:
    """The shape constants of one cache's steady decode step (the same for all its layers)."""

    sinks: int
    window: int
    k: int
    scaling: float
    lam: float
    obs_windows: tuple[int, ...]  # observation windows of the statistics (empty: none kept)


def exit_gather(spec: StepSpec, K: Tensor, V: Tensor, OBS: Tensor | None, t: Tensor):
    """The exiting token's key, value and observed statistics: ``[b, h, 1, *]`` each (``OBS`` may be None)."""
    s, w = spec.sinks, spec.window
    b, h, _, d = K.shape
    ring_off = (t - s) % w  # ring slot of the exiting token, which the new token takes
    slot = (s + ring_off).view(b, 1, 1, 1)
    ex_k = K.gather(2, slot.expand(b, h, 1, d))
    ex_v = V.gather(2, slot.expand(b, h, 1, V.shape[-1]))
    obs = None if OBS is None else OBS.gather(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1]))
    return ex_k, ex_v, obs


def steady_tail(spec: StepSpec, q: Tensor, k_new: Tensor, v_new: Tensor, K: Tensor, V: Tensor, SI: Tensor,
                LP: Tensor, OBS: Tensor | None, t: Tensor, ex_k: Tensor, ex_v: Tensor, prio: Tensor):
    """Rule, writes and attention of a steady step, after scoring.

    ``K``/``V`` ``[b, h, B + 1, d]``, ``SI [b, h, B + 1]`` and ``LP [b, h, k + 1]`` are the layer's
    buffers (with their trash slot), written IN PLACE; ``t [b]`` the new token's index; ``prio
    [b, h]`` the exiting token's score. Returns ``(out [b, hq, 1, d], OBS)`` with the statistics
    updated (a new tensor; None when ``OBS`` is None).
    """
    s, w, kk = spec.sinks, spec.window, spec.k
    n = s + w + kk
    b, hq, _, d = q.shape
    h = K.shape[1]
    g = hq // h
    ex_idx = t - w
    prio = prio.float()
    if spec.lam:
        prio = prio + spec.lam * ex_idx.view(b, 1).float()
    weakest, accept = rule.decide_one_full(LP[:, :, :kk], SI[:, :, s + w : n], prio, ex_idx.view(b, 1).expand(b, h))
    dst = torch.where(accept, s + w + weakest, n)  # [b, h]; rejected: the trash slot
    # index_put_ with (row, head, slot) indices: torch.compile writes it in place (a scatter_ on a
    # graph input is copied whole)
    bi = torch.arange(b, device=q.device).view(b, 1).expand(b, h)
    hi = torch.arange(h, device=q.device).view(1, h).expand(b, h)
    K.index_put_((bi, hi, dst), ex_k.view(b, h, -1))
    V.index_put_((bi, hi, dst), ex_v.view(b, h, -1))
    SI.index_put_((bi, hi, dst), ex_idx.view(b, 1).expand(b, h))
    LP.index_put_((bi, hi, dst - (s + w)), prio)
    ring_off = (t - s) % w
    slot = (s + ring_off).view(b, 1).expand(b, h)
    K.index_put_((bi, hi, slot), k_new.view(b, h, -1))
    V.index_put_((bi, hi, slot), v_new.view(b, h, -1))
    SI.index_put_((bi, hi, slot), t.view(b, 1).expand(b, h))
    keys, values = K[:, :, :n], V[:, :, :n]
    qg = q.view(b, h, g, d)
    if OBS is None:
        out = torch.nn.functional.scaled_dot_product_attention(qg, keys, values, scale=spec.scaling)
        return out.reshape(b, hq, 1, -1), None
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * spec.scaling  # [b, h, g, B]
    # sinks and ring hold exactly the tokens still protected: their attention is what is observed
    p_ring = torch.softmax(logits[..., : s + w], -1)[..., s:].mean(2)  # [b, h, w]
    age = t.view(b, 1, 1) - SI[:, :, s : s + w]
    thr = torch.tensor([w - o for o in spec.obs_windows], device=q.device)
    contrib = (age.unsqueeze(-1) >= thr) * p_ring.unsqueeze(-1)  # [b, h, w, n_obs]
    # the new token's ring slot restarts its statistics; the others accumulate
    OBS = OBS.scatter(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1]), 0.0) + contrib
    out = torch.matmul(torch.softmax(logits, -1).to(values.dtype), values)
    return out.reshape(b, hq, 1, -1), OBS


def steady_learned(spec: StepSpec, sspec: DecodeSpec, params: tuple, state, q: Tensor, k_new: Tensor,
                   v_new: Tensor, K: Tensor, V: Tensor, SI: Tensor, LP: Tensor, OBS: Tensor | None, t: Tensor):
    """The whole steady step of a learned policy: read, score (``kvpop.scorers.decode``), rule,
    writes, attention. Returns ``(out, OBS, state)``."""
    ex_k, ex_v, obs = exit_gather(spec, K, V, OBS, t)
    state, prio = decode_scores(sspec, params, state, k_new, v_new, ex_k, ex_v, t, t - spec.window, obs)
    out, OBS = steady_tail(spec, q, k_new, v_new, K, V, SI, LP, OBS, t, ex_k, ex_v, prio)
    return out, OBS, state


@functools.cache
def compiled(fn_name: str, device_type: str = "cpu"):
    """``torch.compile`` of one of the steady-step functions for one device type (built on first
    use, shared by all caches).

    ``dynamic=False``: decode shapes are static, so each (budget, batch) compiles once. Raises
    whatever ``torch.compile`` raises when no compiler backend works here (the cache then falls
    back to the eager functions).
    """
    fn = {"steady_tail": steady_tail, "steady_learned": steady_learned}[fn_name]
    if device_type != "cpu":  # inductor's defaults (Triton kernels on CUDA)
        return torch.compile(fn, dynamic=False, fullgraph=True)
    # a C++ wrapper (less Python per call) and single-threaded kernels: the tensors of one decode
    # step are too small for a parallel region to pay for itself (measured: ~25 us less per layer
    # at 2 threads); the matmuls still use torch's threads
    return torch.compile(fn, dynamic=False, fullgraph=True, options={"cpp_wrapper": True, "cpp.threads": 1})
