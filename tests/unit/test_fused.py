"""The fused steady decode step (kvpop.step, kvpop.scorers.decode): equal to the warm-up's masked step, eager and
compiled."""

import warnings

import pytest
import torch

from kvpop import KVpopCache
from kvpop.scorers.mlstm import MLSTMState
from kvpop.testing import compile_unavailable, random_learned_policy, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)


def _policy(name, model):
    if name.startswith("kvpop"):
        return random_learned_policy(
            model, "mlp" if "mlp" in name else "mlstm", extra=name.endswith(("+", "x")), cross_heads=name.endswith("x")
        )
    return name


@torch.no_grad()
def _run(model, cache, ids, prefill, steady=True):
    for layer in cache.layers:
        layer.steady = steady
    outs = [model(ids[:, :prefill], past_key_values=cache).logits]
    outs += [model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(outs, 1)


def _ids(n, batch=1):
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(128, generator=g)[:n] for _ in range(batch)])


# (dtype, layers, logits tolerance): bfloat16 with one layer, as in tests/unit/test_cache.py's DTYPES
DTYPES = {"float32": (torch.float32, 2, 1e-5), "bfloat16": (torch.bfloat16, 1, 1e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "policy",
    [
        "h2o",
        "tova",
        "snapkv",
        "knorm",
        "random",
        "kvpop-mlstm",
        "kvpop-mlp",
        "kvpop-mlstm+",
        "kvpop-mlp+",
        "kvpop-mlpx",
    ],
)
@pytest.mark.parametrize("batch", [1, 2])
def test_steady_path_equals_general_decode(policy, batch, dtype):
    """Same logits, same held tokens, same priorities and scorer state with and without the fused steady path."""
    dt, layers, tol = DTYPES[dtype]
    model = tiny_model("llama", num_hidden_layers=layers, dtype=dt)
    ids = _ids(90, batch)
    kw = {"budget": 20, "window": 6, "sinks": 2, "lam": 0.01}
    a = KVpopCache(model.config, policy=_policy(policy, model), **kw)
    b = KVpopCache(model.config, policy=_policy(policy, model), **kw)
    la, lb = _run(model, a, ids, 30), _run(model, b, ids, 30, steady=False)
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    _assert_same_layers(a, b, rtol=1e-5, atol=1e-6)  # priorities and statistics are float32 in either dtype


def _assert_same_layers(a, b, rtol, atol):
    """Same held tokens in every layer of caches ``a`` and ``b``, and the same priorities, window
    statistics and scorer state to tolerance."""
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.slot_index, y.slot_index)
        torch.testing.assert_close(x.lr_prio, y.lr_prio, rtol=rtol, atol=atol)
        torch.testing.assert_close(x.observed, y.observed, rtol=rtol, atol=atol)
        if x.policy_state is not None:
            for s, t in zip(x.policy_state, y.policy_state):
                torch.testing.assert_close(s, t, rtol=rtol, atol=atol)


