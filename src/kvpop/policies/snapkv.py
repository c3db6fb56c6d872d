"""SnapKV (Li et al., 2024): score tokens by the attention of an observation window of queries.

Adapted to the window-exit rule: the mean attention the token received from the last
``obs_window`` queries before it left the window (default 32; a cache with a shorter window
uses all of its window, see :meth:`Policy.observation_window`).
"""

from __future__ import annotations

from .observed import ObservedAttentionPolicy


class SnapKVPolicy(ObservedAttentionPolicy):
    name = "snapkv"

    def __init__(self, obs_window: int = 32) -> None:
        if obs_window < 1:
            raise ValueError(f"obs_window must be >= 1, got {obs_window}")
        self.obs_window = int(obs_window)

    def __repr__(self) -> str:
        return f"SnapKVPolicy(obs_window={self.obs_window})"
