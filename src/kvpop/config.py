"""Eviction budget configuration: sinks + window + long-range slots per KV head.

A user states the budget one of three ways (``budget=B``, ``k=``, or ``compression=r`` with a
reference length ``L``); everything downstream only sees the resolved ``sinks``, ``window``
and ``k``. Validation happens here, once, before any model work starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """Per-layer cache geometry of a decoder: what the budget multiplies."""

    num_layers: int
    kv_heads: int
    head_dim: int


def attention_shape(config) -> AttentionShape:
    """Layers, KV heads and head dim of a (possibly multimodal) transformers config."""
    get = getattr(config, "get_text_config", None)
    text = get(decoder=True) if callable(get) else config
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return AttentionShape(int(text.num_hidden_layers), int(kv), int(head_dim))


def sliding_window_layers(config) -> tuple[int | None, list[int]]:
    """``(window, layers)``: the model's sliding attention window and the layers that use it.

    ``(None, [])`` for full attention everywhere. A window at least ``max_position_embeddings``
    long never slides and counts as full attention. Layer types come from ``layer_types`` where
    the config has them (Qwen2/Qwen3: ``use_sliding_window`` + ``max_window_layers``), else a set
    ``sliding_window`` applies to every layer (Mistral).
    """
    get = getattr(config, "get_text_config", None)
    text = get(decoder=True) if callable(get) else config
    window = getattr(text, "sliding_window", None)
    if window is None:
        return None, []
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and window >= limit:
        return None, []
    types = getattr(text, "layer_types", None)
    if types is not None:
        layers = [i for i, t in enumerate(types) if t in ("sliding_attention", "chunked_attention")]
    elif getattr(text, "use_sliding_window", True) is False:
        layers = []
    else:
        layers = list(range(int(text.num_hidden_layers)))
    return (window if layers else None), layers


def check_full_attention(config) -> None:
    """Refuse a model with sliding-window layers (decision of issue #13: refuse, not honour).

    A KVpop cache would let such a layer attend to sinks and long-range tokens older than the
    model's window, which it never saw in training; the model silently becomes a different one.
    """
    window, layers = sliding_window_layers(config)
    if layers:
        get = getattr(config, "get_text_config", None)
        text = get(decoder=True) if callable(get) else config
        shown = layers if len(layers) <= 8 else [*layers[:8], "..."]
        raise ValueError(
            f"kvpop supports full-attention layers only, but this {text.model_type} config sets "
            f"sliding_window={window}, used by layers {shown} (config.layer_types / use_sliding_window). A "
            "KVpop cache would let those layers attend beyond their window. Use a model without sliding-window "
            "attention, or set config.sliding_window = None if you accept running it as full attention."
        )


def budget_of_compression(compression: float, reference_length: int | None) -> int:
    """``B = round((1 - r) L)``, with ``r`` in (0, 1) and ``L`` a positive int."""
    if isinstance(compression, bool) or not isinstance(compression, (int, float)) or not (0.0 < compression < 1.0):
        raise ValueError(f"compression must be in (0, 1), got {compression!r}")
    if reference_length is None or isinstance(reference_length, bool) or reference_length < 1:
        raise ValueError(
            f"compression={compression} needs reference_length=L (a positive int), got {reference_length!r}"
        )
    budget = round((1.0 - compression) * reference_length)
    if budget < 1:
        raise ValueError(f"compression={compression} of reference_length={reference_length} leaves no slots")
    return budget


@dataclass(frozen=True)
class EvictionConfig:
    """Resolved per-head budget ``B = sinks + window + k`` (method.md section 1)."""

    sinks: int = 4
    window: int = 256
    k: int = 256
    lam: float = 0.0  # recency tilt of the static priority r(t) + lam * t (method.md section 2)
    prefill_chunk: int | None = None  # prefill sub-chunk length; None = window (the largest exact chunk)

    def __post_init__(self) -> None:
        for name in ("sinks", "window", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"EvictionConfig.{name} must be an int, got {type(value).__name__}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (the newest token is always in the window), got {self.window}")
        if self.k < 0:
            raise ValueError(f"k (long-range slots) must be >= 0, got {self.k}")
        if isinstance(self.lam, bool) or not isinstance(self.lam, (int, float)):
            raise TypeError(f"EvictionConfig.lam must be a number, got {self.lam!r}")
        if not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        if self.prefill_chunk is not None and not (1 <= self.prefill_chunk <= self.window):
            raise ValueError(
                f"prefill_chunk must be in [1, window={self.window}] for the chunked prefill to be exact, "
                f"got {self.prefill_chunk}"
            )

    @property
    def budget(self) -> int:
        """Slots per KV head."""
        return self.sinks + self.window + self.k

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or self.window

    def compression(self, reference_length: int) -> float:
        return 1.0 - self.budget / reference_length

    @classmethod
    def from_budget(
        cls,
        budget: int | None = None,
        *,
        k: int | None = None,
        compression: float | None = None,
        reference_length: int | None = None,
        window: int | None = None,
        sinks: int = 4,
        lam: float = 0.0,
        prefill_chunk: int | None = None,
    ) -> EvictionConfig:
        """Resolve exactly one of ``budget``, ``k`` or ``compression`` (+ ``reference_length``).

        ``window`` defaults to ``B // 8`` (the paper's proportion: 256 of 2048), at least 1.
        """
        given = [name for name, v in (("budget", budget), ("k", k), ("compression", compression)) if v is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of budget=B, k=K, or compression=r (with reference_length=L); "
                f"got {given or 'none'}"
            )
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if compression is not None:
            budget = budget_of_compression(compression, reference_length)
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(f"budget must be a positive int, got {budget!r}")
            if window is None:
                window = max(1, budget // 8)
            if budget < sinks + window:
                raise ValueError(
                    f"budget={budget} is smaller than sinks + window = {sinks} + {window} = {sinks + window}; "
                    "raise the budget or shrink the window"
                )
            k = budget - sinks - window
        else:
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"k must be an int >= 0, got {k!r}")
            if window is None:
                raise ValueError("with k=K give window=W too (the budget is sinks + window + k)")
        return cls(sinks=sinks, window=window, k=k, lam=lam, prefill_chunk=prefill_chunk)
