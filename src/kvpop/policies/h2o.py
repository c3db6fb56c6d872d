"""H2O (Zhang et al., 2023): keep "heavy hitters", the tokens with the most accumulated attention.

Adapted to the window-exit rule: the attention a token received from every query that had it
in its window (exactly ``window`` queries for every token, so the sum is fair across tokens).
"""

from __future__ import annotations

from .observed import ObservedAttentionPolicy


class H2OPolicy(ObservedAttentionPolicy):
    name = "h2o"
    obs_window = None
