"""TOVA (Oren et al., 2024): keep the tokens the current query attends to most.

Adapted to the window-exit rule: an exiting token is scored by the attention of the last
query that still had it in its window (observation window of one query).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .observed import ObservedAttentionPolicy


@dataclass(frozen=True, eq=False)
class TovaPolicy(ObservedAttentionPolicy):
    name: ClassVar[str] = "tova"
    obs_window: ClassVar[int | None] = 1
