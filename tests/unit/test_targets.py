import math
import warnings

import pytest
import torch

from kvpop.targets import (
    _flex,
    fused_available,
    future_attention,
    future_attention_windows,
    loss_mask,
    n_future,
    resolve_method,
    row_lse,
    spread_targets,
)


def _qk(B, kv, G, S, D=16, dtype=torch.float32, seed=0, amp=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, kv * G, S, D, generator=g, dtype=torch.float64) * amp).to(dtype)
    k = (torch.randn(B, kv, S, D, generator=g, dtype=torch.float64) * amp).to(dtype)
    return q, k


def _naive(q, k, window, scale=None, power=1.0):
    """Loop-level definition of the spec, float64, independent of the dense implementation."""
    q = q.double()
    k = k.double()
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    scale = D**-0.5 if scale is None else scale
    out = torch.full((B, Hk, S), -math.inf, dtype=torch.float64)
    for b in range(B):
        for g in range(Hq):
            h = g // G
            logits = (q[b, g] @ k[b, h].T) * scale  # [d, t]
            p = torch.zeros(S, S, dtype=torch.float64)
            for d in range(S):
                p[d, : d + 1] = torch.softmax(logits[d, : d + 1], dim=0)
            for t in range(S):
                if t + window > S - 1:
                    continue
                n = max(1, S - (t + window))
                m = (p[t + window :, t] ** power).sum() / n
                out[b, h, t] = max(out[b, h, t], math.log(m) / power)
    return out


def _check(out, ref, atol, rtol=0.0):
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    assert torch.equal(out[~fin], ref[~fin])
    torch.testing.assert_close(out[fin].to(ref.dtype), ref[fin], atol=atol, rtol=rtol)


def test_dense_matches_naive_definition():
    q, k = _qk(2, 2, 2, 23, D=8, dtype=torch.float64)
    for w in (0, 1, 4, 22):
        _check(future_attention(q, k, w, method="dense"), _naive(q, k, w), atol=1e-12)


CASES = [
    # S, window, G (GQA ratio), batch
    (17, 0, 1, 1),
    (17, 5, 3, 2),
    (64, 0, 2, 2),
    (64, 1, 1, 1),
    (64, 5, 2, 1),
    (200, 1, 3, 1),
    (200, 64, 2, 2),
    (513, 0, 3, 1),
    (513, 5, 1, 2),
    (513, 64, 3, 2),
]


@pytest.mark.parametrize("S,window,G,B", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["blocked", "fused"])
def test_fast_matches_dense(S, window, G, B, dtype, method):
    q, k = _qk(B, 2, G, S, dtype=dtype, seed=S + window)
    ref = future_attention(q, k, window, method="dense")
    out = future_attention(q, k, window, method=method, block=64)
    assert out.shape == (B, 2, S) and out.dtype == dtype
    atol = 2e-5 if dtype == torch.float32 else 1e-10
    _check(out, ref, atol=atol)


@pytest.mark.parametrize("S,window,G,B", [(64, 5, 2, 1), (200, 64, 3, 2), (513, 1, 1, 1)])
def test_fused_bf16(S, window, G, B):
    assert fused_available(torch.bfloat16)
    q, k = _qk(B, 2, G, S, dtype=torch.bfloat16, seed=1)
    ref = future_attention(q, k, window, method="dense")  # computed in float32 from the bf16 values
    for method in ("fused", "blocked"):
        out = future_attention(q, k, window, method=method)
        assert out.dtype == torch.float32
        _check(out, ref, atol=2e-2)


