"""Oracle: score each exiting token by its true future attention (method.md section 8).

It needs the whole sequence in advance (teacher-forced evaluation): ``targets[layer]`` is the
log target ``[batch, kv_heads, S]`` from ``kvpop.capture.collect(model, ids, window=W)``. Under
the window-exit rule this is exactly the teacher of the boundary loss, the upper bound for any
learned scorer at the same budget.

Its per-sequence state is the row of ``targets`` each cache row reads (so beam search and batch
reordering keep every row on its own targets); targets of batch 1 serve every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..config import attention_shape
from .base import ExitBatch, Policy


@dataclass(frozen=True, eq=False)
class OraclePolicy(Policy):
    name: ClassVar[str] = "oracle"
    targets: list[torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.targets is None:
            raise ValueError(
                "the oracle policy needs targets: OraclePolicy(targets) with targets[layer] = [batch, kv_heads, S] "
                "log future attention (kvpop.capture.collect(model, ids, window=W)); it cannot run in free generation"
            )
        object.__setattr__(self, "targets", [t.float() for t in self.targets])

    def validate(self, config, eviction) -> None:
        shape = attention_shape(config)
        if len(self.targets) != len(shape.bounded):
            raise ValueError(
                f"oracle has targets for {len(self.targets)} layers, the model has {len(shape.bounded)} "
                "full-attention layers"
            )
        for t in self.targets:
            if t.ndim != 3 or t.shape[1] != shape.kv_heads:
                raise ValueError(f"oracle targets must be [batch, {shape.kv_heads}, S], got {tuple(t.shape)}")

    def init_state(self, batch: int, num_kv_heads: int, layer_idx: int, device) -> torch.Tensor:
        rows = self.targets[layer_idx].shape[0]
        if rows not in (1, batch):
            raise ValueError(f"oracle targets have {rows} rows; the cache has {batch}")
        return (
            torch.arange(batch, device=device) if rows == batch else torch.zeros(batch, dtype=torch.long, device=device)
        )

    def score(self, state: torch.Tensor, batch: ExitBatch) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.targets[batch.layer_idx].to(batch.keys.device).index_select(0, state)
        b, h, x, _ = batch.keys.shape
        if batch.index.max() >= target.shape[-1]:
            raise ValueError(f"oracle targets cover {target.shape[-1]} tokens; token {int(batch.index.max())} exited")
        idx = batch.index.clamp(min=0).unsqueeze(1).expand(b, h, x)
        return state, target.gather(2, idx)
