"""StreamingLLM: attention sinks plus the most recent tokens, nothing else.

At an equal budget ``B`` the long-range slots are given to the window (``window = B - sinks``,
``k = 0``), which is the fair comparison: every policy holds ``B`` slots per head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ExitBatch, Policy


@dataclass(frozen=True, eq=False)
class StreamingPolicy(Policy):
    name: ClassVar[str] = "streaming"
    uses_long_range: ClassVar[bool] = False

    def score(self, state, batch: ExitBatch) -> tuple[None, torch.Tensor]:
        b, h, x, _ = batch.keys.shape
        return state, torch.zeros(b, h, x, dtype=torch.float32, device=batch.keys.device)
