"""kvpop.serving.paged: KVpop layers on per-request pages, driven like a serving engine drives them.

An emulated engine runs a tiny model over several requests at once: each step packs some
requests' new tokens side by side (unaligned prefill chunks, decode tokens, requests that skip a
step), and every layer's attention goes through ``step_layer`` on pages in a pool of random
bytes. Each request must get the logits and end with the slots that a ``KVpopCache`` gives it
alone (the serving parity that the vLLM plugin builds on, checked here without vLLM).
"""

import copy
import random
import warnings

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvpop import KVpopCache
from kvpop.config import EvictionConfig
from kvpop.policies import get_policy
from kvpop.serving.paged import PageLayout, Request, plan_step, step_layer
from kvpop.testing import random_learned_policy, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)

NAME = "kvpop_paged_test"
_ENGINE = {}


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    eng = _ENGINE["current"]
    i = module.layer_idx
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, d]: the engine's flat batch
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"))
    step_layer(eng.cache.layers[i], eng.layouts[i], eng.pools[i], eng.groups, q, k, v, out, scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, _paged_attention)
AttentionMaskInterface.register(NAME, lambda **kwargs: None)


class Engine:
    """A toy serving engine: requests hold one page per layer; each step runs a packed batch."""

    def __init__(self, model, policy, eviction, pages=8, seed=0):
        self.model = model
        self.cache = KVpopCache(copy.deepcopy(model.config), eviction=eviction, policy=policy)
        text = model.config
        h, d = text.num_key_value_heads, text.head_dim
        self.layouts = [PageLayout(layer, h, d, d, torch.float32) for layer in self.cache.layers]
        g = torch.Generator().manual_seed(seed)
        # garbage everywhere: a fresh request must never read its page
        self.pools = [
            torch.randint(0, 256, (pages, lay.page_bytes), dtype=torch.uint8, generator=g) for lay in self.layouts
        ]
        self.groups = []

    @torch.no_grad()
    def step(self, parts):
        """``parts``: (page, tokens [n], seen, prompt_len) per request; returns each request's logits."""
        ids, pos, reqs, start = [], [], [], 0
        for page, tokens, seen, prompt_len in parts:
            n = len(tokens)
            ids += tokens
            pos += list(range(seen, seen + n))
            reqs.append(Request(page, start, n, seen, seen < prompt_len))
            start += n
        eviction = self.cache.eviction
        self.groups = plan_step(reqs, eviction.budget, eviction.chunk)
        _ENGINE["current"] = self
        saved = self.model.config._attn_implementation
        self.model.config._attn_implementation = NAME
        try:
            logits = self.model(torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False).logits[0]
        finally:
            self.model.config._attn_implementation = saved
        out, start = [], 0
        for _, tokens, _, _ in parts:
            out.append(logits[start : start + len(tokens)])
            start += len(tokens)
        return out


def _policy(name, model):
    if name.startswith("kvpop"):
        return random_learned_policy(
            model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith(("+", "x")), cross_heads=name.endswith("x")
        )
    return get_policy(name)


@torch.no_grad()
def _reference(model, policy, eviction, ids, prompt_len):
    """Logits of one request alone through a KVpopCache: the prompt in one call, then token by token."""
    cache = KVpopCache(copy.deepcopy(model.config), eviction=eviction, policy=policy)
    saved = model.config._attn_implementation
    model.config._attn_implementation = "kvpop"
    try:
        out = [model(ids[:, :prompt_len], past_key_values=cache).logits]
        out += [model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(prompt_len, ids.shape[1])]
    finally:
        model.config._attn_implementation = saved
    return torch.cat(out, 1)[0], cache


def _run_engine(model, policy, eviction, requests, seed):
    """Feed ``requests`` (ids [1, n], prompt_len) through the engine on a random schedule."""
    rng = random.Random(seed)
    eng = Engine(model, policy, eviction, pages=2 * len(requests) + 1, seed=seed)
    pages = rng.sample(range(2 * len(requests) + 1), len(requests))  # scattered, not in request order
    seen = [0] * len(requests)
    logits = [[] for _ in requests]
    while any(s < r[0].shape[1] for s, r in zip(seen, requests)):
        parts, who = [], []
        order = list(range(len(requests)))
        rng.shuffle(order)
        for i in order:
            ids, prompt_len = requests[i]
            if seen[i] >= ids.shape[1] or rng.random() < 0.2:  # done, or not scheduled this step
                continue
            n = rng.randint(1, 2 * eviction.window + 3) if seen[i] < prompt_len else 1
            n = min(n, prompt_len - seen[i]) if seen[i] < prompt_len else 1
            parts.append((pages[i], ids[0, seen[i] : seen[i] + n].tolist(), seen[i], prompt_len))
            who.append(i)
        if not parts:
            continue
        for i, lg, part in zip(who, eng.step(parts), parts):
            logits[i].append(lg)
            seen[i] += len(part[1])
    return eng, pages, [torch.cat(x) for x in logits]


