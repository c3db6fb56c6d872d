import pytest
import torch

import kvpop.capture as cap
from kvpop.capture import ATTN_NAME, capturing, collect
from kvpop.targets import future_attention, n_future
from kvpop.testing import ARCHS, tiny_model

KW = {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96}  # GQA ratio 3


def _ids(B, S, seed=0):
    return torch.randint(4, 128, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_matches_cache_logits_and_targets(arch, monkeypatch):
    model = tiny_model(arch, **KW)
    impl = model.config._attn_implementation
    ids = _ids(2, 37)
    calls = []
    orig = cap._flash_forward
    monkeypatch.setattr(cap, "_flash_forward", lambda *a: calls.append(1) or orig(*a))
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        with capturing(model, window=5, keep_queries=True) as state:
            out = model(ids, use_cache=False)
    assert model.config._attn_implementation == impl
    assert calls, "the flash path (output + reused LSE) was not taken"
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-6)
    caps = state.result()
    assert [c.layer for c in caps] == [0, 1]
    cache = ref.past_key_values
    for c in caps:
        assert c.keys.shape == (2, 2, 37, 16) and c.target.shape == (2, 2, 37)
        torch.testing.assert_close(c.keys, cache.layers[c.layer].keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(c.values, cache.layers[c.layer].values, rtol=0, atol=1e-6)
        dense = future_attention(c.queries, c.keys, 5, method="dense")
        fin = torch.isfinite(dense)
        assert torch.equal(torch.isfinite(c.target), fin)
        torch.testing.assert_close(c.target[fin], dense[fin], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_targets_against_eager_attention_probs(arch):
    # independent check: the eager implementation returns the attention probabilities themselves
    ids = _ids(1, 30, seed=1)
    w = 3
    eager = tiny_model(arch, attn_implementation="eager", **KW)
    with torch.no_grad():
        probs = eager(ids, output_attentions=True, use_cache=False).attentions
    caps = collect(tiny_model(arch, **KW), ids, window=w)
    # capturing an eager model works too (its attention runs through SDPA meanwhile) and restores it
    with torch.no_grad():
        ref_logits = eager(ids, use_cache=False).logits
        with capturing(eager, window=w) as st:
            logits = eager(ids, use_cache=False).logits
    assert eager.config._attn_implementation == "eager"
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for c, ce in zip(caps, st.result()):
        torch.testing.assert_close(c.target, ce.target, atol=1e-5, rtol=0)
    S = ids.shape[1]
    d = torch.arange(S)
    fut = (d[:, None] >= d[None, :] + w).float()
    for c, p in zip(caps, probs):
        m = (p * fut).sum(-2) / n_future(S, w).float()  # [1, Hq, S]
        ref = m.view(1, 2, 3, S).amax(2).log()
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(c.target), fin)
        torch.testing.assert_close(c.target[fin], ref[fin], atol=1e-5, rtol=1e-5)


def test_no_reuse_path_and_sdpa_output_equal():
    model = tiny_model("llama", **KW)
    ids = _ids(2, 25, seed=2)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        with capturing(model, window=4, reuse_lse=False) as s1:
            out1 = model(ids, use_cache=False).logits
        with capturing(model, window=4) as s2:
            model(ids, use_cache=False)
    torch.testing.assert_close(out1, ref, rtol=0, atol=1e-6)
    for i in (0, 1):
        a, b = s1.captures[i].target, s2.captures[i].target
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding(side):
    model = tiny_model("mistral", **KW)
    S, w = 24, 3
    ids = _ids(2, S, seed=3)
    mask = torch.ones(2, S, dtype=torch.long)
    n_pad = 7
    if side == "left":
        mask[1, :n_pad] = 0
        valid = slice(n_pad, S)
    else:
        mask[1, S - n_pad :] = 0
        valid = slice(0, S - n_pad)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        with capturing(model, window=w, attention_mask=mask) as state:
            out = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=0, atol=1e-6)
    caps = collect(model, ids, attention_mask=mask, window=w)
    alone = collect(model, ids[1:, valid], window=w)
    for c, c1, a in zip(caps, state.result(), alone):
        torch.testing.assert_close(c.target, c1.target)
        t = c.target[1]
        assert torch.isinf(t[:, ~mask[1].bool()]).all()
        torch.testing.assert_close(t[:, valid], a.target[0], atol=2e-5, rtol=0)
        # unpadded row 0 equals its own single-row capture
        torch.testing.assert_close(c.target[0], collect(model, ids[:1], window=w)[c.layer].target[0], atol=2e-5, rtol=0)


def test_layers_subset_no_window_and_restore_on_error():
    model = tiny_model("qwen2", num_hidden_layers=3, **KW)
    ids = _ids(1, 12)
    caps = collect(model, ids, layers=[2, 0])
    assert [c.layer for c in caps] == [0, 2]
    assert all(c.target is None and c.queries is None for c in caps)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), capturing(model, window=2):
        assert model.config._attn_implementation == ATTN_NAME
        assert model.model.layers[0].self_attn.config._attn_implementation == ATTN_NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert cap._ACTIVE.get() is None
    # outside a capture, the registered function is never used and the model still works
    with torch.no_grad():
        model(ids)


def test_window_longer_than_sequence_and_bf16():
    model = tiny_model("llama", dtype=torch.bfloat16, **KW)
    ids = _ids(1, 10)
    caps = collect(model, ids, window=10)
    assert all(torch.isinf(c.target).all() for c in caps)
    caps = collect(model, ids, window=2, keep_queries=True)
    for c in caps:
        assert c.keys.dtype == torch.bfloat16 and c.target.dtype == torch.float32
        dense = future_attention(c.queries, c.keys, 2, method="dense")
        fin = torch.isfinite(dense)
        torch.testing.assert_close(c.target[fin], dense[fin], atol=2e-2, rtol=0)


def test_errors():
    model = tiny_model("llama", **KW)
    ids = _ids(2, 12)
    bad = torch.ones(2, 12, dtype=torch.long)
    bad[0, 5] = 0
    with pytest.raises(ValueError, match="contiguous"):
        collect(model, ids, attention_mask=bad, window=2)
    with pytest.raises(ValueError, match="layers"):
        collect(model, ids, layers=[5])
    with pytest.raises(ValueError, match="window"):
        collect(model, ids, window=-1)
    with pytest.raises(ValueError):
        collect(model, ids[0])
    assert model.config._attn_implementation == "sdpa"
