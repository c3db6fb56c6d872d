"""Learned KVpop policies: a trained scorer (MLP or mLSTM) behind the policy protocol.

The stateless MLP scores the exiting token's ``[k; v]``. The stateful mLSTM advances its
per-head state with every new token of the layer and reads it when a token exits, at the
exit step (new token ``j`` of the chunk pushes out token ``j - window``), so a chunked
prefill, decode, and the training-time parallel form all see the same state.
"""

from __future__ import annotations

import torch

from ..scorers import ScorerStack
from .base import ExitBatch, Policy


class LearnedPolicy(Policy):
    name = "kvpop"

    def __init__(self, scorer: ScorerStack, name: str | None = None) -> None:
        self.scorer = scorer.eval()
        self.name = name or ("kvpop" if scorer.config.kind == "mlstm" else "kvpop-mlp")
        self.states: list | None = None
        self.stateful = bool(scorer.is_stateful)

    def setup(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int) -> None:
        super().setup(num_layers, num_kv_heads, head_dim, window)
        cfg = self.scorer.config
        if (cfg.num_layers, cfg.kv_heads, cfg.head_dim) != (num_layers, num_kv_heads, head_dim):
            raise ValueError(
                f"scorer was built for {cfg.num_layers} layers x {cfg.kv_heads} KV heads x head_dim {cfg.head_dim}; "
                f"this model has {num_layers} x {num_kv_heads} x {head_dim}"
            )
        self.states = None

    def reset(self) -> None:
        self.states = None

    def reorder(self, index: torch.Tensor) -> None:
        if self.states is not None:
            self.states = [s.index_select(index) if s is not None else None for s in self.states]

    @torch.no_grad()
    def score(self, batch: ExitBatch) -> torch.Tensor:
        b, _, c, _ = batch.new_keys.shape
        dev = batch.new_keys.device
        if self.states is None:
            self.states = self.scorer.init_state(b, device=dev, dtype=torch.float32)
        l = batch.layer_idx
        mask = None if batch.all_valid else batch.new_index >= 0
        # decode (one new token): read after it, the scorer's single-step fast path
        read_steps = None if c == 1 else torch.arange(c, device=dev)
        state, scores = self.scorer.step_and_read(
            l, self.states[l], batch.new_keys.float(), batch.new_values.float(),
            batch.keys.float(), batch.values.float(), read_steps, mask,
        )
        self.states[l] = state
        return scores.float()


def learned_policy_factory(kind: str):
    """Factory registered as ``kvpop`` / ``kvpop-mlp``: a given scorer, a checkpoint path, or the shipped one."""

    def make(scorer: ScorerStack | None = None, path: str | None = None, model=None) -> LearnedPolicy:
        from ..checkpoint import default_scorer_path, load_scorer

        if scorer is None:
            scorer, _ = load_scorer(path or default_scorer_path(kind), model=model)
        if scorer.config.kind != kind:
            raise ValueError(f"policy {'kvpop' if kind == 'mlstm' else 'kvpop-mlp'} needs a {kind} scorer, got {scorer.config.kind}")
        return LearnedPolicy(scorer)

    return make
