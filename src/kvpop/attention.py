"""Routing a model's attention through a KVpop cache, and switching attention implementations.

transformers builds one attention mask per forward (the mask interface of the configured
implementation) and then, per layer, calls ``cache.update`` and the configured attention
function. A ``KVpopCache`` answers ``get_mask_sizes`` with a :class:`KVpopOffset` that carries
its layers; :func:`kvpop_mask` turns that into a :class:`KVpopMask` (the 2D padding mask and the
layers), and :func:`kvpop_attention` finds the layer through it (``mask.layers[layer_idx]``) and
lets it insert the new tokens under the eviction rule and attend. Any other cache, or none, gets
the model's own implementation and mask, bit for bit (tests/unit/test_attention_routing.py).

The ``kvpop`` implementation is set on the model's config while a :class:`Route` is held: each
``KVpopCache`` holds one until it is detached (``cache.detach()``) or garbage-collected, and
``with kvpop.routed(model):`` holds one for a block; when the last is released the model's
previous implementation (``sdpa`` or ``eager``) is back. :func:`detach` restores it at once,
whatever holds it (the caches then refuse to run).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Self

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "NAME",
    "KVpopMask",
    "KVpopOffset",
    "Route",
    "attention_implementation",
    "detach",
    "model_configs",
    "register",
    "routed",
]

NAME = "kvpop"
USE_CACHE_FALSE = (
    "use_cache=False with a KVpop cache: the model would feed the whole sequence through the cache at "
    "every step (neither dense nor bounded attention). Drop use_cache=False, or drop the cache for a "
    "dense run without one."
)
_BASE_ATTR = "_kvpop_base_attn"


@dataclass
class KVpopMask:
    """What the model passes to attention under ``kvpop`` for a KVpop cache: the 2D padding mask and
    the cache's layers (the attention finds its layer here)."""

    padding: torch.Tensor | None  # [batch, tokens seen + new] bool, True = real token
    layers: list = field(repr=False, default_factory=list)
    _new_tokens: dict = field(repr=False, default_factory=dict)  # q_len -> new_tokens(q_len), once per forward

    def new_tokens(self, q_len: int) -> torch.Tensor | None:
        """The new tokens' padding mask, or None when all of them are real: computed once per forward
        (every layer gets this same object), so an unpadded batch costs one device sync per step, not
        one per layer."""
        if self.padding is None:
            return None
        if q_len not in self._new_tokens:
            valid = self.padding[:, -q_len:].bool()
            self._new_tokens[q_len] = None if bool(valid.all()) else valid
        return self._new_tokens[q_len]


class KVpopOffset(int):
    """The ``kv_offset`` a KVpop cache reports from ``get_mask_sizes`` (always 0): it tells
    :func:`kvpop_mask` that the mask is for a KVpop cache, and carries the cache's layers."""

    layers: list

    def __new__(cls, layers: list) -> Self:
        offset = super().__new__(cls, 0)
        offset.layers = layers
        return offset


def _base_name(config) -> str:
    return getattr(config, _BASE_ATTR, None) or "sdpa"


def kvpop_mask(**kwargs):
    """Mask interface of ``kvpop``: a :class:`KVpopMask` for a KVpop cache, the base mask otherwise."""
    offset = kwargs.get("kv_offset")
    if isinstance(offset, KVpopOffset):
        return KVpopMask(padding=kwargs.get("attention_mask"), layers=offset.layers)
    base = ALL_MASK_ATTENTION_FUNCTIONS.get(_base_name(kwargs.get("config")), None)
    return base(**kwargs) if base is not None else None


def _base_attention(module, base: str):
    if base == "eager":  # not registered: each modeling file has its own eager function
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"kvpop: cannot find the eager attention of {type(module).__name__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def kvpop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention under ``kvpop``: the KVpop layer's (found through the mask), else the base implementation's."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(attention_mask, KVpopMask):
        if kwargs.get("use_cache") is False:  # transformers 5.19 passes it here (newer ones to Cache.update)
            raise ValueError(USE_CACHE_FALSE)
        layer = attention_mask.layers[module.layer_idx]
        return layer.attend(query, key, value, attention_mask.new_tokens(query.shape[2]), scaling), None
    fn = _base_attention(module, _base_name(module.config))
    return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register(name: str, attention, mask) -> None:
    """Make ``name`` an attention implementation transformers dispatches to: ``attention`` for the
    attention call, ``mask`` (a mask interface function) for the mask the model builds."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


register(NAME, kvpop_attention, kvpop_mask)


# --- holding the routing ------------------------------------------------------------------------


@dataclass(eq=False)
class _Routing:
    """One model's routing: its configs with their previous implementations, and how many hold it."""

    configs: list  # [(config, previous implementation)]
    holders: int = 0
    detached: bool = False


