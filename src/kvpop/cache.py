"""A transformers ``Cache`` whose every layer holds exactly ``B`` slots per KV head.

A layer (:class:`KVpopLayer`) is small: it holds its tensors (:class:`kvpop.state.LayerState`),
chooses a step (``kvpop.step``: a prefill chunk, a warm-up or a steady decode step) and runs it,
compiled or not (``kvpop.compiled``). Tokens are inserted when the model's attention runs (the
``kvpop`` attention in ``kvpop.attention`` finds the layer through the mask and calls
:meth:`KVpopLayer.attend`): that is the first moment the queries of the chunk are known, which
attention-based policies need, and it lets a chunk of many tokens be decided at once with a
per-query visibility mask equal to the token-by-token rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
import weakref

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .attention import USE_CACHE_FALSE, KVpopOffset, Route
from .compiled import EAGER_STEPS, CompiledStep, compile_default
from .config import (
    BudgetArgs,
    EvictionConfig,
    ScorerSettingsWarning,
    attention_shape,
    check_attention,
    resolve_eviction,
    settings_note,
)
from .policies import DENSE, LEARNED_POLICIES, Policy, get_policy, map_state, resolve_policy
from .state import LayerState
from .step import StepSpec, check_scores, decode_exits, decode_tail, prefill_chunk

NAN_CHECK_EVERY = 64  # steady decode steps between checks of a heuristic policy's scores for NaN


class KVpopLayer(CacheLayerMixin):
    """One layer's bounded cache. State is allocated lazily at the first update.

    Everything that depends on the sequences lives in ``state`` (:class:`~kvpop.state.LayerState`),
    per batch row: the slots, their token indices and priorities, the observed-attention statistic
    of the window, and the policy's own state. The policy is stateless and may be shared; the
    layer calls its per-device kernels (``Policy.prepare``), which the cache makes once per device.
    Beam search, ``batch_repeat_interleave``, ``batch_select_indices`` and ``reset`` map the
    state's rows (:meth:`LayerState.map_rows`).
    """

    is_sliding = False

    def __init__(
        self, cfg: EvictionConfig, policy: Policy, layer_idx: int, cache: KVpopCache, policy_layer: int | None = None
    ):
        super().__init__()
        self.cfg, self.policy, self.layer_idx = cfg, policy, layer_idx
        # the policy's index of this layer: its rank among the bounded layers (a learned scorer has one per
        # bounded layer); the model's layer index where every layer is bounded
        self.policy_layer = layer_idx if policy_layer is None else policy_layer
        self.compiled: CompiledStep = cache.compiled_step
        self._prepared = cache.prepared  # the policy's kernels per device (made once per cache)
        self.route: Route = cache.route
        # observation windows of the attention statistics, per cache: the policy is never mutated
        self.obs_windows = tuple(policy.observation_windows(cfg.window)) if policy.needs_attention else ()
        self.state: LayerState | None = None
        self.kernels = None  # the policy's kernels on this layer's device (set at the first update)
        self.model_config = None  # the (text) config whose attention must route through kvpop
        self.kv_shape: tuple[int, int] | None = None  # (KV heads, head dim) of that config: checked at the first update
        self.pending = False  # update() deferred keys that attend() has not consumed yet (KVpopCache.update checks it)
        self.seen = 0  # tokens fed to this layer, padding included (drives position ids)
        self.fast_decode = True  # single-token steps update the buffers in place (False: always the chunk path)
        self.steady = True  # the steady decode step when every slot is held (False: always the warm-up's, for tests)
        self.timer: dict[str, float] | None = None  # set to {} to accumulate decode seconds per phase (benchmarks)
        self._spec: StepSpec | None = None
        self._warm_spec: StepSpec | None = None
        self._owned_state = None  # the policy state the compiled step may update in place (see _steady)

    # --- transformers' CacheLayerMixin -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if self.kv_shape is not None and (h, d) != self.kv_shape:
            raise ValueError(
                f"this KVpop cache was built for {self.kv_shape[0]} KV heads of dim {self.kv_shape[1]}, but layer "
                f"{self.layer_idx} of the model it runs in gives {h} KV heads of dim {d}: the cache was created from "
                "another model's config. Create it from this model: KVpopCache(model.config, ...) or "
                "kvpop.make_cache(model, ...)."
            )
        self.load(self.new_state(b, h, d, value_states.shape[-1], key_states.dtype, key_states.device))

    # --- the state in and out, for an engine that keeps it elsewhere (kvpop.serving) ---------
    def new_state(
        self, batch: int, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> LayerState:
        """Empty state for ``batch`` new sequences of this layer: what the first update allocates,
        and what a serving engine starts a new request from."""
        device = torch.device(device)
        policy_state = self._prepared.on(device).init_state(batch, kv_heads, self.policy_layer)
        shape_k = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        shape_v = torch.empty(batch, kv_heads, 0, value_dim, dtype=dtype, device=device)
        return LayerState.empty(self.cfg, len(self.obs_windows), shape_k, shape_v, policy_state)

    def load(self, state: LayerState) -> None:
        """Make ``state`` this layer's (the tensors themselves, not copies): the next :meth:`attend`
        reads and updates them. With :meth:`unload` a caller keeps each sequence's state in its own
        memory (a serving engine's KV blocks) and runs this layer's step on any set of sequences:
        build a ``LayerState`` for them, ``load``, ``attend``, ``unload`` and write it back."""
        self.device = state.k.device
        self.kernels = self._prepared.on(self.device)
        self._owned_state = None  # the compiled step updates a policy state in place only after copying it
        self._set_state(state)
        self.is_initialized = True

    def unload(self) -> LayerState:
        """The layer's state, and the layer lets go of it (it is then as before its first update): a
        caller that keeps the state elsewhere writes it back and leaves no copy behind in the layer."""
        if not self.is_initialized:
            raise RuntimeError("this layer holds no state (it is created at the first update, or by load)")
        state = self.state
        self.state = self.keys = self.values = self._owned_state = None
        self.compiled.forget(self.layer_idx)
        self.is_initialized = False
        return state

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Defer insertion to the attention call, which knows the queries and the padding mask."""
        if not self.is_initialized or (self.seen == 0 and not self._fits(key_states, value_states)):
            self.lazy_initialization(key_states, value_states)  # first update, or a reset layer's next sequence
        # checked at the first bounded layer only: every forward passes it first (a config read is slow next to a
        # decode step)
        if self.policy_layer == 0 and not self.route.active:
            raise RuntimeError(
                "this KVpop cache no longer routes the model's attention (its model's attention implementation is "
                f"{self.model_config._attn_implementation!r}, not 'kvpop': cache.detach() or kvpop.detach was "
                "called after this cache was created); it would be bypassed. Create a new KVpopCache, which "
                "routes the model's attention again."
            )
        self.pending = True
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0  # KVpopCache.get_mask_sizes adds the layers to the offset

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the allocated state takes these keys and values: after a reset the next sequence may
        come in another batch size, dtype or device, which a fresh state is then allocated for."""
        k, v = self.state.k, self.state.v
        return (
            k.shape[0] == key_states.shape[0]
            and k.shape[1] == key_states.shape[1]
            and k.shape[3] == key_states.shape[3]
            and v.shape[3] == value_states.shape[3]
            and k.dtype == key_states.dtype
            and k.device == key_states.device
        )

    def reset(self) -> None:
        """Empty the layer for a new sequence, as a fresh one: the buffers are emptied in place (a bound
        compiled step keeps them) and the policy's per-sequence state (a scorer's) starts anew."""
        self.seen = 0
        self.pending = False
        if self.is_initialized:
            b, h = self.state.k.shape[:2]
            fresh = self.kernels.init_state(b, h, self.policy_layer)
            self._set_state(self.state.map_rows(lambda t, empty: t.fill_(empty), policy_state=fresh), same=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._set_state(self.state.map_rows(lambda t, _: t.index_select(0, beam_idx.to(t.device))))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.reorder_cache(torch.arange(self.state.k.shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a KVpop cache cannot be cropped: evicted tokens are gone")

    # --- the state's views, for transformers and for readers ------------------------------
    def _set_state(self, state: LayerState, same: bool = False) -> None:
        """Take ``state``; unless it keeps the same buffers (``same``), the compiled step bound to the
        old ones is dropped."""
        self.state = state
        self.keys, self.values = state.keys, state.values
        if not same:
            self.compiled.forget(self.layer_idx)

    slot_index = property(lambda self: self.state.held, doc="``[b, h, B]`` the token index per slot, -1 = empty")
    lr_prio = property(lambda self: self.state.long_range_prio, doc="``[b, h, k]`` long-range priorities")
    observed = property(lambda self: self.state.observed, doc="``[b, h, w, n_obs]`` the window's statistics")
    policy_state = property(lambda self: self.state.policy_state, doc="the policy's per-sequence state")
    min_real = property(lambda self: self.state.min_real, doc="fewest real tokens seen by any row")

    def held_indices(self) -> torch.Tensor:
        """Logical indices held per (row, head, slot); -1 = empty."""
        return self.state.held.clone()

    def kv_bytes(self) -> int:
        """Bytes held by keys and values (the ``B`` slots, not the trash slot)."""
        return _held_bytes(self)

    # --- kvpop --------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        key_new: torch.Tensor,
        value_new: torch.Tensor,
        valid: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Insert the chunk under the rule and attend; returns ``[b, q_len, q_heads, d]``."""
        self.pending = False
        c = query.shape[2]
        if valid is not None and (
            self.policy_layer == 0 or c > 1
        ):  # every layer of a step gets the same mask: check it once
            _check_padding(valid, self.state.n_real)
        spec = self._spec if self._spec is not None and self._spec.scaling == scaling else self._make_spec(scaling)
        # valid=None (no padding) takes no device sync; the attention routing passes None for an all-real mask
        if c == 1 and self.fast_decode and (valid is None or bool(valid.all())):
            if self.steady and self.state.min_real >= self.cfg.budget:  # every slot held, every row exits
                out = self._steady(spec, query, key_new, value_new)
            else:
                out = self._warm(spec, query, key_new, value_new)
            self.seen += 1
            return out
        step, st = self.cfg.chunk, self.state
        with _light_mode() as light:
            outs = [
                prefill_chunk(
                    spec,
                    self.kernels,
                    self.policy_layer,
                    st,
                    query[:, :, i : i + step],
                    key_new[:, :, i : i + step],
                    value_new[:, :, i : i + step],
                    None if valid is None else valid[:, i : i + step],
                )
                for i in range(0, c, step)
            ]
            out = torch.cat(outs, dim=2).transpose(1, 2)
        if light:  # what the chunks made and the state keeps becomes a plain tensor again (a few elements)
            st.n_real = st.n_real.clone()
            st.policy_state = map_state(st.policy_state, lambda x: x.clone() if x.is_inference() else x)
        self.seen += c
        return out

    def _make_spec(self, scaling: float) -> StepSpec:
        c = self.cfg
        self._spec = StepSpec(c.sinks, c.window, c.k, float(scaling), float(c.lam), self.obs_windows)
        self._warm_spec = dataclasses.replace(self._spec, full=False)
        return self._spec

    def _warm(self, spec: StepSpec, q, k_new, v_new):
        """A decode step before every slot is held (or with ``steady = False``): the steady step's
        function with the empty slots and absent exits masked, scored by the policy's ``score``."""
        st, kernels, timer = self.state, self.kernels, self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        spec = self._warm_spec
        exits = st.min_real >= spec.sinks + spec.window or bool((st.n_real >= spec.sinks + spec.window).any())
        ex_k = ex_v = prio = None
        if (exits and spec.k) or kernels.stateful:
            ex_k, ex_v, prio = decode_exits(spec, kernels, self.policy_layer, st, k_new, v_new)
            check_scores(prio, kernels.name, self.policy_layer)
            t0 = _tick(timer, "score", t0)
        obs = st.observed if kernels.needs_attention else None
        out, st.n_real = decode_tail(
            spec,
            q,
            k_new,
            v_new,
            st.k,
            st.v,
            st.slot_index,
            st.lr_prio,
            obs,
            st.n_real,
            ex_k,
            ex_v,
            None if not (exits and spec.k) else prio,
        )
        st.min_real += 1
        _tick(timer, "fused", t0)
        return out

    def _steady(self, spec: StepSpec, q, k_new, v_new):
        """The decode steady state through ``kvpop.step``'s fused functions, compiled when the cache
        compiles (:class:`kvpop.compiled.CompiledStep`).

        A learned policy (its decode kernel) or a policy with a pure ``steady_score`` is scored inside
        the step; any other through its ``score`` first. Compiled on the CPU, the first such step binds
        the compiled function to this layer's tensors and the next ones pass only the new token's
        query, key and value, while the buffers, the policy state, the statistics and the kernel are
        the same objects (they are updated in place).
        """
        st, kernels, comp, timer = self.state, self.kernels, self.compiled, self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        kernel = kernels.decode_kernel(self.policy_layer, spec.window)
        bound = comp.bound.get(self.layer_idx)
        if (
            bound is not None
            and bound.spec is spec
            and bound.state is st.policy_state
            and bound.observed is st.observed
            and (bound.kernel is None or bound.kernel is kernel)
            and comp.active
            and bound.step.fits(q, k_new, v_new)
        ):
            out, st.n_real = bound.step(q, k_new, v_new, st.n_real)  # only the new token's tensors change
            st.min_real += 1
            _tick(timer, "fused", t0)
            return out
        obs = st.observed if kernels.needs_attention else None
        bufs = (q, k_new, v_new, st.k, st.v, st.slot_index, st.lr_prio, obs, st.n_real)
        steady = None if kernel is not None else kernels.steady_score(self.policy_layer)
        if kernel is not None:
            name, args = "decode_learned", (spec, *kernel, self._own_state(), *bufs)
        elif steady is not None:
            name, args = "decode_scored", (spec, *steady, *bufs)
        else:
            name, args = "decode_tail", (spec, *bufs, *self._score_outside(spec, k_new, v_new))
            t0 = _tick(timer, "score", t0)
        out, t_next = comp.run(self.layer_idx, name, args, self.device.type)
        if name != "decode_tail":
            comp.bind(
                self.layer_idx, name, args, (q, k_new, v_new, st.n_real), spec, st.policy_state, st.observed, kernel
            )
        st.n_real = t_next
        st.min_real += 1
        _tick(timer, "fused", t0)
        return out

    def _own_state(self):
        """The policy state, as tensors nothing else holds (the compiled step updates it in place)."""
        st = self.state
        if st.policy_state is not None and st.policy_state is not self._owned_state:
            st.policy_state = self._owned_state = map_state(
                st.policy_state, lambda x: x.clone(memory_format=torch.contiguous_format)
            )
        return st.policy_state

    def _score_outside(self, spec: StepSpec, k_new, v_new) -> tuple:
        """``(ex_k, ex_v, prio)`` scored by the policy's ``score``, checked for NaN every few steps
        (a device sync); no scores without long-range slots (nothing to decide), unless stateful."""
        if not spec.k and not self.kernels.stateful:
            return None, None, None
        ex_k, ex_v, prio = decode_exits(spec, self.kernels, self.policy_layer, self.state, k_new, v_new)
        if self.seen % NAN_CHECK_EVERY == 0:
            check_scores(prio, self.kernels.name, self.policy_layer)
        return ex_k, ex_v, prio if spec.k else None


