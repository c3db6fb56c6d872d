"""Policies are frozen dataclasses, resolved once and shared; per-device kernels come from prepare()."""

import dataclasses
import warnings

import pytest
import torch

from kvpop import make_cache
from kvpop.compat import cache_kwargs
from kvpop.policies import POLICIES, LearnedPolicy, PolicyKernels, RandomPolicy, get_policy
from kvpop.testing import random_learned_policy, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)


def test_every_builtin_policy_is_a_frozen_dataclass():
    model = tiny_model("llama", num_hidden_layers=2)
    for name in POLICIES:
        kw = {"targets": [torch.zeros(1, 2, 8)] * 2} if name == "oracle" else {}
        policy = (
            random_learned_policy(model, "mlp" if name == "kvpop-mlp" else "mlstm")
            if name.startswith("kvpop")
            else get_policy(name, **kw)
        )
        assert dataclasses.is_dataclass(policy), name
        field = next((f.name for f in dataclasses.fields(policy)), "obs_window")
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(policy, field, None)


def test_a_resolved_policy_is_reused_without_loading_or_hashing(monkeypatch):
    """The evaluation resolves a policy once and builds a cache per unit: with the instance, building a
    cache reads no checkpoint and hashes no weights, and the kernels are the cache's, not the policy's."""
    model = tiny_model("llama", num_hidden_layers=2)
    policy = random_learned_policy(model, extra=True)

    def refuse(*args, **kwargs):
        raise AssertionError("no checkpoint I/O or weight hashing when a policy instance is reused")

    import kvpop.checkpoint

    monkeypatch.setattr(kvpop.checkpoint, "load_scorer", refuse)
    monkeypatch.setattr(kvpop.checkpoint, "model_fingerprint", refuse)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = [make_cache(model, policy, budget=20, window=6, sinks=2) for _ in range(3)]
    with torch.no_grad():
        for cache in caches:
            model(ids, **cache_kwargs(cache))
    kernels = [c.prepared.on(torch.device("cpu")) for c in caches]
    assert all(isinstance(k, PolicyKernels) for k in kernels) and len({id(k) for k in kernels}) == 3
    assert kernels[0].scorer is policy.scorer  # on its own device: the scorer itself, no copy
    assert not any(k.startswith("_kernels") for k in vars(policy))  # nothing per cache is kept in the policy


def test_policy_kernels_keep_each_layers_steady_score():
    """A compiled cache binds the steady score function and its constants: the same objects each step."""
    kernels = RandomPolicy(5).prepare(torch.device("cpu"))
    first = kernels.steady_score(1)
    assert first is not None and kernels.steady_score(1) is first
    assert kernels.steady_score(0) is not first
    assert isinstance(random_learned_policy(tiny_model("llama", num_hidden_layers=1)), LearnedPolicy)
