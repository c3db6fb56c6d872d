"""The physical bounded cache: dense equality, masked-reference parity, chunked prefill, padding, errors."""

import re
import warnings

import pytest
import torch
from transformers import DynamicCache

from kvpop import KVpopCache
from kvpop.config import EvictionConfig
from kvpop.policies import POLICIES, LearnedPolicy, get_policy
from kvpop.reference import MaskedReference
from kvpop.testing import ARCHS, random_learned_policy, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)
BASE_POLICIES = ["streaming", "tova", "h2o", "snapkv", "knorm", "random"]
# "+": position-free keys, observed-attention inputs (three observation windows) and a recency tilt
ALL_POLICIES = BASE_POLICIES + ["kvpop", "kvpop-mlp", "kvpop+", "kvpop-mlp+"]


def _policy(name, model):
    """A fresh policy instance; learned ones get a seeded random-init scorer for the tiny model."""
    if name.startswith("kvpop"):
        return random_learned_policy(model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith("+"))
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
    outs = [model(ids[:, :prefill], past_key_values=cache, attention_mask=None if attention_mask is None else attention_mask[:, :prefill]).logits]
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


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_physical_cache_equals_masked_reference(policy):
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _unique_ids(120)
    cache = KVpopCache(model.config, budget=20, window=6, sinks=2, policy=_policy(policy, model))
    ref = MaskedReference(model, cache.eviction, _policy(policy, model))
    expected = ref.run(ids)
    got = _kvpop_logits(model, ids, cache, prefill=40)  # chunked prefill, then 80 decode steps
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for layer in range(2):
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


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_prefill_equals_token_by_token(policy, chunk):
    model = tiny_model("qwen2")
    ids = _unique_ids(100)
    a = KVpopCache(model.config, budget=22, window=8, sinks=2, policy=_policy(policy, model), prefill_chunk=chunk)
    b = KVpopCache(model.config, budget=22, window=8, sinks=2, policy=_policy(policy, model))
    with torch.no_grad():
        la = model(ids, past_key_values=a).logits
        lb = torch.cat([model(ids[:, i : i + 1], past_key_values=b).logits for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    for layer_a, layer_b in zip(a.layers, b.layers):
        sa, _ = layer_a.slot_index.sort(-1)
        sb, _ = layer_b.slot_index.sort(-1)
        assert torch.equal(sa, sb)


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


@pytest.mark.parametrize("policy", ["knorm", "h2o", "random", "kvpop", "kvpop+"])
def test_left_padded_batch_equals_rows_alone(policy):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    a = torch.randint(1, 128, (1, 40), generator=g)
    b = torch.randint(1, 128, (1, 25), generator=g)
    pad = 0
    batch = torch.cat([a, torch.cat([torch.full((1, 15), pad), b], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :15] = 0
    kw = {"budget": 14, "window": 4, "sinks": 2}
    cb = KVpopCache(model.config, policy=_policy(policy, model), **kw)
    out = model.generate(batch, attention_mask=mask, past_key_values=cb, max_new_tokens=20, do_sample=False, pad_token_id=pad)
    for row, seq in ((0, a), (1, b)):
        ca = KVpopCache(model.config, policy=_policy(policy, model), **kw)
        alone = model.generate(seq, past_key_values=ca, max_new_tokens=20, do_sample=False, pad_token_id=pad)
        assert torch.equal(out[row, -20:], alone[0, -20:])
    # padding never occupies a slot
    assert cb.layers[0].slot_index[1].max() == 25 + 20 - 2


def test_bad_inputs_raise_before_work():
    cfg = tiny_model("llama").config
    with pytest.raises(ValueError, match="smaller than sinks \\+ window"):
        KVpopCache(cfg, budget=10, window=8, sinks=4)
    with pytest.raises(ValueError, match="budget must be a positive int"):
        KVpopCache(cfg, budget=0, window=1, sinks=0)
    with pytest.raises(ValueError, match="window must be"):
        KVpopCache(cfg, budget=64, window=0)
    with pytest.raises(ValueError, match="sinks must be"):
        KVpopCache(cfg, budget=64, sinks=-1)
    with pytest.raises(ValueError, match="compression must be in \\(0, 1\\)"):
        KVpopCache(cfg, compression=1.5, reference_length=4096)
    with pytest.raises(ValueError, match="compression must be in \\(0, 1\\)"):
        KVpopCache(cfg, compression=0.0, reference_length=4096)
    with pytest.raises(ValueError, match="reference_length"):
        KVpopCache(cfg, compression=0.5)
    with pytest.raises(ValueError, match="exactly one of"):
        KVpopCache(cfg, budget=64, compression=0.5, reference_length=100)
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
    assert cfg.budget == 512 and cfg.window == 64 and cfg.sinks == 4 and cfg.k == 444
    assert abs(cfg.compression(4096) - 0.875) < 1e-9


def test_streaming_uses_whole_budget_as_window():
    cfg = tiny_model("llama").config
    cache = KVpopCache(cfg, budget=64, window=8, sinks=4, policy="streaming")
    assert cache.eviction.window == 60 and cache.eviction.k == 0 and cache.budget == 64


def test_policy_registry_names():
    assert set(BASE_POLICIES) <= set(POLICIES)


@pytest.mark.parametrize(
    "arch,overrides,layers",
    [
        ("mistral", {"sliding_window": 16}, "[0, 1]"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "[1]"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "[0, 1]"),
    ],
)
def test_sliding_window_models_are_refused(arch, overrides, layers):
    """Decision: refuse (not honour) a sliding-window config, naming the field and the layers."""
    model = tiny_model(arch, **overrides)
    ids = _unique_ids(40)
    with torch.no_grad():  # the window is real: 40 tokens > 16 change the dense result
        full = tiny_model(arch, **{**overrides, "sliding_window": None})
        assert not torch.allclose(model(ids).logits[:, -1], full(ids).logits[:, -1], atol=1e-4)
    with pytest.raises(ValueError, match=rf"sliding_window=16, used by layers {re.escape(layers)}"):
        KVpopCache(model.config, budget=64, window=8, policy="knorm")


def test_sliding_window_that_never_slides_is_full_attention():
    # Qwen2.5-style configs: use_sliding_window False (or a window >= max_position_embeddings)
    KVpopCache(tiny_model("qwen2", sliding_window=16, use_sliding_window=False).config, budget=64, policy="knorm")
    KVpopCache(tiny_model("mistral", sliding_window=4096).config, budget=64, policy="knorm")


def test_learned_policy_defaults_to_its_trained_window_and_lam_and_warns_on_others():
    from kvpop.cache import ScorerSettingsWarning

    model = tiny_model("llama", num_hidden_layers=2)
    scorer = _policy("kvpop-mlp", model).scorer
    trained = {"budgets": [24], "window": None, "window_fraction": 0.5, "windows": {"24": 12}, "lam": 0.01}
    pol = LearnedPolicy(scorer, trained_for=trained)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        c = KVpopCache(model.config, budget=24, policy=pol)
        assert (c.eviction.window, c.eviction.lam) == (12, 0.01)
        c = KVpopCache(model.config, budget=40, policy=pol)  # another budget: the trained window fraction
        assert c.eviction.window == 20
        c = KVpopCache(model.config, compression=0.5, reference_length=64, policy=pol)
        assert c.eviction.window == 16
    with pytest.warns(ScorerSettingsWarning, match="window 3 .*trained: 12"):
        KVpopCache(model.config, budget=24, window=3, policy=pol)
    with pytest.warns(ScorerSettingsWarning, match="lam 0.0 .*trained: 0.01"):
        KVpopCache(model.config, budget=24, lam=0.0, policy=pol)
    # heuristics keep the library defaults (B // 8, lam 0)
    c = KVpopCache(model.config, budget=24, policy="h2o")
    assert (c.eviction.window, c.eviction.lam) == (3, 0.0)


@pytest.mark.parametrize("policy", ["h2o", "kvpop+"])
def test_layer_state_moved_out_and_back_in_equals_the_layer(policy):
    """``KVpopLayer.buffers`` / ``unload`` / ``load`` (what a serving engine uses to keep each
    sequence's state in its own memory): taking every layer's state out, copying it and loading the
    copies back before each step changes nothing, and ``load`` takes the tensors themselves."""
    from dataclasses import fields

    from kvpop.cache import LayerBuffers
    from kvpop.policies import map_state

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
                assert layer.buffers().keys is layer.buffers().keys  # the tensors themselves, not copies
                buf = layer.unload()  # handed back, and the layer holds nothing any more
                assert not layer.is_initialized and layer.keys is None and layer.policy_state is None
                copy = LayerBuffers(*(map_state(getattr(buf, f.name), torch.clone) for f in fields(LayerBuffers)))
                layer.load(copy)
                assert layer.buffers().keys is copy.keys and layer.buffers().policy_state is copy.policy_state
            outs.append(model(ids[:, i : i + 1], past_key_values=moved).logits)
    assert torch.equal(torch.cat(outs, 1), want)
    for a, b in zip(plain.layers, moved.layers):
        assert torch.equal(a.slot_index, b.slot_index)
