"""Eviction budget configuration: sinks + window + long-range slots per KV head.

A user states the budget one of three ways (``budget=B``, ``k=``, or ``compression=r`` with a
reference length ``L``); everything downstream only sees the resolved ``sinks``, ``window``
and ``k``. Validation happens here, once, before any model work starts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

from .validate import check_int, check_number

DEFAULT_WINDOW_FRACTION = 0.5  # window = B / 2 for every window-based policy (see default_window)


@dataclass(frozen=True)
class AttentionShape:
    """Per-layer cache geometry of a decoder: what the budget multiplies.

    ``bounded``: the layers a KVpop cache bounds with its ``B`` slots (the full-attention ones, in
    order; a learned scorer has one scorer per bounded layer, the ``i``-th for ``bounded[i]``);
    every other layer slides over the model's own ``sliding_window`` and keeps exactly that.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    bounded: tuple[int, ...] = ()
    sliding_window: int | None = None  # the sliding layers' window (None: no layer slides)

    def __post_init__(self) -> None:
        if not self.bounded and self.sliding_window is None:  # full attention everywhere
            object.__setattr__(self, "bounded", tuple(range(self.num_layers)))

    @property
    def sliding(self) -> tuple[int, ...]:
        """The layers that keep the model's own sliding window."""
        return tuple(i for i in range(self.num_layers) if i not in self.bounded)


