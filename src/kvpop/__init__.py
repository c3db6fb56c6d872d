"""kvpop: a fixed-size KV cache for transformers by learned eviction (KVpop)."""

from .cache import KVpopCache, KVpopLayer
from .config import EvictionConfig
from .policies import POLICIES, Policy, get_policy, register_policy

__version__ = "0.1.0"
