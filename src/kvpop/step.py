"""A cache layer's steps as functions of its state: a prefill chunk and a decode step.

Both insert new tokens under the window-exit rule (``kvpop.rule``) and attend, writing the
layer's buffers (:class:`kvpop.state.LayerState`) in place:

* :func:`prefill_chunk`: ``c`` new tokens per row (left padding allowed), decided at once with a
  per-query visibility mask that equals the token-by-token rule (up to ``window`` tokens).
* the decode step, one real token per row, in two cases of one function, :func:`decode_tail`:
  the *steady* case (every slot held, every row's oldest window token leaves: where a long
  generation spends nearly all its steps) with static shapes and no mask, which
  ``kvpop.compiled`` compiles; and the *warm-up* (``StepSpec.full = False``: free slots, rows
  without an exit), the same function with the empty slots and absent exits masked.
  :func:`decode_learned` and :func:`decode_scored` put a learned scorer's or a pure score
  function's scoring in front of it (one compiled graph for the whole step); any other policy is
  scored by its ``score`` first (:func:`decode_exits`).

Every function here takes the policy's per-device kernels (``Policy.prepare``), never a cache: a
serving engine runs the same steps on a :class:`~kvpop.state.LayerState` built around memory it
owns (see ``kvpop.state``), once per request batch and layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import rule
from .observed import chunk_observed, ring_contrib
from .policies import ExitBatch
from .scorers.decode import DecodeSpec, decode_scores
from .state import LayerState

__all__ = [
    "StepSpec",
    "check_scores",
    "decode_exits",
    "decode_learned",
    "decode_scored",
    "decode_tail",
    "exit_gather",
    "prefill_chunk",
]


def ring_offset(t: Tensor, sinks: int, window: int) -> Tensor:
    """The ring offset of token ``t`` (``t >= sinks``) in the window's ring buffer: it lives in slot
    ``sinks + ring_offset`` until the token ``window`` places later takes that slot."""
    return (t - sinks) % window


@dataclass(frozen=True)
class StepSpec:
    """The constants of one cache's steps (the same for all its layers; hashable: a compiled step is
    specialised on them)."""

    sinks: int
    window: int
    k: int
    scaling: float
    lam: float
    obs_windows: tuple[int, ...]  # observation windows of the statistics (empty: none kept)
    full: bool = True  # decode: every slot held and every row exits (False: the masked warm-up)

    @property
    def budget(self) -> int:
        return self.sinks + self.window + self.k


def check_scores(scores: Tensor, name: str, layer_idx: int) -> None:
    """One error for NaN scores (a device sync: callers on the steady path check every few steps)."""
    if torch.isnan(scores).any():
        raise RuntimeError(f"policy {name} returned NaN scores at layer {layer_idx}")


# --- decode: one real token per row -------------------------------------------------------------


def exit_gather(spec: StepSpec, K: Tensor, V: Tensor, OBS: Tensor | None, t: Tensor):
    """The exiting token's key, value and observed statistics: ``[b, h, 1, *]`` each (``OBS`` may be
    None). In the warm-up, rows without an exit read an empty slot (their scores are ignored)."""
    s, w = spec.sinks, spec.window
    b, h, _, d = K.shape
    ring_off = ring_offset(t, s, w)  # ring slot of the exiting token, which the new token takes
    slot = (s + ring_off).view(b, 1, 1, 1)
    ex_k = K.gather(2, slot.expand(b, h, 1, d))
    ex_v = V.gather(2, slot.expand(b, h, 1, V.shape[-1]))
    obs = None if OBS is None else OBS.gather(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1]))
    return ex_k, ex_v, obs


def exit_index(spec: StepSpec, t: Tensor) -> Tensor:
    """``[b]``: the token leaving the window as token ``t`` arrives (-1 where none does: warm-up)."""
    if spec.full:
        return t - spec.window
    return torch.where(t >= spec.sinks + spec.window, t - spec.window, -1)


def decode_exits(spec: StepSpec, kernels, layer_idx: int, st: LayerState, k_new: Tensor, v_new: Tensor):
    """``(ex_k, ex_v, scores [b, h])`` of the exiting tokens, scored by the policy's ``score``; the
    policy state on ``st`` advances."""
    t = st.n_real
    obs = st.observed if kernels.needs_attention else None
    ex_k, ex_v, ex_obs = exit_gather(spec, st.k, st.v, obs, t)
    b, h = ex_k.shape[:2]
    batch = ExitBatch(
        layer_idx, ex_k, ex_v, exit_index(spec, t).view(b, 1), k_new, v_new, t.view(b, 1), ex_obs, True, spec.window
    )
    st.policy_state, prio = kernels.score(st.policy_state, batch)
    return ex_k, ex_v, prio.float().view(b, h)


def decode_tail(
    spec: StepSpec,
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    K: Tensor,
    V: Tensor,
    SI: Tensor,
    LP: Tensor,
    OBS: Tensor | None,
    t: Tensor,
    ex_k: Tensor,
    ex_v: Tensor,
    prio: Tensor,
):
    """Rule, writes and attention of a decode step, after scoring.

    ``K``/``V`` ``[b, h, B + 1, d]``, ``SI [b, h, B + 1]`` and ``LP [b, h, k + 1]`` are the layer's
    buffers (with their trash slot) and ``OBS`` its window statistics (or None), all written IN
    PLACE (a new tensor per step is an allocation and a new object per step, and both cost more
    than the update in a compiled step); ``t [b]`` the new token's index; ``prio [b, h]`` the
    exiting token's score (``ex_k``, ``ex_v``, ``prio`` None: no rule this step). Returns
    ``(out [b, 1, hq, d], t + 1)``: the output in the layout the model takes and the next token's
    index (computed here: one eager op less per layer and step).
    """
    s, w, kk, n = spec.sinks, spec.window, spec.k, spec.budget
    b, h = K.shape[:2]
    bi = torch.arange(b, device=q.device).view(b, 1).expand(b, h)
    hi = torch.arange(h, device=q.device).view(1, h).expand(b, h)
    if kk and prio is not None:  # None: no row has an exit (warm-up), or nothing to decide
        ex_idx = exit_index(spec, t)
        prio = prio.float()
        if spec.lam:
            prio = prio + spec.lam * ex_idx.view(b, 1).float()
        decide = rule.decide_one_full if spec.full else rule.decide_one
        weakest, accept = decide(LP[:, :, :kk], SI[:, :, s + w : n], prio, ex_idx.view(b, 1).expand(b, h))
        dst = torch.where(accept, s + w + weakest, n)  # [b, h]; rejected: the trash slot
        # index_put_ with (row, head, slot) indices: torch.compile writes it in place (a scatter_ on a
        # graph input is copied whole)
        K.index_put_((bi, hi, dst), ex_k.view(b, h, -1))
        V.index_put_((bi, hi, dst), ex_v.view(b, h, -1))
        SI.index_put_((bi, hi, dst), ex_idx.view(b, 1).expand(b, h))
        LP.index_put_((bi, hi, dst - (s + w)), prio)
    ring_off = ring_offset(t, s, w)
    slot = s + ring_off if spec.full else torch.where(t < s, t, s + ring_off)  # warm-up: sinks first
    slot = slot.view(b, 1).expand(b, h)
    K.index_put_((bi, hi, slot), k_new.view(b, h, -1))
    V.index_put_((bi, hi, slot), v_new.view(b, h, -1))
    SI.index_put_((bi, hi, slot), t.view(b, 1).expand(b, h))
    return _decode_attend(spec, q, K, V, SI, OBS, t, ring_off), t + 1


def _decode_attend(
    spec: StepSpec, q: Tensor, K: Tensor, V: Tensor, SI: Tensor, OBS: Tensor | None, t: Tensor, ring_off: Tensor
) -> Tensor:
    """Attention of the new token over the ``B`` slots (empty ones masked in the warm-up) and, with
    ``OBS``, the observed statistics of the window's tokens (``kvpop.observed.ring_contrib``)."""
    s, w, n = spec.sinks, spec.window, spec.budget
    b, hq, _, d = q.shape
    h = K.shape[1]
    keys, values = K[:, :, :n], V[:, :, :n]
    qg = q.view(b, h, hq // h, d)
    filled = None if spec.full else (SI[:, :, :n] >= 0).unsqueeze(2)  # [b, h, 1, B]
    if OBS is None:
        out = torch.nn.functional.scaled_dot_product_attention(qg, keys, values, attn_mask=filled, scale=spec.scaling)
        return out.reshape(b, hq, 1, -1).transpose(1, 2)
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * spec.scaling  # [b, h, g, B]
    if spec.full:  # sinks and ring hold exactly the tokens still protected: their attention is what is observed
        p_ring = torch.softmax(logits[..., : s + w], -1)[..., s:].mean(2)  # [b, h, w]
        OBS.scatter_(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1]), 0.0)
    else:
        kidx = SI[:, :, :n].unsqueeze(2)
        local = filled & ((kidx < s) | (kidx > t.view(b, 1, 1, 1) - w))
        p_ring = torch.softmax(logits.masked_fill(~local, -math.inf), -1)[..., s : s + w].mean(2)
        at = ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1])
        OBS.scatter_(2, at, OBS.gather(2, at) * (t < s).view(b, 1, 1, 1))  # a ring slot's new token restarts it
        logits = logits.masked_fill(~filled, -math.inf)
    OBS.add_(ring_contrib(p_ring, t.view(b, 1, 1) - SI[:, :, s : s + w], w, spec.obs_windows))
    out = torch.matmul(torch.softmax(logits, -1).to(values.dtype), values)
    return out.reshape(b, hq, 1, -1).transpose(1, 2)


