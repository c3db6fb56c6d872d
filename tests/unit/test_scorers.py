"""Tests of the KVpop scorers (src/kvpop/scorers): shapes, parity of the recurrent and
parallel/chunkwise mLSTM forms, masking, gradients, determinism, persistence."""

from __future__ import annotations

import pytest
import torch

from kvpop.scorers import (
    KVpopMLP,
    KVpopMLSTM,
    MLSTMState,
    ScorerConfig,
    ScorerStack,
    build_scorer,
)
from kvpop.scorers.decode import MLPParams, MLSTMParams, decode_params
from kvpop.scorers.mlstm import mlstm_read, score_head

B, H, D = 2, 3, 16


def _kv(T, dtype=torch.float64, b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(b, H, T, D, generator=g) * 3.0).to(dtype)
    v = torch.randn(b, H, T, D, generator=g).to(dtype)
    return k, v


def _mlstm(dtype=torch.float64, stress=False, **kw):
    kw = {"dk": 8, "dv": 8, "hidden": 16, "seed": 1, **kw}
    mod = KVpopMLSTM(H, D, **kw).to(dtype)
    if stress:  # widely varying gates: exercises the stabiliser
        with torch.no_grad():
            o = mod._o_gate
            mod.w_proj[:, :, o : o + 2].mul_(60.0)
            mod.b_proj[:, o + 1].sub_(2.0)
    return mod


def _recurrent(mod, k, v, window, mask=None):
    """Reference: step token by token; token t read right after step t + window; tokens whose exit
    step lies beyond the sequence are read against the final state."""
    b, _, T, _ = k.shape
    st = mod.init_state(b)
    out = torch.full((b, H, T), float("nan"), dtype=mod.w_proj.dtype)
    for q in range(T):
        st = mod.step(st, k[:, :, q : q + 1], v[:, :, q : q + 1], None if mask is None else mask[:, q : q + 1])
        t = q - window
        if t >= 0:
            out[:, :, t] = mod.read(st, k[:, :, t : t + 1], v[:, :, t : t + 1])[:, :, 0]
    lo = max(T - window, 0)
    if lo < T:
        out[:, :, lo:] = mod.read(st, k[:, :, lo:], v[:, :, lo:])
    return out, st


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ config / stack
def test_config_roundtrip_and_validation():
    cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=3, head_dim=16, hidden=8, seed=5)
    assert ScorerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        ScorerConfig(kind="lstm")
    with pytest.raises(ValueError):
        ScorerConfig.from_dict({"kind": "mlp", "bogus": 1})


@pytest.mark.parametrize("kind", ["mlp", "mlstm"])
def test_build_scorer_stack(kind, tmp_path):
    cfg = ScorerConfig(kind=kind, num_layers=3, kv_heads=H, head_dim=D, hidden=8, dk=8, dv=4, seed=2)
    stack = build_scorer(cfg)
    assert isinstance(stack, ScorerStack) and len(stack) == 3
    assert stack.is_stateful == (kind == "mlstm")
    assert stack[0].is_stateful == (kind == "mlstm")
    assert stack.num_parameters() == sum(m.num_parameters() for m in stack) > 0
    # per-layer seeds differ
    p0, p1 = next(stack[0].parameters()), next(stack[1].parameters())
    assert not torch.equal(p0, p1)
    k, v = _kv(9, torch.float32)
    s = stack.forward_layer(1, k, v, 4)
    assert s.shape == (B, H, 9) and torch.isfinite(s).all()
    # uniform inference interface
    states = stack.init_state(B)
    assert len(states) == 3 and (states[0] is None) == (kind == "mlp")
    st = stack.step(0, states[0], k[:, :, :2], v[:, :, :2])
    st, r = stack.step_and_read(0, st, k[:, :, 2:3], v[:, :, 2:3], k[:, :, :1], v[:, :, :1])
    assert r.shape == (B, H, 1)
    assert stack.read(0, st, k[:, :, :2], v[:, :, :2]).shape == (B, H, 2)
    # persistence
    stack.save(tmp_path / "s.pt")
    again = ScorerStack.load(tmp_path / "s.pt")
    assert again.config == cfg
    torch.testing.assert_close(again.forward_layer(1, k, v, 4), s, rtol=0, atol=0)


