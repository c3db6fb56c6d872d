"""kvpop: a fixed-size KV cache for transformers by learned eviction (KVpop)."""

from .attention import detach
from .cache import KVpopCache, KVpopLayer
from .config import EvictionConfig
from .policies import POLICIES, Policy, get_policy, register_policy

__version__ = "0.1.0"

from .capture import LayerCapture, collect
from .checkpoint import load_scorer, save_scorer
from .generate import GenerationResult, generate, make_cache
from .models import SUPPORTED_MODEL_TYPES, ModelLoadError, kv_bytes_per_token, load_model, model_summary
from .targets import future_attention
from .teacher import TeacherLabels, teacher_labels

__all__ = [
    "POLICIES",
    "SUPPORTED_MODEL_TYPES",
    "EvictionConfig",
    "GenerationResult",
    "KVpopCache",
    "KVpopLayer",
    "LayerCapture",
    "ModelLoadError",
    "Policy",
    "TeacherLabels",
    "collect",
    "detach",
    "future_attention",
    "generate",
    "get_policy",
    "kv_bytes_per_token",
    "load_model",
    "load_scorer",
    "make_cache",
    "model_summary",
    "register_policy",
    "save_scorer",
    "teacher_labels",
]
