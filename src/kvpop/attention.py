"""The ``kvpop`` attention implementation registered with transformers.

transformers calls ``cache.update`` and then the configured attention function with the same
key tensor. ``KVpopLayer.update`` tags that tensor; the function below sees the tag and lets the
layer insert the chunk under the eviction rule and attend with its per-head visibility mask.

Decision (issue #13): creating a ``KVpopCache`` sets ``config._attn_implementation = "kvpop"``
and leaves it so; for anything but a KVpop cache the routing is a no-op. The mask function
builds the previous implementation's mask unless the cache's ``get_mask_sizes`` marks it as a
KVpop layer (:class:`KVpopOffset`), and untagged attention calls go to the previous
implementation (``sdpa``, or the model's own eager function) with that mask. So no cache,
``DynamicCache`` and ``StaticCache`` give bit-identical results while a KVpop cache exists and
after it is gone (tests/test_attention_routing.py). :func:`detach` restores the previous
name for code that reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Self

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "kvpop"
_BASE_ATTR = "_kvpop_base_attn"


@dataclass
class KVpopMask:
    """What the model passes to attention under ``kvpop``: the 2D padding mask, and the base mask lazily."""

    padding: torch.Tensor | None  # [batch, tokens seen + new] bool, True = real token
    _base_kwargs: dict = field(repr=False, default_factory=dict)
    _base_fn: object = field(repr=False, default=None)
    _new_tokens: dict = field(repr=False, default_factory=dict)  # q_len -> new_tokens(q_len), once per forward

    def base_mask(self):
        if self._base_fn is None:
            return None
        return self._base_fn(**self._base_kwargs)

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
    """The ``kv_offset`` a KVpop layer reports from ``get_mask_sizes`` (always 0): it tells
    :func:`kvpop_mask` that the mask is for a KVpop cache, which only needs the 2D padding mask."""

    def __new__(cls) -> Self:
        return super().__new__(cls, 0)


def _base_name(config) -> str:
    return getattr(config, _BASE_ATTR, None) or "sdpa"


def kvpop_mask(**kwargs):
    config = kwargs.get("config")
    base = ALL_MASK_ATTENTION_FUNCTIONS.get(_base_name(config), None)
    if not isinstance(kwargs.get("kv_offset"), KVpopOffset):  # any other cache, or none: the base mask itself
        return base(**kwargs) if base is not None else None
    return KVpopMask(padding=kwargs.get("attention_mask"), _base_kwargs=kwargs, _base_fn=base)


def _base_attention(module, base: str):
    if base == "eager":  # not registered: each modeling file has its own eager function
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"kvpop: cannot find the eager attention of {type(module).__name__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def kvpop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = getattr(key, "_kvpop_layer", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer is not None:
        valid = attention_mask.new_tokens(query.shape[2]) if isinstance(attention_mask, KVpopMask) else None
        if attention_mask is not None and not isinstance(attention_mask, KVpopMask):
            raise ValueError("kvpop attention got a prepared 4D attention mask; pass the 2D padding mask instead")
        return layer.attend(query, key, value, valid, scaling), None
    mask = attention_mask.base_mask() if isinstance(attention_mask, KVpopMask) else attention_mask
    fn = _base_attention(module, _base_name(module.config))
    return fn(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def register(name: str, attention, mask) -> None:
    """Make ``name`` an attention implementation transformers dispatches to: ``attention`` for the
    attention call, ``mask`` (a mask interface function) for the mask the model builds."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


register(NAME, kvpop_attention, kvpop_mask)


def attach(config) -> None:
    """Route the model's attention through kvpop (idempotent; remembers the previous implementation)."""
    configs = [config]
    text = config.get_text_config(decoder=True)
    if text is not config:
        configs.append(text)
    for cfg in configs:
        current = cfg._attn_implementation
        if current != NAME:
            if current not in (None, "sdpa", "eager"):
                raise ValueError(
                    f"kvpop supports models loaded with attn_implementation 'sdpa' or 'eager', got {current!r}"
                )
            object.__setattr__(cfg, _BASE_ATTR, current or "sdpa")
            cfg._attn_implementation = NAME


def detach(config) -> None:
    """Restore the attention implementation the model had before :func:`attach` (a KVpop cache
    then no longer works with this model until another ``KVpopCache`` is created for it)."""
    for cfg in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if cfg._attn_implementation == NAME:
            cfg._attn_implementation = _base_name(cfg)


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
def attention_implementation(model: torch.nn.Module, name: str, var: contextvars.ContextVar | None = None,
                             value=None) -> Iterator[None]:  # fmt: skip
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