def test_parameter_counts():
    mlp = KVpopMLP(H, D, hidden=8)
    din = 2 * D + 2
    assert mlp.num_parameters() == H * (din * 8 + 8 + 8 + 1)
    m = KVpopMLSTM(H, D, dk=8, dv=4, hidden=6)
    e = 8 + 4 + 2 + 8 + 6
    assert m.num_parameters() == H * (din * e + e + (4 + 6) + 1)
    m2 = KVpopMLSTM(H, D, dk=8, dv=4, hidden=6, read_mlp=False, input_norm=False)
    e2 = 8 + 4 + 2 + 8
    assert m2.num_parameters() == H * (2 * D * e2 + e2 + 4 + 1)


# --------------------------------------------------------------------------- MLP
def test_mlp_shapes_determinism_heads_independent():
    k, v = _kv(7, torch.float32)
    a, b2, c = KVpopMLP(H, D, 8, seed=3), KVpopMLP(H, D, 8, seed=3), KVpopMLP(H, D, 8, seed=4)
    s = a(k, v)
    assert s.shape == (B, H, 7)
    torch.testing.assert_close(b2(k, v), s, rtol=0, atol=0)
    assert not torch.allclose(c(k, v), s)
    torch.testing.assert_close(a.score(k, v), s)
    # per-token, per-head: changing head 1 / token 3 leaves the rest unchanged
    k2 = k.clone()
    k2[:, 1, 3] += 5.0
    s2 = a(k2, v)
    diff = (s2 - s).abs() > 0
    assert diff[:, 1, 3].all() and diff.sum() == B
    # batch 1 path equals batched path
    torch.testing.assert_close(a(k[1:], v[1:]), s[1:])
    with pytest.raises(ValueError):
        a(k[:, :2], v[:, :2])


def test_mlp_gradients_flow_not_into_inputs():
    k, v = _kv(6, torch.float32)
    k.requires_grad_(True)
    m = KVpopMLP(H, D, 8)
    m(k, v).square().sum().backward()
    assert k.grad is None  # inputs are detached
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_mlp_raw_inputs():
    m = KVpopMLP(H, D, 8, input_norm=False)
    k, v = _kv(4, torch.float32)
    assert m(k, v).shape == (B, H, 4)


# -------------------------------------------------------------------- mLSTM parity
@pytest.mark.parametrize(
    "T,window,chunk", [(1, 0, 4), (6, 0, 4), (13, 3, 4), (17, 5, 7), (20, 25, 8), (32, 8, 16), (33, 1, 5)]
)
def test_mlstm_parity_float64(T, window, chunk):
    mod = _mlstm(stress=True)
    k, v = _kv(T, seed=T)
    ref, st = _recurrent(mod, k, v, window)
    ch, stc = mod(k, v, window, chunk_size=chunk, return_state=True)
    par, stp = mod(k, v, window, mode="parallel", query_block=5, return_state=True)
    assert _rel(ch, ref) < 1e-11 and _rel(par, ref) < 1e-11
    for a, b in ((stc, st), (stp, st)):
        assert _rel(a.C, b.C) < 1e-11 and _rel(a.n, b.n) < 1e-11 and (a.m - b.m).abs().max() < 1e-11


@pytest.mark.parametrize(
    "kw", [{}, {"h_norm": False}, {"read_mlp": False, "input_norm": False}, {"forget_gate": "exp"}]
)
@pytest.mark.parametrize("T,window", [(24, 0), (40, 16)])
@pytest.mark.parametrize("stress", [False, True])
def test_mlstm_parity_float32(kw, T, window, stress):
    # With extreme gates (stress) the readout's denominator n^T q can cancel, and every form
    # (recurrent included) is off the float64 truth by ~1e-5..1e-4: a conditioning limit.
    tol = 2e-4 if stress else 1e-5
    mod = _mlstm(torch.float32, stress=stress, **kw)
    k, v = _kv(T, torch.float32, seed=window)
    ref, _ = _recurrent(mod, k, v, window)
    ch = mod(k, v, window, chunk_size=8)
    par = mod(k, v, window, mode="parallel", query_block=16)
    assert _rel(ch, ref) < tol, _rel(ch, ref)
    assert _rel(par, ref) < tol, _rel(par, ref)


def test_mlstm_chunkwise_matches_parallel_long():
    mod = _mlstm(torch.float32)
    k, v = _kv(300, torch.float32, b=1)
    a = mod(k, v, 64, chunk_size=32)
    b = mod(k, v, 64, mode="parallel", query_block=100)
    assert _rel(a, b) < 1e-5


