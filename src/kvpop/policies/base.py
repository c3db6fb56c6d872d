"""The policy protocol: how a token leaving the window gets its (frozen) score.

A policy is a frozen dataclass: configuration (and, for the learned ones, weights) only, so
one instance, resolved once, serves any number of caches at once. Anything that depends on the
device or on the sequences lives with the cache that uses it:

* :meth:`Policy.prepare` gives the policy on one device (:class:`PolicyKernels`): what a cache's
  steps call, per layer; a cache makes it once per device;
* :meth:`Policy.init_state` makes a layer's per-sequence state (``None`` for most policies);
* :meth:`Policy.score` takes that state and the chunk's exits and returns the new state with
  the scores.

A state is ``None``, a tensor, or (nested) tuples, NamedTuples, lists or dicts of tensors whose
dim 0 is the batch row, so the cache can reorder, select, repeat or reset it without knowing
what it is (:func:`map_state`; beam search, ``batch_repeat_interleave``,
``batch_select_indices``, ``reset``).

Attention-based heuristics declare ``needs_attention`` and then receive, per exiting token,
the attention it got from the last :meth:`Policy.observation_window` queries that had it inside
their window (the cache keeps that statistic, per row, in its layers). It is normalised over
the query's sinks + window only, so it does not depend on earlier eviction decisions, which
keeps a chunked prefill exactly equal to the token-by-token rule for every policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import TrainedSettings


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
    attention: torch.Tensor | None = None  # [b, h, X, n] observed attention, one per observation window
    all_valid: bool = False  # True when no new token is padding (lets policies skip masking)
    window: int = 0  # the cache's protected window (observed statistics sum over up to this many queries)


State = Any  # None | Tensor | tuple / NamedTuple / list / dict of states, batch rows on dim 0


def map_state(state: State, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
    """Apply ``fn`` to every tensor of a policy state, keeping its structure."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple
        return type(state)(*(map_state(s, fn) for s in state))
    if isinstance(state, (tuple, list)):
        return type(state)(map_state(s, fn) for s in state)
    if isinstance(state, dict):
        return {k: map_state(v, fn) for k, v in state.items()}
    raise TypeError(
        f"a policy state must be None, a tensor, or tuples/lists/dicts of tensors; got {type(state).__name__}"
    )


@dataclass(frozen=True, eq=False)
class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`score`; built-in policies are frozen
    dataclasses whose fields are their settings (a subclass that is not a dataclass still works).

    ``score`` returns ``(state, scores)`` with ``scores [b, h, X]`` finite floats; higher means
    keep. Scores of absent exits are ignored. ``uses_long_range = False`` turns the budget into
    sinks + one long window (StreamingLLM at equal ``B``). ``stateful = True`` asks the cache to
    call ``score`` for every chunk, also those without exits, so the state sees every token.
    """

    name: ClassVar[str] = "base"
    needs_attention: ClassVar[bool] = False
    obs_window: ClassVar[int | None] = None  # None: every query that had the token in its window
    uses_long_range: ClassVar[bool] = True
    stateful: ClassVar[bool] = False
    # what a learned scorer was trained for (window fraction, budget range, lam); None: the library
    # defaults. Caches resolve their window and lam from it (kvpop.config.resolve_eviction).
    trained: ClassVar[TrainedSettings | None] = None

    def validate(self, config, eviction) -> None:
        """Refuse a model ``config`` / ``EvictionConfig`` this policy cannot serve. Must not mutate the policy."""

    def observation_window(self, window: int) -> int:
        """How many of the last queries' attention counts, for a cache with this protected window."""
        return window if self.obs_window is None else min(self.obs_window, window)

    def observation_windows(self, window: int) -> tuple[int, ...]:
        """The statistics ``ExitBatch.attention`` carries (last dim), for a cache with this window."""
        return (self.observation_window(window),)

    def init_state(self, batch: int, num_kv_heads: int, layer_idx: int, device: torch.device) -> State:
        """A fresh per-sequence state of one layer (held by the cache layer, not by the policy)."""
        return None

    def score(self, state: State, batch: ExitBatch) -> tuple[State, torch.Tensor]:
        raise NotImplementedError

    def decode_kernel(self, layer_idx: int, window: int, device: torch.device | None = None) -> tuple | None:
        """Optional: ``(DecodeSpec, params)`` of ``kvpop.scorers.decode`` to score the decode steady
        state inside the cache's fused (optionally compiled) step, with ``params`` on ``device`` (the
        cache's); None: the cache calls :meth:`score`.
        Called at every such step: return the same tuple object while it is unchanged (a compiled
        cache keeps its step bound to it, and rebinds when the object changes)."""
        return None

    def steady_score(self, layer_idx: int, device: torch.device) -> tuple[Callable, tuple] | None:
        """Optional: ``(fn, consts)`` with ``fn(consts, keys, values, attention, index)`` a pure tensor
        function equal to :meth:`score` for one exiting token per row (``keys``/``values`` ``[b, h,
        1, d]``, ``attention`` ``[b, h, 1, n]`` or None, ``index [b]``; returns ``[b, h, 1]``), so the
        cache fuses (and with ``compile=True`` compiles) it into its steady decode step. None: the
        cache calls :meth:`score`. A subclass that overrides ``score`` gets None unless it overrides
        this too (see :meth:`_own_steady`). ``fn`` and ``consts`` must stay the same for a policy,
        layer and device: a compiled cache binds them once for the steps that follow."""
        return None

    def prepare(self, device) -> PolicyKernels:
        """What a cache on ``device`` calls, per layer (:class:`PolicyKernels`): made once per cache and
        device, so nothing per device is kept in the policy."""
        return PolicyKernels(self, torch.device(device))

    def _own_steady(self, owner: type, fn: Callable, consts: tuple = ()) -> tuple[Callable, tuple] | None:
        """``(fn, consts)`` if ``score`` is still ``owner.score`` (not overridden below it), else None."""
        return (fn, consts) if type(self).score is owner.score else None


class PolicyKernels:
    """A policy on one device, as a cache's steps (``kvpop.step``) call it: its scores, its
    per-sequence state and its fused decode kernels for each layer. ``Policy.prepare(device)``
    makes one; this default calls the policy's own methods with the device (and keeps each layer's
    ``steady_score``, which must not change for a policy, layer and device).
    """

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy, self.device = policy, device
        self.name, self.needs_attention, self.stateful = policy.name, policy.needs_attention, policy.stateful
        self._steady: dict[int, tuple | None] = {}

    def init_state(self, batch: int, kv_heads: int, layer_idx: int) -> State:
        return self.policy.init_state(batch, kv_heads, layer_idx, self.device)

    def score(self, state: State, batch: ExitBatch) -> tuple[State, torch.Tensor]:
        return self.policy.score(state, batch)

    def decode_kernel(self, layer_idx: int, window: int) -> tuple | None:
        """``(DecodeSpec, params)`` for the fused steady step (the same object while unchanged), or None."""
        return self.policy.decode_kernel(layer_idx, window, self.device)

    def steady_score(self, layer_idx: int) -> tuple[Callable, tuple] | None:
        """``(fn, consts)``: a pure score function for the fused steady step (the same object at every
        step: a compiled cache binds it), or None."""
        if layer_idx not in self._steady:
            self._steady[layer_idx] = self.policy.steady_score(layer_idx, self.device)
        return self._steady[layer_idx]