@contextlib.contextmanager
def _light_mode():
    """Inference mode for a prefill's chunk steps where the caller needs no autograd (``no_grad``,
    as in ``generate()``, and not inside ``torch.compile``): the step's few hundred small operations
    per chunk then skip autograd's view and version bookkeeping (docs/speed.md). Yields whether it is
    on; the caller then turns what the state keeps into plain tensors, so that a later decode step, a
    compiled step or a training run never meets an inference tensor. A caller already in inference
    mode (vLLM's model runner) is left as it is."""
    if torch.is_grad_enabled() or torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
        yield False
        return
    with torch.inference_mode():
        yield True


def _tick(timer: dict[str, float] | None, phase: str, t0: float) -> float:
    if timer is None:
        return t0
    now = time.perf_counter()
    timer[phase] = timer.get(phase, 0.0) + now - t0
    return now


def _source(policy: Policy) -> str:
    """How a warning names a policy's scorer: its checkpoint, else the policy."""
    source = getattr(policy, "source", None)
    return f"scorer {source}" if source else f"policy {policy.name}"


def _layers_used(layers) -> int:
    """How many leading layers saw as many tokens as layer 0 (those the model runs)."""
    seen = [layer.get_seq_length() for layer in layers]
    return next((i for i, n in enumerate(seen) if n != seen[0]), len(layers))