def test_given_lse_is_used_and_row_lse():
    q, k = _qk(2, 2, 3, 100, dtype=torch.float64, seed=3)
    scale = 0.3
    lse = row_lse(q, k, scale=scale)
    logits = torch.matmul(q, k.repeat_interleave(3, 1).transpose(-1, -2)) * scale
    logits = logits.masked_fill(torch.ones(100, 100, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    ref = future_attention(q, k, 7, scale=scale, method="dense")
    for method in ("blocked", "fused"):
        _check(future_attention(q, k, 7, scale=scale, lse=lse, method=method), ref, atol=1e-10)
        # a wrong lse shifts the result: proves it is really used
        shifted = future_attention(q, k, 7, scale=scale, lse=lse + 1.0, method=method)
        fin = torch.isfinite(ref)
        torch.testing.assert_close(shifted[fin], ref[fin] - 1.0)


def test_flex_logic_on_cpu_eager():
    # the CUDA path, run with flex's eager reference implementation (no compile) on CPU
    q, k = _qk(2, 2, 3, 80, dtype=torch.float64, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for w in (0, 5, 79):
            ref = future_attention(q, k, w, method="dense")
            _check(_flex(q, k, w, 16**-0.5, None, compile=False), ref, atol=1e-10)


def test_neg_inf_pattern_and_helpers():
    S, w = 30, 7
    q, k = _qk(1, 2, 2, S, seed=5)
    out = future_attention(q, k, w)
    assert torch.isinf(out[..., S - w :]).all() and (out[..., S - w :] < 0).all()
    assert torch.isfinite(out[..., : S - w]).all()
    # the last finite key receives one query (d = S - 1): N = 1, target <= 0 always
    assert (out <= 1e-6).all()
    nf = n_future(S, w)
    assert nf.dtype == torch.long and nf.tolist() == [max(1, S - (t + w)) for t in range(S)]
    lm = loss_mask(S, w)
    assert lm.tolist() == [S - (t + w) >= w for t in range(S)]
    assert loss_mask(S, w, min_future=1).tolist() == [t <= S - 1 - w for t in range(S)]
    # window 0: every key has a future query (itself at least)
    assert torch.isfinite(future_attention(q, k, 0)).all()


def test_sum_rule_window0():
    # with window 0 and a single head, sum_t N_t m_t = sum_t sum_d p[d, t] = S
    q, k = _qk(1, 1, 1, 50, dtype=torch.float64, seed=6)
    out = future_attention(q, k, 0, method="fused")
    total = (out.exp() * n_future(50, 0).double()).sum()
    torch.testing.assert_close(total, torch.tensor(50.0, dtype=torch.float64))


def test_gqa_group_assignment():
    # query head g belongs to kv head g // G (transformers repeat_kv); make one query head dominate
    B, kv, G, S, D = 1, 2, 3, 40, 8
    q, k = _qk(B, kv, G, S, D=D, dtype=torch.float64, seed=7)
    ref = future_attention(q, k, 3, method="dense")
    for h in range(kv):
        per_head = torch.stack(
            [
                future_attention(q[:, g : g + 1], k[:, h : h + 1], 3, method="dense")[:, 0]
                for g in range(h * G, h * G + G)
            ]
        ).amax(0)
        torch.testing.assert_close(ref[:, h], per_head)


def test_auto_method():
    assert resolve_method("auto", torch.float32, "cpu") == "fused"
    assert resolve_method("auto", torch.float64, "cpu") == "fused"
    assert resolve_method("auto", torch.int32, "cpu") == "blocked"
    assert resolve_method("auto", torch.float32, "cuda") == "flex"
    assert resolve_method("blocked", torch.float32, "cuda") == "blocked"


def test_flash_kernel_causal_convention():
    # Documented: the CPU flash kernel's causal mask is top-left (key j visible to query i iff
    # j <= i) even when Lq != Lk.  The fused path only ever calls it with Lq == Lk.
    f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    g = torch.Generator().manual_seed(0)
    for Lq, Lk in ((4, 9), (9, 4)):
        q = torch.randn(1, 1, Lq, 8, generator=g)
        k = torch.randn(1, 1, Lk, 8, generator=g)
        _, lse = f(q, k, k, 0.0, True, scale=1.0)
        s = (q @ k.transpose(-1, -2))[0, 0]
        mask = torch.arange(Lk)[None, :] > torch.arange(Lq)[:, None]
        ref = torch.logsumexp(s.masked_fill(mask, -math.inf), -1)
        torch.testing.assert_close(lse[0, 0], ref)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda q, k: (q[:, :3], k, 2), "multiple"),
        (lambda q, k: (q, k[:1], 2), "agree"),
        (lambda q, k: (q[:, :, :10], k, 2), "agree"),
        (lambda q, k: (q[..., :8], k, 2), "agree"),
        (lambda q, k: (q, k, 20), "window"),
        (lambda q, k: (q, k, 25), "window"),
        (lambda q, k: (q, k, -1), "window"),
        (lambda q, k: (q, k, 2.0), "window"),
        (lambda q, k: (q[0], k, 2), "4-D"),
        (lambda q, k: (q, k[0], 2), "4-D"),
        (
            lambda q, k: (q.index_put((torch.tensor([0]),) * 4, torch.tensor([float("nan")])), k, 2),
            "non-finite",
        ),
        (
            lambda q, k: (q, k.index_put((torch.tensor([1]),) * 4, torch.tensor([float("inf")])), 2),
            "non-finite",
        ),
        (lambda q, k: (q.double(), k, 2), "dtype"),
        (lambda q, k: (q.long(), k.long(), 2), "floating"),
    ],
)
def test_errors(make, match):
    q, k = _qk(2, 2, 2, 20)
    qq, kk, w = make(q, k)
    with pytest.raises(ValueError, match=match):
        future_attention(qq, kk, w)


