"""kvpop: a fixed-size KV cache for transformers by learned eviction (KVpop).

The public names load on first use (PEP 562): ``import kvpop`` alone imports neither torch nor
transformers, so the command line (``kvpop --help``, a bad argument) answers at once; ``kvpop.X``
imports the module that defines ``X`` the first time it is read.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from .lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .adapt.lora import lora_config, save_adapter_bundle
    from .attention import detach, routed
    from .bundle import AdapterMismatchError, load_adapter_bundle
    from .cache import KVpopCache, KVpopLayer, make_cache
    from .capture import LayerCapture, collect
    from .checkpoint import load_scorer, save_scorer
    from .config import EvictionConfig
    from .generate import GenerationResult, generate
    from .mask import masked_eviction
    from .models import (
        SUPPORTED_MODEL_TYPES,
        ModelLoadError,
        kv_bytes_at,
        kv_bytes_per_token,
        load_model,
        model_summary,
    )
    from .policies import (
        DEFAULT_POLICY,
        DENSE,
        POLICIES,
        Policy,
        default_policy,
        get_policy,
        policy_names,
        register_policy,
        resolve_policy,
    )
    from .rule import leave_steps
    from .targets import future_attention
    from .train.teacher import TeacherLabels, teacher_labels

# the module (under kvpop) -> the public names it defines (the facade of the whole package: a few come from
# kvpop.adapt and kvpop.train, which the runtime modules themselves never import)
_MODULES: dict[str, tuple[str, ...]] = {
    "adapt.lora": ("lora_config", "save_adapter_bundle"),
    "attention": ("detach", "routed"),
    "bundle": ("AdapterMismatchError", "load_adapter_bundle"),
    "cache": ("KVpopCache", "KVpopLayer", "make_cache"),
    "capture": ("LayerCapture", "collect"),
    "checkpoint": ("load_scorer", "save_scorer"),
    "config": ("EvictionConfig",),
    "generate": ("GenerationResult", "generate"),
    "mask": ("masked_eviction",),
    "models": (
        "SUPPORTED_MODEL_TYPES",
        "ModelLoadError",
        "kv_bytes_at",
        "kv_bytes_per_token",
        "load_model",
        "model_summary",
    ),
    "policies": (
        "DEFAULT_POLICY",
        "DENSE",
        "POLICIES",
        "Policy",
        "default_policy",
        "get_policy",
        "policy_names",
        "register_policy",
        "resolve_policy",
    ),
    "rule": ("leave_steps",),
    "targets": ("future_attention",),
    "train.teacher": ("TeacherLabels", "teacher_labels"),
}

__all__ = [
    "DEFAULT_POLICY",
    "DENSE",
    "POLICIES",
    "SUPPORTED_MODEL_TYPES",
    "AdapterMismatchError",
    "EvictionConfig",
    "GenerationResult",
    "KVpopCache",
    "KVpopLayer",
    "LayerCapture",
    "ModelLoadError",
    "Policy",
    "TeacherLabels",
    "collect",
    "default_policy",
    "detach",
    "future_attention",
    "generate",
    "get_policy",
    "kv_bytes_at",
    "kv_bytes_per_token",
    "leave_steps",
    "load_adapter_bundle",
    "load_model",
    "load_scorer",
    "lora_config",
    "make_cache",
    "masked_eviction",
    "model_summary",
    "policy_names",
    "register_policy",
    "resolve_policy",
    "routed",
    "save_adapter_bundle",
    "save_scorer",
    "teacher_labels",
]

# a public name from its module, or a submodule (``kvpop.models``), imported on first use
_EXPORTS, __getattr__, __dir__ = lazy_exports(__name__, _MODULES, globals())


class _Package(types.ModuleType):
    """Importing the submodule ``kvpop.generate`` would bind it over the function ``kvpop.generate``
    (the import system sets the attribute on the package): a public name keeps its meaning."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
