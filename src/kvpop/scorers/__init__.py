"""KVpop scorers: small per-(layer, KV head) networks predicting future attention.

* ``KVpopMLP``   ("kvpop-mlp", stateless): MLP on [k_t ; v_t].
* ``KVpopMLSTM`` ("kvpop-mlstm", stateful): per-head mLSTM over the [k ; v] stream, read
  with token t's projection when t leaves the protected window.
* ``ScorerStack`` holds one scorer per layer; ``build_scorer(ScorerConfig)`` makes one.

No dependency on training / evaluation code.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import BaseScorer, ScorerConfig, feature_dim, kv_features
from .decode import DecodeSpec, decode_params, decode_scores, decode_spec
from .mlp import KVpopMLP
from .mlstm import KVpopMLSTM, MLSTMState

# the learned tilt is softplus(theta) / TILT_SCALE per token: theta near 0 is a typical head's tilt
TILT_SCALE = 1000.0

__all__ = [
    "TILT_SCALE",
    "BaseScorer",
    "KVpopMLP",
    "KVpopMLSTM",
    "MLSTMState",
    "ScorerConfig",
    "ScorerStack",
    "build_scorer",
    "feature_dim",
    "kv_features",
]


def _make_layer(config: ScorerConfig, layer_idx: int) -> BaseScorer:
    if config.kind == "mlp":
        return KVpopMLP.from_config(config, layer_idx)
    return KVpopMLSTM.from_config(config, layer_idx)


class ScorerStack(nn.ModuleList):
    """One scorer per layer (``stack[layer_idx]``), with the shared ``config``.

    Training:  ``forward_layer(layer_idx, k, v, window, positions=, observed=, **kw) -> [b, h, T]``.
    Inference: ``init_state(batch)`` -> list of per-layer states (``None`` for the MLP), then
    ``step`` / ``read`` / ``step_and_read`` per layer (same signatures as the layer modules,
    with the layer index first).

    What the stack adds around the per-layer modules (``config``): with ``position_free`` it
    rotates the post-RoPE keys back by their positions (``kvpop.rope``; the frequencies are a
    buffer saved with the weights, set by :meth:`set_rope`); with ``observed`` it turns the
    observed-attention statistics into features (``kvpop.observed.observed_features``); with
    ``tilt`` it adds the learned per-head recency tilt ``lam_h * position`` to every score.
    ``positions`` are logical token indices (``[b, T]`` or ``[T]``; default ``0..T-1``).
    """

    def __init__(self, config: ScorerConfig) -> None:
        super().__init__([_make_layer(config, i) for i in range(config.num_layers)])
        self.config = config
        if config.position_free:
            self.register_buffer("rope_inv_freq", torch.zeros(config.head_dim // 2))
        if config.tilt:
            # lam_h = softplus(theta) / TILT_SCALE per token; init ~0.3 nats per 1k tokens (a typical head)
            self.tilt_theta = nn.Parameter(torch.full((config.num_layers, config.kv_heads), -1.0))

    @property
    def is_stateful(self) -> bool:
        return self.config.kind == "mlstm"

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_rope(self, spec) -> None:
        """Store the model's RoPE frequencies (a ``kvpop.rope.RopeSpec``) for ``position_free``."""
        if not self.config.position_free:
            raise ValueError("this scorer does not undo RoPE (ScorerConfig.position_free is False)")
        if spec.inv_freq.numel() != self.rope_inv_freq.numel():
            raise ValueError(
                f"RoPE rotates {2 * spec.inv_freq.numel()} of {self.config.head_dim} dims; position_free scorers "
                "support full-dimension RoPE only"
            )
        with torch.no_grad():
            self.rope_inv_freq.copy_(spec.inv_freq)
        self.config.rope_scaling = float(spec.scaling)
        self.__dict__.pop("_decode_specs", None)  # built with the old scaling

    def tilt(self) -> Tensor | None:
        """Per-(layer, head) recency tilt per token, ``[num_layers, kv_heads]`` (None without ``tilt``)."""
        if not self.config.tilt:
            return None
        return F.softplus(self.tilt_theta) / TILT_SCALE

    # --- inputs ---------------------------------------------------------------------------
    def _keys(self, k: Tensor, positions: Tensor | None) -> Tensor:
        if not self.config.position_free:
            return k
        from ..rope import unrotate

        pos = _positions(positions, k)
        return unrotate(k, pos.clamp(min=0), self.rope_inv_freq, self.config.rope_scaling)

    def _extra(self, observed: Tensor | None, window: int | None) -> Tensor | None:
        if not self.config.observed:
            return None
        if observed is None or window is None:
            raise ValueError(
                f"this scorer reads observed attention (windows {self.config.observed}): pass observed= "
                "[b, h, T, n] statistics and the protected window"
            )
        from ..observed import observed_features

        return observed_features(observed, window, self.config.observed)

    def _tilted(self, layer_idx: int, scores: Tensor, positions: Tensor | None) -> Tensor:
        lam = self.tilt()
        if lam is None:
            return scores
        pos = _positions(positions, scores.unsqueeze(-1)).to(scores.dtype)  # [b, T]
        return scores + lam[layer_idx].view(1, -1, 1).to(scores.dtype) * pos.unsqueeze(1)

    # --- training -------------------------------------------------------------------------
    def forward_layer(
        self,
        layer_idx: int,
        k: Tensor,
        v: Tensor,
        window: int,
        positions: Tensor | None = None,
        observed: Tensor | None = None,
        **kwargs,
    ) -> Tensor:
        extra = self._extra(observed, window)
        if extra is not None:
            kwargs["extra"] = extra
        scores = self[layer_idx](self._keys(k, positions), v, window, **kwargs)
        return self._tilted(layer_idx, scores, positions)

    # --- inference ------------------------------------------------------------------------
    def init_state(self, batch: int = 1, device=None, dtype=None) -> list[Any]:
        return [layer.init_state(batch, device, dtype) for layer in self]

    def step(
        self, layer_idx: int, state, k: Tensor, v: Tensor, mask: Tensor | None = None, positions: Tensor | None = None
    ):
        return self[layer_idx].step(state, self._keys(k, positions), v, mask)

    def read(
        self,
        layer_idx: int,
        state,
        k: Tensor,
        v: Tensor,
        positions: Tensor | None = None,
        observed: Tensor | None = None,
        window: int | None = None,
    ) -> Tensor:
        extra = self._extra(observed, window)
        scores = (
            self[layer_idx].read(state, self._keys(k, positions), v, extra)
            if extra is not None
            else self[layer_idx].read(state, self._keys(k, positions), v)
        )
        return self._tilted(layer_idx, scores, positions)

    def step_and_read(
        self,
        layer_idx: int,
        state,
        k_new: Tensor,
        v_new: Tensor,
        k_read: Tensor,
        v_read: Tensor,
        read_steps=None,
        mask: Tensor | None = None,
        *,
        new_positions: Tensor | None = None,
        read_positions: Tensor | None = None,
        observed: Tensor | None = None,
        window: int | None = None,
    ):
        """Consume ``k_new``/``v_new`` and score ``k_read``/``v_read`` (see the layer modules).

        ``new_positions`` / ``read_positions``: logical indices of those tokens (needed with
        ``position_free`` and ``tilt``); ``observed``/``window``: the read tokens' statistics.
        """
        extra = self._extra(observed, window)
        kw = {"extra": extra} if extra is not None else {}
        layer = self[layer_idx]
        state, scores = layer.step_and_read(
            state,
            self._keys(k_new, new_positions) if layer.is_stateful else k_new,  # a stateless scorer reads no new token
            v_new,
            self._keys(k_read, read_positions),
            v_read,
            read_steps,
            mask,
            **kw,
        )
        return state, self._tilted(layer_idx, scores, read_positions)

    def decode_scores(
        self,
        layer_idx: int,
        state,
        k_new: Tensor,
        v_new: Tensor,
        k_read: Tensor,
        v_read: Tensor,
        new_positions: Tensor,
        read_positions: Tensor,
        observed: Tensor | None = None,
        window: int | None = None,
    ):
        """The decode steady state's ``step_and_read``: one new and one exiting token per row
        (``k_* / v_* [b, h, 1, d]``, ``*_positions [b]``, ``observed [b, h, 1, n]``); returns
        ``(state, scores [b, h])``. See ``kvpop.scorers.decode``."""
        return decode_scores(
            self.decode_spec(window),
            decode_params(self, layer_idx),
            state,
            k_new,
            v_new,
            k_read,
            v_read,
            new_positions,
            read_positions,
            observed,
        )

    def decode_spec(self, window: int | None) -> DecodeSpec:
        """The :class:`~kvpop.scorers.decode.DecodeSpec` at protected ``window`` (built once per window)."""
        memo = self.__dict__.setdefault("_decode_specs", {})
        if window not in memo:
            memo[window] = decode_spec(self, window)
        return memo[window]

    # persistence
    def save(self, path: str | os.PathLike) -> None:
        """torch.save of {"config": dict, "state_dict": ...}."""
        torch.save(
            {"format": "kvpop-scorer-v1", "config": self.config.to_dict(), "state_dict": self.state_dict()}, path
        )

    @classmethod
    def load(cls, path: str | os.PathLike, map_location=None) -> ScorerStack:
        blob = torch.load(path, map_location=map_location or "cpu", weights_only=True)
        stack = cls(ScorerConfig.from_dict(blob["config"]))
        stack.load_state_dict(blob["state_dict"])
        return stack

    def extra_repr(self) -> str:
        return f"kind={self.config.kind!r}, num_layers={self.config.num_layers}"


def build_scorer(config: ScorerConfig) -> ScorerStack:
    """Factory: a ``ScorerStack`` of ``config.num_layers`` scorers of ``config.kind``."""
    return ScorerStack(config)


def _positions(positions: Tensor | None, like: Tensor) -> Tensor:
    """Logical positions ``[b, T]`` for ``like [b, h, T, ...]`` (default ``0..T-1``)."""
    b, T = like.shape[0], like.shape[2]
    if positions is None:
        return torch.arange(T, device=like.device).expand(b, T)
    positions = positions.to(like.device)
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.shape[-1] != T:
        raise ValueError(f"positions cover {positions.shape[-1]} tokens, the keys {T}")
    return positions.expand(b, T)