def test_mlstm_multi_token_step_and_read_steps():
    mod = _mlstm(stress=True)
    T, w = 21, 4
    k, v = _kv(T)
    ref, st_ref = _recurrent(mod, k, v, w)
    # several tokens per step == one at a time
    st = mod.step(mod.init_state(B), k[:, :, :9], v[:, :, :9])
    st = mod.step(st, k[:, :, 9:], v[:, :, 9:])
    assert _rel(st.C, st_ref.C) < 1e-11 and (st.m - st_ref.m).abs().max() < 1e-11
    # continue from a state: first part via forward(return_state), rest via step_and_read with
    # read_steps (token t exits right after new token t + w - P)
    P = 8
    s1, st = mod(k[:, :, :P], v[:, :, :P], w, return_state=True)
    torch.testing.assert_close(s1[:, :, : P - w], ref[:, :, : P - w], rtol=1e-11, atol=1e-11)
    reads = torch.arange(P - w, T - w)
    st, s2 = mod.step_and_read(st, k[:, :, P:], v[:, :, P:], k[:, :, reads], v[:, :, reads], read_steps=reads + w - P)
    torch.testing.assert_close(s2, ref[:, :, P - w : T - w], rtol=1e-11, atol=1e-11)
    # read_steps = -1 reads the state before the new tokens; per-batch read steps
    st0 = mod.step(mod.init_state(B), k[:, :, :5], v[:, :, :5])
    _, s3 = mod.step_and_read(
        st0, k[:, :, 5:9], v[:, :, 5:9], k[:, :, :2], v[:, :, :2], read_steps=torch.tensor([[-1, 2], [3, 0]])
    )

    def read_after(j, row, tok):  # read token `tok` after new tokens 5..5+j
        st = mod.step(st0, k[:, :, 5 : 6 + j], v[:, :, 5 : 6 + j]) if j >= 0 else st0
        return mod.read(st, k[:, :, tok : tok + 1], v[:, :, tok : tok + 1])[row, :, 0]

    for row, steps in enumerate([[-1, 2], [3, 0]]):
        for tok, j in enumerate(steps):
            torch.testing.assert_close(s3[row, :, tok], read_after(j, row, tok), rtol=1e-11, atol=1e-11)
    with pytest.raises(ValueError):
        mod.step_and_read(st0, k[:, :, 5:9], v[:, :, 5:9], k[:, :, :2], v[:, :, :2], read_steps=[0, 4])