@pytest.mark.parametrize("policy", ["streaming", "h2o", "kvpop-mlstm", "kvpop-mlp", "kvpop-mlstm+", "kvpop-mlpx"])
def test_paged_engine_equals_kvpop_cache_per_request(policy):
    model = tiny_model(num_hidden_layers=2)
    pol = _policy(policy, model)
    eviction = EvictionConfig(sinks=2, window=8, k=6)
    g = torch.Generator().manual_seed(1)
    lengths = [(23, 44), (41, 55), (9, 40)]  # (prompt, total): prompts shorter and longer than B = 16
    requests = [(torch.randint(3, 128, (1, total), generator=g), prompt) for prompt, total in lengths]
    eng, pages, got = _run_engine(model, pol, eviction, requests, seed=5)
    # between steps a request's state is its pages only: no layer keeps the gathered copies
    assert all(not layer.is_initialized and layer.keys is None for layer in eng.cache.layers)
    for (ids, prompt_len), page, lg in zip(requests, pages, got):
        want, cache = _reference(model, pol, eviction, ids, prompt_len)
        torch.testing.assert_close(lg, want, atol=2e-5, rtol=2e-5)
        for layer, layout, pool in zip(cache.layers, eng.layouts, eng.pools):
            held = layout.view(pool, "slot_index")[page].long()
            assert torch.equal(held, layer.slot_index[0]), "the page holds other tokens than the cache"
            filled = held >= 0
            torch.testing.assert_close(layout.view(pool, "keys")[page][filled], layer.keys[0][filled])
            assert int(layout.view(pool, "n_real")[page]) == ids.shape[1]


def test_page_layout_round_trip_and_sizes():
    model = tiny_model(num_hidden_layers=1)
    eviction = EvictionConfig(sinks=2, window=8, k=6)
    cache = KVpopCache(copy.deepcopy(model.config), eviction=eviction, policy=random_learned_policy(model, "mlstm"))
    layer = cache.layers[0]
    layout = PageLayout(layer, 2, 16, 16, torch.float32)
    sizes = layout.nbytes()
    assert sizes["keys"] == sizes["values"] == 2 * 16 * 16 * 4  # h * B * d * 4 bytes: exactly B slots
    assert sizes["slot_index"] == 2 * 16 * 4 and sizes["lr_prio"] == 2 * 6 * 4
    assert "observed" not in sizes  # the mLSTM policy reads no attention statistics
    assert layout.page_bytes >= sum(sizes.values()) and layout.page_bytes % 16 == 0
    pool = torch.zeros(4, layout.page_bytes, dtype=torch.uint8)
    buf = layout.fresh(layer, 2, "cpu")
    g = torch.Generator().manual_seed(0)
    buf.keys.normal_(generator=g)
    buf.values.normal_(generator=g)
    buf.slot_index.random_(-1, 50, generator=g)
    buf.lr_prio.normal_(generator=g)
    buf.n_real.fill_(17)
    buf.policy_state.C.normal_(generator=g)
    pages = torch.tensor([3, 1])
    layout.write(pool, pages, buf, None)
    got, before = layout.gather(pool, pages, torch.tensor([17, 17]))
    n = eviction.budget
    assert torch.equal(got.keys[:, :, :n], buf.keys[:, :, :n]) and torch.equal(
        got.values[:, :, :n], buf.values[:, :, :n]
    )
    assert torch.equal(got.slot_index[:, :, :n], buf.slot_index[:, :, :n]) and torch.equal(
        before.long(), buf.slot_index[:, :, :n]
    )
    assert torch.equal(got.lr_prio[:, :, :6], buf.lr_prio[:, :, :6])
    for a, b in zip(got.policy_state, buf.policy_state):
        assert torch.equal(a, b)
    assert pool[0].count_nonzero() == 0 and pool[2].count_nonzero() == 0  # other pages untouched
    with pytest.raises(RuntimeError, match="seen"):
        layout.gather(pool, pages, torch.tensor([17, 16]))


def test_plan_step_groups_and_aligned_pieces():
    reqs = [
        Request(page=4, start=0, length=1, seen=30, prefill=False),  # steady decode (B = 16)
        Request(page=2, start=1, length=13, seen=5, prefill=True),  # pieces end at multiples of 8
        Request(page=0, start=14, length=1, seen=7, prefill=False),  # decode, still filling up
        Request(page=1, start=15, length=1, seen=3, prefill=True),  # a prompt's one-token chunk: chunk path
        Request(page=3, start=16, length=1, seen=31, prefill=False),
    ]
    groups = plan_step(reqs, budget=16, chunk=8)
    prefill = [g for g in groups if not g.decode]
    decode = {tuple(g.pages.tolist()): g for g in groups if g.decode}
    assert [g.pieces for g in prefill] == [((1, 4), (4, 12), (12, 14)), ((15, 16),)]
    assert [g.fresh for g in prefill] == [False, False]
    assert set(decode) == {(4, 3), (0,)}
    assert decode[(4, 3)].tokens.tolist() == [0, 16] and decode[(4, 3)].seen.tolist() == [30, 31]
