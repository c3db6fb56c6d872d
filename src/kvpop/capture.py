"""Capture post-RoPE keys/values (and training targets) from a transformers model.

Runtime level (a top-level module): it computes the future-attention targets the oracle policy runs on.

Mechanism: a custom attention function is registered once in transformers'
``AttentionInterface`` (and ``sdpa_mask`` under the same name in ``AttentionMaskInterface``, so
the model builds the same masks as for ``"sdpa"``).  ``capturing(model)`` temporarily sets the
model's ``config._attn_implementation`` to that name and restores it on exit (also on errors).
Every attention module then calls our function with its post-RoPE queries and keys (keys not yet
repeated for GQA) and ``module.layer_idx``; we store keys and values, compute the layer's target
right away (so queries are never kept for all layers) and return the attention output.

The attention output is computed by transformers' ``sdpa_attention_forward``, except in the
plain case (no mask, CPU, no sliding window/softcap/bias) where one call of PyTorch's CPU flash
kernel gives both the output and the row LSE that the target reuses.  Logits are unchanged up to
float rounding (tested).

Padding: ``attention_mask`` (2-D, ``[batch, S]``) may mark padding on the left or the right (the
valid tokens of each row must be contiguous).  The target of a row is computed on its valid
tokens only, exactly as for the unpadded sequence (attention depends on relative positions
only); padded positions get ``-inf``.  Keys/values are returned for all ``S`` positions.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.masking_utils import sdpa_mask

from .attention import attention_implementation, register
from .config import attention_shape, text_config
from .observed import observed_attention_windows
from .targets import check_power, fused_available, future_attention, future_attention_windows

__all__ = ["ATTN_NAME", "CaptureState", "LayerCapture", "capturing", "collect"]

ATTN_NAME = "kvpop_capture"


@dataclass
class LayerCapture:
    """What one attention layer saw.

    Attributes:
        layer: layer index (``module.layer_idx``).
        keys: post-RoPE keys ``[batch, kv_heads, S, head_dim]`` (model dtype and device).
        values: values ``[batch, kv_heads, S, head_dim]``.
        target: log future-attention target ``[batch, kv_heads, S]`` (float32, or float64 for a
            float64 model) when a window was given, else ``None``; ``-inf`` where undefined (the
            last ``window`` valid tokens of a row, and padding).
        queries: post-RoPE queries ``[batch, q_heads, S, head_dim]`` if ``keep_queries=True``.
    """

    layer: int
    keys: Tensor
    values: Tensor
    target: Tensor | None = None
    queries: Tensor | None = None
    targets: dict[int, Tensor] = field(default_factory=dict)  # window -> log target (incl. ``window``)
    observed: dict[int, Tensor] = field(default_factory=dict)  # window -> [batch, kv_heads, S, n] statistics


@dataclass
class CaptureState:
    """Filled while a ``capturing`` context is active; ``captures`` maps layer -> LayerCapture."""

    layers: frozenset[int] | None = None
    window: int | None = None
    method: str = "auto"
    attention_mask: Tensor | None = None  # 2-D padding mask of the current call, if any
    reuse_lse: bool = True
    keep_queries: bool = False
    extra_windows: tuple[int, ...] = ()  # more target windows (LayerCapture.targets)
    observed_windows: tuple[int, ...] = ()  # windows whose observed-attention statistics to record
    sinks: int = 4  # for the observed statistics
    power: float = 1.0  # the target's power mean (kvpop.targets; 1: the mean future attention)
    obs_windows: tuple[int | None, ...] = (None, 32, 1)
    captures: dict[int, LayerCapture] = field(default_factory=dict)
    _warned_sliding: bool = False

    def result(self) -> list[LayerCapture]:
        return [self.captures[i] for i in sorted(self.captures)]


_ACTIVE: contextvars.ContextVar[CaptureState | None] = contextvars.ContextVar("kvpop_capture", default=None)
# --------------------------------------------------------------------------------------------
# the attention function
# --------------------------------------------------------------------------------------------


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


_MODIFIERS = ("sliding_window", "softcap", "position_bias", "s_aux", "sinks")


def _flash_forward(query: Tensor, key: Tensor, value: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention via the CPU flash kernel: (output ``[B, S, Hq, Dv]``, lse ``[B, Hq, S]``)."""
    B, Hq, S, D = query.shape
    Hk = key.shape[1]
    G = Hq // Hk
    qv = query.reshape(B * Hk, G, S, D)
    kv = key.reshape(B * Hk, 1, S, D).expand(B * Hk, G, S, D)
    vv = value.reshape(B * Hk, 1, S, value.shape[-1]).expand(B * Hk, G, S, value.shape[-1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qv, kv, vv, 0.0, True, scale=scale)
    out = out.reshape(B, Hq, S, -1).transpose(1, 2).contiguous()
    return out, lse.reshape(B, Hq, S)


def _segments(mask2d: Tensor, S: int) -> list[tuple[int, int]]:
    """Per row, the contiguous [start, end) range of valid tokens; ValueError otherwise."""
    m = mask2d.to(torch.bool).cpu()
    segs = []
    for r in range(m.shape[0]):
        idx = m[r].nonzero().flatten()
        if idx.numel() == 0:
            segs.append((0, 0))
            continue
        a, b = int(idx[0]), int(idx[-1]) + 1
        if b - a != idx.numel():
            raise ValueError(f"attention_mask row {r}: valid tokens must be contiguous (left or right padding only)")
        segs.append((a, b))
    return segs


def _target(
    state: CaptureState, query: Tensor, key: Tensor, scale: float, lse: Tensor | None, window: int | None = None
) -> Tensor:
    window = state.window if window is None else window
    B, Hk, S, _ = key.shape
    out_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    am = state.attention_mask
    if am is None:
        if window >= S:
            return torch.full((B, Hk, S), -math.inf, dtype=out_dtype, device=key.device)
        return future_attention(query, key, window, scale=scale, lse=lse, method=state.method, power=state.power).to(
            out_dtype
        )
    out = torch.full((B, Hk, S), -math.inf, dtype=out_dtype, device=key.device)
    for r, (a, b) in enumerate(_segments(am, S)):
        if b - a > window:
            out[r : r + 1, :, a:b] = future_attention(
                query[r : r + 1, :, a:b],
                key[r : r + 1, :, a:b],
                window,
                scale=scale,
                method=state.method,
                power=state.power,
            ).to(out_dtype)
    return out


def _capture_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    state = _ACTIVE.get()
    idx = getattr(module, "layer_idx", None)
    if state is None or idx is None or (state.layers is not None and idx not in state.layers):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    S = query.shape[2]
    if key.shape[2] != S:
        raise RuntimeError("kvpop capture expects a cache-free forward (use_cache=False, no past keys)")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    sw = kwargs.get("sliding_window")
    if sw is not None and S > sw and state.window is not None and not state._warned_sliding:
        warnings.warn(
            f"layer {idx} uses sliding-window attention ({sw} < S={S}); kvpop targets assume full causal attention",
            stacklevel=2,
        )
        state._warned_sliding = True

    lse = None
    plain = (
        state.reuse_lse
        and state.window is not None
        and state.attention_mask is None
        and attention_mask is None
        and dropout == 0.0
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
        and kwargs.get("is_causal", True) is not False
        and all(kwargs.get(m) is None for m in _MODIFIERS)
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and fused_available(query.dtype, query.device)
        and key.dtype == query.dtype == value.dtype
    )
    if plain:
        attn_output, lse = _flash_forward(query, key, value, scale)
        attn_weights = None
    else:
        attn_output, attn_weights = _sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    targets: dict[int, Tensor] = {}
    observed: dict[int, Tensor] = {}
    with torch.no_grad():
        q, k = query.detach(), key.detach()
        windows = ([state.window] if state.window is not None else []) + list(state.extra_windows)
        if state.attention_mask is None and len(set(windows)) > 1 and max(windows) < S:
            # every window in about the time of one (kvpop.targets.future_attention_windows)
            targets = future_attention_windows(
                q, k, windows, scale=scale, lse=lse, method=state.method, power=state.power
            )
        else:
            for w in windows:
                if w not in targets:
                    targets[w] = _target(state, q, k, scale, lse, window=w)
        target = targets.get(state.window) if state.window is not None else None
        if state.observed_windows:
            if state.attention_mask is not None:
                raise ValueError("observed-attention statistics need unpadded rows")
            observed = observed_attention_windows(
                q, k, state.observed_windows, state.sinks, state.obs_windows, scale=scale
            )
    state.captures[idx] = LayerCapture(
        layer=idx,
        keys=key.detach(),
        values=value.detach(),
        target=target,
        queries=query.detach() if state.keep_queries else None,
        targets=targets,
        observed=observed,
    )
    return attn_output, attn_weights


register(ATTN_NAME, _capture_attention, sdpa_mask)


def _num_layers(model) -> int | None:
    return getattr(text_config(model.config), "num_hidden_layers", None)


@contextlib.contextmanager
def capturing(
    model: torch.nn.Module,
    *,
    layers: Iterable[int] | None = None,
    window: int | None = None,
    method: str = "auto",
    attention_mask: Tensor | None = None,
    reuse_lse: bool = True,
    keep_queries: bool = False,
    extra_windows: Iterable[int] = (),
    observed_windows: Iterable[int] = (),
    sinks: int = 4,
    obs_windows: Iterable[int | None] = (None, 32, 1),
    power: float = 1.0,
) -> Iterator[CaptureState]:
    """Context manager: while active, forwards of ``model`` fill the yielded ``CaptureState``.

    ``attention_mask`` is the 2-D padding mask of the forward(s) run inside (needed for the
    targets of padded rows).  ``reuse_lse``: in the plain case, take the attention output and the
    row LSE from one flash-kernel call (else the output comes from transformers' SDPA function and
    the target computes its own LSE).  ``power``: the targets' power mean (1: the mean future
    attention; larger favours tokens a few queries read sharply; :mod:`kvpop.targets`).  The model's
    attention implementation is restored on exit.
    ``layers`` (default: the full-attention layers, every layer of a model without sliding-window
    layers): which layers to record; the others run their own attention (a sliding layer with its
    sliding mask) and record nothing. A KVpop cache bounds exactly the full-attention layers, so
    that is what training and the oracle see.
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be an int >= 0 or None; got {window!r}")
    n = _num_layers(model)
    if layers is None:
        shape = attention_shape(model.config)
        layers = None if len(shape.bounded) == shape.num_layers else shape.bounded
    if layers is not None:
        layers = frozenset(int(i) for i in layers)
        if n is not None and any(i < 0 or i >= n for i in layers):
            raise ValueError(f"layers must lie in [0, {n}); got {sorted(layers)}")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError("attention_mask must be 2-D [batch, S]")
    if attention_mask is not None and bool(attention_mask.to(torch.bool).all()):
        attention_mask = None
    state = CaptureState(
        layers=layers,
        window=window,
        method=method,
        attention_mask=attention_mask,
        reuse_lse=reuse_lse,
        keep_queries=keep_queries,
        extra_windows=tuple(int(w) for w in extra_windows),
        observed_windows=tuple(int(w) for w in observed_windows),
        sinks=int(sinks),
        power=check_power(power),
        obs_windows=tuple(obs_windows),
    )
    with attention_implementation(model, ATTN_NAME, _ACTIVE, state):
        yield state


def collect(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    layers: Iterable[int] | None = None,
    window: int | None = None,
    **options,
) -> list[LayerCapture]:
    """Run ``model`` over a batch (no grad, no cache) and return one ``LayerCapture`` per layer.

    Args:
        model: a transformers causal LM (Llama, Qwen2/3, Mistral, ... models that dispatch through
            ``AttentionInterface``).
        input_ids: ``[batch, S]``.
        attention_mask: optional ``[batch, S]`` padding mask (contiguous valid tokens per row).
        layers: layer indices to capture (default: the full-attention layers, all of them in a model
            without sliding-window layers), returned in increasing order.
        window: if given, also compute the target for this window (``kvpop.targets``).
        options: the keyword options of :func:`capturing` (``method``, ``keep_queries``,
            ``extra_windows``, ``observed_windows``, ``sinks``, ``obs_windows``, ``power``).
    """
    if input_ids.ndim != 2:
        raise ValueError("input_ids must be [batch, S]")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError("attention_mask must have the shape of input_ids")
    with (
        torch.no_grad(),
        capturing(model, layers=layers, window=window, attention_mask=attention_mask, **options) as state,
    ):
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    want = state.layers if state.layers is not None else range(_num_layers(model) or len(state.captures))
    missing = sorted(set(want) - set(state.captures))
    if missing:
        raise RuntimeError(
            f"no attention call was captured for layers {missing}; the model may not dispatch "
            "through transformers' AttentionInterface"
        )
    return state.result()