@pytest.mark.parametrize("n,block", [(2, 4), (7, 4), (8, 4), (13, 5), (16, 32)])
@pytest.mark.parametrize("start", [0, 6])
@pytest.mark.parametrize("masked", [False, True])
def test_mlstm_prefill_exits_equal_token_by_token(n, block, start, masked):
    """A prefill piece reads exiting token j right after new token j (``read_steps = arange(n)``), which
    takes the chunkwise form in blocks of ``prefill_block``: from an empty or a used state, padding
    tokens included, it equals stepping and reading one token at a time."""
    mod = _mlstm(stress=True)
    mod.prefill_block = block
    k, v = _kv(start + 2 * n, seed=n + start)
    st0 = mod.step(mod.init_state(B), k[:, :, :start], v[:, :, :start]) if start else mod.init_state(B)
    new = slice(start, start + n)
    reads = slice(start + n, start + 2 * n)  # any tokens can be read; these are not in the state
    mask = torch.ones(B, n, dtype=torch.bool)
    if masked:
        mask[0, :2] = False  # left padding of row 0
    st, got = mod.step_and_read(
        st0,
        k[:, :, new],
        v[:, :, new],
        k[:, :, reads],
        v[:, :, reads],
        read_steps=torch.arange(n),
        mask=mask if masked else None,
    )
    ref, s = [], st0
    for j in range(n):
        s = mod.step(s, k[:, :, start + j : start + j + 1], v[:, :, start + j : start + j + 1], mask[:, j : j + 1])
        ref.append(mod.read(s, k[:, :, start + n + j : start + n + j + 1], v[:, :, start + n + j : start + n + j + 1]))
    ref = torch.cat(ref, 2)
    live = torch.isfinite(ref) & (ref.abs() > 0)
    assert live.any()
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for a, b in ((st.C, s.C), (st.n, s.n), (st.m, s.m)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("h_norm,read_mlp", [(True, True), (False, True), (True, False)])
def test_readout_and_score_head_equal_in_the_training_and_the_decode_form(h_norm, read_mlp):
    """KVpopMLSTM reads several tokens per row (matmuls), the fused decode step one per row (broadcast-and-sum,
    which torch.compile fuses): both forms of the one readout and score head give the same scores, and the
    module's read is that readout and head."""
    mod = _mlstm(stress=True, h_norm=h_norm, read_mlp=read_mlp)
    k, v = _kv(12)
    st = mod.step(mod.init_state(B), k[:, :, :7], v[:, :, :7])
    qq, u = mod._split_read(mod._project(k[:, :, 7:], v[:, :, 7:], mod._read_cols), st.C.dtype)
    head = {"h_norm": h_norm, "read_mlp": read_mlp, "eps": mod.eps}
    many = score_head(mlstm_read(st, qq), u, mod.w_out, mod.b_out, **head)
    assert many.shape == (B, H, 5) and torch.equal(many, mod.read(st, k[:, :, 7:], v[:, :, 7:]))
    one = [
        score_head(mlstm_read(st, qq[:, :, j], nonempty=True), u[:, :, j], mod.w_out, mod.b_out, **head)
        for j in range(5)
    ]
    torch.testing.assert_close(torch.stack(one, 2), many, rtol=1e-12, atol=1e-12)
    empty = mod.init_state(B)  # an empty state reads h = 0 in both forms
    assert not mlstm_read(empty, qq).any() and not mlstm_read(empty, qq[:, :, 0]).any()


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_decode_params_name_the_layer_weights(kind):
    """The decode step's weights are named views of the layer's parameters (no autograd graph)."""
    stack = build_scorer(ScorerConfig(kind=kind, num_layers=2, kv_heads=H, head_dim=D, tilt=True, position_free=True))
    params = decode_params(stack, 1)
    assert isinstance(params, MLSTMParams if kind == "mlstm" else MLPParams)
    head = stack[1].w_out if kind == "mlstm" else stack[1].w2
    w = params.w_out if kind == "mlstm" else params.w2
    assert w.data_ptr() == head.data_ptr() and not w.requires_grad
    assert params.inv_freq is not None and params.lam.shape == (H,)


# ------------------------------------------------------------------------ masking
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_step_leaves_state_unchanged(dtype):
    mod = _mlstm(dtype)
    k, v = _kv(6, dtype)
    empty = mod.init_state(B)
    st = mod.step(empty, k[:, :, :3], v[:, :, :3])
    none = torch.zeros(B, 1, dtype=torch.bool)
    for s0 in (empty, st):
        for n in (1, 3):
            m = torch.zeros(B, n, dtype=torch.bool)
            s1 = mod.step(s0, k[:, :, 3 : 3 + n], v[:, :, 3 : 3 + n], mask=m)
            for a, b in zip(s1, s0):
                assert torch.equal(a, b)
        s2, _ = mod.step_and_read(s0, k[:, :, 3:4], v[:, :, 3:4], k[:, :, :1], v[:, :, :1], mask=none)
        for a, b in zip(s2, s0):
            assert torch.equal(a, b)
    # only the masked row is untouched
    s3 = mod.step(st, k[:, :, 3:4], v[:, :, 3:4], mask=torch.tensor([[True], [False]]))
    assert torch.equal(s3.C[1], st.C[1]) and not torch.equal(s3.C[0], st.C[0])
    # reading an empty state is finite
    assert torch.isfinite(mod.read(empty, k[:, :, :2], v[:, :, :2])).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_mlstm_left_padding_parity(dtype, tol):
    """Left-padded batch: recurrent masked steps == masked forward (both forms), and every row
    equals the same sequence run alone without padding."""
    mod = _mlstm(dtype, stress=True)
    T, w = 19, 3
    pads = [0, 11]  # row 1 has 11 pad slots (> one chunk of 4 is all padding)
    k, v = _kv(T, dtype)
    mask = torch.ones(B, T, dtype=torch.bool)
    for r, p in enumerate(pads):
        mask[r, :p] = False
    ref, st = _recurrent(mod, k, v, w, mask)
    ch, stc = mod(k, v, w, mask=mask, chunk_size=4, return_state=True)
    par = mod(k, v, w, mask=mask, mode="parallel", query_block=6)
    for r, p in enumerate(pads):
        alone = mod(k[r : r + 1, :, p:], v[r : r + 1, :, p:], w, chunk_size=4)[0]
        assert _rel(ref[r, :, p:], alone) < tol
        assert _rel(ch[r, :, p:], alone) < tol
        assert _rel(par[r, :, p:], alone) < tol
    assert _rel(stc.C, st.C) < tol
    # multi-token masked step == token-by-token masked steps
    st2 = mod.step(mod.init_state(B), k, v, mask=mask)
    assert _rel(st2.C, st.C) < tol and _rel(st2.n, st.n) < tol


# ---------------------------------------------------------------------- gradients
@pytest.mark.parametrize("mode", ["chunkwise", "parallel"])
def test_mlstm_gradients(mode):
    mod = _mlstm(torch.float64, stress=True)
    k, v = _kv(23)
    mask = torch.ones(B, 23, dtype=torch.bool)
    mask[1, :9] = False  # left padding: must not produce NaN gradients
    s = mod(k, v, 5, mode=mode, mask=mask, chunk_size=4, query_block=7)
    loss = s[0].square().sum() + s[1, :, 9:].square().sum()
    grads = torch.autograd.grad(loss, list(mod.parameters()))
    for (name, _), g in zip(mod.named_parameters(), grads):
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
    if mode == "parallel":
        return
    s2 = mod(k, v, 5, mode="parallel", mask=mask)
    loss2 = s2[0].square().sum() + s2[1, :, 9:].square().sum()
    grads2 = torch.autograd.grad(loss2, list(mod.parameters()))
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g, g2, rtol=1e-9, atol=1e-11)