def text_config(config):
    """The decoder's text config of a (possibly multimodal) transformers config: the part whose KV cache kvpop
    bounds (``decoder=True``: a config with a text encoder too names both, and the encoder has no cache)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def attention_shape(config) -> AttentionShape:
    """Layers, KV heads, head dim and the bounded (full-attention) layers of a (possibly multimodal)
    transformers config."""
    text = text_config(config)
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    n = int(text.num_hidden_layers)
    window, sliding = sliding_window_layers(text)
    return AttentionShape(n, int(kv), int(head_dim), tuple(i for i in range(n) if i not in sliding), window)


def sliding_window_layers(config) -> tuple[int | None, list[int]]:
    """``(window, layers)``: the model's sliding attention window and the layers that use it.

    ``(None, [])`` for full attention everywhere. A window at least ``max_position_embeddings``
    long never slides and counts as full attention. Layer types come from ``layer_types`` where
    the config has them (Gemma 2/3; Qwen2/Qwen3 derive them from ``use_sliding_window`` +
    ``max_window_layers``), else a set ``sliding_window`` applies to every layer (Mistral).
    """
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    if window is None:
        return None, []
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and window >= limit:
        return None, []
    types = getattr(text, "layer_types", None)
    if types is not None:
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif getattr(text, "use_sliding_window", True) is False:
        layers = []
    else:
        layers = list(range(int(text.num_hidden_layers)))
    return (window if layers else None), layers


def check_attention(config) -> None:
    """Refuse what a KVpop cache cannot bound exactly, in one error naming the field, before any work.

    Full-attention layers get the bounded cache; sliding-window layers keep exactly their own
    window (the model's attention, unchanged). Refused: a model whose every layer slides (its
    cache is bounded already: there is nothing for kvpop to bound), layer types other than
    full and sliding attention (chunked, linear, ...), and attention logit soft-capping (Gemma 2),
    which kvpop's attention does not apply.
    """
    text = text_config(config)
    window, sliding = sliding_window_layers(text)
    n = int(text.num_hidden_layers)
    if sliding and len(sliding) == n:
        raise ValueError(
            f"every layer of this {text.model_type} config slides (sliding_window={window} on all {n} layers): its "
            f"KV cache is bounded already, at {window} tokens per layer, so kvpop has nothing to bound. Use "
            "transformers' own cache (policy='dense' / no cache argument), or a model with full-attention layers."
        )
    other = sorted(
        {t for t in (getattr(text, "layer_types", None) or []) if t not in ("full_attention", "sliding_attention")}
    )
    if other:
        raise ValueError(
            f"kvpop bounds full-attention layers and keeps sliding-window ones; this {text.model_type} config "
            f"has layer_types {other}, which it does not support"
        )
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"this {text.model_type} config sets attn_logit_softcapping={text.attn_logit_softcapping}, "
            "which kvpop's attention does not apply (its outputs would differ from the model's)"
        )
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(
            f"this {text.model_type} config sets use_bidirectional_attention=True: a KV cache needs causal attention"
        )


def budget_of_compression(compression: float, reference_length: int | None) -> int:
    """``B = round((1 - r) L)``, with ``r`` in (0, 1) and ``L`` a positive int."""
    compression = check_number("compression", compression, above=0.0, below=1.0, optional=False)
    if reference_length is None:
        raise ValueError(f"compression={compression} needs reference_length=L (a positive int), got None")
    reference_length = check_int("reference_length", reference_length, 1, optional=False)
    budget = round((1.0 - compression) * reference_length)
    if budget < 1:
        raise ValueError(f"compression={compression} of reference_length={reference_length} leaves no slots")
    return budget


# Default prefill piece. Every length up to the window gives the same cache and outputs; per token, a
# piece of c costs attention over B + c keys, statistics over sinks + window + c and a rule over
# k + c candidates, so shorter pieces are cheaper until the per-piece overhead dominates. 256 was
# the fastest measured (docs/speed.md): 1.08x dense against 0.86x for the whole window (1,024) in one
# run on Qwen2.5-Coder-0.5B at 16,384 tokens and B = 2,048; on SmolLM2 at B = 512, 64 and 128 were slower.
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class EvictionConfig:
    """Resolved per-head budget ``B = sinks + window + k`` (method.md section 1)."""

    sinks: int = 4
    window: int = 256
    k: int = 256
    lam: float = 0.0  # recency tilt of the static priority r(t) + lam * t (method.md section 2)
    prefill_chunk: int | None = None  # prefill piece length (any length <= window is exact); None = PREFILL_CHUNK

    def __post_init__(self) -> None:
        for name, least in (("sinks", 0), ("window", 1), ("k", 0)):  # window >= 1: the newest token is in it
            object.__setattr__(self, name, check_int(name, getattr(self, name), least, optional=False))
        check_number("lam", self.lam, minimum=0.0, optional=False)
        check_int("prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_chunk is not None and self.prefill_chunk > self.window:
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
        """Tokens a prefill piece inserts at once: ``prefill_chunk``, else ``min(window, PREFILL_CHUNK)``."""
        return self.prefill_chunk or min(self.window, PREFILL_CHUNK)

    def compression(self, reference_length: int) -> float:
        return 1.0 - self.budget / reference_length

    @classmethod
    def from_budget(cls, budget: int | None = None, **kwargs) -> EvictionConfig:
        """Resolve exactly one of ``budget``, ``k`` or ``compression`` (+ ``reference_length``), with the
        other keywords of :class:`BudgetArgs`; ``window`` defaults to :func:`default_window` (``B / 2``),
        ``lam`` to 0. This is the arithmetic only; a cache resolves its defaults (a learned scorer's
        trained settings) through :func:`resolve_eviction`."""
        return split_budget(BudgetArgs(budget, **kwargs))


@dataclass(frozen=True)
class BudgetArgs:
    """How a user states a cache's budget: the one list of these keywords (``KVpopCache``,
    ``make_cache``, ``kvpop.generate``, :func:`resolve_eviction` and the CLI take them by name).

    Exactly one of ``budget`` (``B`` slots per KV head), ``k`` (long-range slots, with ``window``)
    or ``compression`` (with ``reference_length``: ``B = round((1 - compression) L)``). Unset
    ``window`` / ``lam`` are resolved later (:func:`resolve_eviction`); ``prefill_chunk``: the
    prefill sub-chunk (default: the window).
    """

    budget: int | None = None
    k: int | None = None
    compression: float | None = None
    reference_length: int | None = None
    window: int | None = None
    sinks: int = 4
    lam: float | None = None
    prefill_chunk: int | None = None

    def checked(self) -> BudgetArgs:
        """Each argument's type and range alone (one error naming it, before anything is built);
        integral numbers (``numpy.int64``, ...) become ``int``, ``compression`` and ``lam`` ``float``.
        How they combine is :func:`split_budget`'s to say."""
        return BudgetArgs(
            budget=check_int("budget", self.budget, 1),
            k=check_int("k", self.k, 0),
            compression=check_number("compression", self.compression, above=0.0, below=1.0),
            reference_length=check_int("reference_length", self.reference_length, 1),
            window=check_int("window", self.window, 1),
            sinks=check_int("sinks", self.sinks, 0, optional=False),
            lam=check_number("lam", self.lam, minimum=0.0),
            prefill_chunk=check_int("prefill_chunk", self.prefill_chunk, 1),
        )

    @property
    def states_budget(self) -> bool:
        """Whether any of the keywords that size the cache is given (they exclude ``eviction=``)."""
        return any(v is not None for v in (self.budget, self.k, self.compression, self.reference_length, self.window))

    @property
    def total(self) -> int | None:
        """``B`` as far as these arguments alone fix it (None: ``k`` without a window, whose ``B`` depends on
        the window a learned scorer was trained with); what picks a shipped scorer for the budget."""
        if self.budget is not None:
            return self.budget
        if self.compression is not None and self.reference_length is not None:
            return budget_of_compression(self.compression, self.reference_length)
        if self.k is not None and self.window is not None:
            return self.sinks + self.window + self.k
        return None

    @classmethod
    def pop_from(cls, kwargs: dict, budget: int | None = None) -> BudgetArgs:
        """The budget keywords taken out of ``kwargs`` (the rest stays: a policy's keywords)."""
        given = {name: kwargs.pop(name) for name in BUDGET_KEYWORDS if name in kwargs}
        if budget is not None and given.get("budget") is not None:
            raise TypeError("budget given twice")
        return cls(**{"budget": budget, **{n: v for n, v in given.items() if n != "budget" or v is not None}})


