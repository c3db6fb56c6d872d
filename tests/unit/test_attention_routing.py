"""Creating a KVpopCache routes the model's attention through kvpop; for any other cache that
routing is a no-op: bit-identical logits and generations, during and after the kvpop cache."""

import gc
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

import kvpop
from kvpop import KVpopCache
from kvpop.testing import tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)


@torch.no_grad()
def _behaviour(model):
    """Logits and greedy tokens under no cache, DynamicCache and StaticCache (prefill + decode), padded batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    out = {"none": model(ids, attention_mask=mask, use_cache=False).logits}
    for name, make in (
        ("dynamic", lambda: DynamicCache(config=model.config)),
        ("static", lambda: StaticCache(config=model.config, max_cache_len=64)),
    ):
        cache = make()
        logits = [model(ids[:, :16], attention_mask=mask[:, :16], past_key_values=cache).logits]
        for i in range(16, 24):
            logits.append(model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], past_key_values=cache).logits)
        out[name] = torch.cat(logits, 1)
    out["generate"] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out["generate_static"] = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static"
    )
    return out


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen3", "eager")])
def test_other_caches_behave_exactly_as_before(arch, attn):
    model = tiny_model(arch, attn_implementation=attn)
    before = _behaviour(model)
    cache = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")
    assert model.config._attn_implementation == "kvpop"  # the documented routing
    during = _behaviour(model)  # the kvpop cache exists but is not used
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 30)), past_key_values=cache)
    del cache
    gc.collect()
    after = _behaviour(model)
    for name in before:
        assert torch.equal(before[name], during[name]), name
        assert torch.equal(before[name], after[name]), name
    kvpop.detach(model.config)  # restores the implementation's name too
    assert model.config._attn_implementation == attn
    restored = _behaviour(model)
    for name in before:
        assert torch.equal(before[name], restored[name]), name


def test_a_detached_model_refuses_its_old_kvpop_cache():
    model = tiny_model("llama")
    cache = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")
    kvpop.detach(model.config)
    with pytest.raises(RuntimeError, match="kvpop.detach was called after this cache was created"), torch.no_grad():
        model(torch.randint(3, 128, (1, 8)), past_key_values=cache)
    fresh = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")  # routes again
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 20)), past_key_values=fresh)
    assert fresh.get_seq_length() == 20 and int(fresh.layers[0].slot_index.max()) == 19


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen3", "eager")])
def test_the_implementation_is_restored_when_the_cache_is_gone_or_detached(arch, attn):
    """A cache routes the model while it lives: collected, or detached, the model's own implementation
    is back (a second cache keeps the routing until it goes too)."""
    model = tiny_model(arch, attn_implementation=attn)
    first = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")
    second = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")
    assert model.config._attn_implementation == "kvpop"
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 20)), past_key_values=first)
    del first
    gc.collect()
    assert model.config._attn_implementation == "kvpop"  # the second still holds it
    second.detach()
    assert model.config._attn_implementation == attn
    with pytest.raises(RuntimeError, match="no longer routes"), torch.no_grad():
        model(torch.randint(3, 128, (1, 8)), past_key_values=second)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen3", "eager")])
def test_routed_block_is_bit_identical_for_other_caches_and_restores(arch, attn):
    """Inside ``with kvpop.routed(model)`` every other cache (and none) gives the model's own results
    bit for bit; a KVpop cache made inside works there; on exit the model's own implementation is back."""
    model = tiny_model(arch, attn_implementation=attn)
    before = _behaviour(model)
    with kvpop.routed(model):
        assert model.config._attn_implementation == "kvpop"
        during = _behaviour(model)
        cache = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")
        with torch.no_grad():
            model(torch.randint(3, 128, (1, 20)), past_key_values=cache)
        assert cache.get_seq_length() == 20
        del cache
    assert model.config._attn_implementation == attn
    after = _behaviour(model)
    for name in before:
        assert torch.equal(before[name], during[name]), name
        assert torch.equal(before[name], after[name]), name


def test_the_attention_finds_its_layer_through_the_mask():
    """No tag on any tensor: the mask the cache hands transformers carries the layers."""
    from kvpop.attention import KVpopMask, KVpopOffset, kvpop_mask

    model = tiny_model("llama")
    cache = KVpopCache(model.config, budget=12, window=4, sinks=2, policy="knorm")
    size, offset = cache.get_mask_sizes(5, 0)
    assert size == 5 and offset == 0 and isinstance(offset, KVpopOffset) and offset.layers is cache.layers
    mask = kvpop_mask(kv_offset=offset, attention_mask=None, config=model.config)
    assert isinstance(mask, KVpopMask) and mask.layers is cache.layers
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 6)), past_key_values=cache)
    assert not any(hasattr(layer.keys, "_kvpop_layer") for layer in cache.layers)
