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

import torch
import torch.nn.functional as F
from torch import Tensor

from ..observed import observed_features
from ..rope import unrotate
from .base import across_heads, head_linear, kv_features
from .mlstm import mlstm_step

__all__ = ["DecodeSpec", "decode_params", "decode_scores", "decode_spec"]


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


def decode_params(stack, layer_idx: int) -> tuple[Tensor | None, ...]:
    """The weights :func:`decode_scores` needs for one layer (detached views of the parameters).

    mLSTM: ``(w_proj, b_proj, w_extra, w_out, b_out, inv_freq, lam)``; MLP: ``(w1, b1, w2, b2,
    inv_freq, lam)``; ``w_extra`` / ``inv_freq`` / ``lam`` are None when unused.
    """
    layer = stack[layer_idx]
    inv = stack.rope_inv_freq if stack.config.position_free else None
    lam = stack.tilt()
    lam = None if lam is None else lam[layer_idx]
    if stack.config.kind == "mlstm":
        params = (layer.w_proj, layer.b_proj, layer.w_extra, layer.w_out, layer.b_out, inv, lam)
    else:
        params = (layer.w1, layer.b1, layer.w2, layer.b2, inv, lam)
    return tuple(None if p is None else p.detach() for p in params)  # inference: no autograd graph


def decode_scores(spec: DecodeSpec, params: tuple, state, k_new: Tensor, v_new: Tensor, k_read: Tensor,
                  v_read: Tensor, t_new: Tensor, t_read: Tensor, observed: Tensor | None):
    """One new token (``k_new``/``v_new [b, h, 1, d]`` at ``t_new [b]``) enters the scorer's state and
    one token (``k_read``/``v_read`` at ``t_read``, with ``observed [b, h, 1, n]``) is scored.

    Returns ``(state, scores [b, h])`` as ``ScorerStack.step_and_read`` (float rounding aside).
    """
    if spec.stateful:
        k = torch.cat([k_new, k_read], 2).float()
        v = torch.cat([v_new, v_read], 2).float()
        pos = torch.stack([t_new, t_read], 1)
        inv, lam = params[5], params[6]
    else:
        k, v, pos = k_read.float(), v_read.float(), t_read.unsqueeze(1)
        inv, lam = params[4], params[5]
    if spec.position_free:
        k = unrotate(k, pos, inv, spec.rope_scaling)
    feats = kv_features(k, v, spec.input_norm, spec.eps)  # [b, h, R, in]
    extra = None
    if spec.obs_windows:
        extra = observed_features(observed.squeeze(2), spec.window, spec.obs_windows)  # [b, h, n]
    if spec.stateful:
        state, scores = _mlstm(spec, params, state, feats, extra)
    else:
        w1, b1, w2, b2 = params[:4]
        if extra is not None:
            feats = torch.cat([feats, extra.unsqueeze(2)], -1)
        if spec.cross_heads:
            feats = across_heads(feats)
        hdn = F.silu(head_linear(feats, w1, b1)).squeeze(2)  # [b, h, hidden]
        scores = (hdn * w2.squeeze(-1)).sum(-1) + b2
    if spec.tilt:
        scores = torch.addcmul(scores, lam.unsqueeze(0), t_read.unsqueeze(1).to(scores.dtype))
    return state, scores


def _mlstm(spec: DecodeSpec, params: tuple, state, feats: Tensor, extra: Tensor | None):
    """The mLSTM's step (:func:`kvpop.scorers.mlstm.mlstm_step`) and readout + head, for ``feats`` rows (new, read).

    The small products (observed inputs, readout, head) are written as broadcast-and-sum, not
    matmuls: ``torch.compile`` fuses those into its loops instead of calling BLAS for a dot product.
    """
    w_proj, b_proj, w_extra, w_out, b_out = params[:5]
    dk, dv = spec.dk, spec.dv
    o = dk + dv
    p = head_linear(feats, w_proj, b_proj)  # [b, h, 2, E]
    pn, pr = p[:, :, 0], p[:, :, 1]
    kk, vv, ig, fg = pn[..., :dk], pn[..., dk:o], pn[..., o], pn[..., o + 1]
    r = pr[..., o + 2 :]
    if extra is not None:
        r = r + (extra.unsqueeze(-1) * w_extra).sum(-2)
    qq, u = r[..., :dk] * spec.q_scale, r[..., dk:]
    state = mlstm_step(state, kk, vv, ig, F.logsigmoid(fg) if spec.sigmoid_gate else fg)
    C, n, m_new = state
    num = (qq.unsqueeze(-1) * C).sum(-2)  # [b, h, dv] = C^T q
    den = torch.maximum((qq * n).sum(-1).abs(), torch.exp(-m_new))
    hr = num / den.unsqueeze(-1)
    if spec.h_norm:
        hr = hr * torch.rsqrt((hr * hr).sum(-1, keepdim=True).mul(1.0 / dv).add(spec.eps))
    z = torch.cat([hr, F.silu(u)], -1) if spec.read_mlp else hr
    scores = (z * w_out.squeeze(-1)).sum(-1) + b_out
    return state, scores