def decode_learned(spec: StepSpec, sspec: DecodeSpec, params: tuple, state, *bufs: Tensor | None):
    """The whole steady step of a learned policy: read, score (``kvpop.scorers.decode``), rule,
    writes, attention. ``bufs``: :func:`decode_tail`'s ``q, k_new, v_new, K, V, SI, LP, OBS, t``. The
    scorer's ``state`` (a tuple of tensors the caller owns, or None) is updated IN PLACE, like the buffers
    (:func:`decode_tail`). Returns ``(out, t + 1)``."""
    _, k_new, v_new, K, V, _, _, OBS, t = bufs
    ex_k, ex_v, obs = exit_gather(spec, K, V, OBS, t)
    new_state, prio = decode_scores(sspec, params, state, k_new, v_new, ex_k, ex_v, t, t - spec.window, obs)
    if state is not None:
        for old, new in zip(state, new_state):
            old.copy_(new)
    return decode_tail(spec, *bufs, ex_k, ex_v, prio)


def decode_scored(spec: StepSpec, score, consts: tuple, *bufs: Tensor | None):
    """The whole steady step of a policy with a pure score function (``Policy.steady_score``):
    read, ``score(consts, ex_k, ex_v, ex_obs, exit_index)``, rule, writes, attention. ``bufs``:
    :func:`decode_tail`'s ``q, k_new, v_new, K, V, SI, LP, OBS, t``. Returns ``(out, t + 1)``."""
    _, _, _, K, V, _, _, OBS, t = bufs
    ex_k, ex_v, obs = exit_gather(spec, K, V, OBS, t)
    prio = score(consts, ex_k, ex_v, obs, t - spec.window).reshape(K.shape[0], K.shape[1])
    return decode_tail(spec, *bufs, ex_k, ex_v, prio)


