"""Eviction policies by name. One file per policy; ``base.Policy`` is the protocol."""

from __future__ import annotations

from collections.abc import Callable

from .base import ExitBatch, Policy, map_state
from .h2o import H2OPolicy
from .knorm import KnormPolicy
from .learned import LearnedPolicy, learned_policy_factory
from .oracle import OraclePolicy
from .random import RandomPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy
from .tova import TovaPolicy

POLICIES: dict[str, Callable[..., Policy]] = {
    "streaming": StreamingPolicy,
    "tova": TovaPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "knorm": KnormPolicy,
    "random": RandomPolicy,
    "oracle": OraclePolicy,
    "kvpop": learned_policy_factory("mlstm"),
    "kvpop-mlp": learned_policy_factory("mlp"),
}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Make a policy available by name (used for the oracle and the learned scorers)."""
    POLICIES[name] = factory


def get_policy(policy: str | Policy, **kwargs) -> Policy:
    """A policy instance from a name or an instance; unknown names list the known ones."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy](**kwargs)


__all__ = [
    "POLICIES",
    "ExitBatch",
    "H2OPolicy",
    "KnormPolicy",
    "LearnedPolicy",
    "OraclePolicy",
    "Policy",
    "RandomPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "TovaPolicy",
    "get_policy",
    "map_state",
    "register_policy",
]
