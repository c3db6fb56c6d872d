"""SnapKV (Li et al., 2024): score tokens by the attention of an observation window of queries.

Adapted to the window-exit rule: the mean attention the token received from the last
``obs_window`` queries before it left the window (default 32; a cache with a shorter window
uses all of its window, see :meth:`Policy.observation_window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .observed import ObservedAttentionPolicy


@dataclass(frozen=True, eq=False)
class SnapKVPolicy(ObservedAttentionPolicy):
    name: ClassVar[str] = "snapkv"
    obs_window: int = 32

    def __post_init__(self) -> None:
        if self.obs_window < 1:
            raise ValueError(f"obs_window must be >= 1, got {self.obs_window}")
        object.__setattr__(self, "obs_window", int(self.obs_window))