def test_mlstm_fp32_gradients_finite_long():
    mod = _mlstm(torch.float32)
    k, v = _kv(130, torch.float32, b=1)
    mod(k, v, 32, chunk_size=32).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in mod.parameters())


# -------------------------------------------------------------- misc mLSTM checks
def test_mlstm_determinism_shapes_heads_independent():
    k, v = _kv(12, torch.float32)
    a, b2, c = (KVpopMLSTM(H, D, 8, 8, 16, seed=s) for s in (7, 7, 8))
    s = a(k, v, 3)
    assert s.shape == (B, H, 12)
    torch.testing.assert_close(b2(k, v, 3), s, rtol=0, atol=0)
    assert not torch.allclose(c(k, v, 3), s)
    st = a.init_state(B)
    assert isinstance(st, MLSTMState)
    assert st.C.shape == (B, H, 8, 8) and st.n.shape == (B, H, 8) and st.m.shape == (B, H)
    k2 = k.clone()
    k2[:, 2] += 1.0
    s2 = a(k2, v, 3)
    torch.testing.assert_close(s2[:, :2], s[:, :2], rtol=0, atol=0)
    assert not torch.allclose(s2[:, 2], s[:, 2])
    # the score of token t depends on tokens up to t + window only (before the end)
    k3 = k.clone()
    k3[:, :, 9] += 1.0
    s3 = a(k3, v, 3)
    torch.testing.assert_close(s3[:, :, :6], s[:, :, :6], rtol=0, atol=0)
    assert not torch.allclose(s3[:, :, 6], s[:, :, 6])
    # empty sequence, bad args
    assert a(k[:, :, :0], v[:, :, :0], 3).shape == (B, H, 0)
    with pytest.raises(ValueError):
        a(k, v, -1)
    with pytest.raises(ValueError):
        a(k, v, 3, mode="bogus")
    with pytest.raises(ValueError):
        a.step(a.init_state(1), k, v)


def test_mlstm_state_index_select_and_bf16_cache():
    mod = _mlstm(torch.float32)
    k, v = _kv(5, torch.float32)
    st = mod.step(mod.init_state(B), k, v)
    sel = st.index_select(torch.tensor([1]))
    torch.testing.assert_close(mod.read(sel, k[1:, :, :1], v[1:, :, :1]), mod.read(st, k, v)[1:, :, :1])
    # a bf16 cache feeds an fp32 scorer/state
    s = mod.step(mod.init_state(B), k.bfloat16(), v.bfloat16())
    assert s.C.dtype == torch.float32
    assert mod.read(s, k[:, :, :1].bfloat16(), v[:, :, :1].bfloat16()).dtype == torch.float32