# --- prefill: a chunk of tokens per row -------------------------------------------------------------


@dataclass
class _Chunk:
    """Where a chunk's tokens go: logical indices (-1 = padding), slots, and the tokens they push out."""

    valid: Tensor  # [b, c] real tokens
    new_idx: Tensor  # [b, c] logical index of each new token, -1 for padding
    new_slot: Tensor  # [b, c] its slot (the trash slot for padding)
    ex_idx: Tensor  # [b, c] the token leaving the window as new token j arrives, -1 if none
    ex_ring: Tensor  # [b, c] the ring offset of that token
    key_idx: Tensor  # [b, h, B + c] logical index of every key the chunk sees: the slots, then the chunk
    padded: bool  # some new token is padding


def _chunk(spec: StepSpec, st: LayerState, valid: Tensor, h: int, padded: bool) -> _Chunk:
    s, w, n = spec.sinks, spec.window, spec.budget
    b, c = valid.shape
    new_idx = torch.where(valid, st.n_real.unsqueeze(1) + valid.long().cumsum(1) - 1, -1)
    new_slot = torch.where(new_idx < s, new_idx, s + ring_offset(new_idx, s, w))
    new_slot = torch.where(valid, new_slot, n)  # padding -> trash slot
    # tokens leaving the window: one per new token with index >= s + w, in order
    ex_idx = torch.where(valid & (new_idx >= s + w), new_idx - w, -1)
    ex_ring = torch.where(ex_idx >= 0, ring_offset(ex_idx, s, w), 0)
    key_idx = torch.cat([st.held, new_idx.unsqueeze(1).expand(b, h, c)], dim=2)
    return _Chunk(valid, new_idx, new_slot, ex_idx, ex_ring, key_idx, padded)