BUDGET_KEYWORDS = tuple(f.name for f in fields(BudgetArgs))


def split_budget(args: BudgetArgs) -> EvictionConfig:
    """The arithmetic of :class:`BudgetArgs`: ``B = sinks + window + k`` from exactly one of
    ``budget``, ``k`` or ``compression``; ``window`` defaults to :func:`default_window`, ``lam`` to 0.
    Each argument is checked alone first (:meth:`BudgetArgs.checked`), then how they combine."""
    args = args.checked()
    budget, k, compression, window, sinks = args.budget, args.k, args.compression, args.window, args.sinks
    given = [name for name, v in (("budget", budget), ("k", k), ("compression", compression)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of budget=B, k=K, or compression=r (with reference_length=L); got {given or 'none'}"
        )
    if compression is not None:
        budget = budget_of_compression(compression, args.reference_length)
    if budget is not None:
        if window is None:
            window = default_window(budget, sinks)
        if budget < sinks + window:
            raise ValueError(
                f"budget={budget} is smaller than sinks + window = {sinks} + {window} = {sinks + window}; "
                "raise the budget or shrink the window"
            )
        k = budget - sinks - window
    elif window is None:
        raise ValueError("with k=K give window=W too (the budget is sinks + window + k)")
    lam = 0.0 if args.lam is None else args.lam
    return EvictionConfig(sinks=sinks, window=window, k=k, lam=lam, prefill_chunk=args.prefill_chunk)


def default_window(budget: int, sinks: int = 4, fraction: float = DEFAULT_WINDOW_FRACTION) -> int:
    """The protected window at ``budget`` when nobody chose one: ``round(fraction * B)``, at least 1
    and leaving room for the sinks.

    ``B / 2`` for every policy: on the evaluation grid it beat ``B / 4`` and ``B / 8`` for the learned
    scorers (sweep: -0.007 retention at ``B / 4``; ``B / 8`` lost to StreamingLLM) and helps the
    heuristics too (H2O at ``B / 8`` fell below StreamingLLM on held-out text).
    """
    window = max(1, round(fraction * budget))
    return max(1, min(window, budget - sinks)) if budget > sinks else window


def tilt_at(budget: int, lam: float = 0.0, lam_scale: float | None = None) -> float:
    """The recency tilt at ``budget``: ``lam``, or ``lam_scale / B`` with ``lam`` as its floor.

    The one rule for training steps, adaptation masks and every cache: a scorer trained so resolves the
    same tilt at the same B wherever it is used (a floor keeps large budgets at a fixed tilt).
    """
    return float(lam) if lam_scale is None else max(float(lam), lam_scale / budget)


class ScorerSettingsWarning(UserWarning):
    """A learned scorer is used at a budget, window or recency tilt it was not trained for."""


@dataclass(frozen=True)
class TrainedSettings:
    """What a learned scorer was trained for (a checkpoint's ``trained_for``); caches default to it.

    The one rule for a window and a recency tilt at any budget (:meth:`window_at`, :meth:`lam_at`): a training
    or adaptation run states its own settings as one, and an evaluation the window it gives every policy, so
    that no other module computes a window or a tilt.

    ``budget_range``: the budgets training drew from (inclusive); ``window_fraction``: the window
    was ``round(fraction * B)`` at every budget (or ``window``: one fixed window); ``lam``: the
    recency tilt its loss used, or with ``lam_scale`` the tilt was ``lam_scale / B`` at every budget, never
    below ``lam`` (:func:`tilt_at`). Older checkpoints list exact ``budgets`` and ``windows``; they are
    read as the range of those budgets and the fraction their windows share.
    """

    budget_range: tuple[int, int] | None = None
    window_fraction: float | None = None
    window: int | None = None
    lam: float = 0.0
    lam_scale: float | None = None

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> TrainedSettings | None:
        if not meta:
            return None
        lo_hi = meta.get("budget_range")
        budgets = [int(b) for b in (meta.get("budgets") or [])]
        if lo_hi is None and budgets:
            lo_hi = (min(budgets), max(budgets))
        fraction = meta.get("window_fraction")
        window = meta.get("window")
        windows = {int(b): int(w) for b, w in (meta.get("windows") or {}).items()}
        if fraction is None and window is None and windows:
            # an older checkpoint: one fixed window, or one fraction f with every window round(f * B)
            top = max(windows)
            f = round(windows[top] / top, 4)
            if len(windows) > 1 and len(set(windows.values())) == 1:
                window = next(iter(windows.values()))
            elif all(round(f * b) == w for b, w in windows.items()):
                fraction = f
            else:
                window = windows[top]  # no single rule: the window of the largest budget
        return cls(
            budget_range=None if lo_hi is None else (int(lo_hi[0]), int(lo_hi[1])),
            window_fraction=None if fraction is None else float(fraction),
            window=None if window is None else int(window),
            lam=float(meta.get("lam") or 0.0),
            lam_scale=None if meta.get("lam_scale") is None else float(meta["lam_scale"]),
        )

    def to_meta(self) -> dict[str, Any]:
        return {
            "budget_range": None if self.budget_range is None else list(self.budget_range),
            "window_fraction": self.window_fraction,
            "window": self.window,
            "lam": self.lam,
            "lam_scale": self.lam_scale,
        }

    def window_at(self, budget: int, sinks: int = 4) -> int:
        """The window this scorer was trained with at ``budget`` (its fraction of ``B``)."""
        if self.window is not None:
            return self.window
        return default_window(budget, sinks, self.window_fraction or DEFAULT_WINDOW_FRACTION)

    def lam_at(self, budget: int) -> float:
        """The recency tilt this scorer was trained with at ``budget``."""
        return tilt_at(budget, self.lam, self.lam_scale)

    def covers(self, budget: int) -> bool:
        return self.budget_range is None or self.budget_range[0] <= budget <= self.budget_range[1]

    def describe(self) -> str:
        parts = []
        if self.budget_range is not None:
            parts.append(f"budgets {self.budget_range[0]}..{self.budget_range[1]}")
        parts.append(
            f"window {self.window}"
            if self.window is not None
            else f"window {self.window_fraction or DEFAULT_WINDOW_FRACTION:g} x B"
        )
        if self.lam_scale is None:
            parts.append(f"lam {self.lam:g}")
        elif self.lam:
            parts.append(f"lam max({self.lam:g}, {self.lam_scale:g} / B)")
        else:
            parts.append(f"lam {self.lam_scale:g} / B")
        return ", ".join(parts)


def resolve_eviction(
    budget: int | BudgetArgs | None = None,
    *,
    trained: TrainedSettings | None = None,
    source: str = "the scorer",
    warn: bool = True,
    **kwargs,
) -> EvictionConfig:
    """The one resolver of budget, window and lam: every path that builds a cache calls it.

    ``budget`` and ``kwargs`` are the keywords of :class:`BudgetArgs` (or ``budget`` is one). Unset ``window`` / ``lam``
    come from ``trained`` (a learned scorer's :class:`TrainedSettings`: its window fraction of
    ``B`` at any budget, its lam), else the library defaults (:func:`default_window`, ``lam = 0``).
    With ``trained``, a :class:`ScorerSettingsWarning` names what differs from training: a budget
    outside its range, another window, another lam.
    """
    args = budget if isinstance(budget, BudgetArgs) and not kwargs else BudgetArgs(budget, **kwargs)
    b = args.budget
    if args.compression is not None and b is None and args.k is None:
        b = budget_of_compression(args.compression, args.reference_length)
    resolved_budget = isinstance(b, int) and not isinstance(b, bool) and b >= 1
    if trained is not None:
        window, lam = args.window, args.lam
        if window is None and args.k is None and resolved_budget:
            window = trained.window_at(b, args.sinks if isinstance(args.sinks, int) else 4)
        if lam is None and trained.lam_scale is None:
            lam = trained.lam
        args = replace(args, window=window, lam=lam)
    ev = split_budget(args)
    if trained is not None and args.lam is None:  # lam_scale / B: known once the split is (k may give B)
        ev = replace(ev, lam=trained.lam_at(ev.budget))
    if warn and trained is not None:
        note = settings_note(ev, trained, source)
        if note:
            warnings.warn(note, ScorerSettingsWarning, stacklevel=3)
    return ev


def settings_note(ev: EvictionConfig, trained: TrainedSettings, source: str = "the scorer") -> str | None:
    """What in ``ev`` differs from what a scorer was trained for (None: nothing)."""
    problems = []
    if not trained.covers(ev.budget):
        lo, hi = trained.budget_range
        problems.append(f"budget {ev.budget} (trained over budgets {lo}..{hi})")
    want = trained.window_at(ev.budget, ev.sinks)
    if abs(ev.window - want) > max(1, 0.1 * want):
        problems.append(f"window {ev.window} (trained: {want} at B={ev.budget})")
    if abs(ev.lam - trained.lam_at(ev.budget)) > 1e-12:
        problems.append(f"lam {ev.lam:g} (trained: {trained.lam_at(ev.budget):g} at B={ev.budget})")
    if not problems:
        return None
    chosen = len(problems) > (0 if trained.covers(ev.budget) else 1)  # a window or lam the caller set
    advice = ["leave window/lam unset to use the trained ones"] if chosen else []
    if not trained.covers(ev.budget):  # a budget no setting can fix
        lo, hi = trained.budget_range
        advice.append(
            ("the window is still what its training rule gives at this B, but " if not chosen else "")
            + f"it never saw a budget outside {lo}..{hi}; `kvpop train --budget-range` over a range "
            "holding this B trains one that did (docs/training.md)"
        )
    return (
        f"{source} was not trained for "
        + " and ".join(problems)
        + f"; its decisions may be worse than where it was trained ({'; '.join(advice)})"
    )