def _held_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer holds now: a KVpop layer's ``B`` slots (its ``keys`` /
    ``values`` views leave the trash slot out), a sliding layer's last ``window - 1`` tokens."""
    if not layer.is_initialized:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


def _check_padding(valid: torch.Tensor, n_real: torch.Tensor) -> None:
    """Only left padding: a row's padding must come before any of its real tokens."""
    started = (n_real > 0).unsqueeze(1) | (valid.long().cumsum(1) > 0)
    if (started & ~valid).any():
        raise ValueError(
            "KVpopCache needs left padding: found a padding token after a real token in a row. "
            "Set tokenizer.padding_side = 'left'."
        )


def _eviction(config, pol: Policy, args: BudgetArgs, eviction: EvictionConfig | None) -> EvictionConfig:
    """The cache's resolved budget: the one resolver, then the policy's view of it (checked against the model)."""
    if eviction is not None and args.states_budget:
        raise ValueError("give either eviction=EvictionConfig(...) or budget/k/compression/window, not both")
    if eviction is None:  # the one resolver: unset window / lam come from a learned scorer's trained settings
        eviction = resolve_eviction(args, trained=pol.trained, warn=False)
    note = None if pol.trained is None else settings_note(eviction, pol.trained, _source(pol))
    if not pol.uses_long_range and eviction.k > 0:  # equal budget, all of it recency: StreamingLLM, a longer window
        eviction = dataclasses.replace(eviction, window=eviction.window + eviction.k, k=0)
    pol.validate(config, eviction)  # a scorer for another model: that error alone, no warning about its settings
    if note:
        warnings.warn(note, ScorerSettingsWarning, stacklevel=4)  # at the caller of KVpopCache(...)
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and eviction.budget > limit:
        raise ValueError(
            f"budget={eviction.budget} exceeds the model's position limit max_position_embeddings={limit}: the "
            f"cache would allocate {eviction.budget} slots per KV head and never evict. Use a budget <= {limit}, "
            "or policy='dense'."
        )
    return eviction


