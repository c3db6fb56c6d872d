"""The policy protocol: how a token leaving the window gets its (frozen) score.

A policy is asked once per layer and chunk to score the tokens that leave the protected
window in that chunk (``ExitBatch``). It may keep state across calls (``reset`` clears it);
attention-based heuristics declare ``needs_attention`` and then receive, per exiting token,
the attention it got from the last ``obs_window`` queries that had it inside their window.
That statistic is normalised over the query's sinks + window only, so it does not depend
on earlier eviction decisions — which keeps a chunked prefill exactly equal to the
token-by-token rule for every policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExitBatch:
    """Everything a policy may look at when tokens exit the window in one chunk of one layer.

    Shapes: ``b`` rows, ``h`` KV heads, ``X`` exit positions (one per new token position of
    the chunk; absent exits have ``index == -1``), ``C`` new tokens, ``d`` head dim.
    """

    layer_idx: int
    keys: torch.Tensor  # [b, h, X, d] keys of the exiting tokens (post-RoPE, as cached)
    values: torch.Tensor  # [b, h, X, d]
    index: torch.Tensor  # [b, X] logical token index of each exiting token (-1: no exit)
    new_keys: torch.Tensor  # [b, h, C, d] the chunk's new keys (exit j happens when new token j arrives)
    new_values: torch.Tensor  # [b, h, C, d]
    new_index: torch.Tensor  # [b, C] logical index of each new token (-1: padding)
    attention: torch.Tensor | None = None  # [b, h, X] observed attention (policies with needs_attention)
    all_valid: bool = False  # True when no new token is padding (lets policies skip masking)


class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`score`.

    ``score`` returns ``[b, h, X]`` finite floats; higher means keep. Scores of absent exits
    are ignored. ``uses_long_range = False`` turns the budget into sinks + one long window
    (StreamingLLM at equal ``B``).
    """

    name: str = "base"
    needs_attention: bool = False
    obs_window: int | None = None  # None: every query that had the token in its window
    uses_long_range: bool = True
    stateful: bool = False  # True: must see every chunk (also those without exits) to advance its state

    def setup(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int) -> None:
        """Called once by the cache before the first token; policies size their state here."""
        self.num_layers, self.num_kv_heads, self.head_dim, self.window = num_layers, num_kv_heads, head_dim, window

    def reset(self) -> None:
        """Forget per-sequence state (a new generation starts)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Select/reorder batch rows of any per-row state (beam search, repeats)."""

    def score(self, batch: ExitBatch) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
