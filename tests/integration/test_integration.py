"""A few checks on the embedded real model (SmolLM2-135M-Instruct)."""

import warnings

import pytest
import torch
from transformers import DynamicCache

import kvpop

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def real():
    try:
        return kvpop.load_model(progress=False)
    except kvpop.ModelLoadError as exc:  # the model package is part of the setup; say so loudly
        pytest.fail(f"embedded model unavailable: {exc}")


def test_real_model_budget_at_least_length_equals_dense(real):
    model, tok = real
    ids = tok("The quick brown fox jumps over the lazy dog. " * 6, return_tensors="pt").input_ids[:, :64]
    with torch.no_grad():
        dense = model(ids[:, :48], past_key_values=DynamicCache(config=model.config)).logits
        cache = kvpop.KVpopCache(model.config, budget=80, window=16, policy="knorm")
        got = model(ids[:, :48], past_key_values=cache).logits
        step = model(ids[:, 48:49], past_key_values=cache).logits
        dcache = DynamicCache(config=model.config)
        model(ids[:, :48], past_key_values=dcache)
        dstep = model(ids[:, 48:49], past_key_values=dcache).logits
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, dstep, rtol=1e-4, atol=1e-4)


def test_real_model_generate_bounded(real):
    model, tok = real
    res = kvpop.generate(model, tok, "The capital of France is", policy="knorm", budget=24, window=8, max_new_tokens=30)
    assert res.new_tokens == 30 and res.text.strip()
    assert res.kv_bytes == kvpop.kv_bytes_per_token(model.config) * 24
    assert res.kv_bytes < res.dense_kv_bytes


def test_shipped_scorers_fit_the_embedded_model_and_are_the_default(real):
    model, tok = real
    for name in ("kvpop-mlstm", "kvpop-mlp"):  # old-format fingerprints: config part and weight hash both pass
        kvpop.KVpopCache(model.config, budget=64, policy=name)
        kvpop.make_cache(model, name, budget=64)
    res = kvpop.generate(model, tok, "The capital of France is", budget=24, window=8, max_new_tokens=6)
    assert res.cache.policy.name == kvpop.DEFAULT_POLICY == "kvpop-mlp" and res.new_tokens >= 1
    assert res.kv_bytes == kvpop.kv_bytes_per_token(model.config) * 24


def test_shipped_scorers_and_adapter_fit_the_embedded_model_in_bfloat16(real):
    """Loaded in bfloat16 (the usual GPU dtype) it is the same model: the shipped scorers' and the
    shipped adapter bundle's weight checks pass (the bfloat16 weight hash)."""
    from kvpop.checkpoint import model_fingerprint

    model, _ = real
    half = kvpop.load_model(dtype=torch.bfloat16, progress=False)[0]
    fp, fp_half = model_fingerprint(model), model_fingerprint(half)
    assert fp["weights_sha256"] != fp_half["weights_sha256"]
    assert fp["weights_bf16_sha256"] == fp_half["weights_bf16_sha256"]
    assert fp["weights_sampled_bf16_sha256"] == fp_half["weights_sampled_bf16_sha256"]
    # the shipped files record the every-layer hash too (metadata added by scripts/refresh_fingerprints.py)
    from kvpop.bundle import read_bundle_meta
    from kvpop.checkpoint import DEFAULT_ADAPTER, DEFAULT_SCORERS, read_header

    for path in DEFAULT_SCORERS.values():
        assert (
            read_header(path)["meta"]["fingerprint"]["weights_sampled_bf16_sha256"] == fp["weights_sampled_bf16_sha256"]
        )
    assert (
        read_bundle_meta(DEFAULT_ADAPTER)["fingerprint"]["weights_sampled_bf16_sha256"]
        == fp["weights_sampled_bf16_sha256"]
    )
    for name in ("kvpop-mlstm", "kvpop-mlp"):
        kvpop.make_cache(half, name, budget=64)
    adapted, _ = kvpop.load_model(adapter="default", dtype=torch.bfloat16, progress=False)
    assert adapted.kvpop_adapter.scorer is not None and next(adapted.parameters()).dtype == torch.bfloat16


