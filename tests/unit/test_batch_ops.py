"""Per-sequence state lives in the cache: shared policy instances, beams, repeats, selection, reset.

Every check compares a row of a batched / reordered / shared run against the same sequence
run alone in a fresh cache.
"""

import warnings

import pytest
import torch

import kvpop.rule
from kvpop import KVpopCache
from kvpop.compat import cache_kwargs
from kvpop.policies import LearnedPolicy, SnapKVPolicy, get_policy
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)
KW = {"budget": 14, "window": 4, "sinks": 2}


def _learned(model, kind="mlstm", seed=7):
    c = model.config
    cfg = ScorerConfig(
        kind=kind, num_layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=c.head_dim, seed=seed
    )
    return LearnedPolicy(build_scorer(cfg))


def _ids(n, seed, vocab=128):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run_alone(model, policy, prefix, cont, **kw):
    """Logits of prefix (one chunk) then cont token by token, in a fresh cache: [1, len(cont) + 1, V]."""
    cache = KVpopCache(model.config, policy=policy, **(kw or KW))
    out = [model(prefix, **cache_kwargs(cache)).logits[:, -1:]]
    out += [model(cont[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(cont.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("policy", ["kvpop-mlstm", "h2o", "snapkv"])
def test_batch_repeat_interleave_and_select_keep_every_row_exact(policy):
    model = tiny_model("llama")
    pol = _learned(model) if policy == "kvpop-mlstm" else get_policy(policy)
    a, b, c = _ids(30, 1), _ids(30, 2), _ids(30, 3)
    cont = torch.randint(3, 128, (6, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = KVpopCache(model.config, policy=pol, **KW)
        first = model(torch.cat([a, b, c]), **cache_kwargs(cache)).logits[:, -1:]
        cache.batch_repeat_interleave(2)  # rows a a b b c c
        cache.batch_select_indices(torch.tensor([5, 0, 3, 1]))  # rows c a b a
        prefixes = [c, a, b, a]
        got = torch.cat(
            [first[[2, 0, 1, 0]], *(model(cont[:4, i : i + 1], **cache_kwargs(cache)).logits for i in range(20))], 1
        )
    for row, prefix in enumerate(prefixes):
        ref = _run_alone(model, pol, prefix, cont[row : row + 1])
        torch.testing.assert_close(got[row : row + 1], ref, rtol=1e-4, atol=1e-4)


def test_shared_policy_instance_in_two_caches_with_different_windows():
    """One policy instance serving two live caches (interleaved steps) changes nothing for either."""
    model = tiny_model("qwen2")
    mlstm, snap = _learned(model), SnapKVPolicy(obs_window=5)
    a, b = _ids(40, 5), _ids(40, 6)
    kw_a, kw_b = {"budget": 12, "window": 4, "sinks": 2}, {"budget": 20, "window": 8, "sinks": 2}
    for pol, fresh in ((mlstm, lambda: _learned(model)), (snap, lambda: SnapKVPolicy(obs_window=5))):
        ca = KVpopCache(model.config, policy=pol, **kw_a)
        cb = KVpopCache(model.config, policy=pol, **kw_b)
        la, lb = [], []
        with torch.no_grad():
            for i in range(40):  # interleaved: a step of a, then a step of b
                la.append(model(a[:, i : i + 1], **cache_kwargs(ca)).logits)
                lb.append(model(b[:, i : i + 1], **cache_kwargs(cb)).logits)
        ref_a = _run_alone(model, fresh(), a[:, :1], a[:, 1:], **kw_a)
        ref_b = _run_alone(model, fresh(), b[:, :1], b[:, 1:], **kw_b)
        torch.testing.assert_close(torch.cat(la, 1), ref_a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat(lb, 1), ref_b, rtol=1e-4, atol=1e-4)
    assert snap.obs_window == 5  # a cache with window 4 did not shrink the shared instance


@pytest.mark.parametrize("policy", ["kvpop-mlstm", "tova"])
def test_beam_search_scores_equal_each_beam_run_alone(policy):
    model = tiny_model("llama")
    pol = _learned(model) if policy == "kvpop-mlstm" else get_policy(policy)
    prompts = torch.cat([_ids(24, 8), _ids(24, 9)])
    n = 12
    cache = KVpopCache(model.config, policy=pol, **KW)
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        **cache_kwargs(cache),
        num_beams=3,
        num_return_sequences=2,
        max_new_tokens=n,
        min_new_tokens=n,
        length_penalty=0.0,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    seqs = out.sequences
    assert seqs.shape == (4, 24 + n)
    for row in range(4):
        prompt, new = prompts[row // 2 : row // 2 + 1], seqs[row : row + 1, 24:]
        logits = _run_alone(model, pol, prompt, new[:, :-1])
        logp = torch.log_softmax(logits.float(), -1)[0, torch.arange(n), new[0]].sum()
        assert float(logp) == pytest.approx(float(out.sequences_scores[row]), abs=1e-3)


def test_num_return_sequences_rows_equal_each_sequence_alone():
    model = tiny_model("mistral")
    pol = _learned(model)
    prompts = torch.cat([_ids(20, 10), _ids(20, 11)])
    n = 14
    torch.manual_seed(0)
    cache = KVpopCache(model.config, policy=pol, **KW)
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        **cache_kwargs(cache),
        do_sample=True,
        num_return_sequences=3,
        max_new_tokens=n,
        min_new_tokens=n,
        top_k=0,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    got = torch.stack(out.logits, 1)  # [6, n, V]
    assert len({tuple(r.tolist()) for r in out.sequences}) > 2  # the samples differ
    for row in range(6):
        prompt, new = prompts[row // 3 : row // 3 + 1], out.sequences[row : row + 1, 20:]
        ref = _run_alone(model, pol, prompt, new[:, :-1])
        torch.testing.assert_close(got[row : row + 1], ref, rtol=1e-4, atol=1e-4)


def test_reset_restarts_policy_state():
    model = tiny_model("llama")
    pol = _learned(model)
    a, b = _ids(30, 12), _ids(30, 13)
    cache = KVpopCache(model.config, policy=pol, **KW)
    with torch.no_grad():
        model(a, **cache_kwargs(cache))
        cache.reset()
        got = torch.cat(
            [model(b[:, :10], **cache_kwargs(cache)).logits[:, -1:]]
            + [model(b[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(10, 30)],
            1,
        )
    torch.testing.assert_close(got, _run_alone(model, pol, b[:, :10], b[:, 10:]), rtol=1e-4, atol=1e-4)


def test_decode_fast_path_decides_through_the_rule(monkeypatch):
    """Both decode branches call kvpop.rule; a change to the rule reaches the fast path."""
    model = tiny_model("llama")
    calls = {"decide_one": 0, "decide_one_full": 0}
    for name in calls:
        original = getattr(kvpop.rule, name)

        def spy(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(kvpop.rule, name, spy)
    ids = _ids(40, 14)
    cache = KVpopCache(model.config, policy="knorm", **KW)
    with torch.no_grad():
        model(ids[:, :7], **cache_kwargs(cache))  # not full yet: the general path decides the next exits
        for i in range(7, 40):
            model(ids[:, i : i + 1], **cache_kwargs(cache))
    assert calls["decide_one"] > 0 and calls["decide_one_full"] > 0
    # a rule that always evicts the exiting token leaves the long-range slots as they were when they filled
    monkeypatch.setattr(
        kvpop.rule, "decide_one_full", lambda p, i, ep, ei: (i.argmax(-1), torch.zeros_like(ep, dtype=torch.bool))
    )
    frozen = KVpopCache(model.config, policy="knorm", **KW)
    with torch.no_grad():
        for i in range(40):
            model(ids[:, i : i + 1], **cache_kwargs(frozen))
    lr = frozen.layers[0].slot_index[0, :, 6:]
    assert lr.max() < 2 + 4 + 8 + 4  # nothing that exited after the slots filled was kept
