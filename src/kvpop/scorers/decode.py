"""A scorer layer's single-token decode step as a pure function of tensors.

In a long generation almost every step of every layer is the same: one new token enters the
window and one token leaves it. The general ``ScorerStack.step_and_read`` serves chunks, padding
and empty states, and costs a few hundred small tensor ops per layer; at 30 layers that was a
quarter of a decode step. Here the steady state is written once, with the layer's weights passed
as arguments (:func:`decode_params`) and its shape constants in a hashable :class:`DecodeSpec`:

* eagerly it is the learned policy's decode path (about 40 ops per layer);
* inside the cache's fused decode step (``kvpop.step``, compiled by ``kvpop.compiled``) it is traced once
  for all layers: same shapes, weights as inputs, no guards on module identity.

Both equal ``step_and_read`` with one new and one read token to float tolerance (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..observed import observed_features
from ..rope import unrotate
from .base import across_heads, head_linear, head_score, kv_features
from .mlstm import mlstm_read, mlstm_step, score_head

__all__ = ["DecodeSpec", "MLPParams", "MLSTMParams", "decode_params", "decode_scores", "decode_spec", "exit_scores"]


class MLSTMParams(NamedTuple):
    """An mLSTM layer's weights for :func:`decode_scores` (``KVpopMLSTM``'s parameters), the RoPE inverse
    frequencies when its keys are position-free, and its layer's recency tilt (None when unused)."""

    w_proj: Tensor
    b_proj: Tensor
    w_extra: Tensor | None
    w_out: Tensor
    b_out: Tensor
    inv_freq: Tensor | None
    lam: Tensor | None


class MLPParams(NamedTuple):
    """An MLP layer's weights for :func:`decode_scores` (``KVpopMLP``'s parameters), as :class:`MLSTMParams`."""

    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor
    inv_freq: Tensor | None
    lam: Tensor | None


@dataclass(frozen=True)
class DecodeSpec:
    """Everything but the weights that the decode step of one scorer layer depends on."""

    stateful: bool
    dk: int
    dv: int
    input_norm: bool
    h_norm: bool
    read_mlp: bool
    sigmoid_gate: bool
    position_free: bool
    rope_scaling: float
    eps: float
    q_scale: float
    window: int | None  # the protected window the observed statistics were summed over
    obs_windows: tuple[int | None, ...]  # the scorer's observation windows (empty: no observed inputs)
    tilt: bool
    cross_heads: bool = False


def decode_spec(stack, window: int | None) -> DecodeSpec:
    """The :class:`DecodeSpec` of a ``ScorerStack`` used with protected ``window``."""
    cfg = stack.config
    if cfg.observed and window is None:
        raise ValueError(f"this scorer reads observed attention (windows {cfg.observed}): pass the protected window")
    layer = stack[0]
    stateful = cfg.kind == "mlstm"
    return DecodeSpec(
        stateful=stateful,
        dk=layer.dk if stateful else 0,
        dv=layer.dv if stateful else 0,
        input_norm=cfg.input_norm,
        h_norm=bool(getattr(layer, "h_norm", False)),
        read_mlp=bool(getattr(layer, "read_mlp", False)),
        sigmoid_gate=cfg.forget_gate == "sigmoid",
        position_free=cfg.position_free,
        rope_scaling=float(cfg.rope_scaling),
        eps=float(cfg.eps),
        q_scale=float(getattr(layer, "q_scale", 1.0)),
        window=window,
        obs_windows=tuple(cfg.observed),
        tilt=cfg.tilt,
        cross_heads=cfg.cross_heads,
    )


def decode_params(stack, layer_idx: int) -> MLSTMParams | MLPParams:
    """The weights :func:`decode_scores` needs for one layer (detached views of the parameters: inference
    builds no autograd graph, and in-place weight updates show through them)."""
    layer = stack[layer_idx]
    inv = stack.rope_inv_freq if stack.config.position_free else None
    lam = stack.tilt()
    lam = None if lam is None else lam[layer_idx]
    if stack.config.kind == "mlstm":
        params = MLSTMParams(layer.w_proj, layer.b_proj, layer.w_extra, layer.w_out, layer.b_out, inv, lam)
    else:
        params = MLPParams(layer.w1, layer.b1, layer.w2, layer.b2, inv, lam)
    return params._make(None if p is None else p.detach() for p in params)