def test_error_method_and_lse():
    q, k = _qk(1, 2, 2, 20)
    with pytest.raises(ValueError, match="method"):
        future_attention(q, k, 2, method="nope")
    with pytest.raises(ValueError, match="CUDA"):
        future_attention(q, k, 2, method="flex")
    with pytest.raises(ValueError, match="lse"):
        future_attention(q, k, 2, lse=torch.zeros(1, 4, 19))
    with pytest.raises(ValueError, match="block"):
        future_attention(q, k, 2, method="blocked", block=0)


def test_bench_worker_in_process():
    from kvpop.bench.targets import _format_rows, _worker

    spec = {
        "S": 96,
        "q_heads": 6,
        "kv_heads": 2,
        "dim": 16,
        "batch": 1,
        "window": 8,
        "dtype": "float32",
        "repeats": 2,
        "block": 32,
        "budget_s": 10.0,
        "threads": None,
    }
    mem = _worker({**spec, "mode": "memory", "methods": ["fused"]})  # its memory number: the next test
    assert mem["method"] == "fused" and mem["S"] == 96 and mem["single_call_s"] > 0
    timed = _worker({**spec, "mode": "time", "methods": ["sdpa", "fused", "fused+lse", "blocked", "dense"]})
    assert set(timed) == {"sdpa", "fused", "fused+lse", "blocked", "dense"}
    assert all(len(v["times_s"]) == 2 and v["time_s"] > 0 for v in timed.values())
    rows = [{"S": 96, "method": m, **v, "peak_extra_bytes": 0} for m, v in timed.items()]
    assert "fused" in _format_rows(rows + [{"S": 96, "method": "x", "skipped": "why"}])


def test_bench_memory_sees_an_attention_matrix_in_the_dense_pass_and_none_in_the_fused_one():
    """``peak_extra_bytes``, measured as the benchmark does (a fresh process per method: in this process the
    peak resident size is the whole test session's), is at least one S x S attention matrix for the dense
    reference, which builds several, and a small part of one for the fused pass (O(S * block) memory)."""
    from kvpop.bench.targets import _run_worker

    S, q_heads = 2048, 6
    spec = {
        "S": S,
        "q_heads": q_heads,
        "kv_heads": 2,
        "dim": 16,
        "batch": 1,
        "window": 64,
        "dtype": "float32",
        "repeats": 1,
        "block": 64,
        "budget_s": 10.0,
        "threads": 1,
        "mode": "memory",
    }
    matrix = S * S * q_heads * 4  # one float32 attention matrix over the query heads: 100 MB
    peak = {}
    for method in ("dense", "fused"):
        got = _run_worker({**spec, "methods": [method]}, timeout=300)
        assert "error" not in got, got
        peak[method] = got["peak_extra_bytes"]
    assert peak["dense"] >= matrix, peak  # the measure sees a materialised matrix
    assert peak["fused"] < matrix / 4, peak  # measured: ~4 MB


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["blocked", "fused"])
@pytest.mark.parametrize(
    "windows,S,G,block",
    [((3, 5, 9, 40), 120, 2, 16), ((1, 64, 91, 128), 513, 3, 100), ((7, 200), 230, 1, 64), ((12,), 50, 2, 8)],
)
def test_several_windows_at_once_equal_one_window_at_a_time(windows, S, G, block, dtype, method):
    """The capture's fast path (one far pass + one band pass for every window) against one
    future_attention call per window, -inf pattern included (windows near S leave few keys)."""
    from kvpop.targets import future_attention_windows

    q, k = _qk(2, 2, G, S, dtype=dtype, seed=S)
    got = future_attention_windows(q, k, windows, method=method, block=block)
    assert sorted(got) == sorted(set(windows))
    atol = 2e-5 if dtype == torch.float32 else 1e-10
    for w in windows:
        assert got[w].dtype == dtype and got[w].shape == (2, 2, S)
        _check(got[w], future_attention(q, k, w, method="dense"), atol=atol)


