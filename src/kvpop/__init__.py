"""kvpop: a fixed-size KV cache for transformers by learned eviction (KVpop)."""

from .attention import detach, routed
from .cache import KVpopCache, KVpopLayer, make_cache
from .config import EvictionConfig
from .policies import DEFAULT_POLICY, DENSE, POLICIES, Policy, default_policy, get_policy, policy_names, register_policy

__version__ = "0.1.0"

from .adapters import AdapterMismatchError, load_adapter_bundle, lora_config, save_adapter_bundle
from .capture import LayerCapture, collect
from .checkpoint import load_scorer, save_scorer
from .generate import GenerationResult, generate
from .mask import masked_eviction
from .models import SUPPORTED_MODEL_TYPES, ModelLoadError, kv_bytes_at, kv_bytes_per_token, load_model, model_summary
from .rule import leave_steps
from .targets import future_attention
from .teacher import TeacherLabels, teacher_labels

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
    "routed",
    "save_adapter_bundle",
    "save_scorer",
    "teacher_labels",
]
