"""One cache layer's per-sequence tensors: what the step functions (``kvpop.step``) read and write.

Layout of one layer (method.md section 1): keys/values ``[batch, kv_heads, B + 1, head_dim]`` with
slots ``[0, s)`` the sinks, ``[s, s + w)`` the protected window as a ring buffer (token ``t``
lives in slot ``s + (t - s) % w``), ``[s + w, B)`` the long-range slots, and slot ``B`` a trash
slot that absorbs the writes of rejected exits and padding (so no write needs a branch). Each
head may hold different tokens in its slots; ``slot_index`` records which (``-1`` = empty).

A serving engine that keeps each request's slots in memory it owns (a vLLM plugin keeps them in
its KV blocks) builds a :class:`LayerState` around views of that memory, ``B + 1`` slots per
request and layer, and the request's own ``lr_prio``, ``observed``, ``n_real`` and policy state;
the step functions write the buffers in place and leave the new ``n_real``, ``min_real`` and
``policy_state`` on the state object, where the engine reads them back after the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .config import EvictionConfig
from .policies import map_state

_KEEP = object()  # map_rows: map the policy state with the same function


@dataclass(eq=False)
class LayerState:
    """The tensors of one layer for ``b`` sequences (rows): every one has the row on dim 0."""

    k: Tensor  # [b, h, B + 1, d] keys, post-RoPE (slot B: trash)
    v: Tensor  # [b, h, B + 1, dv]
    slot_index: Tensor  # [b, h, B + 1] long: the logical token index each slot holds, -1 = empty
    lr_prio: Tensor  # [b, h, k + 1] float32: the frozen priority of each long-range slot (k: trash)
    observed: Tensor  # [b, h, window, n_obs] float32: attention statistics of each ring slot's token
    n_real: Tensor  # [b] long: real (non-padding) tokens seen per row, the next token's index
    policy_state: Any = None  # the policy's per-sequence state (Policy.init_state), rows on dim 0
    min_real: int = 0  # n_real.min() as a Python int (decides the step kind without a device sync)

    # every per-row tensor and the value of an empty slot / fresh row: the one list that
    # allocation, reordering and reset go through
    ROWS: ClassVar[dict[str, float]] = {
        "k": 0.0,
        "v": 0.0,
        "slot_index": -1,
        "lr_prio": -math.inf,
        "observed": 0.0,
        "n_real": 0,
    }

    @classmethod
    def empty(cls, cfg: EvictionConfig, n_obs: int, keys: Tensor, values: Tensor, policy_state=None) -> LayerState:
        """Empty slots for the rows, heads, dims, dtype and device of a layer's first ``keys``/``values``."""
        b, h, _, d = keys.shape
        n, dev = cfg.budget, keys.device
        shapes = {
            "k": ((b, h, n + 1, d), keys.dtype),
            "v": ((b, h, n + 1, values.shape[-1]), values.dtype),
            "slot_index": ((b, h, n + 1), torch.long),
            "lr_prio": ((b, h, cfg.k + 1), torch.float32),
            "observed": ((b, h, cfg.window, max(1, n_obs)), torch.float32),
            "n_real": ((b,), torch.long),
        }
        made = {
            name: torch.full(shape, cls.ROWS[name], dtype=dtype, device=dev) for name, (shape, dtype) in shapes.items()
        }
        return cls(**made, policy_state=policy_state)

    def map_rows(self, fn: Callable[[Tensor, float], Tensor], policy_state: Any = _KEEP) -> LayerState:
        """A state whose every per-row tensor is ``fn(tensor, empty value)``: ``index_select`` for a
        beam reorder, a batch selection or a repeat, ``fill_`` for a reset (in place: the same
        tensors, which a compiled step may hold). ``policy_state``: the new policy state (default:
        the old one through ``fn``, with no empty value)."""
        rows = {name: fn(getattr(self, name), empty) for name, empty in self.ROWS.items()}
        if policy_state is _KEEP:
            policy_state = map_state(self.policy_state, lambda t: fn(t, None))
        return LayerState(**rows, policy_state=policy_state, min_real=int(rows["n_real"].min()))

    @property
    def budget(self) -> int:
        return self.k.shape[2] - 1

    @property
    def keys(self) -> Tensor:
        """``[b, h, B, d]``: the held keys (no trash slot)."""
        return self.k[:, :, : self.budget]

    @property
    def values(self) -> Tensor:
        return self.v[:, :, : self.budget]

    @property
    def held(self) -> Tensor:
        """``[b, h, B]``: the logical index held in each slot, -1 = empty."""
        return self.slot_index[:, :, : self.budget]

    @property
    def long_range_prio(self) -> Tensor:
        """``[b, h, k]``: the priority of each long-range slot (-inf = empty)."""
        return self.lr_prio[:, :, :-1]
