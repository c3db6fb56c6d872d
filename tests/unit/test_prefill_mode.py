"""A prefill under ``no_grad`` runs its chunk steps in inference mode (autograd's bookkeeping is a
large part of their cost on a CPU) and leaves no inference tensor behind: the decode steps that follow,
the compiled step, a reset cache and a scorer trained in the same process see plain tensors, and the
tokens are those of the same steps run without it."""

import contextlib
import warnings

import pytest
import torch

import kvpop.cache as cache_mod
from kvpop import KVpopCache
from kvpop.compat import cache_kwargs
from kvpop.policies import get_policy, map_state
from kvpop.testing import compile_unavailable, random_learned_policy, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)
KW = {"budget": 14, "window": 4, "sinks": 2}
POLICIES = ["h2o", "kvpop-mlstm", "kvpop-mlp+"]


def _policy(name, model):
    if name.startswith("kvpop"):
        return random_learned_policy(model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith("+"))
    return get_policy(name)


def _ids(n, seed, batch=1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _state_tensors(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        st = getattr(layer, "state", None)
        if st is None:
            continue
        out += [st.k, st.v, st.slot_index, st.lr_prio, st.observed, st.n_real]
        map_state(st.policy_state, out.append)
    return out


def _generate(model, ids, cache):
    return model.generate(
        ids, **cache_kwargs(cache), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
    )


@pytest.fixture
def steps_seen(monkeypatch):
    """Whether inference mode was on in each chunk step the cache ran."""
    seen = []
    plain = cache_mod.prefill_chunk

    def spy(*a, **kw):
        seen.append(torch.is_inference_mode_enabled())
        return plain(*a, **kw)

    monkeypatch.setattr(cache_mod, "prefill_chunk", spy)
    return seen


@pytest.mark.parametrize("policy", POLICIES)
def test_no_grad_prefill_runs_in_inference_mode_and_leaves_plain_tensors(policy, steps_seen):
    model = tiny_model("llama", num_hidden_layers=2)
    cache = KVpopCache(model.config, policy=_policy(policy, model), **KW)
    with torch.no_grad():
        model(_ids(40, 1), **cache_kwargs(cache))
    assert steps_seen and all(steps_seen)
    tensors = _state_tensors(cache)
    assert tensors and not any(t.is_inference() for t in tensors)
    with torch.no_grad():  # decode steps update the state in place, outside inference mode
        for t in range(3):
            model(_ids(1, 10 + t), **cache_kwargs(cache))


@pytest.mark.parametrize("policy", POLICIES)
def test_tokens_equal_the_steps_without_inference_mode(policy, monkeypatch):
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy(policy, model)
    ids = _ids(40, 2, batch=2)
    light = _generate(model, ids, KVpopCache(model.config, policy=pol, **KW))

    @contextlib.contextmanager
    def off():
        yield False

    monkeypatch.setattr(cache_mod, "_light_mode", off)
    assert torch.equal(light, _generate(model, ids, KVpopCache(model.config, policy=pol, **KW)))


def test_a_prefill_with_grad_enabled_keeps_autograd(steps_seen):
    """Outside ``no_grad`` the steps run as called: the output stays in autograd's graph."""
    model = tiny_model("llama", num_hidden_layers=2)
    cache = KVpopCache(model.config, policy=get_policy("h2o"), **KW)
    out = model(_ids(40, 3), **cache_kwargs(cache))
    assert steps_seen and not any(steps_seen)
    assert out.logits.requires_grad and not out.logits.is_inference()


def test_a_scorer_used_by_a_cache_still_trains(steps_seen):
    """The scorer object the cache scored with (no copy on its own device) gives gradients afterwards."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = random_learned_policy(model, "mlstm")
    with torch.no_grad():
        _generate(model, _ids(40, 4), KVpopCache(model.config, policy=pol, **KW))
    assert all(steps_seen)
    params = [p for p in pol.scorer.parameters() if p.requires_grad]
    assert params and not any(p.is_inference() for p in params)
    loss = sum((p.float() ** 2).sum() for p in params)
    loss.backward()
    assert all(p.grad is not None for p in params)


@pytest.mark.slow
def test_the_compiled_step_after_an_inference_mode_prefill():
    """The compiled steady step binds the state a light prefill left: the eager cache's tokens."""
    model = tiny_model("llama", num_hidden_layers=2)
    pol = _policy("kvpop-mlstm", model)
    cache = KVpopCache(model.config, policy=pol, compile=True, **KW)
    ids = _ids(30, 5)
    got = _generate(model, ids, cache)
    if cache.compile_status != "compiled":
        compile_unavailable(cache.compile_status)
    assert torch.equal(got, _generate(model, ids, KVpopCache(model.config, policy=pol, compile=False, **KW)))
    again = _ids(12, 6)
    fresh = KVpopCache(model.config, policy=pol, compile=False, **KW)
    assert torch.equal(_generate(model, again, cache), _generate(model, again, fresh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["h2o", "kvpop-mlp+"])
def test_the_additive_chunk_mask_equals_the_visibility_rule(policy, dtype, monkeypatch):
    """Without padding the chunk's attention takes an additive mask built from the slots' leave steps and
    a causal block; it is the boolean visibility rule's 0 / -inf, in every chunk of a long prefill."""
    from kvpop import step

    checked = []
    plain = step._chunk_mask

    def both(spec, ch, lr_leave, ex_leave, dt):
        got = plain(spec, ch, lr_leave, ex_leave, dt)
        if not ch.padded:
            visible = step._chunk_visible(spec, ch, lr_leave, ex_leave)
            assert got.dtype == dt
            assert torch.equal(got, torch.where(visible, 0.0, float("-inf")).to(dt))
            checked.append(visible.shape)
        return got

    monkeypatch.setattr(step, "_chunk_mask", both)
    model = tiny_model("llama", num_hidden_layers=2, dtype=dtype)
    cache = KVpopCache(model.config, policy=_policy(policy, model), prefill_chunk=3, **KW)
    with torch.no_grad():
        model(_ids(40, 7, batch=2), **cache_kwargs(cache))
    assert len(checked) >= 2 * 13