class _Prepared:
    """A cache's policy kernels per device (``Policy.prepare``), made at the first layer on a device."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.devices = policy, {}

    def on(self, device: torch.device):
        kernels = self.devices.get(device)
        if kernels is None:
            kernels = self.devices[device] = self.policy.prepare(device)
        return kernels


class KVpopCache(Cache):
    """Bounded KV cache: ``B = sinks + window + k`` slots per KV head in every full-attention layer.

    A model with sliding-window layers (Gemma 2/3, Qwen2/3 with ``use_sliding_window``) keeps each
    sliding layer's own window: that layer is transformers' ``DynamicSlidingWindowLayer`` and its
    attention is the model's own (mask and attention function, the ``kvpop`` routing passes them
    through), so it equals the model with its own cache bit for bit. Running it through a kvpop ring
    instead would be a second implementation of the model's own rule (no choice is made on such a
    layer: the oldest token always leaves), to be held to the first by a test; transformers' layer
    already holds at most ``window - 1`` tokens between steps, so the whole cache is bounded. Only
    the full-attention (``bounded``) layers evict by the policy; a learned scorer has one scorer per
    bounded layer. A model whose every layer slides is refused (nothing to bound).

    Example::

        cache = kvpop.KVpopCache(model.config, budget=512)  # policy "kvpop-mlp": the shipped MLP scorer
        model.generate(**inputs, cache=cache, max_new_tokens=2000)

    The default policy (:data:`kvpop.policies.DEFAULT_POLICY`, ``"kvpop-mlp"``) loads the scorer
    shipped for SmolLM2-135M-Instruct; on any other
    model it raises ``ScorerMismatchError`` (train one with ``kvpop train`` and pass ``path=``, or
    name a heuristic policy such as ``"h2o"``).

    ``compile`` (default on; ``KVPOP_COMPILE=0`` turns the default off) runs the decode steady state
    (every slot held, one token per step) as code compiled by inductor (``kvpop.compiled``; on the
    CPU called directly, on CUDA through ``torch.compile``): the first step compiles for a few
    seconds, later steps spend less time outside the model's own matmuls; without a working
    compiler it warns once and runs eagerly. The decisions are the same either way;
    ``compile_status`` says which ran.

    Creating the cache routes ``model.config``'s attention through kvpop until the cache is
    detached (:meth:`detach`) or garbage-collected (``kvpop.attention.Route``); for any other
    cache (or none) that routing is a no-op, bit for bit.

    One cache holds one sequence (per batch row). Each ``model.generate()`` call given a cache that
    already holds tokens starts a new sequence: the cache resets itself, so its tokens equal a fresh
    cache's for any prompt (transformers would otherwise take the prompt's first tokens as the ones the
    cache saw, unchecked). To continue the sequence instead (the next turn of a conversation, without
    running the earlier turns again), call :meth:`resume` before that call. Direct ``model(...)``
    calls always continue the sequence; :meth:`reset` empties the cache for a new one.
    """

    def __init__(
        self,
        config,
        budget: int | None = None,
        *,
        policy: str | Policy | None = None,
        eviction: EvictionConfig | None = None,
        compile: bool | None = None,
        **kwargs,
    ):
        """``budget`` and the other keywords of :class:`kvpop.config.BudgetArgs` (``k``, ``compression``,
        ``reference_length``, ``window``, ``sinks``, ``lam``, ``prefill_chunk``), or ``eviction=``; any
        other keyword goes to the policy factory (e.g. ``path=`` a scorer checkpoint, ``seed=``).
        ``policy`` None or ``"kvpop"``: :func:`kvpop.policies.resolve_policy`, the model's default learned policy
        (``"kvpop-mlp"``; on a model loaded with an adapter bundle, the policy its scorer serves)."""
        self._resume = False  # set before Cache.__init__: transformers may set _is_user_defined (a property here)
        self._generate_given = False
        check_attention(config)
        if compile is not None and not isinstance(compile, bool):
            raise TypeError(f"compile must be True, False or None (the default), got {compile!r}")
        # each argument's type and range, before a scorer loads (integral numbers such as numpy.int64 become int)
        args = BudgetArgs.pop_from(kwargs, budget).checked()
        policy = resolve_policy(policy, config=config, scorer=kwargs.get("scorer"), path=kwargs.get("path"))
        if isinstance(policy, str) and policy in LEARNED_POLICIES:
            kwargs.setdefault("config", config)  # a model loaded with an adapter bundle: its scorer
            # the budget picks among the model's shipped scorers the one trained for it
            kwargs.setdefault("budget", eviction.budget if eviction is not None else args.total)
        pol = get_policy(policy, **kwargs)
        self.eviction, self.policy = _eviction(config, pol, args, eviction), pol
        # not told: compile once a generation is long enough to pay for it; compile=True: from the first step
        self.compiled_step = CompiledStep(
            compile_default() if compile is None else compile, eager_steps=EAGER_STEPS if compile is None else 0
        )
        self.prepared = _Prepared(pol)
        self.route = Route(config)  # released when this cache is detached or collected
        weakref.finalize(self, self.route.release)
        shape = attention_shape(config)
        self.bounded = [KVpopLayer(self.eviction, pol, i, self, j) for j, i in enumerate(shape.bounded)]
        for layer in self.bounded:
            layer.model_config = config.get_text_config(decoder=True)
            layer.kv_shape = (shape.kv_heads, shape.head_dim)
        by_index = {layer.layer_idx: layer for layer in self.bounded}
        super().__init__(
            layers=[
                by_index[i] if i in by_index else DynamicSlidingWindowLayer(shape.sliding_window)
                for i in range(shape.num_layers)
            ]
        )

    # --- one sequence per generate() call, unless resumed -----------------------------------
    @property
    def _is_user_defined(self) -> bool:
        """Whether ``model.generate()`` was given this cache. transformers sets it at the start of every
        generate() call that is given a cache, before it reads ``get_seq_length()``: the one moment a cache
        learns that a call begins, which :meth:`_begin_generate` uses."""
        return self._generate_given

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._generate_given = bool(value)
        if value:
            self._begin_generate()

    def _begin_generate(self) -> None:
        """A ``model.generate()`` call begins: on a cache that holds tokens it starts a new sequence (a
        reset), unless :meth:`resume` asked to continue.

        transformers takes the first ``get_seq_length()`` tokens of the prompt as already in the cache
        and feeds only the rest, without looking at them: a prompt that does not extend the cache's
        sequence would silently continue it (longer than the tokens seen) or fail (shorter). The cache
        never sees those token ids, so it cannot tell a continuation from a new prompt; a new sequence is
        the safe reading (the tokens equal a fresh cache's, also for a conversation passed whole, which
        then runs again), and a continuation that keeps the state is asked for by :meth:`resume`."""
        if self._resume:
            self._resume = False
            return
        if any(layer.get_seq_length() for layer in self.layers):
            self.reset()

    def resume(self) -> None:
        """Let the next ``model.generate()`` call continue this cache's sequence instead of starting a
        new one (once). Pass it the whole sequence, the tokens this cache saw and then the new ones (e.g.
        the last output and the next turn): only the tokens after the ``get_seq_length()`` it already saw
        run, on the kept state. A prompt that does not extend that sequence gives wrong tokens."""
        self._resume = True

    def reset(self) -> None:
        """Empty every layer for a new sequence: afterwards the cache runs as a fresh one (slots, policy
        and scorer state, counters, positions); a next sequence of another batch size is taken too."""
        self._resume = False
        super().reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``Cache.update``, after checking that the model this cache runs in is the one it was made for.

        Creating a cache routes the attention of the model that owns ``config`` (that config object)
        through kvpop; another model instance, even with the same weights, still runs its own attention,
        which would leave the cache empty and the outputs wrong without an error. So each layer's update
        checks that the previous layer's deferred keys were consumed by the kvpop attention (layer 0
        checks the last layer's, from the previous forward), and the layer count is checked (the
        checks read a few attributes: no device work). ``use_cache=False`` is refused at layer 0, before
        anything is inserted.
        """
        layers = self.layers
        if layer_idx == 0 and kwargs and (kwargs.get("kwargs") or {}).get("use_cache") is False:
            raise ValueError(USE_CACHE_FALSE)
        if layer_idx >= len(layers):
            raise ValueError(
                f"this KVpop cache has {len(layers)} layers but the model asks for layer {layer_idx}: the cache was "
                "created from another model's config. Create it from this model: KVpopCache(model.config, ...) or "
                "kvpop.make_cache(model, ...)."
            )
        layer = layers[layer_idx]
        if not isinstance(layer, KVpopLayer):  # a sliding layer: transformers' own
            return layer.update(key_states, value_states, *args, **kwargs)
        prev = self.bounded[layer.policy_layer - 1]  # the previous bounded layer (the first: the last one)
        if prev.pending:
            prev.pending = False  # one error, not one per later call
            raise RuntimeError(
                f"layer {prev.layer_idx}'s attention did not run through the KVpop cache: the model's attention "
                "implementation is not the 'kvpop' one this cache installed, so the cache was created from another "
                "model's config (KVpopCache(config) routes only the model that owns that config object; a second "
                "copy of the same model is another model), or the model was given a prepared 4D attention mask "
                "(pass the 2D padding mask). Create the cache from this model: KVpopCache(model.config, ...) or "
                "kvpop.make_cache(model, ...)."
            )
        if layer.policy_layer == 0 and prev.seen != layer.seen:
            raise ValueError(
                f"this KVpop cache has {len(layers)} layers, but its layer {prev.layer_idx} saw {prev.seen} tokens "
                f"and layer {layer.layer_idx} saw {layer.seen}: the model uses only {_layers_used(layers)} of them "
                "(the cache was created from another model's config), or an earlier forward failed midway "
                "(cache.reset() empties it). Create a new cache from this model: KVpopCache(model.config, ...) or "
                "kvpop.make_cache(model, ...)."
            )
        return layer.update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """For the bounded layers the model builds its padding mask against all tokens seen, and the
        offset carries this cache's layers to the ``kvpop`` mask, through which the attention finds its
        layer. For a sliding layer, its own sizes: a plain offset, so the model builds its own sliding
        mask and runs its own attention on that layer."""
        if layer_idx < len(self.layers) and not isinstance(self.layers[layer_idx], KVpopLayer):
            return self.layers[layer_idx].get_mask_sizes(query_length)
        return self.bounded[0].seen + query_length, KVpopOffset(self.layers)

    def detach(self) -> None:
        """Stop routing the model's attention through kvpop for this cache (the model's own attention
        is back once no other cache or ``kvpop.routed`` block holds it); the cache then refuses to run."""
        self.route.release()

    @property
    def budget(self) -> int:
        return self.eviction.budget

    @property
    def compile_status(self) -> str:
        """Which decode step ran: ``"compiled"``, ``"eager"``, ``"eager (compiling failed: ...)"`` or
        ``"compiled (not reached)"`` (no steady decode step yet)."""
        return self.compiled_step.status()

    def kv_bytes(self, part: str | None = None) -> int:
        """Bytes of keys and values held now: all layers, or ``part="bounded"`` (the full-attention
        layers' ``B`` slots) or ``part="sliding"`` (the sliding layers' own windows)."""
        if part not in (None, "bounded", "sliding"):
            raise ValueError(f"part must be None, 'bounded' or 'sliding', got {part!r}")
        return sum(
            _held_bytes(layer)
            for layer in self.layers
            if part is None or isinstance(layer, KVpopLayer) == (part == "bounded")
        )

    def __repr__(self) -> str:
        e = self.eviction
        sliding = len(self.layers) - len(self.bounded)
        extra = (
            f", sliding_layers={sliding} (window {self.layers[self.is_sliding.index(True)].sliding_window})"
            if sliding
            else ""
        )
        return (
            f"KVpopCache(sinks={e.sinks}, window={e.window}, k={e.k}, budget={e.budget}{extra}, policy={self.policy!r})"
        )