def _chunk_observed(spec: StepSpec, st: LayerState, ch: _Chunk, q: Tensor, all_k: Tensor):
    """The window statistics as the chunk's queries add to them: ``(ring, new)``, the accumulated
    statistics of every ring slot before the chunk overwrites it ``[b, h, w, n_obs]`` and the new
    tokens' own ``[b, h, c, n_obs]`` (:func:`kvpop.observed.chunk_observed`). ``q [b, hq, c, d]``,
    ``all_k [b, h, B + c, d]``."""
    s, w = spec.sinks, spec.window
    contrib = chunk_observed(
        q,
        all_k,
        ch.key_idx[:, 0, : s + w],  # sinks and ring hold the same tokens in every head
        st.n_real,
        ch.valid if ch.padded else None,
        s,
        w,
        spec.obs_windows,
        spec.scaling,
    )
    return st.observed + contrib[:, :, :w], contrib[:, :, w:]


def _chunk_scores(
    spec: StepSpec,
    kernels,
    layer_idx: int,
    st: LayerState,
    ch: _Chunk,
    k_new: Tensor,
    v_new: Tensor,
    ring_obs: Tensor | None,
) -> Tensor:
    """The exiting tokens' priorities ``[b, h, c]`` (frozen now): the policy's scores + ``lam * t``."""
    s, w = spec.sinks, spec.window
    b, h, c, d = k_new.shape
    ex_slot = (s + ch.ex_ring).unsqueeze(1).expand(b, h, c)
    ex_k = st.keys.gather(2, ex_slot.unsqueeze(-1).expand(b, h, c, d))
    ex_v = st.values.gather(2, ex_slot.unsqueeze(-1).expand(b, h, c, st.v.shape[-1]))
    observed = None
    if ring_obs is not None:
        observed = ring_obs.gather(2, ch.ex_ring.view(b, 1, c, 1).expand(b, h, c, ring_obs.shape[-1]))
    batch = ExitBatch(
        layer_idx=layer_idx,
        keys=ex_k,
        values=ex_v,
        index=ch.ex_idx,
        new_keys=k_new,
        new_values=v_new,
        new_index=ch.new_idx,
        attention=observed,
        window=w,
    )
    st.policy_state, scores = kernels.score(st.policy_state, batch)
    scores = scores.float()
    if scores.shape != (b, h, c):
        raise RuntimeError(
            f"policy {kernels.name} returned scores of shape {tuple(scores.shape)}, expected {(b, h, c)}"
        )
    check_scores(scores, kernels.name, layer_idx)
    return scores + spec.lam * ch.ex_idx.unsqueeze(1).float()


def _slot_leave(spec: StepSpec, ch: _Chunk, lr_leave: Tensor, ex_leave: Tensor) -> Tensor:
    """``[b, h, B]``: the step at which each slot's token stops being visible during the chunk (the
    rule's leave steps of the long-range tokens and of the ring's exiting tokens; ``NEVER`` for the rest)."""
    s, w, n = spec.sinks, spec.window, spec.budget
    b, h, _ = lr_leave.shape
    c = ch.new_idx.shape[1]
    dev = lr_leave.device
    leave = torch.full((b, h, n), rule.NEVER, dtype=torch.long, device=dev)
    leave[:, :, s + w : n] = torch.where(lr_leave >= 0, lr_leave, rule.NEVER)
    ring_leave = torch.full((b, h, w + 1), rule.NEVER, dtype=torch.long, device=dev)
    exits = ch.ex_idx.unsqueeze(1).expand(b, h, c) >= 0
    ring_pos = torch.where(exits, ch.ex_ring.unsqueeze(1).expand(b, h, c), w)
    ring_leave.scatter_(2, ring_pos, torch.where(exits, ex_leave, rule.NEVER))
    leave[:, :, s : s + w] = ring_leave[:, :, :w]
    return leave