def test_decode_scores_equal_step_and_read():
    model = tiny_model("qwen3", num_hidden_layers=1)
    for kind in ("mlstm", "mlp", "mlp-cross-heads"):
        scorer = random_learned_policy(model, kind.split("-")[0], extra=True, cross_heads="cross" in kind).scorer
        g = torch.Generator().manual_seed(1)
        k_new, v_new, k_rd, v_rd = (torch.randn(2, 2, 1, 16, generator=g) for _ in range(4))
        obs = torch.rand(2, 2, 1, 3, generator=g)
        t_new, t_rd = torch.tensor([40, 57]), torch.tensor([34, 51])
        state = scorer.init_state(2)[0]
        if state is not None:  # a non-empty state, as in decoding
            state = scorer.step(0, state, *(torch.randn(2, 2, 9, 16, generator=g) for _ in range(2)))
        s1, r1 = scorer.step_and_read(
            0,
            state,
            k_new,
            v_new,
            k_rd,
            v_rd,
            new_positions=t_new.view(2, 1),
            read_positions=t_rd.view(2, 1),
            observed=obs,
            window=6,
        )
        s2, r2 = scorer.decode_scores(0, state, k_new, v_new, k_rd, v_rd, t_new, t_rd, obs, 6)
        torch.testing.assert_close(r2, r1.squeeze(-1), rtol=1e-5, atol=1e-5)
        if s1 is not None:
            for x, y in zip(s1, s2):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_chunk_exit_scores_equal_step_and_read():
    """A stateless scorer scores a prefill chunk's exits alone (``learned_score`` -> ``exit_scores``):
    the scores of its general chunk form (what it was trained with), wherever an exit is present."""
    from kvpop.policies import ExitBatch
    from kvpop.policies.learned import learned_score

    model = tiny_model("qwen3", num_hidden_layers=1)
    for kind in ("mlp", "mlp-cross-heads"):
        scorer = random_learned_policy(model, "mlp", extra=True, cross_heads="cross" in kind).scorer
        g = torch.Generator().manual_seed(2)
        k_new, v_new, k_rd, v_rd = (torch.randn(2, 2, 7, 16, generator=g) for _ in range(4))
        obs = torch.rand(2, 2, 7, 3, generator=g)
        t_new = torch.tensor([[40 + i for i in range(7)], [-1, -1, 50, 51, 52, 53, 54]])
        t_rd = torch.where(t_new >= 0, t_new - 6, -1)
        t_rd[0, :2] = -1  # no exit there yet
        _, want = scorer.step_and_read(
            0,
            None,
            k_new,
            v_new,
            k_rd,
            v_rd,
            torch.arange(7),
            t_new >= 0,
            new_positions=t_new,
            read_positions=t_rd,
            observed=obs,
            window=6,
        )
        batch = ExitBatch(0, k_rd, v_rd, t_rd, k_new, v_new, t_new, obs, False, 6)
        state, got = learned_score(scorer, None, batch)
        assert state is None and got.shape == (2, 2, 7)
        present = (t_rd >= 0).unsqueeze(1).expand_as(got)
        torch.testing.assert_close(got[present], want[present], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_step_equals_eager():
    """compile=True (inductor's code for kvpop.step's steady step) gives the eager decisions and outputs."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(70)
    for policy in ("kvpop-mlstm+", "kvpop-mlp+", "h2o", "knorm", "random"):
        kw = {"budget": 20, "window": 6, "sinks": 2}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            a = KVpopCache(model.config, policy=_policy(policy, model), compile=True, **kw)
            la = _run(model, a, ids, 30)
        if any("compiling the decode step failed" in str(w.message) for w in caught):
            compile_unavailable("torch.compile failed and the step ran eagerly")
        b = KVpopCache(model.config, policy=_policy(policy, model), **kw)
        torch.testing.assert_close(la, _run(model, b, ids, 30), rtol=1e-4, atol=1e-4)
        for x, y in zip(a.layers, b.layers):
            assert torch.equal(x.slot_index, y.slot_index)
        assert _all_bound(a)  # the steps after the first ran through the bound step
        assert a.compile_status == "compiled" and b.compile_status == "eager"


@pytest.mark.slow
def test_compiled_step_equals_eager_in_bfloat16():
    """compile=True with bfloat16 buffers (the GPU bench's dtype): the eager decisions and outputs."""
    dt, layers, tol = DTYPES["bfloat16"]
    model = tiny_model("llama", num_hidden_layers=layers, dtype=dt)
    ids = _ids(60)
    for policy in ("kvpop-mlstm+", "h2o"):
        kw = {"budget": 20, "window": 6, "sinks": 2}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            a = KVpopCache(model.config, policy=_policy(policy, model), compile=True, **kw)
            la = _run(model, a, ids, 30)
        if any("compiling the decode step failed" in str(w.message) for w in caught):
            compile_unavailable("torch.compile failed and the step ran eagerly")
        b = KVpopCache(model.config, policy=_policy(policy, model), **kw)
        torch.testing.assert_close(la, _run(model, b, ids, 30), rtol=tol, atol=tol)
        assert a.layers[0].keys.dtype == torch.bfloat16
        _assert_same_layers(a, b, rtol=1e-4, atol=1e-5)
        assert _all_bound(a)


def _all_bound(cache) -> bool:
    return all(cache.compiled_step.bound.get(layer.layer_idx) is not None for layer in cache.layers)


@pytest.mark.slow
def test_compiled_step_follows_reorder_and_reset():
    """The bound compiled step is dropped when the layer's buffers or state are replaced (a beam
    reorder, a reset): the results stay those of the eager path."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(64, batch=2)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    policy = _policy("kvpop-mlstm+", model)
    caches = [KVpopCache(model.config, policy=policy, compile=c, **kw) for c in (True, False)]

    @torch.no_grad()
    def steps(cache, lo, hi):
        return torch.cat([model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(lo, hi)], 1)

    with torch.no_grad():
        for cache in caches:
            model(ids[:, :30], past_key_values=cache)
    outs = []
    for cache in caches:
        la = steps(cache, 30, 40)
        cache.reorder_cache(torch.tensor([1, 0]))
        lb = steps(cache, 40, 50)
        cache.reset()
        with torch.no_grad():
            model(ids[:, :30], past_key_values=cache)
        outs.append(torch.cat([la, lb, steps(cache, 30, 64)], 1))
    if not caches[0].compiled_step.bound:
        compile_unavailable("the compiled step was never bound")
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for x, y in zip(*(c.layers for c in caches)):
        assert torch.equal(x.slot_index, y.slot_index)


def test_a_policy_that_overrides_score_is_not_fused():
    """A subclass of a built-in heuristic with its own score must not be scored by the parent's
    fused function."""
    from kvpop.policies.knorm import KnormPolicy

    class Mine(KnormPolicy):
        name = "mine"

        def score(self, state, batch):
            return state, batch.keys.float().norm(dim=-1)

    assert KnormPolicy().steady_score(0, torch.device("cpu")) is not None
    assert Mine().steady_score(0, torch.device("cpu")) is None
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(60)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    a, b = KVpopCache(model.config, policy=Mine(), **kw), KVpopCache(model.config, policy=Mine(), **kw)
    torch.testing.assert_close(_run(model, a, ids, 30), _run(model, b, ids, 30, steady=False))
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.slot_index, y.slot_index)


def _toy(spec, w: tuple, state, x, buf):
    """A pure step with every argument kind Direct handles: a constant, a tuple with a None, a
    NamedTuple, an in-place write to an input, and a None result."""
    scale, slot = spec
    buf[:, slot] = x.sum(-1)  # in place, as the cache's buffers are written
    return x * scale + w[0], None, type(state)(state.C + 1, state.n, state.m)


@pytest.mark.slow
def test_direct_compiled_call_follows_its_inputs():
    """kvpop.compiled.Direct (inductor's code called without dynamo): one graph per layout and
    constant, the eager results, in-place writes kept, autograd left to the eager function."""
    from kvpop.compiled import Direct

    try:
        direct = Direct(_toy, {"cpp_wrapper": True, "cpp.threads": 1})
        state = MLSTMState(torch.zeros(2, 3), torch.ones(2), torch.zeros(2))
        args = ((2.0, 1), (torch.ones(4), None), state, torch.randn(2, 4), torch.zeros(2, 3))
        got = direct(*args)
    except Exception as exc:  # noqa: BLE001 (no working compiler here)
        compile_unavailable(f"inductor failed: {exc}")
    buf_eager = torch.zeros(2, 3)
    want = _toy(*args[:4], buf_eager)
    torch.testing.assert_close(got[0], want[0])
    assert got[1] is None and isinstance(got[2], MLSTMState)
    torch.testing.assert_close(got[2].C, want[2].C)
    torch.testing.assert_close(args[4], buf_eager)  # the write reached the caller's tensor
    assert len(direct.graphs) == 1
    direct(*args)  # same layout and constants: no new graph
    assert len(direct.graphs) == 1
    direct((3.0, 1), *args[1:])  # another constant: its own graph, its own result
    torch.testing.assert_close(direct((3.0, 2), *args[1:])[0], args[3] * 3.0 + 1)
    assert len(direct.graphs) == 3
    x = torch.randn(4, 2).t()  # same shape, other strides: a new graph, still right
    torch.testing.assert_close(direct((2.0, 0), args[1], state, x, torch.zeros(2, 3))[0], x * 2.0 + 1)
    assert len(direct.graphs) == 4
    xg = torch.randn(2, 4, requires_grad=True)
    out = direct((2.0, 0), args[1], state, xg, torch.zeros(2, 3))[0]
    out.sum().backward()  # ran eagerly: autograd works
    torch.testing.assert_close(xg.grad, torch.full_like(xg, 2.0))
    assert len(direct.graphs) == 4


@pytest.mark.slow
def test_torch_compile_path_equals_eager():
    """The step as other devices (CUDA) compile it, through torch.compile and dynamo's handling of
    the in-place updates (buffers, statistics, scorer state), run here on the CPU: same outputs and
    decisions as eager. No bound step: only inductor's direct CPU code is bound."""
    from kvpop import compiled

    def via_dynamo(name, device_type="cpu"):
        return compiled.Dynamo(compiled.STEPS[name])  # what compiled_code gives other devices

    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(60, batch=2)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    for policy in ("kvpop-mlstm+", "h2o"):
        b = KVpopCache(model.config, policy=_policy(policy, model), **kw)
        want = _run(model, b, ids, 30)
        a = KVpopCache(model.config, policy=_policy(policy, model), compile=True, **kw)
        a.compiled_step.compiler = via_dynamo
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            got = _run(model, a, ids, 30)
        if any("compiling the decode step failed" in str(w.message) for w in caught):
            compile_unavailable("torch.compile failed and the step ran eagerly")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        _assert_same_layers(a, b, rtol=1e-4, atol=1e-5)  # the scorer state: 40 steps in another float order
        assert not a.compiled_step.bound


def _toy_tensors(spec, w: tuple, x, buf):
    scale, slot = spec
    buf[:, slot] = x.sum(-1)
    return x * scale + w[0], x.sum()


@pytest.mark.slow
def test_direct_bind_replaces_only_the_dynamic_tensors():
    """Direct.bind: the bound graph with new dynamic tensors gives the eager results and writes in
    place; new tensors of another layout, dtype, or needing autograd do not fit; a dynamic tensor
    that is not among the arguments, or a function returning non-tensors, is not bound."""
    from kvpop.compiled import Direct

    try:
        direct = Direct(_toy_tensors, {"cpp_wrapper": True, "cpp.threads": 1, "memory_planning": True})
        w, buf, x = (torch.ones(4), None), torch.zeros(2, 3), torch.randn(2, 4)
        bound = direct.bind(((2.0, 1), w, x, buf), (x,))
    except Exception as exc:  # noqa: BLE001 (no working compiler here)
        compile_unavailable(f"inductor failed: {exc}")
    assert bound is not None
    for _ in range(3):  # a new x each call, as a decode step's query
        x = torch.randn(2, 4)
        assert bound.fits(x)
        out, total = bound(x)
        torch.testing.assert_close(out, x * 2.0 + 1)
        torch.testing.assert_close(total, x.sum())
        torch.testing.assert_close(buf[:, 1], x.sum(-1))  # the write reached the bound buffer
    assert not bound.fits(torch.randn(4, 2).t())  # same shape, other strides
    assert not bound.fits(torch.randn(2, 5))
    assert not bound.fits(torch.randn(2, 4, dtype=torch.float64))
    xg = torch.randn(2, 4, requires_grad=True)
    assert not bound.fits(xg)
    with torch.no_grad():
        assert bound.fits(xg)
    assert direct.bind(((2.0, 1), w, x, buf), (torch.randn(2, 4),)) is None  # not an argument
    assert direct.bind(((2.0, 1), w, x, x), (x,)) is None  # appears twice
    assert direct.bind(((2.0, 1), w, x, x), (x, buf)) is None  # one twice, one missing
    assert Direct(_toy, {}).bind(((2.0, 1), w, MLSTMState(x, x, x), x, buf), (x,)) is None  # returns a None


def test_compile_argument_is_checked():
    model = tiny_model("llama", num_hidden_layers=1)
    with pytest.raises(TypeError, match="compile must be True, False or None"):
        KVpopCache(model.config, budget=20, window=6, policy="h2o", compile="yes")


def test_bench_specs_floor_and_compile():
    from transformers import StaticCache

    from kvpop.bench.common import cache_for_spec, parse_policy

    assert parse_policy("dense") == ("dense", None)
    assert parse_policy("floor@64") == ("floor", 64)
    assert parse_policy("kvpop-mlstm@512+compile") == ("kvpop-mlstm+compile", 512)
    with pytest.raises(ValueError, match="floor@budget"):
        parse_policy("h2o")
    model = tiny_model("llama", num_hidden_layers=1)
    floor = cache_for_spec(model, "floor@32")
    assert isinstance(floor, StaticCache)
    with torch.no_grad():
        model(_ids(20), past_key_values=floor)
    assert floor.layers[0].keys.shape[2] == 32  # B slots, whatever the context
    cache = cache_for_spec(model, "h2o@24+compile")
    assert cache.budget == 24 and cache.compiled_step.enabled
    assert not cache_for_spec(model, "h2o@24").compiled_step.enabled  # a spec without +compile: eager
    assert parse_policy("kvpop-mlp@2048/1024") == ("kvpop-mlp", 2048)
    assert cache_for_spec(model, "h2o@24/4").eviction.chunk == 4  # a prefill piece of its own
    assert cache_for_spec(model, "h2o@24").eviction.chunk == cache.eviction.chunk


def _slots_after(n_real: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """``[b, sinks + window]``: the token each sink and ring slot holds after ``n_real`` tokens (-1: none)."""
    out = torch.full((n_real.numel(), sinks + window), -1)
    for row, seen in enumerate(n_real.tolist()):
        for t in range(min(seen, sinks)):
            out[row, t] = t
        for t in range(max(sinks, seen - window), seen):
            out[row, sinks + (t - sinks) % window] = t
    return out


@pytest.mark.parametrize(
    ("sinks", "window", "c", "seen", "pad"),
    [
        (2, 5, 5, [0, 9, 23], [3, 0, 1]),  # a first chunk, a ring filling up, a full ring; left padding
        (2, 5, 3, [1, 4, 40], [0, 2, 0]),  # fewer new tokens than the window; seen inside the sinks
        (0, 6, 6, [0, 7, 30], [2, 0, 0]),  # no sinks
        (4, 8, 1, [3, 12, 50], [0, 0, 0]),  # one token at a time
        (3, 8, 8, [17, 18, 19], [0, 0, 0]),  # no padding (valid=None)
    ],
)
def test_chunk_observed_equals_masked_reference(sinks, window, c, seen, pad):
    """The banded chunk statistics equal the masked form over every column, per observation window."""
    from kvpop.observed import CHUNK_BLOCK, chunk_observed
    from kvpop.testing.observed import chunk_observed_reference

    g = torch.Generator().manual_seed(sinks + window + c)
    b, h, hq, d, k = 3, 2, 4, 8, 3
    n_real = torch.tensor(seen)
    valid = torch.arange(c).view(1, c) >= torch.tensor(pad).view(b, 1)
    valid = None if bool(valid.all()) else valid
    query = torch.randn(b, hq, c, d, generator=g)
    keys = torch.randn(b, h, sinks + window + k + c, d, generator=g)
    slots = _slots_after(n_real, sinks, window)
    for obs in [(window, 2, 1), (1,), (3, window), (window,)]:
        got = chunk_observed(query, keys, slots, n_real, valid, sinks, window, obs, 0.3)
        want = chunk_observed_reference(query, keys, slots, n_real, valid, sinks, window, obs, 0.3)
        assert got.shape == (b, h, window + c, len(obs))
        torch.testing.assert_close(got, want)
    assert CHUNK_BLOCK >= 1


def test_chunk_observed_blocks_agree(monkeypatch):
    """Logits formed block by block give what one block gives (queries beyond the first block)."""
    from kvpop import observed

    g = torch.Generator().manual_seed(0)
    n_real, sinks, window, c = torch.tensor([40, 77]), 2, 16, 16
    query, keys = torch.randn(2, 4, c, 8, generator=g), torch.randn(2, 2, sinks + window + 5 + c, 8, generator=g)
    slots = _slots_after(n_real, sinks, window)
    args = (query, keys, slots, n_real, None, sinks, window, (16, 4, 1), 0.3)
    whole = observed.chunk_observed(*args)
    monkeypatch.setattr(observed, "CHUNK_BLOCK", 5)
    torch.testing.assert_close(observed.chunk_observed(*args), whole)


def test_failed_compile_falls_back_to_eager_once():
    """A compiler that fails warns once and the step runs eagerly with the same result."""

    def broken(name, device_type="cpu"):
        raise RuntimeError("no compiler here")

    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(40)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    a = KVpopCache(model.config, policy="h2o", compile=True, **kw)
    a.compiled_step.compiler = broken
    with pytest.warns(RuntimeWarning, match="no compiler here") as caught:
        la = _run(model, a, ids, 30)
    assert sum("no compiler here" in str(w.message) for w in caught) == 1
    assert a.compiled_step.error is not None and a.compile_status.startswith("eager (compiling failed")
    b = KVpopCache(model.config, policy="h2o", **kw)
    torch.testing.assert_close(la, _run(model, b, ids, 30), rtol=1e-5, atol=1e-5)


def test_compile_is_on_by_default(monkeypatch):
    """A cache compiles its steady step unless told (compile=False) or KVPOP_COMPILE=0 (this suite's setting)."""
    model = tiny_model("llama", num_hidden_layers=1)
    kw = {"budget": 20, "window": 6, "sinks": 2, "policy": "h2o"}
    monkeypatch.delenv("KVPOP_COMPILE", raising=False)
    cache = KVpopCache(model.config, **kw)
    assert cache.compiled_step.enabled and cache.compile_status == "compiled (not reached)"
    assert not KVpopCache(model.config, compile=False, **kw).compiled_step.enabled
    monkeypatch.setenv("KVPOP_COMPILE", "0")
    assert KVpopCache(model.config, **kw).compile_status == "eager"
    assert KVpopCache(model.config, compile=True, **kw).compiled_step.enabled


@pytest.mark.slow
def test_default_compiles_only_once_a_generation_is_long(monkeypatch):
    """Not told (compile=None), a cache runs each layer's first EAGER_STEPS steady steps eagerly (a short
    generation never waits on the compiler), then compiles and binds; the outputs equal an eager cache's."""
    from kvpop.compiled import EAGER_STEPS

    model = tiny_model("llama", num_hidden_layers=2)
    kw = {"budget": 20, "window": 6, "sinks": 2, "policy": "h2o"}
    monkeypatch.delenv("KVPOP_COMPILE", raising=False)
    short, long_ids = _ids(30 + EAGER_STEPS // 2), _ids(30 + EAGER_STEPS + 8)
    a = KVpopCache(model.config, **kw)
    la = _run(model, a, short, 30)
    assert not a.compiled_step.ran and a.compile_status.startswith("eager (the step compiles after")
    torch.testing.assert_close(la, _run(model, KVpopCache(model.config, compile=False, **kw), short, 30))
    b = KVpopCache(model.config, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        lb = _run(model, b, long_ids, 30)
    if any("compiling the decode step failed" in str(w.message) for w in caught):
        compile_unavailable("torch.compile failed and the step ran eagerly")
    assert b.compile_status == "compiled" and _all_bound(b)
    eager = _run(model, KVpopCache(model.config, compile=False, **kw), long_ids, 30)
    torch.testing.assert_close(lb, eager, rtol=1e-4, atol=1e-4)


def test_bench_vllm_parts_and_plot_of_one_part(tmp_path):
    """``kvpop bench vllm --parts`` measures one part alone: a bad part is refused at parsing, and the
    plot of a throughput-only run (with the prefill seconds it reports) is drawn."""
    from kvpop.bench import vllm as bench_vllm

    assert bench_vllm._parse(["--parts", "throughput"]).parts == ["throughput"]
    assert bench_vllm._parse([]).parts == ["admission", "throughput"]
    with pytest.raises(SystemExit):
        bench_vllm._parse(["--parts", "prefill"])
    row = {"count": 2, "tokens_per_s": 10.0, "prefill_seconds": 3.0}
    results = {
        "budget": 512,
        "kv_space_mib": 512,
        "throughput_length": 4096,
        "admission": {},
        "throughput": {"dense": {"rows": [row]}, "kvpop-mlp": {"rows": [dict(row, tokens_per_s=20.0)]}},
    }
    assert bench_vllm.plot(results, tmp_path / "p.png").is_file()


def test_bench_prefill_writes_json_and_png(tmp_path):
    """``kvpop bench prefill`` on a tiny model: one row per spec (a prefill piece of its own included),
    the ratio to dense, and the plot beside the JSON."""
    import json

    from kvpop.bench import prefill

    model = tiny_model("llama", num_hidden_layers=1)

    class Tok:  # text_ids needs a tokenizer only to cut real text; any ids do here
        pass

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill, "load_model_quietly", lambda name: (model, Tok()))
        mp.setattr(prefill, "text_ids", lambda tok, n: _ids(n))
        out = tmp_path / "p"
        assert (
            prefill.main(
                [
                    "--length",
                    "60",
                    "--repeats",
                    "1",
                    "--warmup",
                    "8",
                    "--policies",
                    "dense,h2o@24,h2o@24/4",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["policy"] for r in result["rows"]] == ["dense", "h2o@24", "h2o@24/4"]
    assert result["rows"][0]["throughput_vs_dense"] == 1.0
    assert out.with_suffix(".png").stat().st_size > 0
