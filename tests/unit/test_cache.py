"""The physical bounded cache: dense equality, masked-reference parity, chunked prefill, padding, errors."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from kvpop import KVpopCache
from kvpop.config import EvictionConfig
from kvpop.policies import POLICIES, LearnedPolicy, get_policy
from kvpop.testing import ARCHS, random_learned_policy, tiny_model
from kvpop.testing.reference import MaskedReference

warnings.filterwarnings("ignore", category=FutureWarning)
BASE_POLICIES = ["streaming", "tova", "h2o", "snapkv", "knorm", "random"]
# "+": position-free keys, observed-attention inputs (three observation windows) and a recency tilt
ALL_POLICIES = BASE_POLICIES + ["kvpop-mlstm", "kvpop-mlp", "kvpop-mlstm+", "kvpop-mlp+", "kvpop-mlpx"]


# bfloat16 (what the GPU bench runs) next to float32: (dtype, layers, tolerance). In bfloat16 one layer,
# so both paths see the same bfloat16 keys (a deeper layer's keys differ by rounding between the paths,
# which flips near-tied decisions of these random models), and a tolerance of 1e-2: 2-3 bfloat16 ulps of
# these logits, while one slot fewer moves them by more than 6e-2 (test_bfloat16_tolerance_catches_a_wrong_slot).
DTYPES = {"float32": (torch.float32, 2, 1e-4), "bfloat16": (torch.bfloat16, 1, 1e-2)}


def _policy(name, model):
    """A fresh policy instance; learned ones get a seeded random-init scorer for the tiny model."""
    if name.startswith("kvpop"):
        return random_learned_policy(
            model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith(("+", "x")), cross_heads=name.endswith("x")
        )
    return get_policy(name)


def _unique_ids(n, vocab=128, seed=0):
    # distinct tokens: with repeated tokens, layer-0 key norms tie exactly and float rounding
    # (batched vs single-token matmuls) may break those ties differently
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n].view(1, n)


@torch.no_grad()
def _dense_logits(model, ids, prefill):
    cache = DynamicCache(config=model.config)
    outs = [model(ids[:, :prefill], past_key_values=cache).logits]
    outs += [model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(outs, 1)


@torch.no_grad()
def _kvpop_logits(model, ids, cache, prefill, attention_mask=None):
    outs = [
        model(
            ids[:, :prefill],
            past_key_values=cache,
            attention_mask=None if attention_mask is None else attention_mask[:, :prefill],
        ).logits
    ]
    for i in range(prefill, ids.shape[1]):
        am = None if attention_mask is None else attention_mask[:, : i + 1]
        outs.append(model(ids[:, i : i + 1], past_key_values=cache, attention_mask=am).logits)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["knorm", "h2o"])
def test_budget_at_least_length_is_dense(arch, policy):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    ref = _dense_logits(model, ids, prefill=30)
    cache = KVpopCache(model.config, budget=48, window=8, sinks=2, policy=policy)
    out = _kvpop_logits(model, ids, cache, prefill=30)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_physical_cache_equals_masked_reference(policy, dtype):
    dt, layers, tol = DTYPES[dtype]
    model = tiny_model("llama", num_hidden_layers=layers, dtype=dt)
    ids = _unique_ids(120)
    cache = KVpopCache(model.config, budget=20, window=6, sinks=2, policy=_policy(policy, model))
    ref = MaskedReference(model, cache.eviction, _policy(policy, model))
    expected = ref.run(ids)
    got = _kvpop_logits(model, ids, cache, prefill=40)  # chunked prefill, then 80 decode steps
    assert got.dtype == dt and cache.layers[0].keys.dtype == dt
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    for layer in range(layers):
        held = cache.layers[layer].slot_index[0]
        for head in range(held.shape[0]):
            assert set(held[head][held[head] >= 0].tolist()) == ref.held(layer, head, ids.shape[1] - 1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_physical_equals_reference_long_decode(arch):
    model = tiny_model(arch, num_hidden_layers=2)
    ids = torch.cat([_unique_ids(128), _unique_ids(128, seed=1)], dim=1)[:, :250]
    cache = KVpopCache(model.config, budget=24, window=8, sinks=4, policy="random")
    ref = MaskedReference(model, cache.eviction, get_policy("random"))
    torch.testing.assert_close(_kvpop_logits(model, ids, cache, prefill=16), ref.run(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_prefill_equals_token_by_token(policy, chunk, dtype):
    dt, layers, tol = DTYPES[dtype]
    model = tiny_model("qwen2", num_hidden_layers=layers, dtype=dt)
    ids = _unique_ids(100)
    a = KVpopCache(model.config, budget=22, window=8, sinks=2, policy=_policy(policy, model), prefill_chunk=chunk)
    b = KVpopCache(model.config, budget=22, window=8, sinks=2, policy=_policy(policy, model))
    with torch.no_grad():
        la = model(ids, past_key_values=a).logits
        lb = torch.cat([model(ids[:, i : i + 1], past_key_values=b).logits for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    for layer_a, layer_b in zip(a.layers, b.layers):
        sa, _ = layer_a.slot_index.sort(-1)
        sb, _ = layer_b.slot_index.sort(-1)
        assert torch.equal(sa, sb)


def test_default_prefill_piece_is_at_most_256_and_exact():
    """Windows above 256 prefill in pieces of 256 (the fastest measured), smaller ones in one window;
    a long prompt prefilled that way holds what the whole-window pieces hold."""
    from kvpop.config import PREFILL_CHUNK, EvictionConfig

    assert EvictionConfig(window=8).chunk == 8
    assert EvictionConfig(window=1024).chunk == PREFILL_CHUNK == 256
    assert EvictionConfig(window=1024, prefill_chunk=1000).chunk == 1000
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.cat([_unique_ids(128, seed=i) for i in range(8)], dim=1)[:, :900]
    a = KVpopCache(model.config, budget=400, window=300, sinks=4, policy="h2o")
    b = KVpopCache(model.config, budget=400, window=300, sinks=4, policy="h2o", prefill_chunk=300)
    assert a.eviction.chunk == 256 and b.eviction.chunk == 300
    with torch.no_grad():
        la = model(ids, past_key_values=a).logits
        lb = model(ids, past_key_values=b).logits
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for layer_a, layer_b in zip(a.layers, b.layers):
        assert torch.equal(layer_a.slot_index.sort(-1).values, layer_b.slot_index.sort(-1).values)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "kvpop-mlstm+"])
def test_bfloat16_tolerance_catches_a_wrong_slot(policy):
    """The bfloat16 parity tolerance is not so loose that a wrong slot passes: a reference holding one
    slot fewer (one token per head not held from some step on) is far outside it."""
    dt, layers, tol = DTYPES["bfloat16"]
    model = tiny_model("llama", num_hidden_layers=layers, dtype=dt)
    ids = _unique_ids(120)
    cache = KVpopCache(model.config, budget=20, window=6, sinks=2, policy=_policy(policy, model))
    got = _kvpop_logits(model, ids, cache, prefill=40)
    ev = cache.eviction
    fewer = EvictionConfig(sinks=ev.sinks, window=ev.window - (ev.k == 0), k=max(0, ev.k - 1), lam=ev.lam)
    wrong = MaskedReference(model, fewer, _policy(policy, model)).run(ids)
    assert (got - wrong).abs().max().item() > 4 * tol


def test_cache_stays_at_budget():
    model = tiny_model("llama", num_hidden_layers=3)
    cache = KVpopCache(model.config, budget=16, window=4, sinks=2, policy="knorm")
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :50], past_key_values=cache)
        for i in range(50, 200):
            model(ids[:, i : i + 1], past_key_values=cache)
    assert cache.get_seq_length() == 200
    for layer in cache.layers:
        assert layer.keys.shape == (1, 2, 16, 16) and layer.values.shape == (1, 2, 16, 16)
        assert (layer.slot_index >= 0).all()  # every slot holds a token
        assert layer.slot_index.max() == 199
    assert cache.kv_bytes() == 3 * 2 * (1 * 2 * 16 * 16 * 4)


def test_generate_drop_in_and_positions_follow_seen_tokens():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    big = KVpopCache(model.config, budget=200, window=16, policy="knorm")
    out = model.generate(ids, past_key_values=big, max_new_tokens=40, do_sample=False)
    dense = model.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, dense)  # budget >= length: identical greedy tokens
    small = KVpopCache(model.config, budget=16, window=4, policy="knorm")
    out2 = model.generate(ids, past_key_values=small, max_new_tokens=40, do_sample=False)
    assert out2.shape == (1, 70)
    assert small.get_seq_length() == 69
    assert small.layers[0].slot_index.max() == 68


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["knorm", "h2o", "random", "kvpop-mlstm", "kvpop-mlstm+"])
def test_left_padded_batch_equals_rows_alone(policy, dtype):
    dt, layers, _ = DTYPES[dtype]
    model = tiny_model("llama", num_hidden_layers=layers, dtype=dt)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(1, 128, (1, 40), generator=g)
    b = torch.randint(1, 128, (1, 25), generator=g)
    pad = 0
    batch = torch.cat([a, torch.cat([torch.full((1, 15), pad), b], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :15] = 0
    kw = {"budget": 14, "window": 4, "sinks": 2}
    cb = KVpopCache(model.config, policy=_policy(policy, model), **kw)
    out = model.generate(
        batch, attention_mask=mask, past_key_values=cb, max_new_tokens=20, do_sample=False, pad_token_id=pad
    )
    for row, seq in ((0, a), (1, b)):
        ca = KVpopCache(model.config, policy=_policy(policy, model), **kw)
        alone = model.generate(seq, past_key_values=ca, max_new_tokens=20, do_sample=False, pad_token_id=pad)
        assert torch.equal(out[row, -20:], alone[0, -20:])
    # padding never occupies a slot
    assert cb.layers[0].slot_index[1].max() == 25 + 20 - 2


def test_bad_inputs_raise_before_work():
    """Budget arguments are checked whatever the policy (a heuristic here: no scorer fits a tiny model)."""
    cfg = tiny_model("llama").config
    with pytest.raises(ValueError, match="smaller than sinks \\+ window"):
        KVpopCache(cfg, budget=10, window=8, sinks=4, policy="streaming")
    with pytest.raises(ValueError, match="budget must be a positive int"):
        KVpopCache(cfg, budget=0, window=1, sinks=0, policy="streaming")
    with pytest.raises(ValueError, match="window must be"):
        KVpopCache(cfg, budget=64, window=0, policy="streaming")
    with pytest.raises(ValueError, match="sinks must be"):
        KVpopCache(cfg, budget=64, sinks=-1, policy="streaming")
    with pytest.raises(ValueError, match="compression must be in \\(0, 1\\)"):
        KVpopCache(cfg, compression=1.5, reference_length=4096, policy="streaming")
    with pytest.raises(ValueError, match="compression must be in \\(0, 1\\)"):
        KVpopCache(cfg, compression=0.0, reference_length=4096, policy="streaming")
    with pytest.raises(ValueError, match="reference_length"):
        KVpopCache(cfg, compression=0.5, policy="streaming")
    with pytest.raises(ValueError, match="exactly one of"):
        KVpopCache(cfg, budget=64, compression=0.5, reference_length=100, policy="streaming")
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies"):
        KVpopCache(cfg, budget=64, policy="nope")


def test_right_padding_is_refused():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    cache = KVpopCache(model.config, budget=16, window=4, policy="knorm")
    with pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=mask, past_key_values=cache)


def test_compression_resolves_budget():
    cfg = EvictionConfig.from_budget(compression=0.875, reference_length=4096)
    assert cfg.budget == 512 and cfg.window == 256 and cfg.sinks == 4 and cfg.k == 252
    assert abs(cfg.compression(4096) - 0.875) < 1e-9


def test_streaming_uses_whole_budget_as_window():
    cfg = tiny_model("llama").config
    cache = KVpopCache(cfg, budget=64, window=8, sinks=4, policy="streaming")
    assert cache.eviction.window == 60 and cache.eviction.k == 0 and cache.budget == 64


def test_policy_registry_names():
    assert set(BASE_POLICIES) <= set(POLICIES)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("mistral", {"sliding_window": 16}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
    ],
)
def test_models_whose_every_layer_slides_are_refused(arch, overrides):
    """A model whose every layer slides has a bounded cache already: refused, naming the field (hybrid
    models, with full-attention layers too, are tests/unit/test_hybrid.py's)."""
    model = tiny_model(arch, **overrides)
    ids = _unique_ids(40)
    with torch.no_grad():  # the window is real: 40 tokens > 16 change the dense result
        full = tiny_model(arch, **{**overrides, "sliding_window": None})
        assert not torch.allclose(model(ids).logits[:, -1], full(ids).logits[:, -1], atol=1e-4)
    with pytest.raises(ValueError, match=r"sliding_window=16 on all 2 layers"):
        KVpopCache(model.config, budget=64, window=8, policy="knorm")


def test_sliding_window_that_never_slides_is_full_attention():
    """Qwen2.5-style configs (use_sliding_window False) and a window >= max_position_embeddings never slide: the
    cache bounds every layer, and 40 tokens (more than the window of 16) are all held, as dense attention."""
    ids = _unique_ids(40)
    for model in (
        tiny_model("qwen2", sliding_window=16, use_sliding_window=False),
        tiny_model("mistral", sliding_window=4096),
    ):
        cache = KVpopCache(model.config, budget=64, policy="knorm")
        assert [type(layer).__name__ for layer in cache.layers] == ["KVpopLayer"] * model.config.num_hidden_layers
        with torch.no_grad():
            got, dense = model(ids, past_key_values=cache).logits, model(ids).logits
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
        for layer in cache.layers:
            for held in layer.slot_index[0]:
                assert sorted(held[held >= 0].tolist()) == list(range(40))


def test_learned_policy_defaults_to_its_trained_window_and_lam_and_warns_on_others():
    from kvpop.cache import ScorerSettingsWarning

    model = tiny_model("llama", num_hidden_layers=2)
    scorer = _policy("kvpop-mlp", model).scorer
    trained = {"budget_range": [24, 48], "window_fraction": 0.5, "lam": 0.01}
    pol = LearnedPolicy(scorer, trained_for=trained)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        c = KVpopCache(model.config, budget=24, policy=pol)
        assert (c.eviction.window, c.eviction.lam) == (12, 0.01)
        c = KVpopCache(model.config, budget=40, policy=pol)  # any budget in the range: the trained fraction
        assert c.eviction.window == 20
        c = KVpopCache(model.config, compression=0.5, reference_length=64, policy=pol)
        assert c.eviction.window == 16
    with pytest.warns(ScorerSettingsWarning, match="window 3 .*trained: 12"):
        KVpopCache(model.config, budget=24, window=3, policy=pol)
    with pytest.warns(ScorerSettingsWarning, match="lam 0 .*trained: 0.01"):
        KVpopCache(model.config, budget=24, lam=0.0, policy=pol)
    # outside the trained range: still the trained fraction, with a warning naming the range
    with pytest.warns(ScorerSettingsWarning, match="budget 64 .*trained over budgets 24..48") as rec:
        c = KVpopCache(model.config, budget=64, policy=pol)
    assert c.eviction.window == 32
    # the advice fits the cause: nothing to unset when only the budget is outside the range
    (msg,) = [str(w.message) for w in rec if w.category is ScorerSettingsWarning]
    assert (
        "leave window/lam unset" not in msg and "never saw a budget outside 24..48" in msg and "--budget-range" in msg
    )
    with pytest.warns(ScorerSettingsWarning, match="leave window/lam unset"):
        KVpopCache(model.config, budget=24, window=3, policy=pol)
    # heuristics: the library defaults (B / 2, lam 0)
    c = KVpopCache(model.config, budget=24, policy="h2o")
    assert (c.eviction.window, c.eviction.lam) == (12, 0.0)


def test_a_tilt_that_scales_with_the_budget_resolves_per_budget_and_warns_on_others():
    """A scorer trained with ``lam_scale`` (lam = lam_scale / B at each step's budget) gets that tilt at
    every budget through the one resolver, from a budget, a compression or k; a fixed lam the caller
    sets is compared with the trained tilt at that B."""
    from kvpop.cache import ScorerSettingsWarning
    from kvpop.config import TrainedSettings

    model = tiny_model("llama", num_hidden_layers=2)
    scorer = _policy("kvpop-mlp", model).scorer
    trained = {"budget_range": [24, 48], "window_fraction": 0.5, "lam": 0.0, "lam_scale": 0.48}
    t = TrainedSettings.from_meta(trained)
    assert t.lam_at(24) == pytest.approx(0.02) and t.lam_at(48) == pytest.approx(0.01)
    assert "lam 0.48 / B" in t.describe() and TrainedSettings.from_meta(t.to_meta()) == t
    pol = LearnedPolicy(scorer, trained_for=trained)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        assert KVpopCache(model.config, budget=24, policy=pol).eviction.lam == pytest.approx(0.02)
        assert KVpopCache(model.config, budget=48, policy=pol).eviction.lam == pytest.approx(0.01)
        c = KVpopCache(model.config, compression=0.5, reference_length=64, policy=pol)
        assert c.eviction.lam == pytest.approx(0.48 / 32)
        c = KVpopCache(model.config, k=14, window=16, policy=pol)  # B = 4 + 16 + 14 = 34, known after the split
        assert c.eviction.budget == 34 and c.eviction.lam == pytest.approx(0.48 / 34)
    with pytest.warns(ScorerSettingsWarning, match=r"lam 0.02 \(trained: 0.01 at B=48\)"):
        KVpopCache(model.config, budget=48, lam=0.02, policy=pol)
    # with a floor (lam and lam_scale both recorded): lam_scale / B until it falls below lam
    floored = {**trained, "lam": 0.015}
    t = TrainedSettings.from_meta(floored)
    assert t.lam_at(24) == pytest.approx(0.02) and t.lam_at(48) == pytest.approx(0.015)
    assert "lam max(0.015, 0.48 / B)" in t.describe()
    pol = LearnedPolicy(scorer, trained_for=floored)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        assert KVpopCache(model.config, budget=24, policy=pol).eviction.lam == pytest.approx(0.02)
        assert KVpopCache(model.config, budget=48, policy=pol).eviction.lam == pytest.approx(0.015)


def test_older_checkpoint_metadata_reads_as_a_range_and_a_fraction():
    """Shipped checkpoints list exact budgets and windows (``{"512": 256, "1024": 512}``, fraction null
    in the adapter bundle): they read as budgets 512..1024 at window B / 2, so B = 384 gets 192, not a
    fallback (the bug of issue #23: the bundle path resolved window 48 at B = 384)."""
    from kvpop.config import TrainedSettings

    old = {
        "budgets": [512, 1024],
        "window": None,
        "window_fraction": None,
        "windows": {"512": 256, "1024": 512},
        "sinks": 4,
        "lam": 0.0,
        "seq_len": 2048,
    }
    t = TrainedSettings.from_meta(old)
    assert t.budget_range == (512, 1024) and t.window_fraction == 0.5 and t.window is None
    assert [t.window_at(b) for b in (256, 384, 2048)] == [128, 192, 1024]
    fixed = TrainedSettings.from_meta({"budgets": [24, 32], "windows": {"24": 8, "32": 8}})
    assert fixed.window == 8 and fixed.window_at(100) == 8


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "knorm", "kvpop-mlstm", "kvpop-mlp+"])
def test_a_chunk_after_steady_decode_equals_masked_reference(policy):
    """The second turn of a chat that reuses the cache: prefill, decode into the steady state, then a
    multi-token chunk (longer than the window, so it is split), then decode again."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _unique_ids(120)
    cache = KVpopCache(model.config, budget=20, window=6, sinks=2, policy=_policy(policy, model))
    ref = MaskedReference(model, cache.eviction, _policy(policy, model))
    expected = ref.run(ids)
    with torch.no_grad():
        outs = [model(ids[:, :30], past_key_values=cache).logits]
        outs += [model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(30, 70)]
        assert cache.layers[0].min_real >= cache.budget  # the steady state was reached
        outs.append(model(ids[:, 70:85], past_key_values=cache).logits)  # the next turn: 15 tokens at once
        outs += [model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(85, 120)]
    torch.testing.assert_close(torch.cat(outs, 1), expected, rtol=1e-4, atol=1e-4)
    for layer in range(2):
        held = cache.layers[layer].slot_index[0]
        for head in range(held.shape[0]):
            assert set(held[head][held[head] >= 0].tolist()) == ref.held(layer, head, ids.shape[1] - 1)


@pytest.mark.parametrize("policy", ["knorm", "h2o", "random", "kvpop-mlstm+"])
def test_physical_cache_with_a_recency_tilt_equals_masked_reference(policy):
    """lam > 0 (priority r(t) + lam * t) through prefill chunks, the general decode and the steady step."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _unique_ids(120)
    cache = KVpopCache(model.config, budget=20, window=6, sinks=2, lam=0.05, policy=_policy(policy, model))
    assert cache.eviction.lam == 0.05
    ref = MaskedReference(model, cache.eviction, _policy(policy, model))
    expected = ref.run(ids)
    torch.testing.assert_close(_kvpop_logits(model, ids, cache, prefill=40), expected, rtol=1e-4, atol=1e-4)
    for layer in range(2):
        held = cache.layers[layer].slot_index[0]
        for head in range(held.shape[0]):
            assert set(held[head][held[head] >= 0].tolist()) == ref.held(layer, head, ids.shape[1] - 1)
    # the tilt changed the decisions (else this test would not test it)
    flat = KVpopCache(model.config, budget=20, window=6, sinks=2, lam=0.0, policy=_policy(policy, model))
    _kvpop_logits(model, ids, flat, prefill=40)
    assert not torch.equal(flat.layers[1].slot_index.sort(-1).values, cache.layers[1].slot_index.sort(-1).values)


