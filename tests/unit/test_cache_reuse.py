"""A KVpop cache used again: ``model.generate()`` on a used cache starts a new sequence (the cache resets
itself and its tokens equal a fresh cache's), ``cache.resume()`` continues one, ``cache.reset()`` restores
a fresh cache's state, whatever the batch size of the next sequence."""

import warnings

import pytest
import torch

from kvpop import KVpopCache
from kvpop.compat import cache_kwargs
from kvpop.policies import get_policy, map_state
from kvpop.testing import compile_unavailable, random_learned_policy, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)
KW = {"budget": 14, "window": 4, "sinks": 2}
NEW = 20  # new tokens per call: the first call leaves 24 + 20 - 1 = 43 tokens seen, past the budget
# heuristic policies, a learned one whose scorer carries a recurrent state (mLSTM), and one with extra inputs
POLICIES = ["streaming", "h2o", "kvpop-mlstm", "kvpop-mlp+"]
ARCHS = {"llama": {"num_hidden_layers": 2}, "gemma3": {}}  # gemma3: sliding layers next to the bounded ones


def _policy(name, model):
    if name.startswith("kvpop"):
        return random_learned_policy(model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith("+"))
    return get_policy(name)


def _leaves(state) -> list:
    out = []
    map_state(state, out.append)
    return out


