"""Training-time eviction mask: the bounded cache as an attention mask over the whole sequence.

Runtime level (a top-level module): the masked simulation is the cache's fast path that evaluation and adaptation use.

With a static per-token priority (frozen when the token leaves the window; method.md section 5,
"Adapting the LLM"), the long-range set after any number of exits is the top-``k`` of the
exited tokens in the order ``(priority, -index)`` (``kvpop.rule``). So each token has one
*leave step*: the first query step at which the cache no longer holds it, and

    key ``t`` is visible to query ``q``  iff  ``t <= q < leave[t]``.

:func:`masked_eviction` is a context manager (modelled on
``kvpop.capture.capturing``) under which a cache-free forward of a model attends with that
mask, per KV head: the logits equal those of the same tokens fed through
:class:`kvpop.KVpopCache` with the same priorities, and gradients reach the model's own
weights (the priorities are computed without gradient). Ready-made priority functions:
:func:`streaming_priority_fn`, :func:`learned_priority_fn`, :func:`oracle_priority_fn`.

"Equal" is to float tolerance, decision for decision, as long as no two priorities lie within
float rounding of each other: the cache scores exits chunk by chunk from keys that went through
differently shaped kernels, so a near-tie (seen on SmolLM2-135M with the shipped MLP scorer:
two priorities ~1e-6 apart in one head of one layer) may be broken the other way, and the
logits after that step differ by more (~1e-2 there). Exact ties follow the same rule in both.

Leave steps come from :func:`kvpop.rule.leave_steps` (``O(S log S)`` per head).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import attention_implementation, register
from .config import attention_shape
from .rule import NEVER, leave_steps
from .validate import check_int

__all__ = [
    "MASK_ATTN_NAME",
    "MaskedEvictionState",
    "PriorityFn",
    "learned_priority_fn",
    "logical_positions",
    "masked_eviction",
    "oracle_priority_fn",
    "streaming_priority_fn",
    "visibility",
]

MASK_ATTN_NAME = "kvpop_masked"

# priority_fn(layer_idx, keys [b, kv_heads, S, d], values [b, kv_heads, S, dv], positions [b, S]) -> [b, kv_heads, S]
PriorityFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def visibility(leave: Tensor, q_pos: Tensor | None = None, k_pos: Tensor | None = None) -> Tensor:
    """Boolean ``[b, h, Q, K]``: key visible to query, ``t <= q < leave[t]`` on logical indices.

    ``leave`` ``[b, h, K]`` (indexed by key); ``q_pos`` ``[b, Q]`` / ``k_pos`` ``[b, K]`` logical
    indices of queries and keys (``-1`` = padding; default ``arange``). A padding query sees only
    the key at its own position (so no attention row is empty).
    """
    b, _, K = leave.shape
    if k_pos is None:
        k_pos = torch.arange(K, device=leave.device).expand(b, K)
    if q_pos is None:
        q_pos = k_pos
    Q = q_pos.shape[1]
    lq = q_pos.view(b, 1, Q, 1)
    lk = k_pos.view(b, 1, 1, K)
    vis = (lk >= 0) & (lk <= lq) & (lq < leave.unsqueeze(2))
    pad_q = lq < 0
    if bool(pad_q.any()):
        # a padding query at physical position i sees key i (queries and keys share positions here)
        off = K - Q
        self_key = torch.arange(Q, device=leave.device).view(1, 1, Q, 1) + off == torch.arange(K, device=leave.device)
        vis = vis | (pad_q & self_key)
    return vis


def logical_positions(attention_mask: Tensor | None, batch: int, S: int, device=None) -> Tensor:
    """Logical token index of each position ``[b, S]``: the count of real tokens before it, ``-1`` for padding."""
    if attention_mask is None:
        return torch.arange(S, device=device).expand(batch, S)
    valid = attention_mask.to(torch.bool)
    return torch.where(valid, valid.long().cumsum(1) - 1, -1)


def _leave_logical(prio: Tensor, pos: Tensor, sinks: int, window: int, k: int) -> Tensor:
    """Leave steps (logical) of each physical key ``[b, h, S]`` for rows that may hold padding."""
    b, h, S = prio.shape
    valid = pos >= 0
    if bool(valid.all()):
        return leave_steps(prio, sinks, window, k)
    # real tokens first, in order: padding moved to the end exits after every real query, so it changes nothing
    perm = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # [b, S]
    p = prio.gather(2, perm.unsqueeze(1).expand(b, h, S))
    tail = ~valid.gather(1, perm)
    p = p.masked_fill(tail.unsqueeze(1), -math.inf)
    leave_log = leave_steps(p, sinks, window, k)
    return leave_log.gather(2, pos.clamp(min=0).unsqueeze(1).expand(b, h, S))


# --------------------------------------------------------------------------------------------
# priority functions
# --------------------------------------------------------------------------------------------


def streaming_priority_fn() -> PriorityFn:
    """Zeros: with ``k = 0`` (StreamingLLM, ``window = B - sinks``) priorities are never compared."""

    def fn(layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)

    return fn


def learned_priority_fn(scorer, window: int, lam: float = 0.0, sinks: int = 4) -> PriorityFn:
    """A ``ScorerStack``'s training form: ``scorer.forward_layer(layer, k, v, window) + lam * t``.

    ``window`` is the eviction window (the mLSTM reads token ``t`` after consuming ``t + window``,
    as the cache does). Padding (``positions < 0``) is passed as the scorer's ``mask``. A scorer
    that reads observed attention gets it from the layer's queries (``kvpop.observed``, with
    ``sinks`` sink tokens; unpadded rows only).
    """
    window = check_int("window", window, 0, optional=False)
    lam = float(lam)
    obs = tuple(scorer.config.observed)

    def fn(layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor, queries: Tensor | None = None) -> Tensor:
        valid = positions >= 0
        mask = None if bool(valid.all()) else valid
        observed = None
        if obs:
            if queries is None or mask is not None:
                raise ValueError("a scorer with observed-attention inputs needs the queries of unpadded rows")
            from .observed import observed_attention

            observed = observed_attention(queries, keys, window, sinks, obs)
        r = scorer.forward_layer(
            layer_idx, keys.float(), values.float(), window, positions=positions, observed=observed, mask=mask
        ).float()
        return r + lam * positions.float().unsqueeze(1) if lam else r

    return fn


def oracle_priority_fn(targets: Sequence[Tensor], lam: float = 0.0) -> PriorityFn:
    """Precomputed priorities: ``targets[layer]`` ``[b, kv_heads, S]`` indexed by logical token, ``+ lam * t``.

    E.g. the log future-attention targets of ``kvpop.capture.collect(model, ids, window=W)``
    (which are indexed by physical position: pass them for unpadded batches).
    """
    targets = [t.float() for t in targets]
    lam = float(lam)

    def fn(layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        tgt = targets[layer_idx].to(keys.device)
        b, h, S = keys.shape[:3]
        if tgt.shape[0] != b or tgt.shape[1] != h or tgt.shape[2] < int(positions.max()) + 1:
            raise ValueError(f"oracle targets of layer {layer_idx} are {tuple(tgt.shape)}; need [{b}, {h}, >= tokens]")
        idx = positions.clamp(min=0).unsqueeze(1).expand(b, h, S)
        r = tgt.gather(2, idx)
        return r + lam * positions.float().unsqueeze(1) if lam else r

    return fn


# --------------------------------------------------------------------------------------------
# the attention function
# --------------------------------------------------------------------------------------------


@dataclass
class MaskedEvictionState:
    """What :func:`masked_eviction` holds while active; ``leave[layer]`` is filled by each forward."""

    priority_fn: PriorityFn | None
    sinks: int
    window: int
    k: int
    query_block: int = 128
    backend: str = "auto"
    keep_leave: bool = False
    leave: dict[int, Tensor] | None = None
    # a hybrid model: each full-attention layer's rank among them (what priority_fn is called with, as a
    # scorer or the oracle's targets count layers), and the sliding layers' window (run as the model's own)
    ranks: dict[int, int] | None = None
    sliding_window: int | None = None


_ACTIVE: contextvars.ContextVar[MaskedEvictionState | None] = contextvars.ContextVar("kvpop_masked", default=None)
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def _padding_mask(**kwargs):
    """Mask interface: hand the attention function the 2-D padding mask (or None) untouched."""
    am = kwargs.get("attention_mask")
    if am is None or bool(am.all()):
        return None
    return am


def _sdpa_blocks(query, key, value, leave, pos, scale, block, dropout):
    """CPU (and fallback) path: SDPA with a boolean mask, one block of queries at a time.

    A block of ``c`` queries only needs the keys that some query of it sees: those still held
    at the block's first query (at most ``B`` of them) and the block's own. Each head gathers
    its set (padded to the largest count of the batch), so the cost is ``O(S (B + c))``, not
    ``O(S^2)``. Padding queries see every gathered key (their outputs are never used).
    """
    b, hq, S, d = query.shape
    hk = key.shape[1]
    g = hq // hk
    outs = []
    for q0 in range(0, S, block):
        q1 = min(S, q0 + block)
        c = q1 - q0
        lq = pos[:, q0:q1].view(b, 1, c, 1)
        lq_min = torch.where(lq >= 0, lq, NEVER).amin(dim=(1, 2, 3))  # first real query of each row's block
        lv = leave[..., :q1]
        sel = lv > lq_min.view(b, 1, 1)  # a superset of the keys any query of the block sees
        n = max(1, int(sel.sum(-1).max()))
        idx = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices[..., :n]  # [b, hk, n] in order
        k_pos = torch.where(sel.gather(-1, idx), pos[:, :q1].unsqueeze(1).expand(b, hk, q1).gather(-1, idx), -1)
        k_leave = lv.gather(-1, idx)
        kk = key[:, :, :q1].gather(2, idx.unsqueeze(-1).expand(b, hk, n, d))
        vv = value[:, :, :q1].gather(2, idx.unsqueeze(-1).expand(b, hk, n, value.shape[-1]))
        lk = k_pos.unsqueeze(2)  # [b, hk, 1, n]
        vis = ((lk >= 0) & (lk <= lq) & (lq < k_leave.unsqueeze(2))) | (lq < 0)  # [b, hk, c, n]
        # the g query heads of a KV group side by side: [b, hk, g*c, d] against [b, hk, n, d]
        qv = query[:, :, q0:q1].reshape(b, hk, g * c, d)
        mask = vis.unsqueeze(2).expand(b, hk, g, c, n).reshape(b, hk, g * c, n)
        out = torch.nn.functional.scaled_dot_product_attention(
            qv, kk, vv, attn_mask=mask, dropout_p=dropout, scale=scale
        )
        outs.append(out.view(b, hq, c, -1))
    return torch.cat(outs, 2)


_FLEX = None


def _flex(query, key, value, leave, pos, scale):
    """CUDA path: FlexAttention with a ``mask_mod`` reading the leave steps (same rule as ``visibility``).

    Compiled on CUDA only: torch 2.13's compiled CPU kernel returned NaN or wrong rows on some calls
    (seen on an AMD EPYC, 4 of 6 random inputs; eager flex_attention matched sdpa on all 6), so
    elsewhere it runs eager, which is exact and only slower."""
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not query.is_cuda:
        fn = flex_attention
    else:
        if _FLEX is None:
            _FLEX = torch.compile(flex_attention, dynamic=False)
        fn = _FLEX
    b, hq, S, _ = query.shape
    g = hq // key.shape[1]

    def mask_mod(bi, hi, qi, ki):
        lq, lk = pos[bi, qi], pos[bi, ki]
        return ((lk >= 0) & (lk <= lq) & (lq < leave[bi, hi // g, ki])) | (qi == ki)

    block_mask = create_block_mask(mask_mod, B=b, H=hq, Q_LEN=S, KV_LEN=S, device=query.device)
    return fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=g > 1)


def _takes_queries(fn) -> bool:
    """Whether a priority function accepts the layer's queries (``queries=`` or ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "queries" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _sliding_attention(
    query, key, value, attention_mask, window: int, scale: float, dropout: float, block: int
) -> Tensor:
    """A sliding-window layer of a hybrid model, as the model runs it with its own cache: query ``i``
    sees keys ``j`` with ``i - window < j <= i`` (physical positions, as transformers' sliding mask and
    ``DynamicSlidingWindowLayer``), padding keys never; ``[b, hq, S, d]`` computed ``block`` queries at
    a time against the keys they may see (memory ``O(S (window + block))``). A padding query sees itself
    only (its output is never used)."""
    b, hq, S, _ = query.shape
    g = hq // key.shape[1]
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    pad = None if attention_mask is None else attention_mask.bool()
    out = torch.empty(b, hq, S, value.shape[-1], dtype=query.dtype, device=query.device)
    for a in range(0, S, block):
        e, lo = min(S, a + block), max(0, a - window + 1)
        qi = torch.arange(a, e, device=query.device).view(-1, 1)
        kj = torch.arange(lo, e, device=query.device).view(1, -1)
        see = ((kj <= qi) & (kj > qi - window)).view(1, 1, e - a, e - lo)
        if pad is not None:
            see = (see & pad[:, lo:e].view(b, 1, 1, e - lo)) | (kj == qi).view(1, 1, e - a, e - lo)
        out[:, :, a:e] = F.scaled_dot_product_attention(
            query[:, :, a:e], key[:, :, lo:e], value[:, :, lo:e], attn_mask=see, dropout_p=dropout, scale=scale
        )
    return out.transpose(1, 2).contiguous()


