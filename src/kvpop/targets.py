"""Training targets: future attention after the protected window (spec sections 3 and 4).

Runtime level (a top-level module): the oracle policy runs on these targets, not only training.

For a causal attention layer with post-RoPE queries ``q`` ``[batch, q_heads, S, d]`` and keys
``k`` ``[batch, kv_heads, S, d]``, the attention probability of query ``d`` on key ``t`` is
``p[g, d, t] = exp(scale * q_d . k_t - LSE[g, d])`` (``LSE`` = row log-sum-exp over keys
``0..d``).  The target of key ``t`` for window ``w`` is

    m[g, t]      = (1 / N_t) * sum_{d = t + w}^{S - 1} p[g, d, t],   N_t = max(1, S - (t + w))
    target[h, t] = log( max_{g in G(h)} m[g, t] )

where ``G(h)`` are the query heads served by KV head ``h`` (query head ``g`` belongs to KV head
``g // (q_heads // kv_heads)``, as in transformers' ``repeat_kv``).

Keys with no future query after the window (``t + w > S - 1``, i.e. the last ``w`` keys) get
``-inf`` (the sum is empty).

A ``power`` ``beta >= 1`` replaces the mean by the power mean of the same probabilities,

    m_beta[g, t] = ( (1 / N_t) * sum_{d = t + w}^{S - 1} p[g, d, t] ** beta ) ** (1 / beta),

which is the mean at ``beta = 1`` and tends to the largest single probability as ``beta`` grows: a
token read sharply by a few queries (a needle read by the question) then outranks one read faintly
by many. Every method below computes it by the same pass with the logits multiplied by ``beta``.

The fast methods never form an ``S x S`` matrix per head.  They use the transposed-attention
identity: with the bias ``-LSE[g, d]`` and the mask ``d >= t + w``, the log-sum-exp over ``d``
of a key-as-query row is ``log(N_t * m[g, t])``.

Methods
-------
``"dense"``   reference: materialise ``p`` (``O(S^2)`` memory), sum.
``"blocked"`` pure PyTorch, ``O(S * block)`` memory: row LSE block by block (if not given),
              then the transposed pass key block by key block.
``"fused"``   CPU: the sequence is reversed so that ``d >= t + w`` becomes an ordinary (square,
              top-left) causal mask; the bias is folded in as extra dimensions, and one causal call
              of ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` per pass gives the
              LSE of every row.  Two calls in all: the forward one (row LSE, skipped when ``lse``
              is given) and the transposed one.
``"flex"``    CUDA: FlexAttention (``score_mod`` subtracting the LSE, ``mask_mod`` ``d >= t + w``,
              LSE returned), compiled.
``"auto"``    flex on CUDA, else fused when the kernel supports the dtype, else blocked.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import Tensor

from .validate import check_number

__all__ = [
    "METHODS",
    "check_power",
    "future_attention",
    "future_attention_windows",
    "loss_mask",
    "n_future",
    "row_lse",
    "spread_targets",
]

METHODS = ("auto", "dense", "blocked", "fused", "flex")

_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def n_future(S: int, window: int, device: torch.device | str | None = None) -> Tensor:
    """``N_t = max(1, S - (t + window))`` for ``t = 0..S-1`` as a LongTensor ``[S]``."""
    t = torch.arange(S, device=device, dtype=torch.long)
    return (S - (t + window)).clamp_min(1)


def loss_mask(S: int, window: int, min_future: int | None = None, device=None) -> Tensor:
    """Boolean ``[S]``: keys with enough future queries to carry signal.

    True where the number of queries after the window, ``S - (t + window)``, is at least
    ``min_future`` (default: ``window``, the spec's choice ``N_t >= w``; at least 1 in any case,
    so the ``-inf`` positions are always excluded).
    """
    if min_future is None:
        min_future = window
    min_future = max(1, int(min_future))
    t = torch.arange(S, device=device, dtype=torch.long)
    return (S - (t + window)) >= min_future


def spread_targets(target: Tensor, span: int) -> Tensor:
    """Each defined position's target raised to the largest within ``span`` positions either side
    (``target [..., S]``, log scale; ``-inf`` positions, which have no target, stay ``-inf``).

    A fact is several tokens (a 7-digit number is 7 tokens for Qwen's tokenizer), and the teacher
    ranks each on its own, so a head may keep the one digit a later query read hardest and drop the
    rest; spread targets rank a fact's tokens together. ``span = 0`` returns ``target`` unchanged."""
    if isinstance(span, bool) or not isinstance(span, int) or span < 0:
        raise ValueError(f"span must be an integer >= 0, got {span!r}")
    if span == 0:
        return target
    S = target.shape[-1]
    flat = target.reshape(-1, 1, S)
    spread = torch.nn.functional.max_pool1d(flat, kernel_size=2 * span + 1, stride=1, padding=span)
    spread = spread.reshape(target.shape)
    return torch.where(torch.isneginf(target), target, spread)


def check_power(power) -> float:
    """The power-mean exponent as a float (finite, at least 1: 1 is the mean), by the project's number
    check; a value of the wrong kind is a ValueError too, like every bad input of this module."""
    try:
        return check_number("power", power, minimum=1.0, optional=False)
    except TypeError as e:
        raise ValueError(str(e)) from None


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _validate(q: Tensor, k: Tensor, window: int, lse: Tensor | None, method: str) -> None:
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        raise ValueError("q and k must be torch tensors")  # noqa: TRY004 (one error type for bad input)
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be 4-D [batch, heads, S, d]; got q.ndim={q.ndim}, k.ndim={k.ndim}")
    bq, hq, sq, dq = q.shape
    bk, hk, sk, dk = k.shape
    if bq != bk or sq != sk or dq != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, S and d")
    if hk < 1 or hq % hk != 0:
        raise ValueError(f"q_heads ({hq}) must be a positive multiple of kv_heads ({hk})")
    if sq < 1 or dq < 1:
        raise ValueError(f"empty sequence or head dim: q {tuple(q.shape)}")
    if not q.is_floating_point() or not k.is_floating_point():
        raise ValueError(f"q and k must be floating point; got {q.dtype}, {k.dtype}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have the same dtype; got {q.dtype}, {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on the same device; got {q.device}, {k.device}")
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"window must be an int; got {window!r}")  # noqa: TRY004
    if window < 0 or window >= sq:
        raise ValueError(f"window must satisfy 0 <= window < S={sq}; got {window}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if lse is not None:
        if not isinstance(lse, Tensor) or tuple(lse.shape) != (bq, hq, sq):
            shape = tuple(lse.shape) if isinstance(lse, Tensor) else type(lse)
            raise ValueError(f"lse must have shape [batch, q_heads, S] = {(bq, hq, sq)}; got {shape}")
        if not _all_finite(lse):
            raise ValueError("lse contains non-finite values")
    if not _all_finite(q):
        raise ValueError("q contains non-finite values (nan/inf)")
    if not _all_finite(k):
        raise ValueError("k contains non-finite values (nan/inf)")


def _all_finite(x: Tensor) -> bool:
    """Cheap check: one float64 sum (nan/inf propagate); the exact test only if it is not finite."""
    if bool(torch.isfinite(x.sum(dtype=torch.float64))):
        return True
    return bool(torch.isfinite(x).all())


def _finish(lse_t: Tensor, S: int, window: int, kv_heads: int, power: float = 1.0) -> Tensor:
    """``lse_t`` ``[B, Hq, S]`` = ``log(N_t m_beta[g, t] ** beta)`` (``-inf`` where undefined) -> target."""
    B, Hq, _ = lse_t.shape
    G = Hq // kv_heads
    best = lse_t.view(B, kv_heads, G, S).amax(dim=2)
    log_n = n_future(S, window, device=lse_t.device).to(best.dtype).log()
    out = best - log_n
    if power != 1.0:
        out = out / power
    if window > 0:
        out[..., S - window :] = -math.inf
    return out


# --------------------------------------------------------------------------------------------
# dense reference
# --------------------------------------------------------------------------------------------


def _dense(q: Tensor, k: Tensor, window: int, scale: float, power: float = 1.0) -> Tensor:
    B, Hq, S, _D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    cdt = _out_dtype(q.dtype)
    qf = q.to(cdt)
    kf = k.to(cdt).repeat_interleave(G, dim=1)
    logits = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hq, S(d), S(t)]
    idx = torch.arange(S, device=q.device)
    causal = idx[None, :] <= idx[:, None]  # [d, t]: t <= d
    logits = logits.masked_fill(~causal, -math.inf)
    future = idx[:, None] >= idx[None, :] + window  # d >= t + w
    if power != 1.0:  # in log space: p ** beta underflows
        logp = torch.log_softmax(logits, dim=-1) * power
        lm = torch.logsumexp(logp.masked_fill(~future, -math.inf), dim=-2)  # [B, Hq, S]
        lm = (lm - n_future(S, window, device=q.device).to(cdt).log()) / power
        return lm.view(B, Hk, G, S).amax(dim=2)
    p = torch.softmax(logits, dim=-1)
    m = (p * future).sum(dim=-2)  # [B, Hq, S]
    m = m / n_future(S, window, device=q.device).to(cdt)
    return m.view(B, Hk, G, S).amax(dim=2).log()


