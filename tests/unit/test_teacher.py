import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpop.rule import kept_mask_static
from kvpop.testing.rule import teacher_labels_bruteforce
from kvpop.train.teacher import static_priority, teacher_labels


def _eq(a, b):
    for f in ("q", "t_new", "t_bnd", "y", "valid"):
        x, z = getattr(a, f), getattr(b, f)
        assert x.shape == z.shape, f
        assert torch.equal(x, z), f


def _final_held(prio_row, S, window, k, sinks):
    """Literal simulation of the rule to the end; returns the set of held tokens."""
    held = []
    for t in range(sinks, S - window):
        if len(held) < k:
            held.append(t)
            continue
        if k == 0:
            continue
        worst = min(held, key=lambda u: (prio_row[u], -u))
        if prio_row[t] > prio_row[worst]:
            held.remove(worst)
            held.append(t)
    return set(range(min(sinks, S))) | set(range(max(0, S - window), S)) | set(held)


def test_small_example_by_hand():
    # sinks 1, window 2, k 2; competitors t = 1..7 exit at q = 3..9
    tgt = torch.tensor([[[9.0, 5.0, 1.0, 3.0, 3.0, 7.0, 0.0, 4.0, 8.0, 8.0]]])
    lab = teacher_labels(tgt, window=2, budget_k=2, sinks=1)
    assert lab.q.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert lab.t_new[0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    # t=1 (5) free, t=2 (1) free -> {1,2}; t=3 (3) vs bnd 2 (1): keep -> {1,3}
    # t=4 (3) vs bnd 3 (3): tie -> drop; t=5 (7) vs bnd 3: keep -> {1,5}
    # t=6 (0) vs bnd 1 (5): drop; t=7 (4) vs bnd 1 (5): drop
    assert lab.y[0, 0].tolist() == [1, 1, 1, -1, 1, -1, -1]
    assert lab.t_bnd[0, 0].tolist() == [-1, -1, 2, 3, 3, 1, 1]
    assert lab.valid[0, 0].tolist() == [False, False, True, True, True, True, True]
    _eq(lab, teacher_labels_bruteforce(tgt, 2, 2, 1))
    # final: sinks {0}, window {8, 9}, long-range {1, 5}
    kept = kept_mask_static(static_priority(tgt), 2, 2, 1)
    assert kept[0, 0].nonzero().flatten().tolist() == [0, 1, 5, 8, 9]


def test_tie_rule_evicts_newest_among_equal_minimum():
    # all equal priorities: the exiting token always loses; t_bnd is the newest held token
    tgt = torch.zeros(1, 1, 12)
    lab = teacher_labels(tgt, window=1, budget_k=3, sinks=2)
    assert lab.y[0, 0].tolist() == [1, 1, 1] + [-1] * 6
    assert lab.t_bnd[0, 0].tolist() == [-1, -1, -1] + [4] * 6
    # a strictly higher exiting token evicts the newest of the tied minimum (t=4)
    tgt[0, 0, 5] = 1.0
    lab = teacher_labels(tgt, window=1, budget_k=3, sinks=2)
    assert lab.y[0, 0].tolist() == [1, 1, 1, 1] + [-1] * 5
    assert lab.t_bnd[0, 0].tolist() == [-1, -1, -1, 4] + [3] * 5
    kept = kept_mask_static(tgt.double(), 1, 3, 2)
    assert kept[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 11]


def test_lam_and_inf_and_options():
    tgt = torch.tensor([[[0.0, -1.0, -math.inf, -1.0, -0.5, -math.inf, -math.inf]]])
    lab = teacher_labels(tgt, window=2, budget_k=1, sinks=0)
    # competitors 0..4
    assert lab.t_bnd[0, 0].tolist() == [-1, 0, 0, 0, 0]
    assert lab.y[0, 0].tolist() == [1, -1, -1, -1, -1]
    # t_new = 2 has -inf priority: invalid
    assert lab.valid[0, 0].tolist() == [False, True, False, True, True]
    # a recency tilt lets later tokens win
    lab2 = teacher_labels(tgt, window=2, budget_k=1, sinks=0, lam=0.6)
    assert lab2.y[0, 0].tolist() == [1, -1, -1, 1, 1]
    _eq(lab2, teacher_labels_bruteforce(tgt, 2, 1, 0, lam=0.6))
    # sub-sampled steps and min_future
    lab3 = teacher_labels(tgt, window=2, budget_k=1, sinks=0, query_steps=[6, 3], min_future=2)
    assert lab3.q.tolist() == [6, 3]
    assert lab3.t_new[0, 0].tolist() == [4, 1]
    assert lab3.y[0, 0].tolist() == [-1, -1]
    assert lab3.valid[0, 0].tolist() == [False, True]  # S - 6 = 1 < 2
    # budget 0 and no competitor at all
    lab4 = teacher_labels(tgt, window=2, budget_k=0, sinks=0)
    assert lab4.y.eq(-1).all() and lab4.t_bnd.eq(-1).all() and not lab4.valid.any()
    lab5 = teacher_labels(tgt, window=5, budget_k=3, sinks=2)
    assert lab5.q.numel() == 0 and lab5.y.shape == (1, 1, 0)


def test_errors():
    tgt = torch.zeros(1, 2, 10)
    with pytest.raises(ValueError):
        teacher_labels(tgt[0], 2, 2, 1)
    with pytest.raises(ValueError):
        teacher_labels(tgt, -1, 2, 1)
    with pytest.raises(ValueError):
        teacher_labels(tgt, 2, 2, 1, lam=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        teacher_labels(torch.full((1, 1, 5), float("nan")), 1, 1, 0)
    with pytest.raises(ValueError, match="query_steps"):
        teacher_labels(tgt, 2, 2, 1, query_steps=[2])
    with pytest.raises(ValueError):
        kept_mask_static(tgt, 2, -2, 1)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    S=st.integers(1, 40),
    window=st.integers(0, 8),
    k=st.integers(0, 8),
    sinks=st.integers(0, 5),
    lam=st.sampled_from([0.0, 0.0, 0.25, 1.0]),
    ints=st.booleans(),
)
def test_property_matches_bruteforce(data, B, H, S, window, k, sinks, lam, ints):
    if ints:  # small integers: many ties
        vals = data.draw(st.lists(st.integers(-3, 1), min_size=B * H * S, max_size=B * H * S))
        tgt = torch.tensor(vals, dtype=torch.float32).view(B, H, S)
        tgt[tgt == 1] = -math.inf
    else:
        vals = data.draw(st.lists(st.floats(-20, 0, allow_nan=False), min_size=B * H * S, max_size=B * H * S))
        tgt = torch.tensor(vals, dtype=torch.float64).view(B, H, S)
    mf = data.draw(st.sampled_from([None, 0, 3]))
    fast_all = teacher_labels(tgt, window, k, sinks, lam=lam, min_future=mf)
    ref = teacher_labels_bruteforce(tgt, window, k, sinks, lam=lam, min_future=mf)
    _eq(fast_all, ref)
    if S > sinks + window:  # a subset of steps is the same columns
        qs = data.draw(st.lists(st.integers(sinks + window, S - 1), max_size=5))
        sub = teacher_labels(tgt, window, k, sinks, lam=lam, query_steps=qs, min_future=mf)
        cols = torch.tensor(qs, dtype=torch.long) - (sinks + window)
        for f in ("t_new", "t_bnd", "y", "valid"):
            assert torch.equal(getattr(sub, f), getattr(fast_all, f)[..., cols])
    # invariants
    Q = max(0, S - sinks - window)
    assert fast_all.y.shape == (B, H, Q)
    assert torch.equal(fast_all.valid, fast_all.valid & (fast_all.t_bnd >= 0))
    kept_steps = (fast_all.y > 0).sum(-1)
    assert (kept_steps >= min(k, Q)).all()
    # the final state agrees with kept_mask_static and with a literal simulation
    prio = static_priority(tgt, lam)
    kept = kept_mask_static(prio, window, k, sinks)
    for b in range(B):
        for h in range(H):
            exp = _final_held(prio[b, h].tolist(), S, window, k, sinks)
            assert set(kept[b, h].nonzero().flatten().tolist()) == exp
    assert (kept.sum(-1) <= min(S, sinks + window + k)).all()


def test_speed_report():
    # [30 layers * 1 batch, 3 heads, 4096] in one call (layers stacked into the batch dim)
    g = torch.Generator().manual_seed(0)
    tgt = torch.randn(30, 3, 4096, generator=g) - 5
    t0 = time.perf_counter()
    lab = teacher_labels(tgt, window=256, budget_k=512, sinks=4, min_future=256)
    dt = time.perf_counter() - t0
    print(f"teacher_labels [30, 3, 4096]: {dt:.3f}s")
    assert lab.y.shape == (30, 3, 4096 - 260)
    assert dt < 30
