"""Training-time eviction mask: leave steps against the plain rule, masked attention against the physical cache."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpop
from kvpop.capture import collect
from kvpop.compat import cache_kwargs
from kvpop.mask import (
    MASK_ATTN_NAME,
    learned_priority_fn,
    masked_eviction,
    oracle_priority_fn,
    streaming_priority_fn,
    visibility,
)
from kvpop.policies import LearnedPolicy, OraclePolicy
from kvpop.rope import RopeSpec
from kvpop.rule import NEVER, kept_mask_static, leave_steps
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import tiny_model
from kvpop.testing.rule import reference_rule

warnings.filterwarnings("ignore", category=FutureWarning)


# --------------------------------------------------------------------------------------------
# leave steps
# --------------------------------------------------------------------------------------------


def _check_against_reference(prio, sinks, window, k):
    """prio [b, h, S]: leave steps and per-step held sets equal reference_rule's, head by head."""
    got = leave_steps(prio, sinks, window, k)
    assert got.dtype == torch.long and got.shape == prio.shape
    b, h, S = prio.shape
    vis = visibility(got)  # [b, h, S, S]
    for r in range(b):
        for j in range(h):
            states, ref = reference_rule(prio[r, j].tolist(), sinks, window, k)
            assert [-1 if x == NEVER else x for x in got[r, j].tolist()] == ref
            for q in range(S):
                assert set(vis[r, j, q].nonzero().flatten().tolist()) == states[q]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    S=st.integers(0, 40),
    sinks=st.integers(0, 4),
    window=st.integers(0, 6),
    k=st.integers(0, 9),
    rows=st.integers(1, 2),
    heads=st.integers(1, 3),
    levels=st.integers(1, 6),
)
def test_leave_steps_match_reference_rule_with_ties(data, S, sinks, window, k, rows, heads, levels):
    # few distinct priority values: many exact ties, resolved by age
    vals = data.draw(st.lists(st.integers(0, levels - 1), min_size=rows * heads * S, max_size=rows * heads * S))
    prio = torch.tensor(vals, dtype=torch.float32).view(rows, heads, S)
    _check_against_reference(prio, sinks, window, k)


@pytest.mark.parametrize("k", [0, 1, 7, 64, 299, 400])
def test_leave_steps_long_sequence_float_and_inf(k):
    g = torch.Generator().manual_seed(k)
    prio = torch.randn(2, 2, 300, generator=g)
    prio[0, 0, 250:] = -math.inf  # e.g. oracle targets of the last window tokens
    prio[1, 1, ::7] = 0.25  # exact ties among scattered tokens
    _check_against_reference(prio, 4, 16, k)


@pytest.mark.parametrize("S,k", [(1, 3), (5, 0), (64, 8), (257, 40)])
def test_leave_steps_held_at_end_is_teacher_kept_set(S, k):
    prio = torch.randint(0, 5, (2, 3, S), generator=torch.Generator().manual_seed(S)).double()
    leave = leave_steps(prio, 3, 8, k)
    assert torch.equal(leave == NEVER, kept_mask_static(prio, 8, k, 3))


def test_leave_steps_rejects_nan_and_bad_args():
    with pytest.raises(ValueError, match="NaN"):
        leave_steps(torch.tensor([[[0.0, float("nan"), 1.0, 2.0]]]), 0, 1, 1)
    with pytest.raises(ValueError):
        leave_steps(torch.zeros(3, 4), 0, 1, 1)
    with pytest.raises(ValueError):
        leave_steps(torch.zeros(1, 1, 4), -1, 1, 1)


# --------------------------------------------------------------------------------------------
# masked attention vs the physical cache
# --------------------------------------------------------------------------------------------

SINKS, WINDOW, K = 2, 6, 12
BUDGET = SINKS + WINDOW + K


def _ids(n, seed=0, rows=1):
    # distinct tokens (see tests/unit/test_cache.py: repeated tokens tie exactly in layer 0)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(128, generator=g)[:n] for _ in range(rows)])