def _chunk_visible(spec: StepSpec, ch: _Chunk, lr_leave: Tensor, ex_leave: Tensor) -> Tensor:
    """``[b, h, c, B + c]``: which key each query sees (the rule's leave steps; a padding query sees
    only itself)."""
    n = spec.budget
    b, h, _ = lr_leave.shape
    c = ch.new_idx.shape[1]
    dev = lr_leave.device
    slots = _slot_leave(spec, ch, lr_leave, ex_leave)
    leave = torch.cat([slots, slots.new_full((b, h, c), rule.NEVER)], dim=2)  # the chunk's keys stay
    # a key is visible from its arrival up to its leave step; an empty slot (-1) never arrives
    arrive = torch.where(ch.key_idx >= 0, ch.key_idx, rule.NEVER).unsqueeze(2)  # [b, h, 1, n + c]
    tq = ch.new_idx.view(b, 1, c, 1)
    visible = (arrive <= tq) & (tq < leave.unsqueeze(2))
    if not ch.padded:
        return visible
    pad_q = ~ch.valid.view(b, 1, c, 1)
    self_key = torch.arange(n, n + c, device=dev).view(1, 1, c, 1) == torch.arange(n + c, device=dev).view(1, 1, 1, -1)
    return torch.where(pad_q, self_key, visible)


def _chunk_mask(spec: StepSpec, ch: _Chunk, lr_leave: Tensor, ex_leave: Tensor, dtype: torch.dtype) -> Tensor:
    """The chunk's attention mask, ``[b, h, c, B + c]``: :func:`_chunk_visible`, or without padding the
    same as an additive ``0 / -inf`` mask of ``dtype`` in fewer passes (what SDPA would convert a boolean
    mask to). Every held slot's token arrived before the chunk, so a slot is visible until its leave
    step (an empty one never), and the chunk's own keys are causal (none leaves within the chunk)."""
    if ch.padded:
        return _chunk_visible(spec, ch, lr_leave, ex_leave)
    n = spec.budget
    b, h, _ = lr_leave.shape
    c = ch.new_idx.shape[1]
    dev = lr_leave.device
    leave = torch.where(ch.key_idx[:, :, :n] >= 0, _slot_leave(spec, ch, lr_leave, ex_leave), -1)
    mask = torch.empty(b, h, c, n + c, dtype=dtype, device=dev)
    open_, shut = torch.zeros((), dtype=dtype, device=dev), torch.full((), -math.inf, dtype=dtype, device=dev)
    torch.where(ch.new_idx.view(b, 1, c, 1) < leave.unsqueeze(2), open_, shut, out=mask[..., :n])
    mask[..., n:] = torch.full((c, c), -math.inf, dtype=dtype, device=dev).triu_(1)
    return mask


def _chunk_attend(q: Tensor, all_k: Tensor, all_v: Tensor, visible: Tensor, scaling: float) -> Tensor:
    """Each query over the slots and the chunk, as ``visible`` (:func:`_chunk_mask`) allows:
    ``[b, hq, c, d]`` (one fused attention call; the statistics formed their own logits over the local
    keys only).

    The KV heads go into the batch and each one's query heads into the head dimension, so one
    ``[c, B + c]`` mask per KV head broadcasts over its query heads instead of being copied for each."""
    b, hq, c, d = q.shape
    h, nk = all_k.shape[1], all_k.shape[2]
    g = hq // h
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b * h, g, c, d),
        all_k.reshape(b * h, 1, nk, d),
        all_v.reshape(b * h, 1, nk, all_v.shape[-1]),
        attn_mask=visible.reshape(b * h, 1, c, nk),
        scale=scaling,
        enable_gqa=True,
    )
    return out.reshape(b, hq, c, -1)  # CUDA kernels may return a non-contiguous layout