def make_cache(
    model,
    policy: str | Policy | None = None,
    *,
    budget: int | None = None,
    eviction: EvictionConfig | None = None,
    compile: bool | None = None,
    **kwargs,
) -> KVpopCache | None:
    """A cache for ``model`` under ``policy``: ``None`` for ``"dense"`` (transformers' own cache).

    The one place that builds a cache from a policy name (``kvpop.generate``, the evaluation,
    the benchmarks, the CLI and the vLLM plugin all call it). Unlike ``KVpopCache(model.config, ...)`` it has the
    model, so a learned policy also checks its checkpoint's weight hash, not only the config.
    ``kwargs``: the budget keywords and the policy factory's, as for :class:`KVpopCache`. A policy
    instance (``get_policy(name, model=model)``, resolved once) is reused as it is: no checkpoint
    is read and no weights are hashed again. ``model`` may also be just a config (a
    ``PretrainedConfig``, e.g. a serving engine's, which has no transformers model): then only the
    config part is checked, as by ``KVpopCache``. ``policy`` None or ``"kvpop"``: the model's default
    learned policy (:func:`kvpop.policies.resolve_policy`).
    """
    if isinstance(policy, str) and policy == DENSE:
        return None
    config = model if isinstance(model, PretrainedConfig) else model.config
    policy = resolve_policy(
        policy, None if config is model else model, config, scorer=kwargs.get("scorer"), path=kwargs.get("path")
    )
    if isinstance(policy, str) and policy in LEARNED_POLICIES and config is not model:
        kwargs.setdefault("model", model)
    return KVpopCache(config, budget, policy=policy, eviction=eviction, compile=compile, **kwargs)
