"""Random eviction: a seeded score per (layer, head, token).

The score is a hash of ``(seed, layer, head, token index)`` rather than a draw from a
generator, so it does not depend on how the sequence was chunked or batched: a prefill in
chunks, token by token, or a row alone or in a padded batch all evict the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ExitBatch, Policy


def hash_uniform(seed: int, layer: int, head: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Deterministic pseudo-uniform [0, 1) values (the classic sin-fract hash, in float64)."""
    return _hash(index.double() * 12.9898 + head.double() * 78.233, _offset(seed, layer))


def _offset(seed: int, layer: int) -> float:
    return layer * 37.719 + seed * 4.1414


def _hash(x: torch.Tensor, offset) -> torch.Tensor:
    y = torch.sin(x + offset) * 43758.5453
    return (y - torch.floor(y)).float()


def _steady_hash(consts, keys, values, attention, index) -> torch.Tensor:
    """``hash_uniform`` of one exit per row; the layer's offset is a tensor (``consts``), so one
    compiled graph serves every layer."""
    (offset,) = consts
    head = torch.arange(keys.shape[1], device=keys.device).view(1, -1, 1)
    return _hash(index.view(-1, 1, 1).double() * 12.9898 + head.double() * 78.233, offset)


@dataclass(frozen=True, eq=False)
class RandomPolicy(Policy):
    name: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", int(self.seed))

    def score(self, state, batch: ExitBatch) -> tuple[None, torch.Tensor]:
        b, h, x, _ = batch.keys.shape
        head = torch.arange(h, device=batch.keys.device).view(1, h, 1)
        index = batch.index.unsqueeze(1).expand(b, h, x)
        return state, hash_uniform(self.seed, batch.layer_idx, head, index)

    def steady_score(self, layer_idx: int, device: torch.device):
        offset = torch.tensor(_offset(self.seed, layer_idx), dtype=torch.float64, device=device)
        return self._own_steady(RandomPolicy, _steady_hash, (offset,))