_ROUTINGS: dict[int, _Routing] = {}  # id(the model's config) -> its routing, while held
_LOCK = threading.Lock()


def _configs_of(config) -> list:
    text = config.get_text_config(decoder=True)
    return [config] if text is config else [config, text]


class Route:
    """A hold on a model's routing through kvpop (see the module doc): the model's config names the
    ``kvpop`` implementation from the first hold until the last :meth:`release`. Also a context manager."""

    def __init__(self, config) -> None:
        with _LOCK:
            routing = _ROUTINGS.get(id(config))
            if routing is None:
                saved = []
                for cfg in _configs_of(config):
                    current = cfg._attn_implementation
                    if current != NAME and current not in (None, "sdpa", "eager"):
                        raise ValueError(
                            f"kvpop supports models loaded with attn_implementation 'sdpa' or 'eager', got {current!r}"
                        )
                    saved.append((cfg, current))
                for cfg, current in saved:
                    if current != NAME:
                        object.__setattr__(cfg, _BASE_ATTR, current or "sdpa")
                        cfg._attn_implementation = NAME
                routing = _ROUTINGS[id(config)] = _Routing(saved)
            routing.holders += 1
        self.config, self._routing, self._held = config, routing, True

    @property
    def active(self) -> bool:
        """Held, not detached, and the config still names ``kvpop`` (nobody switched it since)."""
        return self._held and not self._routing.detached and self.config._attn_implementation == NAME

    def release(self) -> None:
        """Let go (idempotent); the last hold restores the model's previous implementation."""
        with _LOCK:
            if not self._held:
                return
            self._held = False
            routing = self._routing
            routing.holders -= 1
            if routing.holders == 0 and not routing.detached:
                _restore(routing)
                _ROUTINGS.pop(id(self.config), None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _restore(routing: _Routing) -> None:
    for cfg, previous in routing.configs:
        if cfg._attn_implementation == NAME:
            cfg._attn_implementation = _base_name(cfg) if previous == NAME else previous


def routed(model) -> Route:
    """``with kvpop.routed(model):`` the model's attention runs through kvpop inside the block (caches
    created there hold their own route, so a cache kept past the block keeps it until it is gone)."""
    return Route(getattr(model, "config", model))


def detach(config) -> None:
    """Restore the attention implementation the model had before kvpop routed it, whatever holds the
    routing: the KVpop caches made for it then refuse to run (create a new one to route it again)."""
    with _LOCK:
        routing = _ROUTINGS.pop(id(config), None)
        if routing is not None:
            routing.detached = True
            _restore(routing)
            return
    for cfg in _configs_of(config):  # routed by hand, or by an older kvpop: the name alone
        if cfg._attn_implementation == NAME:
            cfg._attn_implementation = _base_name(cfg)


# --- switching the implementation for a block of code ---------------------------------------------


def model_configs(model: torch.nn.Module) -> list:
    """Every distinct config object reachable from the model's modules (and their sub-configs)."""
    seen: dict[int, object] = {}
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            stack.append(getattr(cfg, key, None))
    return list(seen.values())


@contextlib.contextmanager
def attention_implementation(
    model: torch.nn.Module, name: str, var: contextvars.ContextVar | None = None, value=None
) -> Iterator[None]:
    """While active, every config of ``model`` names the attention implementation ``name`` (one
    registered with :func:`register`) and ``var`` (if given) holds ``value``, what that attention
    function reads; both are restored on exit, also on errors. The one place that switches a
    model's attention for a block of code (capture, the training mask, the test reference)."""
    configs = model_configs(model)
    saved = [(c, c._attn_implementation_internal) for c in configs]
    token = None if var is None else var.set(value)
    try:
        for c in configs:
            c._attn_implementation_internal = name
        yield
    finally:
        for c, v in saved:
            c._attn_implementation_internal = v
        if token is not None:
            var.reset(token)
