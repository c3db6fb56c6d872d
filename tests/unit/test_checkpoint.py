"""Scorer checkpoints meet models: config fingerprint always, weight hash when the model is at hand."""

import copy
import warnings

import pytest
import torch

from kvpop import KVpopCache, get_policy
from kvpop.checkpoint import (
    ScorerMismatchError,
    config_fingerprint,
    load_scorer,
    model_fingerprint,
    save_scorer,
)
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import tiny_config, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)
KW = {"budget": 16, "window": 4, "sinks": 2}


def _scorer_for(model, path, fingerprint=None, kind="mlp"):
    cfg = ScorerConfig(kind=kind, num_layers=2, kv_heads=2, head_dim=16)
    fp = model_fingerprint(model) if fingerprint is None else fingerprint
    return save_scorer(build_scorer(cfg), path, {"fingerprint": fp})


def test_config_fingerprint_fields():
    fp = config_fingerprint(tiny_config("qwen3", num_hidden_layers=3))
    assert fp == {
        "model_type": "qwen3",
        "num_layers": 3,
        "q_heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "vocab_size": 128,
        "rope": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    assert set(model_fingerprint(tiny_model("qwen3"))) == set(fp) | {
        "weights_sha256",
        "weights_bf16_sha256",
        "weights_sampled_bf16_sha256",
    }


def test_config_fingerprint_checked_without_the_model(tmp_path):
    """KVpopCache(config, policy=...) has no weights to hash; the config part is still checked."""
    model = tiny_model("llama")
    path = _scorer_for(model, tmp_path / "s.safetensors")
    pol = get_policy("kvpop-mlp", path=path)
    KVpopCache(model.config, policy=pol, **KW)  # the model it was trained for
    other_rope = tiny_config("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(ScorerMismatchError, match="rope: trained"):
        KVpopCache(other_rope, policy=pol, **KW)
    with pytest.raises(ScorerMismatchError, match="vocab_size: trained 128 vs this model 256"):
        KVpopCache(tiny_config("llama", vocab_size=256), policy="kvpop-mlp", path=path, **KW)
    with pytest.raises(ScorerMismatchError, match="model_type: trained 'llama' vs this model 'qwen2'"):
        KVpopCache(tiny_config("qwen2"), policy=pol, **KW)


def test_weights_checked_when_the_model_is_given(tmp_path):
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    path = _scorer_for(model, tmp_path / "s.safetensors")
    KVpopCache(model.config, policy="kvpop-mlp", path=path, model=model, **KW)
    KVpopCache(other.config, policy="kvpop-mlp", path=path, **KW)  # same config: only the weights differ
    with pytest.raises(ScorerMismatchError, match="weights_sha256"):
        KVpopCache(other.config, policy="kvpop-mlp", path=path, model=other, **KW)
    with pytest.raises(ScorerMismatchError, match="different model"):
        load_scorer(path, model=other)


def test_weights_hash_does_not_depend_on_the_dtype(tmp_path):
    """A scorer trained on a float32 model fits the same model loaded in bfloat16 (as on a GPU):
    the bfloat16 weight hash stands for the weights; another model's weights still fail."""
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    path = _scorer_for(model, tmp_path / "s.safetensors")
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert model_fingerprint(half)["weights_sha256"] != model_fingerprint(model)["weights_sha256"]
    KVpopCache(half.config, policy="kvpop-mlp", path=path, model=half, **KW)
    with pytest.raises(ScorerMismatchError, match="weights_bf16_sha256"):
        KVpopCache(other.config, policy="kvpop-mlp", path=path, model=other.to(torch.bfloat16), **KW)
    # a checkpoint from before the bfloat16 hash: only the float32 hash, so only a float32 model fits
    old = {
        k: v
        for k, v in model_fingerprint(model).items()
        if k not in ("weights_bf16_sha256", "weights_sampled_bf16_sha256")
    }
    old_path = _scorer_for(model, tmp_path / "old.safetensors", fingerprint=old)
    KVpopCache(model.config, policy="kvpop-mlp", path=old_path, model=model, **KW)
    with pytest.raises(ScorerMismatchError, match="weights_sha256"):
        KVpopCache(half.config, policy="kvpop-mlp", path=old_path, model=half, **KW)


def test_old_checkpoint_fingerprint_missing_fields_are_not_a_mismatch(tmp_path):
    """Shipped checkpoints record only architecture, layers, KV heads, head dim and the weight hash."""
    model = tiny_model("llama")
    old = {
        k: v
        for k, v in model_fingerprint(model).items()
        if k in ("model_type", "num_layers", "kv_heads", "head_dim", "weights_sha256")
    }
    path = _scorer_for(model, tmp_path / "old.safetensors", fingerprint=old)
    KVpopCache(tiny_config("llama", vocab_size=256), policy="kvpop-mlp", path=path, **KW)  # vocab not recorded
    KVpopCache(model.config, policy="kvpop-mlp", path=path, model=model, **KW)
    with pytest.raises(ScorerMismatchError, match="num_layers: trained 2 vs this model 3"):
        KVpopCache(tiny_config("llama", num_hidden_layers=3), policy="kvpop-mlp", path=path, **KW)


@pytest.mark.parametrize("name", ["kvpop-mlstm", "kvpop-mlp"])
def test_shipped_scorer_refuses_a_tiny_model(name):
    with pytest.raises(ScorerMismatchError, match=r"no shipped mls?t?m?p? scorer fits this model.*2 layers"):
        KVpopCache(tiny_model("llama").config, policy=name, **KW)


def test_default_policy_is_the_shipped_scorer_and_refuses_a_tiny_model():
    """KVpopCache, make_cache and kvpop.generate default to policy "kvpop-mlp" (the shipped MLP, trained
    over the budget range); on a model it was not
    trained for that is a clear error before any work."""
    import kvpop
    from kvpop.testing import tiny_tokenizer

    model = tiny_model("qwen2")
    for build in (
        lambda: KVpopCache(model.config, **KW),
        lambda: kvpop.make_cache(model, **KW),
        lambda: kvpop.generate(model, tiny_tokenizer(), "hello", max_new_tokens=2, **KW),
    ):
        with warnings.catch_warnings():  # the mismatch alone: no warning about the settings of a scorer that cannot run
            warnings.simplefilter("error")
            with pytest.raises(
                ScorerMismatchError,
                match=r"smollm2-135m-instruct-mlp\) were trained for a different model \(this one: qwen2",
            ):
                build()
    assert kvpop.DEFAULT_POLICY == "kvpop-mlp"


def test_scorer_without_fingerprint_still_checks_shapes():
    cfg = ScorerConfig(kind="mlstm", num_layers=3, kv_heads=2, head_dim=16)
    from kvpop.policies import LearnedPolicy

    with pytest.raises(ScorerMismatchError, match="built for 3 layers"):
        KVpopCache(tiny_config("llama"), policy=LearnedPolicy(build_scorer(cfg)), **KW)


def test_make_cache_checks_the_weights_of_the_model_it_is_given(tmp_path):
    from kvpop import make_cache

    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    path = _scorer_for(model, tmp_path / "s.safetensors")
    assert make_cache(model, "dense", budget=16) is None
    assert make_cache(model, "kvpop-mlp", path=path, **KW).budget == 16
    with pytest.raises(ScorerMismatchError, match="weights_sha256"):
        make_cache(other, "kvpop-mlp", path=path, **KW)


def test_the_shipped_scorer_is_chosen_by_the_model(monkeypatch, tmp_path):
    """Each shipped scorer serves the model whose config fingerprint it records; none fitting is one clear error."""
    from kvpop import checkpoint

    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    monkeypatch.setattr(checkpoint, "ASSETS", tmp_path)
    _scorer_for(llama, tmp_path / "tiny-llama-mlp.safetensors")
    _scorer_for(qwen, tmp_path / "tiny-qwen2-mlp.safetensors")
    assert checkpoint.default_scorer_path("mlp", llama.config).name == "tiny-llama-mlp.safetensors"
    assert checkpoint.default_scorer_path("mlp", qwen.config).name == "tiny-qwen2-mlp.safetensors"
    policy = get_policy("kvpop-mlp", model=qwen)
    assert policy.source.endswith("tiny-qwen2-mlp.safetensors")
    with pytest.raises(ScorerMismatchError, match="no shipped mlstm scorer fits this model"):
        checkpoint.default_scorer_path("mlstm", qwen.config)
    with pytest.raises(ScorerMismatchError, match=r"tiny-llama-mlp, tiny-qwen2-mlp\) were trained for a different"):
        checkpoint.default_scorer_path("mlp", tiny_config("qwen3"))


def test_a_budget_outside_the_default_scorers_range_reads_the_shipped_scorer_trained_for_it(monkeypatch, tmp_path):
    """A scorer shipped beside a model's default for other budgets (``<model>-<kind>-b<lo>-<hi>``) serves the
    budgets outside the default's training range, however the cache's budget is stated and whichever way
    the cache is made; inside that range, or with no budget, the default serves."""
    from kvpop import checkpoint, make_cache
    from kvpop.config import ScorerSettingsWarning
    from kvpop.evaluate.grid import Settings
    from kvpop.evaluate.harness import file_sha256, shipped_scorers_sha256

    qwen, llama = tiny_model("qwen2"), tiny_model("llama")
    monkeypatch.setattr(checkpoint, "ASSETS", tmp_path)

    def ship(name, model, budget_range, seed):
        torch.manual_seed(seed)
        trained = {"budget_range": list(budget_range), "window_fraction": 0.5, "lam": 0.0}
        meta = {"fingerprint": model_fingerprint(model), "trained_for": trained}
        cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16)
        return save_scorer(build_scorer(cfg), tmp_path / f"{name}.safetensors", meta)

    main = ship("tiny-qwen2-mlp", qwen, (64, 4096), 0)
    assert shipped_scorers_sha256(qwen.config, "mlp") == file_sha256(main)  # one file: its own sha256
    small = ship("tiny-qwen2-mlp-b24-48", qwen, (24, 48), 1)
    ship("tiny-llama-mlp", llama, (8, 4096), 2)
    ship("tiny-llama-mlp-b8-16", llama, (8, 16), 3)  # another model's: never Qwen's
    assert checkpoint.shipped_scorers("mlp", qwen.config) == [main, small]
    for budget, want in ((None, main), (64, main), (100, main), (5000, main), (48, small), (24, small), (12, small)):
        assert checkpoint.default_scorer_path("mlp", qwen.config, budget=budget) == want, budget
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at B = 32 the default would warn: it never saw a budget below 64
        caches = [
            make_cache(qwen, "kvpop-mlp", budget=32),
            make_cache(qwen, "kvpop", budget=32),
            KVpopCache(qwen.config, budget=32, policy="kvpop-mlp"),
            KVpopCache(qwen.config, compression=0.75, reference_length=128, policy="kvpop-mlp"),
            KVpopCache(qwen.config, k=12, window=16, policy="kvpop-mlp"),
        ]
    assert [c.budget for c in caches] == [32] * 5
    assert {c.policy.source for c in caches} == {str(small)}
    assert make_cache(qwen, "kvpop-mlp", budget=100).policy.source == str(main)
    with pytest.warns(ScorerSettingsWarning, match="not trained for budget 32"):  # a file given: that file
        assert make_cache(qwen, "kvpop-mlp", budget=32, path=main).policy.source == str(main)
    # the vLLM plugin builds its cache from its settings: the same pick
    from kvpop.serving.vllm.settings import ServeSettings

    served = ServeSettings.from_additional_config({"kvpop": {"budget": 32}}).build_cache(qwen.config)
    assert served.policy.source == str(small)
    # the evaluation resolves a policy per budget, and fingerprints the whole set
    settings = Settings()
    assert settings.policy(qwen, "kvpop-mlp", 32).source == str(small)
    assert settings.policy(qwen, "kvpop-mlp", 100).source == str(main)
    assert shipped_scorers_sha256(qwen.config, "mlp") not in (file_sha256(main), file_sha256(small), None)
