"""KVpop (stateful): a small per-KV-head mLSTM (xLSTM matrix memory) scorer.

Per KV head and token s, from the input features x_s (see ``kv_features``) one
fused projection gives

    kk_s  [dk]   memory key            vv_s [dv]   memory value
    i_s   []     input-gate pre-act. (exponential input gate, exp(i_s))
    f_s   []     forget-gate pre-act. (log f_s = logsigmoid(f_s), or f_s for "exp")
    qq_s  [dk]   query, scaled by 1/sqrt(dk) (used when token s is *read*)
    u_s   [hid]  feature-MLP pre-activation (score head input, if read_mlp)

The state after consuming tokens 0..q (stabilised form, m_{-1} = -inf, C = n = 0):

    m_q = max(log f_q + m_{q-1}, i_q)
    C_q = exp(log f_q + m_{q-1} - m_q) C_{q-1} + exp(i_q - m_q) kk_q vv_q^T      [dk, dv]
    n_q = exp(log f_q + m_{q-1} - m_q) n_{q-1} + exp(i_q - m_q) kk_q             [dk]

Token t is scored when it leaves the protected window, at step q(t) = t + window,
against the state that has consumed tokens 0..q(t):

    h_t = C_q^T qq_t / max(|n_q^T qq_t|, exp(-m_q))                             [dv]
    r_hat(t) = w_out . [rmsnorm(h_t) ; SiLU(u_t)] + b_out

(``exp(-m)`` is the stabilised form of the usual ``max(|n^T q|, 1)``.) An empty
state (nothing consumed) reads h = 0.

Training uses a parallel form: with F_q = sum_{r<=q} log f_r the log weight of
token s in the state at step q is D[q, s] = F_q - F_s + i_s (s <= q), so

    h_t = sum_s exp(D[q(t),s] - M_t) (qq_t . kk_s) vv_s / max(|sum_s exp(D - M_t) qq_t . kk_s|, exp(-M_t)),
    M_t = max_s D[q(t), s]     (= the recurrent m_{q(t)}).

``forward(..., mode="chunkwise")`` (default) splits the steps into chunks of L:
the within-chunk part is a causal L x L block and the chunk-start states come from
a small [nc+1, nc] log-weight matrix over the chunks' local states (no Python loop),
so memory and compute are O(T * L + (T/L)^2 * dk * dv), never T x T.
``mode="parallel"`` materialises D per block of queries (O(block * T) memory; a
reference, fine up to T ~ 2k). Tokens with
t + window > T - 1 have no state at their exit step inside the sequence: they are
read against the FINAL state (step T-1). (They have fewer than ``window`` future
queries and are excluded from the training loss anyway.) Both forms equal the
recurrent ``step``/``read`` to float tolerance (tests/unit/test_scorers.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (
    BaseScorer,
    feature_dim,
    head_linear,
    head_score,
    kv_features,
    normal_init_,
    seeded_generator,
)

__all__ = ["KVpopMLSTM", "MLSTMState", "mlstm_read", "mlstm_step", "score_head"]

_NEG_INF = float("-inf")


class MLSTMState(NamedTuple):
    """Recurrent state of one layer: C [b, h, dk, dv], n [b, h, dk], m [b, h] (m = -inf: empty)."""

    C: Tensor
    n: Tensor
    m: Tensor

    def index_select(self, batch_idx: Tensor) -> MLSTMState:
        """Reorder / select batch rows (e.g. for beam search)."""
        return MLSTMState(
            self.C.index_select(0, batch_idx), self.n.index_select(0, batch_idx), self.m.index_select(0, batch_idx)
        )


def _exp_diff(a: Tensor, b: Tensor) -> Tensor:
    """exp(a - b) with exp(-inf - (-inf)) := 0 (empty-state guard), gradient-safe."""
    return torch.exp((a - b).masked_fill(torch.isneginf(a), _NEG_INF))


def _absorb(a: Tensor, m: Tensor, kk: Tensor, vv: Tensor) -> tuple[Tensor, Tensor]:
    """What tokens with log weights ``a [..., n]`` add to a state stabilised by ``m [...]``:
    ``(sum_s exp(a_s - m) kk_s vv_s^T [..., dk, dv], sum_s exp(a_s - m) kk_s [..., dk])``."""
    wk = _exp_diff(a, m.unsqueeze(-1)).unsqueeze(-1) * kk
    return torch.matmul(wk.transpose(-1, -2), vv), wk.sum(-2)


def _state_dots(qq: Tensor, C: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """``(C^T q, n^T q)`` of queries against a state: qq [..., M, dk] (several per row: matmuls) or
    [..., dk] (one per row, the decode step: broadcast-and-sum, which ``torch.compile`` fuses into its
    loops instead of calling BLAS for a dot product) -> ([..., (M,) dv], [..., (M)])."""
    if qq.dim() < C.dim():
        return (qq.unsqueeze(-1) * C).sum(-2), (qq * n).sum(-1)
    return torch.matmul(qq, C), torch.matmul(qq, n.unsqueeze(-1)).squeeze(-1)


def _stabilised(num: Tensor, den: Tensor, m: Tensor) -> Tensor:
    """The readout ``num / max(|den|, exp(-m))`` (the stabilised ``max(|n^T q|, 1)``)."""
    return num / torch.maximum(den.abs(), torch.exp(-m)).unsqueeze(-1)


def _attend(Q: Tensor, K: Tensor, V: Tensor, D: Tensor, inter: Tensor, C0: Tensor, n0: Tensor) -> Tensor:
    """Stabilised mLSTM readout of queries Q against (a prior state C0, n0 with log weight
    ``inter`` per query) plus the tokens K, V with log weights D (-inf = not in the state).

    Q [..., M, dk], K [..., N, dk], V [..., N, dv], D [..., M, N], inter [..., M],
    C0 [..., dk, dv], n0 [..., dk]  ->  h [..., M, dv].
    """
    mrow = torch.maximum(inter, D.amax(-1))
    ms = mrow.masked_fill(torch.isneginf(mrow), 0.0)  # empty rows: everything below is 0
    Wd = torch.exp(D - ms.unsqueeze(-1))
    wi = torch.exp(inter - ms)
    S = torch.matmul(Q, K.transpose(-1, -2)) * Wd
    qc, qn = _state_dots(Q, C0, n0)
    return _stabilised(torch.matmul(S, V) + wi.unsqueeze(-1) * qc, S.sum(-1) + wi * qn, ms)


def mlstm_read(state: MLSTMState, qq: Tensor, nonempty: bool = False) -> Tensor:
    """The readout ``h = C^T q / max(|n^T q|, exp(-m))`` of queries against a state: qq [b, h, M, dk]
    -> [b, h, M, dv], or qq [b, h, dk] (one per row: the decode step) -> [b, h, dv]. An empty state
    reads h = 0; ``nonempty=True`` skips that guard (m finite, e.g. right after a step)."""
    C, n, m = state
    if not nonempty:
        m = m.masked_fill(torch.isneginf(m), 0.0)  # empty state: C = n = 0 -> h = 0
    num, den = _state_dots(qq, C, n)
    return _stabilised(num, den, m.unsqueeze(-1) if qq.dim() == C.dim() else m)


def score_head(
    h: Tensor, u: Tensor, w_out: Tensor, b_out: Tensor, *, h_norm: bool, read_mlp: bool, eps: float
) -> Tensor:
    """The score head ``r_hat = w_out . [rmsnorm(h) ; SiLU(u)] + b_out`` per KV head: h [b, h, M, dv] and
    u [b, h, M, hidden] -> [b, h, M], or one read per row (the decode step) h [b, h, dv] -> [b, h]."""
    if h.dtype != w_out.dtype:
        h = h.to(w_out.dtype)
    if h_norm:
        h = h * torch.rsqrt((h * h).sum(-1, keepdim=True).mul(1.0 / h.shape[-1]).add(eps))
    return head_score(torch.cat([h, F.silu(u)], -1) if read_mlp else h, w_out, b_out)


def mlstm_step(state: MLSTMState, kk: Tensor, vv: Tensor, ig: Tensor, logf: Tensor) -> MLSTMState:
    """The recurrence (module docstring) for one token per row: ``kk [b, h, dk]``, ``vv [b, h, dv]``,
    ``ig``/``logf [b, h]`` (the input gate and the log forget gate). The one step that the module's
    ``step`` and the decode path (``kvpop.scorers.decode``) share; ``m`` stays finite (``ig`` is)."""
    C0, n0, m0 = state
    mg = logf + m0
    m_new = torch.maximum(mg, ig)
    d1 = torch.exp(mg - m_new)
    wk = torch.exp(ig - m_new).unsqueeze(-1) * kk  # [b, h, dk]
    C = torch.addcmul(d1[..., None, None] * C0, wk.unsqueeze(-1), vv.unsqueeze(-2))
    n = torch.addcmul(wk, d1.unsqueeze(-1), n0)
    return type(state)(C, n, m_new)


class KVpopMLSTM(BaseScorer):
    """Stateful scorer ("kvpop-mlstm"): per-KV-head mLSTM over the cache's [k ; v] stream.

    Parameters (H = kv_heads, Din = feature dim, E = dk + dv + 2 + dk + hidden):
      w_proj [H, Din, E], b_proj [H, E]   fused projection; columns
            [0:dk] kk | [dk:dk+dv] vv | [dk+dv] i | [dk+dv+1] f | [.. +dk] qq | [..] u (feature MLP)
      w_out [H, dv + hidden, 1], b_out [H]   linear score head on [rmsnorm(h); SiLU(u)]
    """

    is_stateful = True
    prefill_block = 32  # a prefill piece reads its exits in causal blocks of this many (fastest on CPU)

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        dk: int = 32,
        dv: int = 32,
        hidden: int = 64,
        *,
        input_norm: bool = True,
        read_mlp: bool = True,
        h_norm: bool = True,
        forget_gate: str = "sigmoid",
        forget_bias: tuple[float, float] = (3.0, 6.0),
        chunk_size: int = 128,
        eps: float = 1e-6,
        seed: int = 0,
        n_extra: int = 0,
    ) -> None:
        super().__init__()
        if forget_gate not in ("sigmoid", "exp"):
            raise ValueError(f"forget_gate must be 'sigmoid' or 'exp', got {forget_gate!r}")
        self.kv_heads = int(kv_heads)
        self.head_dim = int(head_dim)
        self.dk = int(dk)
        self.dv = int(dv)
        self.read_mlp = bool(read_mlp) and int(hidden) > 0
        self.hidden = int(hidden) if self.read_mlp else 0
        self.input_norm = bool(input_norm)
        self.h_norm = bool(h_norm)
        self.forget_gate = forget_gate
        self.forget_bias = tuple(float(x) for x in forget_bias)
        self.chunk_size = int(chunk_size)
        self.eps = float(eps)
        self.in_dim = feature_dim(self.head_dim, self.input_norm)
        H = self.kv_heads
        self._o_gate = self.dk + self.dv  # column of i; f is the next one
        self._o_q = self._o_gate + 2
        self._o_u = self._o_q + self.dk
        E = self._o_u + self.hidden
        self._new_cols = slice(0, self._o_q)
        self._read_cols = slice(self._o_q, E)
        self.w_proj = nn.Parameter(torch.empty(H, self.in_dim, E))
        self.b_proj = nn.Parameter(torch.empty(H, E))
        self.w_out = nn.Parameter(torch.empty(H, self.dv + self.hidden, 1))
        self.b_out = nn.Parameter(torch.empty(H))
        # extra read-time features (observed attention) enter the read columns (query and feature MLP)
        self.n_extra = int(n_extra)
        self.w_extra = nn.Parameter(torch.empty(H, self.n_extra, self.dk + self.hidden)) if self.n_extra else None
        self.q_scale = 1.0 / math.sqrt(self.dk)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic init: projections N(0, 1/Din), gate weights N(0, 0.1^2/Din), input-gate
        bias 0, forget-gate bias linspace(forget_bias) over heads, head N(0, 1/(dv+hidden))."""
        g = seeded_generator(seed)
        normal_init_(self.w_proj, 1.0 / math.sqrt(self.in_dim), g)
        normal_init_(self.w_out, 1.0 / math.sqrt(self.dv + self.hidden), g)
        with torch.no_grad():
            self.w_proj[:, :, self._o_gate : self._o_gate + 2].mul_(0.1)
            self.b_proj.zero_()
            lo, hi = self.forget_bias
            fb = torch.linspace(lo, hi, self.kv_heads) if self.kv_heads > 1 else torch.tensor([lo])
            if self.forget_gate == "exp":  # same initial decay: log f = logsigmoid(b)
                fb = F.logsigmoid(fb)
            self.b_proj[:, self._o_gate + 1].copy_(fb.to(self.b_proj.dtype))
            self.b_out.zero_()
        if self.w_extra is not None:
            normal_init_(self.w_extra, 1.0 / math.sqrt(self.n_extra), g)

    # ----------------------------------------------------------------- helpers
    def _project(self, k: Tensor, v: Tensor, cols: slice = slice(None)) -> Tensor:
        """The fused projection's columns ``cols`` (``_new_cols``: what a consumed token adds to the state;
        ``_read_cols``: what a read token asks), or all of them."""
        x = kv_features(k, v, self.input_norm, self.eps, dtype=self.w_proj.dtype)
        return head_linear(x, self.w_proj[..., cols], self.b_proj[..., cols])

    def _split_new(self, p: Tensor, dtype: torch.dtype | None = None):
        if dtype is not None and p.dtype != dtype:
            p = p.to(dtype)
        o = self._o_gate
        kk = p[..., : self.dk]
        vv = p[..., self.dk : o]
        ig = p[..., o]
        fg = p[..., o + 1]
        logf = F.logsigmoid(fg) if self.forget_gate == "sigmoid" else fg
        return kk, vv, ig, logf

    def _split_read(self, r: Tensor, dtype: torch.dtype | None = None, extra: Tensor | None = None):
        """The read columns ``r`` (``_read_cols``) -> (query, feature-MLP pre-activation)."""
        if self.n_extra:
            if extra is None or extra.shape[:-1] != r.shape[:-1] or extra.shape[-1] != self.n_extra:
                got = None if extra is None else tuple(extra.shape)
                raise ValueError(
                    f"this scorer needs extra features [b, h, n, {self.n_extra}] (observed attention), got {got}"
                )
            r = r + torch.einsum("bhne,hef->bhnf", extra.to(r.dtype), self.w_extra)
        elif extra is not None and extra.shape[-1]:
            raise ValueError(f"this scorer takes no extra features, got {tuple(extra.shape)}")
        qq = r[..., : self.dk]
        if dtype is not None and qq.dtype != dtype:
            qq = qq.to(dtype)
        return qq * self.q_scale, r[..., self.dk :]

    def _head(self, h: Tensor, u: Tensor) -> Tensor:
        return score_head(h, u, self.w_out, self.b_out, h_norm=self.h_norm, read_mlp=self.read_mlp, eps=self.eps)

    @staticmethod
    def _apply_mask(ig: Tensor, logf: Tensor, mask: Tensor | None):
        """Masked (padding) tokens: input gate -inf, log forget 0 -> identity update."""
        if mask is None:
            return ig, logf
        if mask.dim() != 2 or mask.shape[0] != ig.shape[0] or mask.shape[1] != ig.shape[2]:
            raise ValueError(f"mask must be [batch, n] = {(ig.shape[0], ig.shape[2])}, got {tuple(mask.shape)}")
        drop = ~mask.to(device=ig.device, dtype=torch.bool).unsqueeze(1)
        return ig.masked_fill(drop, _NEG_INF), logf.masked_fill(drop, 0.0)

    def _check_state(self, state: MLSTMState, batch: int) -> None:
        if state.C.shape[:2] != (batch, self.kv_heads):
            raise ValueError(
                f"state is for batch/heads {tuple(state.C.shape[:2])}, inputs are {(batch, self.kv_heads)}"
            )

    # ---------------------------------------------------------- state update
    @staticmethod
    def _update(
        state: MLSTMState, kk: Tensor, vv: Tensor, ig: Tensor, logf: Tensor, F64: Tensor | None = None
    ) -> MLSTMState:
        """Consume n tokens (masks already folded into ig/logf) in closed form."""
        if kk.shape[2] == 0:
            return state
        C0, n0, m0 = state
        if F64 is None:
            F64 = logf.double().cumsum(-1)
        G = F64[..., -1:]
        a = (G - F64).to(ig.dtype) + ig  # log weight of each new token in the new state
        mg = G.squeeze(-1).to(m0.dtype) + m0  # log weight of the old state
        m_new = torch.maximum(mg, a.amax(-1))
        d1 = _exp_diff(mg, m_new)
        C, n = _absorb(a, m_new, kk, vv)
        return MLSTMState(d1[..., None, None] * C0 + C, d1.unsqueeze(-1) * n0 + n, m_new)

    @staticmethod
    def _update1(
        state: MLSTMState, kk: Tensor, vv: Tensor, ig: Tensor, logf: Tensor, mask: Tensor | None
    ) -> MLSTMState:
        """Fast path for ONE new token (kk [b,h,1,dk], ig/logf [b,h,1]): :func:`mlstm_step`."""
        new = mlstm_step(state, kk.squeeze(-2), vv.squeeze(-2), ig.squeeze(-1), logf.squeeze(-1))
        if mask is None:
            return new
        keep = mask.to(device=new.C.device, dtype=torch.bool).reshape(-1, 1)  # [b, 1]
        return MLSTMState(
            torch.where(keep[..., None, None], new.C, state.C),
            torch.where(keep[..., None], new.n, state.n),
            torch.where(keep, new.m, state.m),
        )

    # ------------------------------------------------ general parallel readout
    def _scan(
        self,
        state: MLSTMState,
        kk: Tensor,
        vv: Tensor,
        ig: Tensor,
        logf: Tensor,
        qq: Tensor,
        read_steps: Tensor,
        query_block: int = 512,
    ) -> tuple[Tensor, MLSTMState]:
        """Consume n new tokens from ``state`` and read queries qq [b,h,M,dk], query j against the
        state after new token read_steps[b, j] (in [-1, n-1]; -1 = before any new token).
        O(query_block * n) memory. Returns (h [b,h,M,dv], state after all n tokens)."""
        b, H, n, _ = kk.shape
        M = qq.shape[2]
        F64 = logf.double().cumsum(-1)
        if M == 0:
            h = qq.new_zeros(b, H, 0, self.dv)
        elif n == 0:
            h = mlstm_read(state, qq)
        else:
            C0, n0, m0 = state
            dtype = ig.dtype
            Fq = F.pad(F64, (1, 0)).gather(-1, (read_steps + 1).unsqueeze(1).expand(b, H, M))
            pos = torch.arange(n, device=kk.device)
            outs = []
            for j0 in range(0, M, query_block):
                j1 = min(M, j0 + query_block)
                Fqb = Fq[..., j0:j1]
                ref = Fqb[..., :1]  # subtract a per-block reference: small, exact-ish differences
                D = (Fqb - ref).to(dtype).unsqueeze(-1) - (F64 - ref).to(dtype).unsqueeze(-2) + ig.unsqueeze(-2)
                future = pos.view(1, 1, n) > read_steps[:, j0:j1].unsqueeze(-1)  # [b, mb, n]
                D = D.masked_fill(future.unsqueeze(1), _NEG_INF)
                inter = Fqb.to(dtype) + m0.unsqueeze(-1)
                outs.append(_attend(qq[:, :, j0:j1], kk, vv, D, inter, C0, n0))
            h = torch.cat(outs, dim=2)
        return h, self._update(state, kk, vv, ig, logf, F64)

    # --------------------------------------------------------------- chunkwise
    @staticmethod
    def _chunk_scan(
        state: MLSTMState, kk: Tensor, vv: Tensor, ig: Tensor, logf: Tensor, qq: Tensor, L: int
    ) -> tuple[Tensor, MLSTMState]:
        """Consume n new tokens from ``state``, reading query j right after new token j
        (qq [b,h,n,dk]), in chunks of L: each chunk's reads are a causal L x L block against the state
        at the chunk's start, and every chunk-start state comes from one small [nc+1, nc+1] log-weight
        matrix over the initial state and the chunks' local states (no loop over chunks). O(n * L)
        memory. Returns (h [b,h,n,dv], state after all n tokens)."""
        b, H, n, dk = kk.shape
        dv = vv.shape[-1]
        C0, n0, m0 = state
        nc = -(-n // L)
        pad = nc * L - n
        if pad:  # padding steps are identity updates (i = -inf, log f = 0)
            kk = F.pad(kk, (0, 0, 0, pad))
            vv = F.pad(vv, (0, 0, 0, pad))
            qq = F.pad(qq, (0, 0, 0, pad))
            ig = F.pad(ig, (0, pad), value=_NEG_INF)
            logf = F.pad(logf, (0, pad))
        kk = kk.reshape(b, H, nc, L, dk)
        vv = vv.reshape(b, H, nc, L, dv)
        qq = qq.reshape(b, H, nc, L, dk)
        ig = ig.reshape(b, H, nc, L)
        Fl = logf.reshape(b, H, nc, L).cumsum(-1)  # within-chunk cumulative log forget
        G = Fl[..., -1]  # [b, H, nc] total log decay of each chunk
        # each chunk's own contribution to the state at its end, stabilised by its own max
        a = G.unsqueeze(-1) - Fl + ig
        mloc = a.amax(-1)
        Cloc, nloc = _absorb(a, mloc, kk, vv)  # [b, H, nc, dk, dv], [b, H, nc, dk]
        # the state at every chunk start c = 0..nc (nc: the final state): the initial state enters
        # with log weight (G_0 + ... + G_{c-1}) + m0, chunk j < c with (G_{j+1} + ... + G_{c-1}) + mloc_j;
        # rows are stabilised by their max (= m; -inf = empty state)
        Gc = F.pad(G.double().cumsum(-1), (1, 0))  # Gc[c] = G_0 + ... + G_{c-1}, c = 0..nc
        A = (Gc[..., :, None] - Gc[..., None, 1:]).to(mloc.dtype) + mloc.unsqueeze(-2)  # [b,H,nc+1,nc]
        A = A.masked_fill(~torch.ones(nc + 1, nc, dtype=torch.bool, device=kk.device).tril(-1), _NEG_INF)
        A = torch.cat([(Gc.to(m0.dtype) + m0.unsqueeze(-1)).unsqueeze(-1), A], -1)  # [b,H,nc+1,1+nc]
        mst = A.amax(-1)
        Wc = torch.exp(A - mst.masked_fill(torch.isneginf(mst), 0.0).unsqueeze(-1))
        Cst = torch.einsum("bhcj,bhjkv->bhckv", Wc[..., 1:], Cloc) + Wc[..., 0, None, None] * C0.unsqueeze(2)
        nst = torch.einsum("bhcj,bhjk->bhck", Wc[..., 1:], nloc) + Wc[..., 0, None] * n0.unsqueeze(2)
        final = MLSTMState(Cst[:, :, nc], nst[:, :, nc], mst[:, :, nc])
        D = Fl.unsqueeze(-1) - Fl.unsqueeze(-2) + ig.unsqueeze(-2)  # [b, H, nc, L, L]
        D = D.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=kk.device).tril(), _NEG_INF)
        inter = Fl + mst[:, :, :nc].unsqueeze(-1)
        h = _attend(qq, kk, vv, D, inter, Cst[:, :, :nc], nst[:, :, :nc])
        return h.reshape(b, H, nc * L, dv)[:, :, :n], final

    def _chunkwise(
        self, kk: Tensor, vv: Tensor, ig: Tensor, logf: Tensor, qq: Tensor, window: int, L: int
    ) -> tuple[Tensor, MLSTMState]:
        """Every token read at its exit step t + window from the empty state (``forward``)."""
        b, H, T, dk = kk.shape
        nmain = max(T - window, 0)  # tokens 0..nmain-1 are read at step t + window <= T-1
        # query read at step s is the token s - window (zeros for s < window: discarded)
        Qs = torch.cat([qq.new_zeros(b, H, T - nmain, dk), qq[:, :, :nmain]], dim=2)
        hs, final = self._chunk_scan(self.init_state(b, kk.device, kk.dtype), kk, vv, ig, logf, Qs, L)
        parts = [hs[:, :, window : window + nmain]] if nmain > 0 else []
        if nmain < T:  # tokens whose exit step lies beyond the sequence: final state
            parts.append(mlstm_read(final, qq[:, :, nmain:]))
        return torch.cat(parts, dim=2), final

    # ------------------------------------------------------------- public API
    def forward(
        self,
        k: Tensor,
        v: Tensor,
        window: int,
        *,
        mask: Tensor | None = None,
        mode: str = "chunkwise",
        chunk_size: int | None = None,
        query_block: int = 512,
        return_state: bool = False,
        extra: Tensor | None = None,
    ):
        """Scores of every token of a sequence, ``[b, h, T]``: token t read at step
        min(t + window, T - 1) (see module docstring). ``mask`` [b, T] (bool, True = real
        token) makes padding positions identity updates of the state (left padding keeps
        exit steps aligned); their own scores are meaningless. ``return_state``: also return
        the state after the whole sequence (to continue with ``step``)."""
        self._check_kv(k, v)
        window = int(window)
        if window < 0:
            raise ValueError("window must be >= 0")
        b, _, T, _ = k.shape
        if T == 0:
            s = k.new_zeros(b, self.kv_heads, 0, dtype=self.w_out.dtype)
            return (s, self.init_state(b, k.device)) if return_state else s
        p = self._project(k, v)
        kk, vv, ig, logf = self._split_new(p)
        qq, u = self._split_read(p[..., self._read_cols], extra=extra)
        ig, logf = self._apply_mask(ig, logf, mask)
        if mode == "chunkwise":
            h, state = self._chunkwise(kk, vv, ig, logf, qq, window, int(chunk_size or self.chunk_size))
        elif mode == "parallel":
            steps = (torch.arange(T, device=k.device) + window).clamp_(max=T - 1)
            h, state = self._scan(
                self.init_state(b, k.device), kk, vv, ig, logf, qq, steps.unsqueeze(0).expand(b, T), query_block
            )
        else:
            raise ValueError(f"mode must be 'chunkwise' or 'parallel', got {mode!r}")
        scores = self._head(h, u)
        return (scores, state) if return_state else scores

    def init_state(self, batch: int = 1, device=None, dtype=None) -> MLSTMState:
        """Empty state: C = 0 [b,h,dk,dv], n = 0 [b,h,dk], m = -inf [b,h].
        dtype defaults to the parameter dtype (keep it fp32 even with a bf16 cache)."""
        device = device if device is not None else self.w_proj.device
        dtype = dtype or self.w_proj.dtype
        H = self.kv_heads
        return MLSTMState(
            torch.zeros(batch, H, self.dk, self.dv, device=device, dtype=dtype),
            torch.zeros(batch, H, self.dk, device=device, dtype=dtype),
            torch.full((batch, H), _NEG_INF, device=device, dtype=dtype),
        )

    def step(self, state: MLSTMState, k: Tensor, v: Tensor, mask: Tensor | None = None) -> MLSTMState:
        """Consume new tokens k, v [b, h, n, d] in order. mask [b, n] bool (True = real token):
        masked positions leave the state unchanged."""
        self._check_kv(k, v)
        self._check_state(state, k.shape[0])
        if k.shape[2] == 0:
            return state
        kk, vv, ig, logf = self._split_new(self._project(k, v, self._new_cols), state.C.dtype)
        if k.shape[2] == 1:
            return self._update1(state, kk, vv, ig, logf, mask)
        ig, logf = self._apply_mask(ig, logf, mask)
        return self._update(state, kk, vv, ig, logf)

    def read(self, state: MLSTMState, k: Tensor, v: Tensor, extra: Tensor | None = None) -> Tensor:
        """Scores [b, h, n] of (exiting) tokens k, v [b, h, n, d] against the current state."""
        self._check_kv(k, v)
        self._check_state(state, k.shape[0])
        qq, u = self._split_read(self._project(k, v, self._read_cols), state.C.dtype, extra)
        return self._head(mlstm_read(state, qq), u)

    def step_and_read(
        self,
        state: MLSTMState,
        k_new: Tensor,
        v_new: Tensor,
        k_read: Tensor,
        v_read: Tensor,
        read_steps: Tensor | Sequence[int] | None = None,
        mask: Tensor | None = None,
        query_block: int = 512,
        extra: Tensor | None = None,
    ) -> tuple[MLSTMState, Tensor]:
        """Consume n new tokens and score m tokens, in one call.

        read_steps: None -> every read after all new tokens (decode: n = m = 1); else [m] or
        [b, m] ints in [-1, n-1]: read j happens right after new token read_steps[j] (-1: before
        the first one), e.g. a prefill chunk where token t exits at step t + window. mask [b, n]
        as in ``step``. Returns (state after all n tokens, scores [b, h, m])."""
        self._check_kv(k_new, v_new)
        self._check_kv(k_read, v_read)
        b, _, n, _ = k_new.shape
        self._check_state(state, b)
        dt = state.C.dtype
        kk, vv, ig, logf = self._split_new(self._project(k_new, v_new, self._new_cols), dt)
        qq, u = self._split_read(self._project(k_read, v_read, self._read_cols), dt, extra)
        if read_steps is None:
            if n == 1:
                state = self._update1(state, kk, vv, ig, logf, mask)
                h = mlstm_read(state, qq, nonempty=mask is None)
            else:
                ig, logf = self._apply_mask(ig, logf, mask)
                state = self._update(state, kk, vv, ig, logf)
                h = mlstm_read(state, qq)
        else:
            rs = torch.as_tensor(read_steps, device=k_new.device, dtype=torch.long)
            m_reads = k_read.shape[2]
            rs = rs.expand(b, m_reads) if rs.dim() == 1 else rs
            if rs.shape != (b, m_reads):
                raise ValueError(f"read_steps must be [m] or [b, m] = {(b, m_reads)}, got {tuple(rs.shape)}")
            if m_reads and (int(rs.min()) < -1 or int(rs.max()) > n - 1):
                raise ValueError("read_steps must lie in [-1, n-1]")
            ig, logf = self._apply_mask(ig, logf, mask)
            if m_reads == n > 1 and bool((rs == torch.arange(n, device=rs.device)).all()):
                # read j right after new token j (the prefill chunk's exits): the chunkwise form
                h, state = self._chunk_scan(state, kk, vv, ig, logf, qq, min(self.chunk_size, self.prefill_block))
            else:
                h, state = self._scan(state, kk, vv, ig, logf, qq, rs, query_block)
        return state, self._head(h, u)

    def extra_repr(self) -> str:
        return (
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dk={self.dk}, dv={self.dv}, "
            f"hidden={self.hidden}, input_norm={self.input_norm}, h_norm={self.h_norm}, "
            f"forget_gate={self.forget_gate!r}"
        )