def _chunk_commit(
    spec: StepSpec,
    st: LayerState,
    ch: _Chunk,
    k_new: Tensor,
    v_new: Tensor,
    ex_prio: Tensor,
    lr_leave: Tensor,
    ex_leave: Tensor,
    obs: tuple | None,
) -> None:
    """Write the chunk's outcome into ``st``: the long-range set, then sinks and ring, statistics, counts."""
    s, w, kk, n = spec.sinks, spec.window, spec.k, spec.budget
    b, h, c, d = k_new.shape
    if kk > 0:
        order, kept = rule.commit_order(lr_leave, ex_leave)
        ex_slot = (s + ch.ex_ring).unsqueeze(1).expand(b, h, c)
        src = torch.cat([torch.arange(s + w, n, device=k_new.device).expand(b, h, kk), ex_slot], dim=2).gather(2, order)
        cand_prio = torch.cat([st.long_range_prio, ex_prio], dim=2).gather(2, order)
        cand_idx = torch.cat([st.held[:, :, s + w :], ch.ex_idx.unsqueeze(1).expand(b, h, c)], dim=2).gather(2, order)
        new_lr_k = st.keys.gather(2, src.unsqueeze(-1).expand(b, h, kk, d))
        new_lr_v = st.values.gather(2, src.unsqueeze(-1).expand(b, h, kk, st.v.shape[-1]))
    # sinks and ring: new tokens overwrite their slots (padding goes to the trash slot)
    st.k.scatter_(2, ch.new_slot.view(b, 1, c, 1).expand(b, h, c, d), k_new)
    st.v.scatter_(2, ch.new_slot.view(b, 1, c, 1).expand(b, h, c, v_new.shape[-1]), v_new)
    st.slot_index.scatter_(2, ch.new_slot.view(b, 1, c).expand(b, h, c), ch.new_idx.unsqueeze(1).expand(b, h, c))
    st.slot_index[:, :, n] = -1
    if kk > 0:
        st.k[:, :, s + w : n] = new_lr_k
        st.v[:, :, s + w : n] = new_lr_v
        st.slot_index[:, :, s + w : n] = torch.where(kept, cand_idx, -1)
        st.lr_prio[:, :, :kk] = torch.where(kept, cand_prio, -math.inf)
    if obs is not None:
        ring_old, new_contrib = obs
        nobs = ring_old.shape[-1]
        ring_obs = torch.cat([ring_old, ring_old.new_zeros(b, h, 1, nobs)], dim=2)
        at = (
            torch.where(ch.valid & (ch.new_idx >= s), ring_offset(ch.new_idx, s, w), w)
            .view(b, 1, c, 1)
            .expand(b, h, c, nobs)
        )
        ring_obs.scatter_(2, at, new_contrib)
        st.observed.copy_(ring_obs[:, :, :w])
    st.n_real = st.n_real + ch.valid.long().sum(1)
    st.min_real = int(st.n_real.min())


def prefill_chunk(
    spec: StepSpec,
    kernels,
    layer_idx: int,
    st: LayerState,
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    valid: Tensor | None,
) -> Tensor:
    """Insert ``c <= window`` new tokens per row under the rule and attend; returns ``[b, hq, c, d]``.

    ``q [b, hq, c, d]``, ``k_new``/``v_new [b, h, c, d]``, ``valid [b, c]`` (False: left padding;
    None: every token is real).
    Every query sees exactly the keys the token-by-token rule would hold at its step: the chunk's
    exits are decided at once (:func:`kvpop.rule.decide_chunk`) and each key's leave step masks it.
    """
    h = k_new.shape[1]
    padded = valid is not None
    if valid is None:
        valid = torch.ones(k_new.shape[0], k_new.shape[2], dtype=torch.bool, device=k_new.device)
    ch = _chunk(spec, st, valid, h, padded)
    all_k = torch.cat([st.keys, k_new], dim=2)  # [b, h, B + c, d]
    all_v = torch.cat([st.values, v_new], dim=2)
    obs = _chunk_observed(spec, st, ch, q, all_k) if kernels.needs_attention else None
    ex_prio = _chunk_scores(spec, kernels, layer_idx, st, ch, k_new, v_new, None if obs is None else obs[0])
    ex_idx_h = ch.ex_idx.unsqueeze(1).expand_as(ex_prio)
    lr_leave, ex_leave = rule.decide_chunk(
        st.long_range_prio, st.held[:, :, spec.sinks + spec.window :], ex_prio, ex_idx_h, spec.window
    )
    out = _chunk_attend(q, all_k, all_v, _chunk_mask(spec, ch, lr_leave, ex_leave, q.dtype), spec.scaling)
    _chunk_commit(spec, st, ch, k_new, v_new, ex_prio, lr_leave, ex_leave, obs)
    return out