def _scorer(model, kind, seed=7):
    """A random scorer; kind "mlp+"/"mlstm+": position-free keys, observed-attention inputs, recency tilt."""
    c = model.config
    extra = kind.endswith("+")
    sc = build_scorer(
        ScorerConfig(
            kind=kind.rstrip("+"),
            num_layers=c.num_hidden_layers,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            seed=seed,
            position_free=extra,
            observed=(None, 3, 1) if extra else (),
            tilt=extra,
        )
    )
    if extra:
        sc.set_rope(RopeSpec.from_config(c))
        with torch.no_grad():
            sc.tilt_theta.uniform_(0.0, 3.0, generator=torch.Generator().manual_seed(seed))
    return sc


@torch.no_grad()
def _cache_logits(
    model, ids, policy, lam=0.0, budget=BUDGET, window=WINDOW, sinks=SINKS, attention_mask=None, stepwise=False
):
    cache = kvpop.KVpopCache(model.config, budget=budget, window=window, sinks=sinks, policy=policy, lam=lam)
    if not stepwise:
        return model(input_ids=ids, attention_mask=attention_mask, **cache_kwargs(cache), use_cache=True).logits
    outs = [
        model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits for i in range(ids.shape[1])
    ]
    return torch.cat(outs, 1)


@torch.no_grad()
def _masked_logits(model, ids, fn, sinks=SINKS, window=WINDOW, k=K, attention_mask=None, position_ids=None, **kw):
    with masked_eviction(model, fn, sinks=sinks, window=window, k=k, **kw):
        return model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits


def _policy_and_fn(model, name, lam, ids):
    """(cache policy, priority fn, sinks, window, k) for one policy at BUDGET."""
    if name == "streaming":
        return "streaming", streaming_priority_fn(), SINKS, BUDGET - SINKS, 0
    if name in ("mlp", "mlstm", "mlp+", "mlstm+"):
        sc = _scorer(model, name)
        return LearnedPolicy(sc), learned_priority_fn(sc, WINDOW, lam, sinks=SINKS), SINKS, WINDOW, K
    targets = [c.target for c in collect(model, ids, window=WINDOW)]
    return OraclePolicy(targets), oracle_priority_fn(targets, lam), SINKS, WINDOW, K


@pytest.mark.parametrize("lam", [0.0, 0.05])
@pytest.mark.parametrize("name", ["streaming", "mlp", "mlstm", "mlp+", "mlstm+", "oracle"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_masked_equals_cache_one_forward(arch, name, lam):
    model = tiny_model(arch)
    ids = _ids(64, seed=1)
    policy, fn, s, w, k = _policy_and_fn(model, name, lam, ids)
    ref = _cache_logits(model, ids, policy, lam)
    got = _masked_logits(model, ids, fn, s, w, k, query_block=24)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (got - model(input_ids=ids).logits).abs().max() > 1e-2  # the mask does bite


@pytest.mark.parametrize("name", ["streaming", "mlp", "mlstm", "oracle"])
def test_masked_equals_cache_token_by_token(name):
    model = tiny_model("llama")
    ids = _ids(30, seed=2)
    s, w, k = 1, 4, 5
    if name == "streaming":
        policy, fn, w, k = "streaming", None, w + k, 0
    elif name == "oracle":
        targets = [c.target for c in collect(model, ids, window=w)]
        policy, fn = OraclePolicy(targets), oracle_priority_fn(targets, 0.02)
    else:
        sc = _scorer(model, name, seed=3)
        policy, fn = LearnedPolicy(sc), learned_priority_fn(sc, w, 0.02)
    ref = _cache_logits(
        model, ids, policy, 0.0 if name == "streaming" else 0.02, budget=s + w + k, window=w, sinks=s, stepwise=True
    )
    got = _masked_logits(model, ids, fn, s, w, k)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "mlstm"])