def test_shipped_scorers_default_to_their_trained_window(real):
    """Both shipped scorers were trained over 128..2,048 with window B/2 and lam 5e-4 (the mLSTM since
    4 December 2026; before, at B = 512 and 1,024 with lam 0): a cache at a budget inside that range uses
    that window and lam by default, and says nothing."""
    from kvpop.config import ScorerSettingsWarning

    model, _ = real
    for name, budgets, lam in (
        ("kvpop-mlstm", (128, 384, 512, 2048), 5e-4),
        ("kvpop-mlp", (128, 384, 512, 2048), 5e-4),
    ):
        for budget in budgets:
            with warnings.catch_warnings():
                warnings.simplefilter("error", ScorerSettingsWarning)
                cache = kvpop.KVpopCache(model.config, budget=budget, policy=name)
            assert cache.eviction.window == budget // 2 and cache.eviction.lam == lam, (name, budget)


def test_shipped_adapter_loads_onto_the_embedded_model_and_serves_its_policy(real):
    """load_model(adapter="default"): the shipped LoRA bundle; its scorer serves the model's default
    policy (the one its kind names: kvpop-mlp for the MLP bundle shipped since December 2026);
    the adapted model is a slightly different model; the adapter off gives the base model back."""
    from kvpop.bundle import teacher_mode
    from kvpop.policies import KIND_TO_POLICY

    base, tok = real
    model, _ = kvpop.load_model(adapter="default", progress=False)
    assert model.kvpop_adapter.scorer is not None
    policy = kvpop.default_policy(model)
    assert policy == KIND_TO_POLICY[model.kvpop_adapter.scorer.config.kind]
    for cache in (kvpop.make_cache(model, budget=512), kvpop.make_cache(model, policy, budget=512)):
        assert "adapter bundle" in cache.policy.source and cache.eviction.window == 256
    ids = tok("The quick brown fox jumps over the lazy dog. " * 6, return_tensors="pt").input_ids[:, :48]
    with torch.no_grad():
        want = base(ids).logits
        got = model(ids).logits
        assert 0 < (got - want).abs().max() < 5
        with teacher_mode(model):
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_one_resolver_for_base_and_adapted_model_config_and_model(real):
    """Issue #23: every path that builds a cache gets the same split at every budget — the base model and
    the adapted bundle, through ``KVpopCache(model.config)`` and ``make_cache(model)`` — the trained window
    fraction of B (the bundle path used to fall back to B // 8 at budgets it was not trained at exactly)
    and the scorer's own trained lam, and the config and model paths of one model take the same decisions.
    With no policy named, each model gets its default: the shipped MLP on the base model, the bundle's
    scorer on the adapted one. Every budget here is inside the trained range (128..2,048), so no
    ``ScorerSettingsWarning`` may be raised."""
    from kvpop.config import ScorerSettingsWarning

    base, tok = real
    adapted, _ = kvpop.load_model(adapter="default", merge=True, progress=False)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 80, return_tensors="pt").input_ids[:, :700]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        for budget in (256, 384, 512, 768, 2048):
            for model, bundle in ((base, False), (adapted, True)):
                by_config = kvpop.KVpopCache(model.config, budget=budget)
                by_model = kvpop.make_cache(model, budget=budget)
                splits = set()
                for cache in (by_config, by_model):
                    assert ("adapter bundle" in cache.policy.source) == bundle
                    if bundle:  # the bundle's scorer (the config path reads it from the bundle's folder)
                        want = adapted.kvpop_adapter.scorer.state_dict()
                        got = cache.policy.scorer.state_dict()
                        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
                    e = cache.eviction
                    splits.add((e.sinks, e.window, e.k, e.lam))
                lam = cache.policy.trained.lam  # the scorer's own (mLSTM 0, the shipped MLP 5e-4)
                assert len(splits) == 1, (budget, bundle, splits)
                sinks, window, k, got_lam = splits.pop()
                assert (sinks, window, k) == (4, budget // 2, budget - 4 - budget // 2), (budget, bundle)
                assert got_lam == lam, (budget, bundle, got_lam, lam)
                if budget <= 384:  # the same decisions through the config and the model
                    with torch.no_grad():
                        model(ids, past_key_values=by_config)
                        model(ids, past_key_values=by_model)
                    for a, b in zip(by_config.layers, by_model.layers, strict=True):
                        assert torch.equal(a.held_indices(), b.held_indices())


def test_generate_cli_resolves_the_bundle_window_at_any_budget(capsys):
    from kvpop.cli import main

    assert main(["generate", "--prompt", "The capital of France is", "--budget", "384", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "adapter bundle" in err and "window=192" in err and "budget=384" in err