def decode_scores(
    spec: DecodeSpec,
    params: MLSTMParams | MLPParams,
    state,
    k_new: Tensor,
    v_new: Tensor,
    k_read: Tensor,
    v_read: Tensor,
    t_new: Tensor,
    t_read: Tensor,
    observed: Tensor | None,
):
    """One new token (``k_new``/``v_new [b, h, 1, d]`` at ``t_new [b]``) enters the scorer's state and
    one token (``k_read``/``v_read`` at ``t_read``, with ``observed [b, h, 1, n]``) is scored.

    Returns ``(state, scores [b, h])`` as ``ScorerStack.step_and_read`` (float rounding aside).
    """
    if not spec.stateful:
        return state, exit_scores(spec, params, k_read, v_read, t_read.unsqueeze(1), observed).squeeze(2)
    k = torch.cat([k_new, k_read], 2).float()
    v = torch.cat([v_new, v_read], 2).float()
    if spec.position_free:
        k = unrotate(k, torch.stack([t_new, t_read], 1), params.inv_freq, spec.rope_scaling)
    feats = kv_features(k, v, spec.input_norm, spec.eps)  # [b, h, 2, in]
    extra = None
    if spec.obs_windows:
        extra = observed_features(observed.squeeze(2), spec.window, spec.obs_windows)  # [b, h, n]
    state, scores = _mlstm(spec, params, state, feats, extra)
    if spec.tilt:
        scores = torch.addcmul(scores, params.lam.unsqueeze(0), t_read.unsqueeze(1).to(scores.dtype))
    return state, scores


def exit_scores(
    spec: DecodeSpec, params: MLPParams, k: Tensor, v: Tensor, t: Tensor, observed: Tensor | None
) -> Tensor:
    """A stateless (MLP) scorer layer's scores of exiting tokens, ``[b, h, X]``: keys/values
    ``[b, h, X, d]`` at ``t [b, X]`` (negative: absent, scored as position 0 and ignored by the
    caller), with their statistics ``observed [b, h, X, n]``. The decode step's scoring (``X = 1``)
    and a prefill chunk's: the scorer reads no new token, so a chunk's exits need none of
    ``ScorerStack.step_and_read``'s handling of new tokens, padding and state."""
    k, v = k.float(), v.float()
    if spec.position_free:
        k = unrotate(k, t.clamp(min=0), params.inv_freq, spec.rope_scaling)
    feats = kv_features(k, v, spec.input_norm, spec.eps)  # [b, h, X, in]
    if spec.obs_windows:
        feats = torch.cat([feats, observed_features(observed, spec.window, spec.obs_windows)], -1)
    if spec.cross_heads:
        feats = across_heads(feats)
    hdn = F.silu(head_linear(feats, params.w1, params.b1))  # [b, h, X, hidden]
    if hdn.shape[2] == 1:  # one row per head: broadcast-and-sum (compiled into the decode step's loops)
        scores = head_score(hdn.squeeze(2), params.w2, params.b2).unsqueeze(2)
    else:
        scores = head_score(hdn, params.w2, params.b2)
    if spec.tilt:
        scores = torch.addcmul(scores, params.lam.view(1, -1, 1), t.unsqueeze(1).to(scores.dtype))
    return scores


def _mlstm(spec: DecodeSpec, params: MLSTMParams, state, feats: Tensor, extra: Tensor | None):
    """The mLSTM's step (:func:`kvpop.scorers.mlstm.mlstm_step`), readout (``mlstm_read``) and score head
    (``score_head``), the ones ``KVpopMLSTM`` uses, for ``feats`` rows (new, read).

    The small products (the observed inputs here; the readout and head in their one-read-per-row form) are
    broadcast-and-sum, not matmuls: ``torch.compile`` fuses those into its loops instead of calling BLAS.
    """
    dk, dv = spec.dk, spec.dv
    o = dk + dv
    p = head_linear(feats, params.w_proj, params.b_proj)  # [b, h, 2, E]
    pn, pr = p[:, :, 0], p[:, :, 1]
    kk, vv, ig, fg = pn[..., :dk], pn[..., dk:o], pn[..., o], pn[..., o + 1]
    r = pr[..., o + 2 :]
    if extra is not None:
        r = r + (extra.unsqueeze(-1) * params.w_extra).sum(-2)
    qq, u = r[..., :dk] * spec.q_scale, r[..., dk:]
    state = mlstm_step(state, kk, vv, ig, F.logsigmoid(fg) if spec.sigmoid_gate else fg)
    hr = mlstm_read(state, qq, nonempty=True)  # [b, h, dv]
    scores = score_head(hr, u, params.w_out, params.b_out, h_norm=spec.h_norm, read_mlp=spec.read_mlp, eps=spec.eps)
    return state, scores
