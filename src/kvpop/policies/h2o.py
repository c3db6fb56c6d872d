"""H2O (Zhang et al., 2023): keep "heavy hitters", the tokens with the most accumulated attention.

Adapted to the window-exit rule: the attention a token received from every query that had it
in its window (exactly ``window`` queries for every token, so the sum is fair across tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .observed import ObservedAttentionPolicy


@dataclass(frozen=True, eq=False)
class H2OPolicy(ObservedAttentionPolicy):
    name: ClassVar[str] = "h2o"
    obs_window: ClassVar[int | None] = None
