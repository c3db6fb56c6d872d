"""KVpop-MLP: stateless per-KV-head scorer, r_hat(t) = MLP([k_t ; v_t]) (with ``cross_heads``: the
token's features in every KV head of the layer).

Per head: x_t (see ``kv_features``, 2*head_dim+2 dims) -> Linear(hidden) -> SiLU -> Linear(1).
All heads of one layer are evaluated at once with batched matmuls (weights have a
leading ``kv_heads`` dim).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (
    BaseScorer,
    across_heads,
    feature_dim,
    head_linear,
    head_score,
    kv_features,
    normal_init_,
    seeded_generator,
)

__all__ = ["KVpopMLP"]


class KVpopMLP(BaseScorer):
    """Stateless scorer ("kvpop-mlp"). ``forward(k, v) -> [b, h, T]``.

    Parameters: w1 [H, Din, hidden], b1 [H, hidden], w2 [H, hidden, 1], b2 [H].
    """

    is_stateful = False

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        hidden: int = 64,
        *,
        input_norm: bool = True,
        eps: float = 1e-6,
        seed: int = 0,
        n_extra: int = 0,
        cross_heads: bool = False,
    ) -> None:
        super().__init__()
        self.kv_heads = int(kv_heads)
        self.head_dim = int(head_dim)
        self.hidden = int(hidden)
        self.input_norm = bool(input_norm)
        self.eps = float(eps)
        self.n_extra = int(n_extra)
        self.cross_heads = bool(cross_heads)
        din = feature_dim(self.head_dim, self.input_norm) + self.n_extra
        if self.cross_heads:
            din *= self.kv_heads
        self.in_dim = din
        H = self.kv_heads
        self.w1 = nn.Parameter(torch.empty(H, din, self.hidden))
        self.b1 = nn.Parameter(torch.empty(H, self.hidden))
        self.w2 = nn.Parameter(torch.empty(H, self.hidden, 1))
        self.b2 = nn.Parameter(torch.empty(H))
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int = 0) -> None:
        g = seeded_generator(seed)
        normal_init_(self.w1, 1.0 / math.sqrt(self.in_dim), g)
        normal_init_(self.w2, 1.0 / math.sqrt(self.hidden), g)
        with torch.no_grad():
            self.b1.zero_()
            self.b2.zero_()

    # ------------------------------------------------------------------ scoring
    def score(self, k: Tensor, v: Tensor, extra: Tensor | None = None) -> Tensor:
        """[b, h, T, D] keys/values (+ extra [b, h, T, n_extra] features) -> [b, h, T] scores."""
        self._check_kv(k, v)
        x = kv_features(k, v, self.input_norm, self.eps, dtype=self.w1.dtype)
        x = self._with_extra(x, extra)
        if self.cross_heads:
            x = across_heads(x)
        hdn = F.silu(head_linear(x, self.w1, self.b1))
        return head_score(hdn, self.w2, self.b2)

    def forward(
        self,
        k: Tensor,
        v: Tensor,
        window: int | None = None,
        *,
        mask: Tensor | None = None,
        extra: Tensor | None = None,
        **unused,
    ) -> Tensor:
        """Scores of every token, ``[b, h, T]``. ``window`` and ``mask`` are accepted for
        interface parity with the mLSTM scorer and ignored (the MLP is per-token)."""
        return self.score(k, v, extra)

    # --------------------------------------------- uniform inference interface
    def init_state(self, batch: int = 1, device=None, dtype=None) -> None:
        return None

    def step(self, state, k: Tensor, v: Tensor, mask: Tensor | None = None):
        return state

    def read(self, state, k: Tensor, v: Tensor, extra: Tensor | None = None) -> Tensor:
        return self.score(k, v, extra)

    def step_and_read(
        self,
        state,
        k_new: Tensor,
        v_new: Tensor,
        k_read: Tensor,
        v_read: Tensor,
        read_steps: Tensor | None = None,
        mask: Tensor | None = None,
        extra: Tensor | None = None,
    ):
        return state, self.score(k_read, v_read, extra)

    def extra_repr(self) -> str:
        return (
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, hidden={self.hidden}, "
            f"input_norm={self.input_norm}, cross_heads={self.cross_heads}"
        )
