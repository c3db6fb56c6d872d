"""Models with sliding-window layers (Gemma 3, Qwen2 with use_sliding_window): the full-attention
layers are bounded by kvpop and equal the masked reference, the sliding layers keep exactly their own
window and equal the model's own sliding attention, for every policy; a model whose every layer
slides is refused; capture and training see the full-attention layers only."""

import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import kvpop
from kvpop import KVpopCache
from kvpop.capture import collect
from kvpop.checkpoint import ScorerMismatchError
from kvpop.compat import cache_kwargs
from kvpop.config import attention_shape
from kvpop.policies import OraclePolicy, get_policy
from kvpop.rope import RopeSpec
from kvpop.testing import random_learned_policy, tiny_model, tiny_tokenizer
from kvpop.testing.reference import MaskedReference

warnings.filterwarnings("ignore", category=FutureWarning)
# every policy (kvpop.policy_names() but dense, which is no KVpop cache), the learned ones with their extra inputs too
POLICIES = [p for p in kvpop.policy_names() if p != "dense"] + ["kvpop-mlstm+", "kvpop-mlp+", "kvpop-mlpx"]
# Gemma 3 (sliding, full, sliding, full; window 8) and Qwen2 with its last two of four layers sliding
HYBRIDS = {
    "gemma3": {},
    "qwen2": {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
}
KW = {"budget": 20, "window": 6, "sinks": 2}


def _ids(n, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n].view(1, n)


def _policy(name, model, ids=None):
    if name == "oracle":
        return OraclePolicy([c.target for c in collect(model, ids, window=KW["window"])])
    if name.startswith("kvpop"):
        return random_learned_policy(
            model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith(("+", "x")), cross_heads=name.endswith("x")
        )
    return get_policy(name)


@torch.no_grad()
def _logits(model, ids, cache, prefill, attention_mask=None):
    outs = [model(ids[:, :prefill], **cache_kwargs(cache)).logits]
    outs += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(outs, 1)


def test_layer_kinds_read_from_each_config_family():
    g = attention_shape(tiny_model("gemma3").config)
    assert (g.bounded, g.sliding, g.sliding_window) == ((1, 3), (0, 2), 8)
    q = attention_shape(tiny_model("qwen2", **HYBRIDS["qwen2"]).config)
    assert (q.bounded, q.sliding, q.sliding_window) == ((0, 1), (2, 3), 8)
    full = attention_shape(tiny_model("llama").config)
    assert (full.bounded, full.sliding, full.sliding_window) == ((0, 1), (), None)
    cache = KVpopCache(tiny_model("gemma3").config, policy="h2o", **KW)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer", "KVpopLayer"] * 2
    assert cache.is_sliding == [True, False, True, False] and "sliding_layers=2 (window 8)" in repr(cache)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("mistral", {"sliding_window": 16}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
        ("gemma3", {"layer_types": ["sliding_attention"] * 4}),
    ],
)
def test_a_model_whose_every_layer_slides_is_refused_before_any_work(arch, overrides, monkeypatch):
    model = tiny_model(arch, **overrides)
    monkeypatch.setattr(kvpop.cache, "get_policy", lambda *a, **k: pytest.fail("a policy was built"))
    with pytest.raises(ValueError, match=r"every layer of this \w+ config slides \(sliding_window=\d+ on all"):
        KVpopCache(model.config, budget=64, policy="kvpop-mlstm")
    with pytest.raises(ValueError, match="kvpop has nothing to bound"):
        kvpop.make_cache(model, "h2o", budget=64)


