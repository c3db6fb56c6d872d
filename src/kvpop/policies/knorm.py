"""Key-norm: keep tokens whose key has a *small* L2 norm.

Low-norm keys tend to receive high attention (Devoto et al., 2024, as in kvpress' KnormPress),
so the score is the negative key norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ExitBatch, Policy


@dataclass(frozen=True, eq=False)
class KnormPolicy(Policy):
    name: ClassVar[str] = "knorm"

    def score(self, state, batch: ExitBatch) -> tuple[None, torch.Tensor]:
        return state, _negative_norm((), batch.keys, None, None, None)

    def steady_score(self, layer_idx: int, device: torch.device):
        return self._own_steady(KnormPolicy, _negative_norm)


def _negative_norm(consts, keys, values, attention, index) -> torch.Tensor:
    return -keys.float().norm(dim=-1)