def _masked_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    state = _ACTIVE.get()
    if state is None:
        raise RuntimeError(f"the {MASK_ATTN_NAME!r} attention runs only inside kvpop.mask.masked_eviction(...)")
    layer = getattr(module, "layer_idx", None)
    b, _, S, d = query.shape
    hk = key.shape[1]
    if key.shape[2] != S:
        raise RuntimeError("masked_eviction expects a cache-free forward over the whole sequence (use_cache=False)")
    if any(kwargs.get(m) is not None for m in _UNSUPPORTED):
        raise ValueError(f"masked_eviction does not support attention modifiers {_UNSUPPORTED}")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError("masked_eviction expects a 2-D padding mask [batch, S]")
    if not module.training:
        dropout = 0.0
    scale = float(scaling) if scaling is not None else d**-0.5
    if state.ranks is not None and layer not in state.ranks:  # a sliding layer: its own window, no eviction
        return _sliding_attention(
            query, key, value, attention_mask, state.sliding_window, scale, dropout, state.query_block
        ), None
    if kwargs.get("sliding_window") is not None and S > kwargs["sliding_window"]:
        raise ValueError(
            f"layer {layer} uses sliding-window attention ({kwargs['sliding_window']} < S={S}), but the "
            "model's config names no sliding layer"
        )
    pos = logical_positions(attention_mask, b, S, device=query.device)
    layer = layer if state.ranks is None else state.ranks[layer]  # what priority_fn and keep_leave count

    if state.k == 0 or state.priority_fn is None:
        if state.k > 0:
            raise ValueError("masked_eviction with k > 0 needs a priority_fn")
        prio = torch.zeros(b, hk, S, device=query.device)
    else:
        with torch.no_grad():
            if _takes_queries(state.priority_fn):
                prio = state.priority_fn(layer, key.detach(), value.detach(), pos, queries=query.detach())
            else:
                prio = state.priority_fn(layer, key.detach(), value.detach(), pos)
        if tuple(prio.shape) != (b, hk, S):
            raise RuntimeError(f"priority_fn returned {tuple(prio.shape)} at layer {layer}; expected {(b, hk, S)}")
        prio = prio.detach()
        if bool(torch.isnan(prio.masked_fill(pos.unsqueeze(1) < 0, 0.0)).any()):
            raise RuntimeError(f"priority_fn returned NaN at layer {layer}")
    leave = _leave_logical(prio, pos, state.sinks, state.window, state.k)
    if state.keep_leave:
        state.leave[layer] = leave

    if attention_mask is None and bool((leave == NEVER).all()):
        # nothing ever leaves: the plain causal mask, through the same function as dense attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)

    backend = state.backend
    if backend == "auto":
        backend = "flex" if query.is_cuda else "sdpa"
    if backend == "flex":
        out = _flex(query, key, value, leave, pos, scale)
    else:
        out = _sdpa_blocks(query, key, value, leave, pos, scale, state.query_block, dropout)
    return out.transpose(1, 2).contiguous(), None


