"""Policies are frozen dataclasses, resolved once and shared; per-device kernels come from prepare()."""

import dataclasses
import json
import warnings
from types import SimpleNamespace

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
            random_learned_policy(model, "mlstm" if name == "kvpop-mlstm" else "mlp")
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


def test_kvpop_is_the_model_s_default_learned_policy(tmp_path):
    """``kvpop`` names the model's default learned policy (the shipped default kind, the MLP, for every embedded
    model; a bundle's scorer's on an adapted model; a given scorer's), resolved to a concrete name, so a cache,
    and a record, names the policy that ran; ``kvpop-mlstm`` is the mLSTM, ``kvpop-mlp`` the MLP."""
    from kvpop import KVpopCache, names
    from kvpop.checkpoint import DEFAULT_SCORERS, model_fingerprint, save_scorer
    from kvpop.policies import ALIAS, DEFAULT_POLICY, KIND_TO_POLICY, default_policy, resolve_policy
    from kvpop.testing import tiny_config

    assert ALIAS == "kvpop" and KIND_TO_POLICY == {"mlp": "kvpop-mlp", "mlstm": "kvpop-mlstm"}
    assert DEFAULT_POLICY == KIND_TO_POLICY[names.DEFAULT_KIND] == "kvpop-mlp"
    assert default_policy() == resolve_policy("kvpop") == resolve_policy(None) == "kvpop-mlp"
    assert all(resolve_policy(p) == p for p in ("kvpop-mlp", "kvpop-mlstm", "h2o"))
    # a model without an adapter bundle: the shipped default kind's policy, the MLP
    assert resolve_policy("kvpop", config=tiny_config("llama")) == "kvpop-mlp"
    assert DEFAULT_SCORERS[names.DEFAULT_KIND].name.endswith("-mlp.safetensors")
    # built by name: the concrete policy, its scorer of that kind
    model = tiny_model("llama", num_hidden_layers=2)
    for kind in ("mlp", "mlstm"):
        path = tmp_path / f"{kind}.safetensors"
        save_scorer(random_learned_policy(model, kind).scorer, path, {"fingerprint": model_fingerprint(model)})
        for name in (KIND_TO_POLICY[kind], "kvpop"):
            cache = KVpopCache(model.config, budget=16, policy=name, path=str(path))
            assert cache.policy.name == KIND_TO_POLICY[kind] and cache.policy.scorer.config.kind == kind, name
            assert get_policy(name, path=str(path)).name == KIND_TO_POLICY[kind]
        assert make_cache(model, "kvpop", budget=16, path=str(path)).policy.name == KIND_TO_POLICY[kind]
    with pytest.raises(ValueError, match="reserved"):
        from kvpop.policies import register_policy

        register_policy("kvpop", RandomPolicy)


def test_an_evaluation_asking_for_kvpop_records_the_concrete_policy(tmp_path):
    """The evaluations resolve ``kvpop`` before they run (records name ``kvpop-mlp`` / ``kvpop-mlstm``), and a
    folder made when ``kvpop`` was the mLSTM (its run.json records the mLSTM scorer's sha256 under ``kvpop``)
    is refused with the folder-mismatch error, not resumed under today's meaning."""
    from kvpop.checkpoint import DEFAULT_SCORERS, model_fingerprint, save_scorer
    from kvpop.evaluate.core import concrete_policies
    from kvpop.evaluate.harness import content_kwargs, file_sha256
    from kvpop.evaluate.store import StoreMismatch, check_fingerprint
    from kvpop.testing import embedded_config

    model = tiny_model("llama", num_hidden_layers=2)
    assert concrete_policies(model, ("dense", "kvpop", "kvpop-mlp")) == (("dense", "kvpop-mlp"), {})
    path = tmp_path / "s.safetensors"
    save_scorer(random_learned_policy(model, "mlstm").scorer, path, {"fingerprint": model_fingerprint(model)})
    given = {"kvpop-mlstm": {"path": str(path)}}  # --scorer: kvpop is the policy of the one scorer given
    assert concrete_policies(model, ("kvpop",), given) == (("kvpop-mlstm",), given)
    own = {"kvpop": {"path": str(path)}}
    assert concrete_policies(model, ("kvpop", "h2o"), own) == (("kvpop-mlstm", "h2o"), given)
    # the fingerprint: today's kvpop is the MLP; a folder from before the rename recorded the mLSTM's file
    # (the default model's shipped scorers: a model of its shape reads them)
    now = content_kwargs(SimpleNamespace(config=embedded_config("smollm2-135m-instruct")), None)
    mlp, mlstm = (file_sha256(DEFAULT_SCORERS[k]) for k in ("mlp", "mlstm"))
    assert now["kvpop"] == now["kvpop-mlp"] == {"sha256": mlp} and now["kvpop-mlstm"] == {"sha256": mlstm}
    old = {"kvpop": {"sha256": mlstm}, "kvpop-mlp": {"sha256": mlp}}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run.json").write_text(json.dumps({"fingerprint": {"policy_kwargs": old}}))
    with pytest.raises(StoreMismatch, match="of policy kvpop: sha256"):
        check_fingerprint(tmp_path / "old", {"policy_kwargs": now})
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "run.json").write_text(json.dumps({"fingerprint": {"policy_kwargs": now}}))
    assert check_fingerprint(tmp_path / "new", {"policy_kwargs": now}) == {"policy_kwargs": now}
