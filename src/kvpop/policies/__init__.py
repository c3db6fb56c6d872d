"""Eviction policies by name. One file per policy; ``base.Policy`` is the protocol.

The names are listed here and only here: the CLI's ``--policy`` choices, the evaluation's
default grid and the benchmarks' defaults all come from :func:`policy_names`.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import ExitBatch, Policy, PolicyKernels, map_state
from .h2o import H2OPolicy
from .knorm import KnormPolicy
from .learned import KIND_TO_POLICY, LearnedPolicy, adapter_scorer, learned_policy_factory
from .oracle import OraclePolicy
from .random import RandomPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy
from .tova import TovaPolicy

DENSE = "dense"  # not a policy: no eviction, a plain transformers cache
# the shipped MLP scorer: both shipped scorers are trained over every budget 128..2,048, and the MLP is the
# better of the two on the test grids (docs/evaluation.md); with an adapter bundle: default_policy
DEFAULT_POLICY = "kvpop-mlp"

POLICIES: dict[str, Callable[..., Policy]] = {
    "streaming": StreamingPolicy,
    "tova": TovaPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "knorm": KnormPolicy,
    "random": RandomPolicy,
    "oracle": OraclePolicy,
    "kvpop-mlp": learned_policy_factory("mlp"),
    "kvpop": learned_policy_factory("mlstm"),
}
LEARNED_POLICIES = tuple(KIND_TO_POLICY.values())  # built from a scorer checkpoint: accept path= and model=
TEACHER_FORCED_ONLY = ("oracle",)  # needs the whole sequence in advance: not for free generation


def policy_names(*, dense: bool = True, teacher_forced: bool = True) -> list[str]:
    """Every registered name, in table order; ``dense`` first when asked for."""
    names = [n for n in POLICIES if teacher_forced or n not in TEACHER_FORCED_ONLY]
    return [DENSE, *names] if dense else names


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Make a policy available by name."""
    if name == DENSE:
        raise ValueError(f"{DENSE!r} is reserved for no eviction")
    POLICIES[name] = factory


def default_policy(model=None, config=None) -> str:
    """The policy a cache uses when none is named: on a model loaded with an adapter bundle
    (``load_model(adapter=...)``, found through the model or its config) the learned policy its
    scorer serves (an MLP bundle: ``"kvpop-mlp"``), else :data:`DEFAULT_POLICY`. So
    ``KVpopCache(adapted.config, budget=B)`` runs the bundle's scorer whichever kind it is; naming
    the other learned policy explicitly stays an error that says which one serves the bundle."""
    bundle = adapter_scorer(model, config)
    return DEFAULT_POLICY if bundle is None else KIND_TO_POLICY[bundle[1].config.kind]


def get_policy(policy: str | Policy, **kwargs) -> Policy:
    """A policy instance from a name or an instance; unknown names list the known ones."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy](**kwargs)


__all__ = [
    "DEFAULT_POLICY",
    "DENSE",
    "KIND_TO_POLICY",
    "LEARNED_POLICIES",
    "POLICIES",
    "TEACHER_FORCED_ONLY",
    "ExitBatch",
    "H2OPolicy",
    "KnormPolicy",
    "LearnedPolicy",
    "OraclePolicy",
    "Policy",
    "PolicyKernels",
    "RandomPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "TovaPolicy",
    "default_policy",
    "get_policy",
    "map_state",
    "policy_names",
    "register_policy",
]