@pytest.mark.parametrize("policy", ["h2o", "kvpop-mlstm+"])
def test_layer_state_moved_out_and_back_in_equals_the_layer(policy):
    """``KVpopLayer.unload`` / ``load`` (what a serving engine uses to keep each sequence's state in its
    own memory): taking every layer's state out, copying it and loading the copies back before each
    step changes nothing, and ``load`` takes the tensors themselves."""
    model = tiny_model()
    ids = _unique_ids(60)
    pol = _policy(policy, model)
    plain = KVpopCache(model.config, budget=24, window=8, policy=pol)
    moved = KVpopCache(model.config, budget=24, window=8, policy=pol)
    with torch.no_grad():
        want = _kvpop_logits(model, ids, plain, prefill=20)
        outs = [model(ids[:, :20], past_key_values=moved).logits]
        for i in range(20, ids.shape[1]):
            for layer in moved.layers:
                state = layer.unload()  # handed back, and the layer holds nothing any more
                assert not layer.is_initialized and layer.keys is None and layer.state is None
                copy = state.map_rows(lambda t, _: t.clone())
                layer.load(copy)
                assert layer.state is copy and layer.keys.data_ptr() == copy.k.data_ptr()
            outs.append(model(ids[:, i : i + 1], past_key_values=moved).logits)
    assert torch.equal(torch.cat(outs, 1), want)
    for a, b in zip(plain.layers, moved.layers):
        assert torch.equal(a.slot_index, b.slot_index)
