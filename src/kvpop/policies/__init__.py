"""Eviction policies by name. One file per policy; ``base.Policy`` is the protocol.

The names are the table of :mod:`kvpop.names` (torch-free, for the command lines); the registry here
holds a factory for each, and the evaluation's default grid and the benchmarks' defaults come from
:func:`policy_names`. ``"kvpop"`` is an alias: the model's default learned policy, resolved to
``"kvpop-mlp"`` or ``"kvpop-mlstm"`` by :func:`resolve_policy`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..names import ALIAS, DEFAULT_POLICY, DENSE, KIND_TO_POLICY, LEARNED_POLICIES, TEACHER_FORCED_ONLY
from .base import ExitBatch, Policy, PolicyKernels, map_state
from .h2o import H2OPolicy
from .knorm import KnormPolicy
from .learned import LearnedPolicy, adapter_scorer, learned_policy_factory, policy_for_scorer
from .oracle import OraclePolicy
from .random import RandomPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy
from .tova import TovaPolicy


def _default_learned(scorer=None, path=None, model=None, config=None, budget=None) -> Policy:
    """Factory registered as the alias ``kvpop``: the learned policy :func:`resolve_policy` picks."""
    name = resolve_policy(ALIAS, model, config, scorer=scorer, path=path)
    return POLICIES[name](scorer=scorer, path=path, model=model, config=config, budget=budget)


POLICIES: dict[str, Callable[..., Policy]] = {
    "streaming": StreamingPolicy,
    "tova": TovaPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "knorm": KnormPolicy,
    "random": RandomPolicy,
    "oracle": OraclePolicy,
    ALIAS: _default_learned,
    **{name: learned_policy_factory(kind) for kind, name in KIND_TO_POLICY.items()},
}


def policy_names(*, dense: bool = True, teacher_forced: bool = True, alias: bool = False) -> list[str]:
    """Every registered name, in table order; ``dense`` first when asked for; the alias ``kvpop`` only with
    ``alias`` (a command line's choices; a grid of every policy would run one learned policy twice)."""
    names = [n for n in POLICIES if (teacher_forced or n not in TEACHER_FORCED_ONLY) and (alias or n != ALIAS)]
    return [DENSE, *names] if dense else names


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Make a policy available by name."""
    if name == DENSE:
        raise ValueError(f"{DENSE!r} is reserved for no eviction")
    if name == ALIAS:
        raise ValueError(f"{ALIAS!r} is reserved for the model's default learned policy")
    POLICIES[name] = factory


def default_policy(model=None, config=None) -> str:
    """The model's default learned policy, which a cache uses when none is named and the alias ``kvpop``
    names: on a model loaded with an adapter bundle (``load_model(adapter=...)``, found through the model
    or its config) the learned policy its scorer serves (an mLSTM bundle: ``"kvpop-mlstm"``), else
    :data:`DEFAULT_POLICY`, the policy of the scorer kind shipped as the default (the MLP). So
    ``KVpopCache(adapted.config, budget=B)`` runs the bundle's scorer whichever kind it is; naming
    the other learned policy explicitly stays an error that says which one serves the bundle."""
    bundle = adapter_scorer(model, config)
    return DEFAULT_POLICY if bundle is None else KIND_TO_POLICY[bundle[1].config.kind]


def resolve_policy(policy: str | Policy | None, model=None, config=None, *, scorer=None, path=None):
    """``policy`` with the default resolved to a concrete learned policy: ``None`` -> :func:`default_policy`;
    the alias ``"kvpop"`` -> the policy of the scorer given (``scorer=`` an instance, ``path=`` a
    checkpoint, its kind read from the file), else :func:`default_policy`; any other name or a policy
    instance as it is."""
    if policy is None:
        return default_policy(model, config)
    if not isinstance(policy, str) or policy != ALIAS:
        return policy
    if scorer is not None:
        return KIND_TO_POLICY[scorer.config.kind]
    if path is not None:
        return policy_for_scorer(str(path))
    return default_policy(model, config)


def get_policy(policy: str | Policy, **kwargs) -> Policy:
    """A policy instance from a name or an instance; unknown names list the known ones."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy](**kwargs)


__all__ = [
    "ALIAS",
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
    "resolve_policy",
]