def test_masked_left_padding_equals_cache_and_single_rows(name):
    model = tiny_model("llama")
    ids = _ids(40, seed=4, rows=2)
    am = torch.ones_like(ids)
    am[1, :9] = 0
    sc = _scorer(model, name)
    fn = learned_priority_fn(sc, WINDOW, 0.01)
    got = _masked_logits(model, ids, fn, attention_mask=am, query_block=16)
    ref = _cache_logits(model, ids, LearnedPolicy(sc), 0.01, attention_mask=am)
    valid = am.bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    # each row as if alone (the padded row with RoPE positions counted from its first real token)
    torch.testing.assert_close(got[:1], _masked_logits(model, ids[:1], fn), rtol=1e-5, atol=1e-5)
    shifted = _masked_logits(model, ids, fn, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))
    torch.testing.assert_close(shifted[1:, 9:], _masked_logits(model, ids[1:, 9:], fn), rtol=1e-5, atol=1e-5)


def test_query_blocks_do_not_change_the_result():
    model = tiny_model("mistral")
    ids = _ids(50, seed=9, rows=2)
    am = torch.ones_like(ids)
    am[0, :13] = 0
    fn = learned_priority_fn(_scorer(model, "mlp"), WINDOW)
    ref = _masked_logits(model, ids, fn, attention_mask=am, query_block=50)
    valid = am.bool()
    for block in (1, 7, 128):
        got = _masked_logits(model, ids, fn, attention_mask=am, query_block=block)
        torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_flex_backend_equals_sdpa_backend():
    # the CUDA path (FlexAttention mask_mod over the leave steps); on the CPU it runs eager (see kvpop.mask._flex)
    model = tiny_model("llama")
    ids = _ids(40, seed=10, rows=2)
    am = torch.ones_like(ids)
    am[1, :7] = 0
    fn = learned_priority_fn(_scorer(model, "mlstm"), WINDOW, 0.01)
    ref = _masked_logits(model, ids, fn, attention_mask=am, backend="sdpa")
    got = _masked_logits(model, ids, fn, attention_mask=am, backend="flex")
    valid = am.bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["streaming", "mlp", "mlstm"])
def test_budget_at_least_length_is_exactly_dense(name):
    model = tiny_model("llama")
    ids = _ids(40, seed=5)
    dense = model(input_ids=ids).logits
    if name == "streaming":
        got = _masked_logits(model, ids, None, 4, 36, 0)
    else:
        got = _masked_logits(model, ids, learned_priority_fn(_scorer(model, name), 8, 0.1), 4, 8, 28)
    assert torch.equal(got, dense)


def test_gradients_reach_model_not_scorer():
    model = tiny_model("llama")
    ids = _ids(48, seed=6)
    sc = _scorer(model, "mlstm")
    model.train()
    with masked_eviction(model, learned_priority_fn(sc, WINDOW), sinks=SINKS, window=WINDOW, k=K, query_block=20):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    assert grads["model.layers.1.self_attn.k_proj.weight"].abs().sum() > 0
    assert all(p.grad is None for p in sc.parameters())
    # same gradient as through the physical cache? the logits agree; here check the loss does
    model.eval()
    with torch.no_grad():
        ref = _cache_logits(model, ids, LearnedPolicy(sc))
    torch.testing.assert_close(logits.detach(), ref, rtol=1e-5, atol=1e-5)


def test_keep_leave_and_restore():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    ids = _ids(32, seed=8)
    sc = _scorer(model, "mlp")
    with masked_eviction(
        model, learned_priority_fn(sc, WINDOW), sinks=SINKS, window=WINDOW, k=K, keep_leave=True
    ) as st_:
        assert model.config._attn_implementation == MASK_ATTN_NAME
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == before
    assert sorted(st_.leave) == [0, 1]
    assert st_.leave[0].shape == (1, 2, 32)
    past = model(input_ids=ids[:, :8], use_cache=True).past_key_values
    with pytest.raises(RuntimeError, match="cache-free"), masked_eviction(model, None, sinks=1, window=4, k=0):
        model(input_ids=ids[:, 8:9], **cache_kwargs(past), use_cache=True)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="priority_fn"), masked_eviction(model, None, sinks=1, window=4, k=2):
        pass
    with pytest.raises(ValueError, match="window"), masked_eviction(model, None, sinks=1, window=0, k=0):
        pass


# --------------------------------------------------------------------------------------------
# the real model
# --------------------------------------------------------------------------------------------