# --------------------------------------------------------------------------------------------
# blocked pure-PyTorch path
# --------------------------------------------------------------------------------------------


def _grouped(q: Tensor, Hk: int) -> Tensor:
    B, Hq, S, D = q.shape
    return q.view(B, Hk, Hq // Hk, S, D)


def _row_lse_blocked(q: Tensor, k: Tensor, scale: float, block: int) -> Tensor:
    """Causal row LSE ``[B, Hq, S]`` with ``O(S * block)`` memory."""
    B, Hq, S, _D = q.shape
    Hk = k.shape[1]
    qg = _grouped(q, Hk)  # [B, Hk, G, S, D]
    kg = k[:, :, None]  # [B, Hk, 1, S, D]
    out = torch.empty(B, Hk, Hq // Hk, S, dtype=q.dtype, device=q.device)
    for d0 in range(0, S, block):
        d1 = min(S, d0 + block)
        logits = torch.matmul(qg[:, :, :, d0:d1], kg[:, :, :, :d1].transpose(-1, -2)) * scale
        d_idx = torch.arange(d0, d1, device=q.device)[:, None]
        t_idx = torch.arange(d1, device=q.device)[None, :]
        logits.masked_fill_(t_idx > d_idx, -math.inf)
        out[..., d0:d1] = torch.logsumexp(logits, dim=-1)
    return out.view(B, Hq, S)


def _blocked(
    q: Tensor, k: Tensor, window: int, scale: float, lse: Tensor | None, block: int, power: float = 1.0
) -> Tensor:
    return _finish(_blocked_raw(q, k, window, scale, lse, block, power), q.shape[2], window, k.shape[1], power)


def _blocked_raw(
    q: Tensor, k: Tensor, window: int, scale: float, lse: Tensor | None, block: int, power: float = 1.0
) -> Tensor:
    """``log sum_{d >= t + w} p[g, d, t] ** power`` per query head ``[B, Hq, S]`` (-inf where empty)."""
    B, Hq, S, _D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    cdt = _out_dtype(q.dtype)
    q = q.to(cdt)
    k = k.to(cdt)
    if lse is None:
        lse = _row_lse_blocked(q, k, scale, block)
    lse = lse.to(cdt)
    qg = _grouped(q, Hk)  # [B, Hk, G, S, D]
    lseg = lse.view(B, Hk, G, S)
    out = torch.full((B, Hq, S), -math.inf, dtype=cdt, device=q.device)
    outg = out.view(B, Hk, G, S)
    last = S - window  # keys t < last have at least one future query
    for t0 in range(0, last, block):
        t1 = min(last, t0 + block)
        dstart = t0 + window
        kb = k[:, :, None, t0:t1]  # [B, Hk, 1, bt, D]
        qb = qg[:, :, :, dstart:]  # [B, Hk, G, nd, D]
        logits = torch.matmul(kb, qb.transpose(-1, -2)) * scale  # [B, Hk, G, bt, nd]
        logits -= lseg[:, :, :, None, dstart:]
        if power != 1.0:
            logits *= power
        t_idx = torch.arange(t0, t1, device=q.device)[:, None]
        d_idx = torch.arange(dstart, S, device=q.device)[None, :]
        logits.masked_fill_(d_idx < t_idx + window, -math.inf)
        outg[..., t0:t1] = torch.logsumexp(logits, dim=-1)
    return out


# --------------------------------------------------------------------------------------------
# fused CPU flash-kernel path
# --------------------------------------------------------------------------------------------


def _flash_cpu():
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):  # pragma: no cover - very old torch
        return None


def fused_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the ``"fused"`` method can run for this dtype/device."""
    return torch.device(device).type == "cpu" and dtype in _FUSED_DTYPES and _flash_cpu() is not None


def _flash_lse(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Causal (top-left) flash attention on CPU; returns only the row LSE ``[B, Hq, L]``.

    ``q`` ``[B, Hq, L, E]``; ``k`` ``[B, Hk, L, E]`` with ``Hq % Hk == 0``.  The KV heads are
    broadcast over their group as a stride-0 view (no copy); the value is one zero head, broadcast.
    """
    B, Hq, L, E = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    qv = q.reshape(B * Hk, G, L, E)
    kv = k.reshape(B * Hk, 1, L, E).expand(B * Hk, G, L, E)
    # (a fully stride-0 value tensor makes the kernel ~2x slower; one real head is fine)
    v = torch.zeros(B * Hk, 1, L, E, dtype=q.dtype, device=q.device).expand(B * Hk, G, L, E)
    _, lse = _flash_cpu()(qv, kv, v, 0.0, True, scale=scale)
    return lse.reshape(B, Hq, L)


def row_lse(q: Tensor, k: Tensor, *, scale: float | None = None, block: int = 1024) -> Tensor:
    """Causal row log-sum-exp ``[batch, q_heads, S]`` (keys ``0..d`` for query ``d``).

    Uses the CPU flash kernel when possible, else a blocked pass.  Returned in float32 for
    half-precision inputs.
    """
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else float(scale)
    if fused_available(q.dtype, q.device):
        return _flash_lse(q, k, scale).to(_out_dtype(q.dtype))
    cdt = _out_dtype(q.dtype)
    return _row_lse_blocked(q.to(cdt), k.to(cdt), scale, block)


def _fused(q: Tensor, k: Tensor, window: int, scale: float, lse: Tensor | None, power: float = 1.0) -> Tensor:
    return _finish(_fused_raw(q, k, window, scale, lse, power), q.shape[2], window, k.shape[1], power)


def _fused_raw(q: Tensor, k: Tensor, window: int, scale: float, lse: Tensor | None, power: float = 1.0) -> Tensor:
    """:func:`_blocked_raw` by the CPU flash kernel on the reversed sequence (see the module doc); the
    kernel's scale ``scale * power`` multiplies logit and bias alike, so ``power`` costs nothing."""
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    dt = q.dtype
    if lse is None:
        lse = _flash_lse(q, k, scale)  # float32 for half inputs, else dt
    lse = lse.to(torch.float64 if dt == torch.float64 else torch.float32)
    L = S - window  # rows (keys t = 0..S-w-1 reversed) and columns (queries d = w..S-1 reversed)
    # Bias -LSE_d / scale, so that the kernel's ``scale`` multiplies it back to -LSE_d.
    bias = (-lse[..., window:] / scale).flip(-1)  # [B, Hq, L], reversed query order
    if dt in _LOW_PRECISION:
        hi = bias.to(dt)
        lo = (bias - hi.to(bias.dtype)).to(dt)
        extra_k = torch.stack([hi, lo], dim=-1)
    else:
        extra_k = bias.to(dt)[..., None]
    n_extra = extra_k.shape[-1]
    width = -(-(D + n_extra) // 8) * 8
    # "keys" of the transposed pass: original queries d = S-1 .. w  -> [q_d, -LSE_d / scale, (lo), 0..]
    kp = torch.empty(B, Hq, L, width, dtype=dt, device=q.device)
    kp[..., :D] = q[..., window:, :].flip(-2)
    kp[..., D : D + n_extra] = extra_k
    kp[..., D + n_extra :] = 0
    # "queries": original keys t = S-1-w .. 0 -> [k_t, 1, (1), 0..]
    qp = torch.empty(B, Hk, L, width, dtype=dt, device=q.device)
    qp[..., :D] = k[..., :L, :].flip(-2)
    qp[..., D : D + n_extra] = 1
    qp[..., D + n_extra :] = 0
    # Reversed row i <-> key t = S-1-w-i; reversed column j <-> query d = S-1-j.
    # d >= t + w  <=>  j <= i : a square causal (top-left) mask, Lq == Lk == S - w.  The key
    # side carries each query head's own bias, so it has q_heads heads; the query side (the
    # keys of one KV head) is broadcast over that head's group as a stride-0 view.
    G = Hq // Hk
    qpv = qp.reshape(B * Hk, 1, L, width).expand(B * Hk, G, L, width)
    kpv = kp.reshape(B * Hk, G, L, width)
    v = torch.zeros(B * Hk, 1, L, width, dtype=dt, device=q.device).expand(B * Hk, G, L, width)
    _, lse_t = _flash_cpu()(qpv, kpv, v, 0.0, True, scale=scale * power)
    lse_t = lse_t.reshape(B, Hq, L).to(_out_dtype(dt)).flip(-1)  # back to t = 0 .. S-1-w
    full = torch.full((B, Hq, S), -math.inf, dtype=lse_t.dtype, device=q.device)
    full[..., :L] = lse_t
    return full


# --------------------------------------------------------------------------------------------
# FlexAttention path (CUDA)
# --------------------------------------------------------------------------------------------

_FLEX_COMPILED = None


def _flex_fn(compile: bool):
    """Return (flex_attention callable, create_block_mask, AuxRequest or None); imported lazily."""
    global _FLEX_COMPILED
    from torch.nn.attention import flex_attention as fa  # lazy: heavy import, CUDA use only

    aux = getattr(fa, "AuxRequest", None)
    fn = fa.flex_attention
    if compile:
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(fa.flex_attention, dynamic=False)
        fn = _FLEX_COMPILED
    return fn, fa.create_block_mask, aux


def _flex_call(fn, aux, q, k, v, score_mod, block_mask, scale, enable_gqa):
    if aux is not None:
        _, out = fn(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            return_aux=aux(lse=True),
        )
        return out.lse
    _, lse = fn(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=True,
    )
    return lse


def _flex(
    q: Tensor, k: Tensor, window: int, scale: float, lse: Tensor | None, *, compile: bool = True, power: float = 1.0
) -> Tensor:
    """FlexAttention implementation.  ``compile=False`` runs flex's eager reference (which
    materialises scores; only for testing the logic on CPU at small sizes)."""
    _B, Hq, S, _D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    fn, create_block_mask, aux = _flex_fn(compile)
    dev = q.device
    # compiled block-mask creation avoids materialising the S x S boolean mask
    bm_kwargs = {"device": dev, "_compile": compile}
    v = torch.zeros_like(k)  # real (not stride-0) zeros: kernels want a unit last-dim stride
    if lse is None:

        def causal(b, h, qi, ki):
            return ki <= qi

        bm = create_block_mask(causal, None, None, S, S, **bm_kwargs)
        lse = _flex_call(fn, aux, q, k, v, None, bm, scale, G > 1)
    lse = lse.to(torch.float32 if q.dtype in _LOW_PRECISION else q.dtype).contiguous()

    # Transposed pass: rows are the keys t (broadcast to the q_heads), columns the queries d.
    kq = k.repeat_interleave(G, dim=1)  # [B, Hq, S, D]; O(S) copy, query head g -> kv head g // G
    vq = torch.zeros_like(q)

    def score_mod(score, b, h, t_idx, d_idx):
        return (score - lse[b, h, d_idx]) * power

    def future(b, h, t_idx, d_idx):
        return d_idx >= t_idx + window

    bm_t = create_block_mask(future, None, None, S, S, **bm_kwargs)
    lse_t = _flex_call(fn, aux, kq, q, vq, score_mod, bm_t, scale, False)
    lse_t = lse_t.to(_out_dtype(q.dtype))
    if window > 0:  # rows without any allowed column: whatever flex returns, make it -inf
        lse_t[..., S - window :] = -math.inf
    return _finish(lse_t, S, window, Hk, power)


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


def resolve_method(method: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """The concrete method ``"auto"`` stands for on this device/dtype."""
    dev = torch.device(device)
    if method != "auto":
        return method
    if dev.type == "cuda":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:  # pragma: no cover - old torch
            return "blocked"
        return "flex"
    if fused_available(dtype, dev):
        return "fused"
    return "blocked"


def future_attention(
    q: Tensor,
    k: Tensor,
    window: int,
    *,
    scale: float | None = None,
    lse: Tensor | None = None,
    method: str = "auto",
    block: int = 1024,
    power: float = 1.0,
) -> Tensor:
    """Per-KV-head log future attention ``[batch, kv_heads, S]`` (spec section 3).

    Args:
        q: post-RoPE queries ``[batch, q_heads, S, d]`` of a causal attention layer.
        k: post-RoPE keys ``[batch, kv_heads, S, d]`` (not repeated for GQA).
        window: protected window ``w``, ``0 <= w < S``.
        scale: logit scale (default ``d ** -0.5``).
        lse: optional causal row log-sum-exp ``[batch, q_heads, S]`` (natural log, of the
            *scaled* logits over keys ``0..d``), e.g. returned by a flash kernel in the forward
            pass; computed here otherwise.
        method: ``"auto"``, ``"dense"``, ``"blocked"``, ``"fused"`` or ``"flex"`` (see module doc).
        block: block size of the ``"blocked"`` method (memory ``O(batch * q_heads * S * block)``).
        power: ``beta >= 1`` of the power mean ``m_beta`` (module doc); 1 is the mean.

    Returns:
        ``log(max_g m[g, t])`` (``m_beta`` for ``power != 1``) with ``N_t = max(1, S - (t + window))``;
        ``-inf`` for the last
        ``window`` keys (``t > S - 1 - window``: no query after the window).  dtype: the input
        dtype, float32 for half-precision inputs.

    Raises:
        ValueError: wrong ndim, batch/S/d mismatch, q_heads not a multiple of kv_heads, window out
            of ``[0, S)``, non-finite q/k/lse, bad lse shape, unknown or unavailable method.
    """
    _validate(q, k, window, lse, method)
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float; got {scale}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int; got {block!r}")
    power = check_power(power)
    m = resolve_method(method, q.dtype, q.device)
    if m == "flex" and q.device.type != "cuda":
        raise ValueError("method='flex' needs CUDA tensors")
    if m == "fused" and not fused_available(q.dtype, q.device):
        raise ValueError(f"method='fused' needs CPU tensors of dtype in {_FUSED_DTYPES}; got {q.dtype} on {q.device}")

    with torch.no_grad():
        if m == "dense":
            return _dense(q, k, window, scale, power)
        if m == "blocked":
            return _blocked(q, k, window, scale, lse, block, power)
        if m == "fused":
            return _fused(q, k, window, scale, lse, power)
        return _flex(q, k, window, scale, lse, compile=True, power=power)


# --------------------------------------------------------------------------------------------
# several windows at once (a training capture records one target per window of the grid)
# --------------------------------------------------------------------------------------------


def _band_suffix_lse(
    q: Tensor, k: Tensor, lse: Tensor, scale: float, windows: list[int], block: int, power: float = 1.0
) -> Tensor:
    """``log sum_{d : w_i <= d - t < w_max} p[g, d, t] ** power`` for each window ``w_i`` but the largest:
    ``[n - 1, B, Hq, S]`` (-inf where empty).

    One pass over the band ``w_min <= d - t < w_max``, key block by key block: the band's
    probabilities, shifted by their row maximum, are summed from the far end (a reverse cumulative
    sum over the queries), and the sum starting at ``d = t + w_i`` is read for every window. No
    differences are taken, so small sums keep their precision.
    """
    B, Hq, S, _D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    cdt = _out_dtype(q.dtype)
    qg = _grouped(q.to(cdt), Hk)
    kc = k.to(cdt)
    lseg = lse.to(cdt).view(B, Hk, G, S)
    w_min, w_max = windows[0], windows[-1]
    offs = torch.tensor([w - w_min for w in windows[:-1]], device=q.device)
    out = torch.full((len(windows) - 1, B, Hk, G, S), -math.inf, dtype=cdt, device=q.device)
    for t0 in range(0, max(0, S - w_min), block):
        t1 = min(S - w_min, t0 + block)
        d0, d1 = t0 + w_min, min(S, t1 - 1 + w_max)
        nd = d1 - d0
        x = torch.matmul(kc[:, :, None, t0:t1], qg[:, :, :, d0:d1].transpose(-1, -2)) * scale  # [B, Hk, G, bt, nd]
        x -= lseg[:, :, :, None, d0:d1]
        if power != 1.0:
            x *= power
        age = torch.arange(d0, d1, device=q.device)[None, :] - torch.arange(t0, t1, device=q.device)[:, None]
        x.masked_fill_((age < w_min) | (age >= w_max), -math.inf)
        col = torch.arange(t1 - t0, device=q.device)[:, None] + offs[None, :]  # [bt, n-1]: d = t + w_i
        idx = col.clamp(max=nd - 1).expand(B, Hk, G, t1 - t0, len(offs))
        if power == 1.0:
            top = x.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            suffix = torch.exp(x - top).flip(-1).cumsum(-1).flip(-1)  # sum over d' >= d of the band
            got = torch.where(col < nd, suffix.gather(-1, idx), torch.zeros_like(top)).log() + top
        else:  # a power spreads the logits so far that one shift underflows: sum in log space
            suffix = torch.logcumsumexp(x.flip(-1), -1).flip(-1)
            got = suffix.gather(-1, idx).masked_fill(col >= nd, -math.inf)
        out[..., t0:t1] = got.permute(4, 0, 1, 2, 3)
    return out.view(len(windows) - 1, B, Hq, S)


def future_attention_windows(
    q: Tensor,
    k: Tensor,
    windows,
    *,
    scale: float | None = None,
    lse: Tensor | None = None,
    method: str = "auto",
    block: int = 128,
    power: float = 1.0,
) -> dict[int, Tensor]:
    """:func:`future_attention` for several windows, ``{window: [batch, kv_heads, S]}``, in about the
    time of one: the transposed pass of the largest window covers ``d - t >= w_max`` for all of them,
    and one pass over the band between the smallest and the largest window adds each window's part
    (:func:`_band_suffix_lse`). Equal to one :func:`future_attention` call per window (tested).

    On CUDA (flex) and for ``method="dense"`` it calls :func:`future_attention` per window.
    """
    ws = sorted({int(w) for w in windows})
    if not ws:
        raise ValueError("give at least one window")
    for w in ws:
        _validate(q, k, w, lse, method)
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else float(scale)
    power = check_power(power)
    m = resolve_method(method, q.dtype, q.device)
    if len(ws) == 1 or m in ("dense", "flex"):
        return {w: future_attention(q, k, w, scale=scale, lse=lse, method=method, power=power) for w in ws}
    if m == "fused" and not fused_available(q.dtype, q.device):
        raise ValueError(f"method='fused' needs CPU tensors of dtype in {_FUSED_DTYPES}; got {q.dtype} on {q.device}")
    with torch.no_grad():
        if lse is None:
            lse = row_lse(q, k, scale=scale)
        if m == "fused":
            far = _fused_raw(q, k, ws[-1], scale, lse, power)
        else:
            far = _blocked_raw(q, k, ws[-1], scale, lse, 1024, power)
        band = _band_suffix_lse(q, k, lse, scale, ws, block, power)
        S, Hk = q.shape[2], k.shape[1]
        out = {ws[-1]: _finish(far, S, ws[-1], Hk, power)}
        for i, w in enumerate(ws[:-1]):
            out[w] = _finish(torch.logaddexp(far.to(band.dtype), band[i]), S, w, Hk, power)
    return out