def test_attention_logit_softcapping_is_refused():
    cfg = tiny_model("gemma3").config
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        KVpopCache(cfg, budget=64, policy="h2o")


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_physical_cache_equals_masked_reference_and_sliding_layers_their_window(arch, policy):
    model = tiny_model(arch, **HYBRIDS[arch])
    ids = _ids(60)
    cache = KVpopCache(model.config, policy=_policy(policy, model, ids), **KW)
    ref = MaskedReference(model, cache.eviction, _policy(policy, model, ids))
    expected = ref.run(ids)
    got = _logits(model, ids, cache, prefill=25)  # chunked prefill, then 35 decode steps
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    shape, t = attention_shape(model.config), ids.shape[1] - 1
    for i in shape.bounded:
        held = cache.layers[i].slot_index[0]
        for head in range(held.shape[0]):
            assert set(held[head][held[head] >= 0].tolist()) == ref.held(i, head, t)
    for i in shape.sliding:  # the model's own window: the last window - 1 tokens between steps
        assert isinstance(cache.layers[i], DynamicSlidingWindowLayer)
        assert cache.layers[i].keys.shape[2] == shape.sliding_window - 1
    kv_heads, d = shape.kv_heads, shape.head_dim
    assert cache.kv_bytes("bounded") == len(shape.bounded) * 2 * kv_heads * KW["budget"] * d * 4
    assert cache.kv_bytes("sliding") == len(shape.sliding) * 2 * kv_heads * (shape.sliding_window - 1) * d * 4
    assert cache.kv_bytes() == cache.kv_bytes("bounded") + cache.kv_bytes("sliding")


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("policy", ["streaming", "h2o", "kvpop-mlstm+"])
def test_budget_at_least_length_equals_the_model_with_its_own_cache(arch, policy):
    model = tiny_model(arch, **HYBRIDS[arch])
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    dense = _logits(model, ids, DynamicCache(config=model.config), prefill=30)
    cache = KVpopCache(model.config, budget=48, window=8, sinks=2, policy=_policy(policy, model))
    torch.testing.assert_close(_logits(model, ids, cache, prefill=30), dense, rtol=1e-5, atol=1e-5)
    prompt = ids[:1, :20]
    big = KVpopCache(model.config, budget=64, window=8, sinks=2, policy=_policy(policy, model))
    out = model.generate(prompt, **cache_kwargs(big), max_new_tokens=30, do_sample=False)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=30, do_sample=False))


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prefill_equals_token_by_token(policy):
    model = tiny_model("gemma3")
    ids = _ids(70)
    a = KVpopCache(model.config, policy=_policy(policy, model, ids), prefill_chunk=3, **KW)
    b = KVpopCache(model.config, policy=_policy(policy, model, ids), **KW)
    with torch.no_grad():
        la = model(ids, **cache_kwargs(a)).logits
        lb = torch.cat([model(ids[:, i : i + 1], **cache_kwargs(b)).logits for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    for i in attention_shape(model.config).bounded:
        assert torch.equal(a.layers[i].slot_index.sort(-1)[0], b.layers[i].slot_index.sort(-1)[0])


@pytest.mark.parametrize("policy", ["streaming", "h2o", "random", "kvpop-mlstm+"])
def test_left_padded_batch_equals_rows_alone(policy):
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 128, (1, 40), generator=g), torch.randint(1, 128, (1, 25), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 15, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :15] = 0
    cb = KVpopCache(model.config, policy=_policy(policy, model), **KW)
    out = model.generate(
        batch, attention_mask=mask, **cache_kwargs(cb), max_new_tokens=20, do_sample=False, pad_token_id=0
    )
    for row, seq in ((0, a), (1, b)):
        alone = model.generate(
            seq,
            **cache_kwargs(KVpopCache(model.config, policy=_policy(policy, model), **KW)),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
        new = alone[0, seq.shape[1] :]  # up to its end of sequence, where a row alone stops
        assert torch.equal(out[row, batch.shape[1] : batch.shape[1] + new.shape[0]], new)
    assert cb.layers[1].slot_index[1].max() == 25 + 20 - 2  # padding never occupies a slot


def test_generate_keeps_the_whole_cache_bounded():
    model = tiny_model("gemma3")
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = kvpop.make_cache(model, "h2o", **KW)
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert out.shape == (1, 90) and cache.get_seq_length() == 89
    held = cache.kv_bytes()
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(out[:, :-1], **cache_kwargs(dense))
    full = sum(layer.keys.numel() * 4 * 2 for layer in dense.layers if not layer.is_sliding)
    assert cache.kv_bytes("bounded") < full and held == cache.kv_bytes("bounded") + cache.kv_bytes("sliding")


def test_learned_scorer_of_another_model_is_refused():
    gemma, llama = tiny_model("gemma3"), tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ScorerMismatchError, match="2 full-attention layers"):
        KVpopCache(gemma.config, policy=random_learned_policy(llama), **KW)
    KVpopCache(gemma.config, policy=random_learned_policy(gemma), **KW)  # one scorer per full-attention layer


def test_capture_records_the_full_attention_layers_with_their_rope():
    model = tiny_model("gemma3")
    caps = collect(model, _ids(30), window=6)
    assert [c.layer for c in caps] == [1, 3]
    assert float(RopeSpec.from_config(model.config).inv_freq[1]) == pytest.approx(1e6 ** (-2 / 16))


def test_training_a_scorer_for_a_hybrid_model_starts(tmp_path):
    from kvpop.checkpoint import load_scorer
    from kvpop.train import TrainConfig, train

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(" ".join(["the cat sat on a mat while dogs ran far"] * 40))
    model = tiny_model("gemma3")
    cfg = TrainConfig(
        out=str(tmp_path / "run"),
        docs_from=str(docs),
        seq_len=64,
        budgets=(24,),
        window=8,
        sinks=2,
        steps=2,
        val_every=2,
        ckpt_every=2,
        val_docs=1,
        progress=False,
        observed=(None, 4, 1),
    )
    summary = train(cfg, model, tiny_tokenizer())
    assert len(summary["history"]) == 2 and all(torch.isfinite(torch.tensor([h["loss"] for h in summary["history"]])))
    scorer, _ = load_scorer(tmp_path / "run" / "scorer.safetensors", model=model)
    assert scorer.config.num_layers == 2  # one per full-attention layer
    KVpopCache(model.config, 24, policy="kvpop-mlstm", path=str(tmp_path / "run" / "scorer.safetensors"))


@pytest.mark.parametrize("policy", ["h2o", "kvpop-mlstm"])
def test_beam_search_reorders_both_kinds_of_layer(policy):
    """Beam search reorders the bounded and the sliding layers alike: at a budget covering the sequence
    the beams equal the model's own; at a small one every beam's score equals its sequence run alone."""
    model = tiny_model("gemma3")
    prompt = _ids(24, seed=8)
    kw = {
        "num_beams": 3,
        "num_return_sequences": 2,
        "max_new_tokens": 12,
        "min_new_tokens": 12,
        "do_sample": False,
        "length_penalty": 0.0,
        "output_scores": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    big = KVpopCache(model.config, budget=64, window=8, sinks=2, policy=_policy(policy, model))
    assert torch.equal(
        model.generate(prompt, **cache_kwargs(big), **kw).sequences, model.generate(prompt, **kw).sequences
    )
    pol = _policy(policy, model)
    out = model.generate(prompt, **cache_kwargs(KVpopCache(model.config, policy=pol, **KW)), **kw)
    for row in range(2):
        new = out.sequences[row : row + 1, 24:]
        alone = _logits(model, torch.cat([prompt, new[:, :-1]], 1), KVpopCache(model.config, policy=pol, **KW), 24)
        logp = torch.log_softmax(alone[0, 23:].float(), -1)[torch.arange(12), new[0]].sum()
        assert float(logp) == pytest.approx(float(out.sequences_scores[row]), abs=1e-3)


# --- the training-time mask (kvpop.mask.masked_eviction) on hybrid models --------------------------


@pytest.mark.parametrize("arch", list(HYBRIDS))
@pytest.mark.parametrize("name", ["streaming", "kvpop-mlp+", "kvpop-mlstm", "oracle"])
def test_masked_eviction_equals_the_cache_on_hybrid_models(arch, name):
    """One cache-free forward under masked_eviction (what kvpop adapt and the evaluation's window-only
    pass run) equals KVpopCache: full-attention layers masked by the rule, sliding layers their own window;
    priority functions count the full-attention layers by rank."""
    from kvpop.mask import learned_priority_fn, masked_eviction, oracle_priority_fn, streaming_priority_fn

    model = tiny_model(arch, **HYBRIDS[arch])
    ids = _ids(60, seed=3)
    pol = _policy(name, model, ids)
    s, w, b = KW["sinks"], KW["window"], KW["budget"]
    if name == "streaming":
        fn, window, k = streaming_priority_fn(), b - s, 0
    elif name == "oracle":
        fn, window, k = oracle_priority_fn(pol.targets), w, b - s - w
    else:
        fn, window, k = learned_priority_fn(pol.scorer, w, sinks=s), w, b - s - w
    cache = KVpopCache(model.config, policy=pol, **KW)
    with torch.no_grad():
        want = model(ids, **cache_kwargs(cache)).logits
        with masked_eviction(model, fn, sinks=s, window=window, k=k, query_block=7):
            got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - model(ids).logits).abs().max() > 1e-2  # the mask does bite


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_masked_eviction_without_eviction_is_the_model_itself(arch):
    """Window >= S: nothing leaves, so only the sliding layers' own windows act: the model's own forward,
    also with left padding (the padded row's real tokens equal the row alone)."""
    from kvpop.mask import masked_eviction

    model = tiny_model(arch, **HYBRIDS[arch])
    ids = _ids(40, seed=4)
    with torch.no_grad():
        with masked_eviction(model, None, sinks=2, window=64, k=0, query_block=16):
            got = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-5, atol=1e-5)
        padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
        mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], 1)
        with masked_eviction(model, None, sinks=2, window=64, k=0, query_block=16):
            got_pad = model(input_ids=padded, attention_mask=mask, use_cache=False).logits[:, 5:]
    torch.testing.assert_close(got_pad, got, rtol=1e-4, atol=1e-4)