def _ids(n, seed, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(
        ids,
        attention_mask=mask,
        **cache_kwargs(cache),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("second", [60, 10], ids=["longer", "shorter"])
@pytest.mark.parametrize("policy", POLICIES)
def test_generate_on_a_used_cache_equals_a_fresh_cache(policy, second, arch):
    """A second, unrelated prompt longer (60) or shorter (10) than the 43 tokens the cache saw: the
    same tokens as a fresh cache, not a continuation of the first sequence nor an error."""
    model = tiny_model(arch, **ARCHS[arch])
    pol = _policy(policy, model)
    cache = KVpopCache(model.config, policy=pol, **KW)
    _generate(model, _ids(24, 1), cache)
    assert cache.get_seq_length() == 24 + NEW - 1
    prompt = _ids(second, 2)
    got = _generate(model, prompt, cache)
    assert torch.equal(got, _generate(model, prompt, KVpopCache(model.config, policy=pol, **KW)))
    assert cache.get_seq_length() == second + NEW - 1


@pytest.mark.parametrize("policy", ["h2o", "kvpop-mlstm"])
def test_generate_on_a_used_cache_with_another_batch_size(policy):
    """A batch of two left-padded prompts, then one prompt, a batch of three, and a beam search (three
    beams: rows repeated and reordered): each equals a fresh cache."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy(policy, model)
    cache = KVpopCache(model.config, policy=pol, **KW)
    two = _ids(30, 3, batch=2)
    mask = torch.ones_like(two)
    mask[1, :6] = 0
    calls = [
        (two, mask, {}),
        (_ids(12, 4), None, {}),
        (_ids(50, 5, batch=3), None, {}),
        (_ids(30, 6), None, {"num_beams": 3}),
    ]
    for ids, m, kw in calls:
        got = _generate(model, ids, cache, m, **kw)
        assert torch.equal(got, _generate(model, ids, KVpopCache(model.config, policy=pol, **KW), m, **kw))


@pytest.mark.slow
def test_generate_on_a_used_cache_with_the_compiled_step():
    """The compiled steady step (bound to the layer's buffers and the scorer's state) after the cache
    reset itself, also into another batch size: a fresh eager cache's tokens."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy("kvpop-mlstm", model)
    cache = KVpopCache(model.config, policy=pol, compile=True, **KW)
    _generate(model, _ids(24, 1), cache)
    if cache.compile_status != "compiled":
        compile_unavailable(cache.compile_status)
    for ids in (_ids(10, 2), _ids(30, 3, batch=2)):
        got = _generate(model, ids, cache)
        assert torch.equal(got, _generate(model, ids, KVpopCache(model.config, policy=pol, compile=False, **KW)))


@pytest.mark.parametrize("policy", ["h2o", "kvpop-mlstm"])
def test_a_conversation_continues_by_resume_or_reruns_exactly(policy):
    """The second turn passes the whole conversation (the first call's output and new tokens). By
    default the cache starts over, so the tokens are a fresh cache's for the whole conversation; after
    ``cache.resume()`` only the new tokens run, on the kept state (once: the call after starts over)."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy(policy, model)
    fed = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    cache = KVpopCache(model.config, policy=pol, **KW)
    first = _generate(model, _ids(24, 1), cache)
    turn = torch.cat([first, _ids(9, 6)], 1)  # 44 + 9 tokens, 43 of them seen
    fresh = _generate(model, turn, KVpopCache(model.config, policy=pol, **KW))
    fed.clear()
    assert torch.equal(_generate(model, turn, cache), fresh)
    assert fed[0] == turn.shape[1]  # the whole conversation ran again

    cache = KVpopCache(model.config, policy=pol, **KW)
    _generate(model, _ids(24, 1), cache)
    cache.resume()
    fed.clear()
    resumed = _generate(model, turn, cache)
    assert fed[0] == turn.shape[1] - (24 + NEW - 1)  # only the tokens the cache has not seen
    assert cache.get_seq_length() == turn.shape[1] + NEW - 1
    # the chunk rule equals the token-by-token rule: continuing gives a fresh cache's tokens here too
    assert torch.equal(resumed, fresh)
    prompt = _ids(10, 2)
    fed.clear()
    assert torch.equal(
        _generate(model, prompt, cache), _generate(model, prompt, KVpopCache(model.config, policy=pol, **KW))
    )
    assert fed[0] == 10


@pytest.mark.parametrize("policy", ["h2o", "kvpop-mlstm", "kvpop-mlp+"])
def test_reset_equals_a_fresh_cache(policy):
    """After ``cache.reset()`` forward calls (no generate(), so nothing resets by itself) give a fresh
    cache's logits and state exactly: slots, priorities, statistics, counters and the scorer's state."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy(policy, model)
    used, fresh = (KVpopCache(model.config, policy=pol, **KW) for _ in range(2))
    ids = _ids(60, 7)

    @torch.no_grad()
    def run(cache):
        out = [model(ids[:, :20], **cache_kwargs(cache)).logits]
        out += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(20, 60)]
        return torch.cat(out, 1)

    with torch.no_grad():
        model(_ids(30, 8), **cache_kwargs(used))
        for i in range(25):
            model(_ids(1, 9 + i), **cache_kwargs(used))
    used.reset()
    assert used.get_seq_length() == 0
    for layer in used.layers:
        assert layer.seen == 0 and layer.min_real == 0 and not layer.pending
        assert (layer.slot_index == -1).all() and (layer.state.n_real == 0).all()
    assert torch.equal(run(used), run(fresh))
    for a, b in zip(used.layers, fresh.layers):
        assert a.seen == b.seen and a.min_real == b.min_real
        for name in ("k", "v", "slot_index", "lr_prio", "observed", "n_real"):
            assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name
        sa, sb = a.state.policy_state, b.state.policy_state
        assert (sa is None) == (sb is None)
        if sa is not None:
            flat_a, flat_b = _leaves(sa), _leaves(sb)
            assert len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def test_reset_before_a_batch_of_another_size():
    """A reset cache takes a next sequence of another batch size, as a fresh cache does."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy("kvpop-mlstm", model)
    used, fresh = (KVpopCache(model.config, policy=pol, **KW) for _ in range(2))
    with torch.no_grad():
        model(_ids(30, 1), **cache_kwargs(used))
        used.reset()
        ids = _ids(30, 2, batch=3)
        assert torch.equal(model(ids, **cache_kwargs(used)).logits, model(ids, **cache_kwargs(fresh)).logits)
        step = _ids(1, 3, batch=3)
        assert torch.equal(model(step, **cache_kwargs(used)).logits, model(step, **cache_kwargs(fresh)).logits)
