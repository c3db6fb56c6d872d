"""KVpop scorers: small per-(layer, KV head) networks predicting future attention.

* ``KVpopMLP``   ("kvpop-mlp", stateless): MLP on [k_t ; v_t].
* ``KVpopMLSTM`` ("kvpop", stateful): per-head mLSTM over the [k ; v] stream, read
  with token t's projection when t leaves the protected window.
* ``ScorerStack`` holds one scorer per layer; ``build_scorer(ScorerConfig)`` makes one.

No dependency on training / evaluation code.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from .base import BaseScorer, ScorerConfig, feature_dim, kv_features
from .mlp import KVpopMLP
from .mlstm import KVpopMLSTM, MLSTMState

__all__ = [
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

    Training:  ``forward_layer(layer_idx, k, v, window, **kw) -> [b, h, T]``.
    Inference: ``init_state(batch)`` -> list of per-layer states (``None`` for the MLP), then
    ``step`` / ``read`` / ``step_and_read`` per layer (same signatures as the layer modules,
    with the layer index first).
    """

    def __init__(self, config: ScorerConfig) -> None:
        super().__init__([_make_layer(config, i) for i in range(config.num_layers)])
        self.config = config

    @property
    def is_stateful(self) -> bool:
        return self.config.kind == "mlstm"

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # training
    def forward_layer(self, layer_idx: int, k: Tensor, v: Tensor, window: int, **kwargs) -> Tensor:
        return self[layer_idx](k, v, window, **kwargs)

    # inference
    def init_state(self, batch: int = 1, device=None, dtype=None) -> list[Any]:
        return [layer.init_state(batch, device, dtype) for layer in self]

    def step(self, layer_idx: int, state, k: Tensor, v: Tensor, mask: Tensor | None = None):
        return self[layer_idx].step(state, k, v, mask)

    def read(self, layer_idx: int, state, k: Tensor, v: Tensor) -> Tensor:
        return self[layer_idx].read(state, k, v)

    def step_and_read(self, layer_idx: int, state, k_new: Tensor, v_new: Tensor, k_read: Tensor,
                      v_read: Tensor, read_steps=None, mask: Tensor | None = None):
        return self[layer_idx].step_and_read(state, k_new, v_new, k_read, v_read, read_steps, mask)

    # persistence
    def save(self, path: str | os.PathLike) -> None:
        """torch.save of {"config": dict, "state_dict": ...}."""
        torch.save({"format": "kvpop-scorer-v1", "config": self.config.to_dict(),
                    "state_dict": self.state_dict()}, path)

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
