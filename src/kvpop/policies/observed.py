"""Shared base of the attention-based heuristics (TOVA, H2O, SnapKV).

Under the window-exit rule each token is seen by exactly ``window`` queries while it is
protected; these policies score it at exit by the attention those queries paid it:
H2O sums over all of them, SnapKV averages over the last ``obs_window`` (its observation
window), TOVA takes the last one (the "current" query). Attention is averaged over the query
heads of the KV group and normalised over each query's sinks + window, which the cache
computes for free while attending (see ``ExitBatch.attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ExitBatch, Policy


@dataclass(frozen=True, eq=False)
class ObservedAttentionPolicy(Policy):
    needs_attention: ClassVar[bool] = True

    def score(self, state, batch: ExitBatch) -> tuple[None, torch.Tensor]:
        if batch.attention is None:
            raise RuntimeError(f"{self.name} needs attention statistics but the cache gave none")
        return state, _observed((), None, None, batch.attention, None)

    def steady_score(self, layer_idx: int, device: torch.device):
        return self._own_steady(ObservedAttentionPolicy, _observed)


def _observed(consts, keys, values, attention, index) -> torch.Tensor:
    return attention[..., 0].float()
