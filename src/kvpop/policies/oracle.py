"""Oracle: score each exiting token by its true future attention (method.md section 8).

It needs the whole sequence in advance (teacher-forced evaluation): ``targets[layer]`` is the
log target ``[batch, kv_heads, S]`` from ``kvpop.capture.collect(model, ids, window=W)``. Under
the window-exit rule this is exactly the teacher of the boundary loss, the upper bound for any
learned scorer at the same budget.
"""

from __future__ import annotations

import torch

from .base import ExitBatch, Policy


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, targets: list[torch.Tensor] | None = None) -> None:
        if targets is None:
            raise ValueError(
                "the oracle policy needs targets: OraclePolicy(targets) with targets[layer] = [batch, kv_heads, S] "
                "log future attention (kvpop.capture.collect(model, ids, window=W)); it cannot run in free generation"
            )
        self.targets = [t.float() for t in targets]

    def setup(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int) -> None:
        super().setup(num_layers, num_kv_heads, head_dim, window)
        if len(self.targets) != num_layers:
            raise ValueError(f"oracle has targets for {len(self.targets)} layers, the model has {num_layers}")
        for t in self.targets:
            if t.ndim != 3 or t.shape[1] != num_kv_heads:
                raise ValueError(f"oracle targets must be [batch, {num_kv_heads}, S], got {tuple(t.shape)}")

    def score(self, batch: ExitBatch) -> torch.Tensor:
        target = self.targets[batch.layer_idx].to(batch.keys.device)
        b, h, x, _ = batch.keys.shape
        if batch.index.max() >= target.shape[-1]:
            raise ValueError(f"oracle targets cover {target.shape[-1]} tokens; token {int(batch.index.max())} exited")
        idx = batch.index.clamp(min=0).unsqueeze(1).expand(b, h, x)
        return target.gather(2, idx)