@pytest.mark.parametrize("power", [2.0, 8.0])
def test_power_mean_target_matches_its_definition_on_every_path(power):
    """``power`` replaces the mean by the power mean of the same probabilities: the loop-level definition,
    the dense reference, the blocked and fused passes and the several-windows pass agree."""
    q, k = _qk(2, 2, 3, 40, amp=1.0)
    for window in (0, 5):
        ref = _naive(q, k, window, power=power)
        for method in ("dense", "blocked", "fused"):
            _check(future_attention(q, k, window, method=method, power=power).double(), ref, atol=2e-5)
    got = future_attention_windows(q, k, [3, 5, 9], power=power, block=8)
    for w, t in got.items():
        _check(t.double(), _naive(q, k, w, power=power), atol=2e-5)
    assert not torch.allclose(got[5], future_attention(q, k, 5)), "the power changes the target"


def test_power_mean_tends_to_the_largest_future_probability():
    """A large power gives the maximum future attention (the oracle that keeps needles) within
    ``log(N_t) / power``, with the fused pass at full sequence length (no underflow)."""
    q, k = _qk(1, 2, 2, 300, amp=2.0)
    window, power = 16, 64.0
    got = future_attention_windows(q, k, [8, window, 40], power=power)[window].double()
    qd, kd = q.double(), k.double().repeat_interleave(2, dim=1)
    S = q.shape[2]
    logits = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
    idx = torch.arange(S)
    logp = torch.log_softmax(logits.masked_fill(idx[None, :] > idx[:, None], -math.inf), dim=-1)
    future = idx[:, None] >= idx[None, :] + window
    best = logp.masked_fill(~future, -math.inf).amax(dim=-2).view(1, 2, 2, S).amax(dim=2)
    fin = torch.isfinite(best)
    assert torch.equal(torch.isfinite(got), fin)
    gap = best[fin] - got[fin]
    assert float(gap.min()) >= -1e-5 and float(gap.max()) <= math.log(S) / power + 1e-5


def test_power_is_checked():
    q, k = _qk(1, 1, 1, 8)
    for bad in (0.5, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="power must be"):
            future_attention(q, k, 1, power=bad)


@pytest.mark.parametrize("span", [1, 3])
def test_spread_targets_takes_the_largest_neighbour_and_keeps_undefined_positions(span):
    torch.manual_seed(0)
    target = torch.randn(2, 3, 20)
    target[..., -5:] = -math.inf  # the last window: no target
    target[0, 1, 7] = 9.0  # one sharply read token
    out = spread_targets(target, span)
    expect = target.clone()
    for t in range(20):
        if not math.isinf(target[0, 0, t]):
            lo, hi = max(0, t - span), min(20, t + span + 1)
            expect[..., t] = target[..., lo:hi].amax(-1)
    torch.testing.assert_close(out, expect)
    assert (out[0, 1, 7 - span : 7 + span + 1] == 9.0).all() and out[0, 1, 7 + span + 1] < 9.0
    assert spread_targets(target, 0) is target
    with pytest.raises(ValueError, match="span must be an integer >= 0"):
        spread_targets(target, -1)