register(MASK_ATTN_NAME, _masked_attention, _padding_mask)


@contextlib.contextmanager
def masked_eviction(
    model: torch.nn.Module,
    priority_fn: PriorityFn | None,
    *,
    sinks: int,
    window: int,
    k: int,
    query_block: int = 128,
    backend: str = "auto",
    keep_leave: bool = False,
) -> Iterator[MaskedEvictionState]:
    """While active, cache-free forwards of ``model`` attend under the eviction mask.

    Each attention layer calls ``priority_fn(layer_idx, keys, values, positions)`` (post-RoPE
    keys ``[b, kv_heads, S, d]``, values, logical token indices ``[b, S]``, ``-1`` = padding;
    called under ``no_grad``, the result is detached) for the static priority ``[b, kv_heads, S]``
    (fold any recency tilt ``lam * t`` into it), computes :func:`leave_steps` with ``sinks``,
    ``window`` and ``k`` long-range slots, and attends with the per-KV-head mask (shared by the
    query heads of each group). ``priority_fn`` may be ``None`` when ``k == 0`` (StreamingLLM:
    ``window = B - sinks``). Gradients flow to the model's weights through the attention.

    ``backend``: ``"sdpa"`` (boolean mask, ``query_block`` queries at a time against the keys
    they may see: time and memory ``O(S (B + query_block))`` per head),
    ``"flex"`` (FlexAttention, CUDA), or ``"auto"`` (flex on CUDA, else sdpa).
    ``keep_leave``: record each layer's leave steps in the yielded state's ``leave``.
    A hybrid model (Gemma 3, Qwen2/3 with sliding layers): only its full-attention layers are masked,
    and ``priority_fn`` and ``leave`` count them by rank among the full-attention layers (as a
    scorer's layers and the oracle's targets do); each sliding layer attends over its own window,
    as the model with its own cache (and ``KVpopCache``) runs it.
    Padding: pass the usual 2-D ``attention_mask``; real tokens of a row get logical indices
    ``0, 1, ...`` as in :class:`kvpop.KVpopCache` (left padding). The model's attention
    implementation is restored on exit, also on errors.
    """
    sinks, k = check_int("sinks", sinks, 0, optional=False), check_int("k", k, 0, optional=False)
    window = check_int("window", window, 1, optional=False)
    query_block = check_int("query_block", query_block, 1, optional=False)
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"backend must be 'auto', 'sdpa' or 'flex'; got {backend!r}")
    if k > 0 and priority_fn is None:
        raise ValueError("k > 0 long-range slots need a priority_fn (priority_fn=None is for k = 0)")
    shape = attention_shape(model.config)
    hybrid = len(shape.bounded) < shape.num_layers
    state = MaskedEvictionState(
        priority_fn,
        sinks,
        window,
        k,
        query_block,
        backend,
        keep_leave,
        {} if keep_leave else None,
        ranks={layer: r for r, layer in enumerate(shape.bounded)} if hybrid else None,
        sliding_window=shape.sliding_window if hybrid else None,
    )
    with attention_implementation(model, MASK_ATTN_NAME, _ACTIVE, state):
        yield state
