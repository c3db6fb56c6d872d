"""A transformers ``Cache`` whose every layer holds exactly ``B`` slots per KV head.

Layout of one layer (method.md section 1): keys/values ``[batch, kv_heads, B, head_dim]`` with
slots ``[0, s)`` the sinks, ``[s, s + w)`` the protected window as a ring buffer (token ``t``
lives in slot ``s + (t - s) % w``), and ``[s + w, B)`` the long-range slots. Each head may
hold different tokens in those slots; ``slot_index`` records which (``-1`` = empty).

Tokens are inserted when the model's attention runs (the ``kvpop`` attention function in
``kvpop.attention`` calls :meth:`KVpopLayer.attend`): that is the first moment the queries of
the chunk are known, which attention-based policies need, and it lets a chunk of many tokens
be decided at once with a per-query visibility mask equal to the token-by-token rule.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from . import fused, rule
from .attention import NAME as ATTN_NAME
from .attention import KVpopOffset, attach
from .config import EvictionConfig, attention_shape, budget_of_compression, check_full_attention
from .policies import DEFAULT_POLICY, DENSE, LEARNED_POLICIES, ExitBatch, Policy, get_policy, map_state
from .rule import NEVER, decide_chunk

_PENDING = "_kvpop_layer"


class ScorerSettingsWarning(UserWarning):
    """A learned scorer is used with a window or recency tilt it was not trained for."""


@dataclass(slots=True)
class _BoundStep:
    """A layer's compiled steady step with its own tensors bound, and what it was bound with: the
    layer uses it while these are still the same objects (``KVpopLayer._attend_steady``)."""

    step: fused.Bound
    scaling: float
    state: object  # the policy state (updated in place by the step)
    observed: torch.Tensor  # the window statistics (idem)
    kernel: tuple | None  # the learned policy's decode_kernel (None: a pure steady_score)


@dataclass
class LayerBuffers:
    """One layer's per-sequence state, batch rows on dim 0: what :meth:`KVpopLayer.buffers`
    returns and :meth:`KVpopLayer.load` takes. Slot ``B`` of ``keys``/``values``/``slot_index`` and
    entry ``k`` of ``lr_prio`` are scratch ("trash") entries that absorb rejected writes; their
    content is never read."""

    keys: torch.Tensor  # [b, h, B + 1, d]: sinks, window ring, long-range slots, scratch
    values: torch.Tensor  # [b, h, B + 1, dv]
    slot_index: torch.Tensor  # [b, h, B + 1] long: the token index each slot holds, -1 = empty
    lr_prio: torch.Tensor  # [b, h, k + 1] float32: frozen priorities of the long-range slots
    observed: torch.Tensor  # [b, h, window, max(1, n_obs)] float32: attention statistics of the window ring
    n_real: torch.Tensor  # [b] long: tokens each row has seen (the next token's index)
    policy_state: object  # the policy's per-sequence state (Policy.init_state), None for most policies


class KVpopLayer(CacheLayerMixin):
    """One layer's bounded cache. State is allocated lazily at the first update.

    Everything that depends on the sequences lives here, per batch row: the slots, their token
    indices and priorities, the observed-attention statistic of the window, and the policy's own
    state (``policy_state``, from :meth:`Policy.init_state`). The policy itself is stateless and
    may be shared. Beam search, ``batch_repeat_interleave`` and ``batch_select_indices`` reorder
    all of it (:meth:`reorder_cache`).
    """

    is_sliding = False

    def __init__(self, cfg: EvictionConfig, policy: Policy, layer_idx: int):
        super().__init__()
        self.cfg, self.policy, self.layer_idx = cfg, policy, layer_idx
        # observation windows of the attention statistics, per cache: the policy is never mutated
        self.obs_windows = tuple(policy.observation_windows(cfg.window)) if policy.needs_attention else ()
        self.policy_state = None
        self.model_config = None  # the (text) config whose attention must route through kvpop
        self.seen = 0  # tokens fed to this layer, padding included (drives position ids)
        self.fast_decode = True  # single-token steps update the buffers in place (False: always the chunk path)
        self.timer: dict[str, float] | None = None  # set to {} to accumulate decode seconds per phase (benchmarks)
        self.compile = False  # compile the steady decode step (KVpopCache(compile=True), kvpop.fused.compiled)
        self.steady = True  # the fused steady decode step (False: always the general path, for tests)
        self._bound: _BoundStep | None = None  # the compiled steady step with this layer's tensors bound
        self._owned_state = None  # the policy state the fused step may update in place (see _attend_steady)

    # --- transformers' CacheLayerMixin -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.load(self.new_buffers(b, h, d, value_states.shape[-1], key_states.dtype, key_states.device))

    def new_buffers(
        self, batch: int, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype, device
    ) -> LayerBuffers:
        """Fresh (empty) buffers for ``batch`` new sequences of this layer: what the first update
        allocates, and what a serving engine starts a new request's state from."""
        cfg = self.cfg
        n = cfg.budget
        b, h = batch, kv_heads
        return LayerBuffers(
            # one extra "trash" slot at the end absorbs writes for padding tokens (no branching)
            keys=torch.zeros(b, h, n + 1, head_dim, dtype=dtype, device=device),
            values=torch.zeros(b, h, n + 1, value_dim, dtype=dtype, device=device),
            # slot_index / lr_prio also carry a trash entry at the end, for branch-free rejected writes
            slot_index=torch.full((b, h, n + 1), -1, dtype=torch.long, device=device),
            lr_prio=torch.full((b, h, cfg.k + 1), -math.inf, dtype=torch.float32, device=device),
            # per ring slot and observation window
            observed=torch.zeros(b, h, cfg.window, max(1, len(self.obs_windows)), dtype=torch.float32, device=device),
            n_real=torch.zeros(b, dtype=torch.long, device=device),
            policy_state=self.policy.init_state(b, h, self.layer_idx, torch.device(device)),
        )

    def load(self, buffers: LayerBuffers) -> None:
        """Make ``buffers`` this layer's state (the tensors themselves, not copies): the next
        :meth:`attend` reads and updates them. With :meth:`buffers` this lets a caller keep each
        sequence's state in its own memory (a serving engine's KV blocks) and run the layer's step
        on any set of sequences: gather their state into ``LayerBuffers``, ``load``, ``attend``,
        then write :meth:`buffers` back (which may be new tensor objects)."""
        self._k, self._v = buffers.keys, buffers.values
        self._slot_index, self._lr_prio = buffers.slot_index, buffers.lr_prio
        self._views()
        self.n_real = buffers.n_real
        self.min_real = int(buffers.n_real.min()) if buffers.n_real.numel() else 0  # a Python int: no sync on the hot path
        self.observed = buffers.observed
        self.device = buffers.keys.device
        self.policy_state = buffers.policy_state
        self._owned_state = None  # the fused step may update a state in place only after copying it (_attend_steady)
        self.is_initialized = True

    def buffers(self) -> LayerBuffers:
        """This layer's current state (the tensors themselves; see :meth:`load`)."""
        if not self.is_initialized:
            raise RuntimeError("this layer holds no state yet (it is created at the first update, or by load)")
        return LayerBuffers(self._k, self._v, self._slot_index, self._lr_prio, self.observed, self.n_real,
                            self.policy_state)  # fmt: skip

    def unload(self) -> LayerBuffers:
        """:meth:`buffers`, and the layer lets go of them (it is then as before its first update): a
        caller that keeps the state elsewhere writes it back and leaves no copy behind in the layer."""
        buffers = self.buffers()
        self._k = self._v = self._slot_index = self._lr_prio = None
        self.keys = self.values = self.slot_index = self.lr_prio = None
        self.observed = self.n_real = self.policy_state = None
        self._bound = self._owned_state = None
        self.is_initialized = False
        return buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Defer insertion to the attention call, which knows the queries and the padding mask."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # checked at the first layer only: every forward starts there (a config read is slow next to a decode step)
        if self.layer_idx == 0 and self.model_config is not None and self.model_config._attn_implementation != ATTN_NAME:
            raise RuntimeError(
                f"the model's attention implementation is {self.model_config._attn_implementation!r}, not "
                f"{ATTN_NAME!r} (kvpop.detach was called after this cache was created); the KVpop cache would be "
                "bypassed. Create a new KVpopCache, which routes the model's attention again."
            )
        setattr(key_states, _PENDING, self)
        return key_states, value_states

    def _views(self) -> None:
        self._bound = None  # new buffers: the bound step must neither use nor keep the old ones
        n, k = self.cfg.budget, self.cfg.k
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]
        self.slot_index = self._slot_index[:, :, :n]
        self.lr_prio = self._lr_prio[:, :, :k]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model builds its padding mask against all tokens seen; kvpop reads the new tokens' part.
        return self.seen + query_length, KVpopOffset()

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        if self.is_initialized:
            self._k.zero_()
            self._v.zero_()
            self._slot_index.fill_(-1)
            self._lr_prio.fill_(-math.inf)
            self.n_real.zero_()
            self.observed.zero_()
            self.min_real = 0
            b, h = self._k.shape[:2]
            self.policy_state = self.policy.init_state(b, h, self.layer_idx, self.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        for name in ("_k", "_v", "_slot_index", "_lr_prio", "n_real", "observed"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.policy_state = map_state(self.policy_state, lambda t: t.index_select(0, idx.to(t.device)))
        self._views()
        self.min_real = int(self.n_real.min())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            b = self._k.shape[0]
            self.reorder_cache(torch.arange(b, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.reorder_cache(indices)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a KVpop cache cannot be cropped: evicted tokens are gone")

    # --- kvpop --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes held by keys and values (the ``B`` slots, not the trash slot)."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def attend(
        self,
        query: torch.Tensor,
        key_new: torch.Tensor,
        value_new: torch.Tensor,
        valid: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Insert the chunk under the rule and attend; returns ``[b, q_len, q_heads, d]``."""
        b, _, c, _ = query.shape
        if valid is not None and (self.layer_idx == 0 or c > 1):  # every layer of a step gets the same mask: check it once
            _check_padding(valid, self.n_real)
        # valid=None (no padding) takes no device sync; the attention routing passes None for an all-real mask
        if c == 1 and self.fast_decode and (valid is None or bool(valid.all())):
            if self.steady and self.min_real >= self.cfg.budget and self.cfg.k > 0:  # every slot held, every row exits
                out = self._attend_steady(query, key_new, value_new, scaling)  # already [b, 1, hq, d]
            else:
                out = self._attend_decode(query, key_new, value_new, scaling).transpose(1, 2)
            self.seen += 1
            return out
        if valid is None:
            valid = torch.ones(b, c, dtype=torch.bool, device=query.device)
        outs = []
        step = self.cfg.chunk
        for start in range(0, c, step):
            sl = slice(start, start + step)
            outs.append(self._attend_chunk(query[:, :, sl], key_new[:, :, sl], value_new[:, :, sl], valid[:, sl], scaling))
        self.seen += c
        return torch.cat(outs, dim=2).transpose(1, 2)

    def _attend_steady(self, q, k_new, v_new, scaling):
        """The decode steady state through ``kvpop.fused`` (compiled with ``compile=True``).

        Same decisions and outputs as :meth:`_attend_decode` (tests hold them together). A learned
        policy (its ``decode_kernel``) or a policy with a pure ``steady_score`` is scored inside
        the fused function; any other through its ``score``. Compiled on the CPU, the first such
        step binds the compiled function to this layer's tensors (:meth:`_bind`) and the next ones
        pass only the new token's query, key and value, while the buffers, the policy state, the
        statistics and the kernel are the same objects (they are updated in place).
        """
        timer = self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        pol, t = self.policy, self.n_real
        bound = self._bound
        if (bound is not None and bound.scaling == scaling and bound.state is self.policy_state
                and bound.observed is self.observed and self.compile
                and (bound.kernel is None or bound.kernel is pol.decode_kernel(self.layer_idx, self.cfg.window))
                and bound.step.fits(q, k_new, v_new)):  # t is n_real: this layer's own tensor
            # the repeated step: only the new token's tensors change (see kvpop.fused.Bound)
            out, self.n_real = bound.step(q, k_new, v_new, t)
            self.min_real += 1
            if timer is not None:
                _tick(timer, "fused", t0)
            return out
        spec = self._step_spec(scaling)
        obs = self.observed if pol.needs_attention else None
        kernel = pol.decode_kernel(self.layer_idx, self.cfg.window)
        args = (q, k_new, v_new, self._k, self._v, self._slot_index, self._lr_prio, obs, t)
        steady = None if kernel is not None else pol.steady_score(self.layer_idx, q.device)
        if kernel is not None or steady is not None:
            name = "steady_learned" if kernel is not None else "steady_scored"
            if kernel is not None:
                state = self.policy_state
                if state is not None and state is not self._owned_state:
                    # the fused step updates the state in place: give it tensors nothing else holds
                    state = self.policy_state = self._owned_state = map_state(
                        state, lambda x: x.clone(memory_format=torch.contiguous_format))
                args = (spec, *kernel, state, *args)
            else:  # a pure score function: scored inside the fused step
                args = (spec, *steady, *args)
            out, t_next = self._fused(name, *args)
            self._bind(name, args, (q, k_new, v_new, t), scaling, kernel)
            if timer is not None:
                _tick(timer, "fused", t0)
        else:
            ex_k, ex_v, ex_obs = fused.exit_gather(spec, self._k, self._v, obs, t)
            b, h = ex_k.shape[:2]
            w = self.cfg.window
            batch = ExitBatch(self.layer_idx, ex_k, ex_v, (t - w).view(b, 1), k_new, v_new, t.view(b, 1), ex_obs, True, w)
            self.policy_state, prio = pol.score(self.policy_state, batch)
            prio = prio.float().view(b, h)
            # checked every NAN_CHECK_EVERY steps, not every step: the check is a device sync
            if self.seen % NAN_CHECK_EVERY == 0 and torch.isnan(prio).any():
                raise RuntimeError(f"policy {pol.name} returned NaN scores at layer {self.layer_idx}")
            if timer is not None:
                t0 = _tick(timer, "score", t0)
            out, t_next = self._fused("steady_tail", spec, *args, ex_k, ex_v, prio)
            if timer is not None:
                _tick(timer, "fused", t0)
        self.n_real = t_next
        self.min_real += 1
        return out

    def _bind(self, name: str, args: tuple, dynamic: tuple, scaling: float, kernel) -> None:
        """Keep the compiled step just called with everything but ``dynamic`` bound, for the next
        steps (:class:`kvpop.fused.Bound`; CPU only: other devices go through ``torch.compile``)."""
        self._bound = None
        if not self.compile or fused.COMPILE_ERROR is not None or self.device.type != "cpu":
            return
        bind = getattr(fused.compiled(name, "cpu"), "bind", None)
        step = None if bind is None else bind(args, dynamic)
        if step is not None:
            self._bound = _BoundStep(step, scaling, self.policy_state, self.observed, kernel)

    def _step_spec(self, scaling: float) -> fused.StepSpec:
        spec = self.__dict__.get("_spec")
        if spec is None or spec.scaling != scaling:
            c = self.cfg
            spec = self._spec = fused.StepSpec(c.sinks, c.window, c.k, float(scaling), float(c.lam), tuple(self.obs_windows))
        return spec

    def _fused(self, name: str, *args):
        """``kvpop.fused.<name>(*args)``, compiled when ``self.compile``; a compiler that fails here
        turns compilation off for the whole process (``fused.COMPILE_ERROR``) with one warning (the
        eager function gives the same result)."""
        fn = getattr(fused, name)
        if self.compile and fused.COMPILE_ERROR is None:
            try:
                return fused.compiled(name, self.device.type)(*args)
            except Exception as exc:  # noqa: BLE001 (no C++ compiler, an unsupported platform, ...: any failure)
                fused.COMPILE_ERROR = f"{type(exc).__name__}: {exc}"  # no other layer or cache tries again
                warnings.warn(f"compiling the decode step failed ({fused.COMPILE_ERROR}); running it eagerly",
                              RuntimeWarning, stacklevel=3)
        return fn(*args)

    def _attend_decode(self, q, k_new, v_new, scaling):
        """One new token per row, all rows real: in-place update of the fixed buffers, attention over B slots.

        Same decisions as :meth:`_attend_chunk` (the tests hold both to the masked reference),
        without concatenating the chunk or building a ``[B + C]`` mask.
        """
        cfg = self.cfg
        s, w, kk = cfg.sinks, cfg.window, cfg.k
        b, hq, _, d = q.shape
        h = k_new.shape[1]
        g = hq // h
        timer = self.timer
        t0 = time.perf_counter() if timer is not None else 0.0
        t = self.n_real  # [b] index of the new token
        n = cfg.budget
        slot = torch.where(t < s, t, s + (t - s) % w)  # sink slot, or the ring slot it shares with the exiting token
        all_exit = self.min_real >= s + w
        ex_idx = t - w if all_exit else torch.where(t >= s + w, t - w, -1)  # [b]
        slot_h = slot.view(b, 1, 1).expand(b, h, 1)
        ring_off = ((t - s) % w).clamp(min=0)

        if all_exit or self.policy.stateful or bool((t >= s + w).any()):
            ex_k = self.keys.gather(2, slot_h.unsqueeze(-1).expand(b, h, 1, d))
            ex_v = self.values.gather(2, slot_h.unsqueeze(-1).expand(b, h, 1, self.values.shape[-1]))
            observed = None
            if self.policy.needs_attention:
                nobs = self.observed.shape[-1]
                observed = self.observed.gather(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, nobs))
            batch = ExitBatch(self.layer_idx, ex_k, ex_v, ex_idx.view(b, 1), k_new, v_new, t.view(b, 1), observed, True, w)
            self.policy_state, prio = self.policy.score(self.policy_state, batch)
            prio = prio.float().view(b, h)
            if timer is not None:
                t0 = _tick(timer, "score", t0)
            if torch.isnan(prio).any():
                raise RuntimeError(f"policy {self.policy.name} returned NaN scores at layer {self.layer_idx}")
            if cfg.lam:
                prio = prio + cfg.lam * ex_idx.view(b, 1).float()
            if kk > 0:
                # the rule decides (kvpop.rule); when every long-range slot is held, its cheaper variant
                decide = rule.decide_one_full if self.min_real - s - w >= kk else rule.decide_one
                weakest, accept = decide(self.lr_prio, self.slot_index[:, :, s + w :], prio, ex_idx.view(b, 1).expand(b, h))
                # rejected exits write to the trash slot: no gather-and-rewrite of the old content
                dst = torch.where(accept, s + w + weakest, n).unsqueeze(-1)  # [b, h, 1]
                self._k.scatter_(2, dst.unsqueeze(-1).expand(b, h, 1, d), ex_k)
                self._v.scatter_(2, dst.unsqueeze(-1).expand(b, h, 1, ex_v.shape[-1]), ex_v)
                self._slot_index.scatter_(2, dst, ex_idx.view(b, 1, 1).expand(b, h, 1))
                self._lr_prio.scatter_(2, dst - (s + w), prio.unsqueeze(-1))

        # the new token takes its slot (evicting the exiting token's copy in the ring)
        self._k.scatter_(2, slot_h.unsqueeze(-1).expand(b, h, 1, d), k_new)
        self._v.scatter_(2, slot_h.unsqueeze(-1).expand(b, h, 1, v_new.shape[-1]), v_new)
        self._slot_index.scatter_(2, slot_h, t.view(b, 1, 1).expand(b, h, 1))
        self.n_real = t + 1
        self.min_real += 1
        if timer is not None:
            t0 = _tick(timer, "evict", t0)

        qg = q.view(b, h, g, d)
        full = self.min_real >= cfg.budget
        if self.policy.needs_attention:
            logits = torch.einsum("bhgd,bhkd->bhgk", qg.float(), self.keys.float()) * scaling
            kidx = self.slot_index.unsqueeze(2)  # [b, h, 1, n]
            tq = t.view(b, 1, 1, 1)
            filled = kidx >= 0
            local = filled & ((kidx < s) | (kidx > tq - w))
            p_local = torch.softmax(logits.masked_fill(~local, -math.inf), dim=-1)
            p_ring = p_local[..., s : s + w].mean(dim=2)  # [b, h, w]: only ring slots accumulate
            age = tq.view(b, 1, 1) - kidx[:, :, 0, s : s + w]  # [b, h, w]
            ring_contrib = torch.stack([p_ring * (age >= (w - o)) for o in self.obs_windows], -1)
            # the slot of the new token restarts its statistic; the others accumulate
            fresh = torch.zeros(b, h, w, 1, device=q.device).scatter_(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, 1), 1.0)
            fresh = fresh * (t >= s).view(b, 1, 1, 1)
            self.observed = self.observed * (1 - fresh) + ring_contrib
            probs = torch.softmax(logits.masked_fill(~filled, -math.inf), dim=-1)
            out = torch.einsum("bhgk,bhkd->bhgd", probs.to(self.values.dtype), self.values)
        else:
            mask = None if full else (self.slot_index >= 0).unsqueeze(2)
            out = torch.nn.functional.scaled_dot_product_attention(qg, self.keys, self.values, attn_mask=mask, scale=scaling)
        if timer is not None:
            _tick(timer, "attend", t0)
        return out.reshape(b, hq, 1, -1)

    def _attend_chunk(self, q, k_new, v_new, valid, scaling):
        cfg = self.cfg
        s, w, kk, n = cfg.sinks, cfg.window, cfg.k, cfg.budget
        b, hq, c, d = q.shape
        h = k_new.shape[1]
        g = hq // h
        dev = q.device

        # logical index of each new token in its row; -1 for padding
        new_idx = torch.where(valid, self.n_real.unsqueeze(1) + valid.long().cumsum(1) - 1, -1)
        new_slot = torch.where(new_idx < s, new_idx, s + (new_idx - s) % w)
        new_slot = torch.where(valid, new_slot, n)  # padding -> trash slot

        # tokens leaving the window: one per new token with index >= s + w, in order
        ex_idx = torch.where(valid & (new_idx >= s + w), new_idx - w, -1)  # [b, c]
        ex_ring = torch.where(ex_idx >= 0, (ex_idx - s) % w, 0)  # ring offset of the exiting token
        ex_slot = (s + ex_ring).unsqueeze(1).expand(b, h, c)

        key_idx_old = self.slot_index  # [b, h, n]
        all_k = torch.cat([self.keys, k_new], dim=2)  # [b, h, n + c, d]
        all_v = torch.cat([self.values, v_new], dim=2)
        key_idx = torch.cat([key_idx_old, new_idx.unsqueeze(1).expand(b, h, c)], dim=2)  # [b, h, n + c]
        qv = q.reshape(b, h, g * c, d)  # query heads of one KV group side by side: [b, h, g*c, d]
        t_q = new_idx.view(b, 1, c, 1)

        observed = None
        logits = None
        if self.policy.needs_attention:
            logits = torch.einsum("bhqd,bhkd->bhqk", qv.float(), all_k.float()) * scaling
            logits = logits.view(b, h, g, c, n + c)
            kidx = key_idx.view(b, h, 1, 1, n + c)
            tq = t_q.view(b, 1, 1, c, 1)
            local = (kidx >= 0) & (kidx <= tq) & ((kidx < s) | (kidx > tq - w))
            p_local = torch.softmax(logits.masked_fill(~local, -math.inf), dim=-1).nan_to_num(0.0)
            p_mean = p_local.mean(dim=2)  # [b, h, c, n + c], over the query heads of a group
            contrib = _observed_sums(p_mean, key_idx, self.n_real, valid, w, self.obs_windows)  # [b, h, n + c, nobs]
            ring = slice(s, s + w)
            # accumulated statistic of every ring slot before new tokens overwrite them
            acc_old = self.observed + contrib[:, :, ring]
            nobs = acc_old.shape[-1]
            observed = acc_old.gather(2, ex_ring.view(b, 1, c, 1).expand(b, h, c, nobs))
            new_contrib = contrib[:, :, n:]

        # scores of the exiting tokens, frozen now
        ex_k = self.keys.gather(2, ex_slot.unsqueeze(-1).expand(b, h, c, d))
        ex_v = self.values.gather(2, ex_slot.unsqueeze(-1).expand(b, h, c, self.values.shape[-1]))
        batch = ExitBatch(
            layer_idx=self.layer_idx,
            keys=ex_k,
            values=ex_v,
            index=ex_idx,
            new_keys=k_new,
            new_values=v_new,
            new_index=new_idx,
            attention=observed,
            window=w,
        )
        self.policy_state, scores = self.policy.score(self.policy_state, batch)
        scores = scores.float()
        if scores.shape != (b, h, c):
            raise RuntimeError(f"policy {self.policy.name} returned scores of shape {tuple(scores.shape)}, expected {(b, h, c)}")
        if torch.isnan(scores).any():
            raise RuntimeError(f"policy {self.policy.name} returned NaN scores at layer {self.layer_idx}")
        ex_prio = scores + cfg.lam * ex_idx.unsqueeze(1).float()
        ex_idx_h = ex_idx.unsqueeze(1).expand(b, h, c)

        lr_idx = key_idx_old[:, :, s + w :]
        lr_leave, ex_leave = decide_chunk(self.lr_prio, lr_idx, ex_prio, ex_idx_h, w)

        # leave step of every key: held long-range slots, exiting ring tokens, NEVER otherwise
        leave = torch.full((b, h, n + c), NEVER, dtype=torch.long, device=dev)
        leave[:, :, s + w : n] = torch.where(lr_leave >= 0, lr_leave, NEVER)
        ring_leave = torch.full((b, h, w + 1), NEVER, dtype=torch.long, device=dev)
        ring_pos = torch.where(ex_idx_h >= 0, ex_ring.unsqueeze(1).expand(b, h, c), w)
        ring_leave.scatter_(2, ring_pos, torch.where(ex_idx_h >= 0, ex_leave, NEVER))
        leave[:, :, s : s + w] = ring_leave[:, :, :w]

        kidx = key_idx.unsqueeze(2)  # [b, h, 1, n + c]
        tq = new_idx.view(b, 1, c, 1)
        visible = (kidx >= 0) & (kidx <= tq) & (tq < leave.unsqueeze(2))
        # padding queries attend to themselves only (their output is never used)
        pad_q = ~valid.view(b, 1, c, 1)
        self_key = torch.arange(n, n + c, device=dev).view(1, 1, c, 1) == torch.arange(n + c, device=dev).view(1, 1, 1, -1)
        visible = torch.where(pad_q, self_key, visible)  # [b, h, c, n + c]

        if logits is not None:
            probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(2), -math.inf), dim=-1)
            out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(all_v.dtype), all_v)
            out = out.reshape(b, h * g, c, -1)
        else:
            mask = visible.unsqueeze(2).expand(b, h, g, c, n + c).reshape(b, h, g * c, n + c)
            out = torch.nn.functional.scaled_dot_product_attention(qv, all_k, all_v, attn_mask=mask, scale=scaling)
            out = out.reshape(b, h * g, c, -1)  # CUDA kernels may return a non-contiguous layout

        # --- commit: long-range set, then sinks/ring -------------------------------------
        if kk > 0:
            keep = torch.cat([lr_leave == NEVER, ex_leave == NEVER], dim=2)  # [b, h, kk + c]
            src = torch.cat(
                [torch.arange(s + w, n, device=dev).expand(b, h, kk), ex_slot], dim=2
            )
            cand_prio = torch.cat([self.lr_prio, ex_prio], dim=2)
            cand_idx = torch.cat([lr_idx, ex_idx_h], dim=2)
            order = torch.sort((~keep).to(torch.int8), dim=2, stable=True).indices[:, :, :kk]
            kept = keep.gather(2, order)
            src_slot = src.gather(2, order)
            new_lr_k = self.keys.gather(2, src_slot.unsqueeze(-1).expand(b, h, kk, d))
            new_lr_v = self.values.gather(2, src_slot.unsqueeze(-1).expand(b, h, kk, self.values.shape[-1]))
            new_lr_idx = torch.where(kept, cand_idx.gather(2, order), -1)
            new_lr_prio = torch.where(kept, cand_prio.gather(2, order), -math.inf)
        # sinks and ring: new tokens overwrite their slots (padding goes to the trash slot)
        slot4 = new_slot.view(b, 1, c, 1).expand(b, h, c, d)
        self._k.scatter_(2, slot4, k_new)
        self._v.scatter_(2, new_slot.view(b, 1, c, 1).expand(b, h, c, v_new.shape[-1]), v_new)
        self._slot_index.scatter_(2, new_slot.view(b, 1, c).expand(b, h, c), new_idx.unsqueeze(1).expand(b, h, c))
        self._slot_index[:, :, n] = -1
        if kk > 0:
            self._k[:, :, s + w : n] = new_lr_k
            self._v[:, :, s + w : n] = new_lr_v
            self.slot_index[:, :, s + w :] = new_lr_idx
            self.lr_prio.copy_(new_lr_prio)
        if observed is not None:
            ring_obs = torch.cat([acc_old, acc_old.new_zeros(b, h, 1, nobs)], dim=2)
            ring_new = torch.where(valid & (new_idx >= s), (new_idx - s) % w, w).view(b, 1, c, 1).expand(b, h, c, nobs)
            ring_obs.scatter_(2, ring_new, new_contrib)
            self.observed = ring_obs[:, :, :w].contiguous()
        self.n_real = self.n_real + valid.long().sum(1)
        self.min_real = int(self.n_real.min())
        return out

    def held_indices(self) -> torch.Tensor:
        """Logical indices held per (row, head, slot); -1 = empty."""
        return self.slot_index.clone()


def _observed_sums(p_mean, key_idx, n_real, valid, window: int, obs_windows) -> torch.Tensor:
    """Per key, the attention it got from the chunk's queries that are at least ``window - o`` newer,
    for each observation window ``o``: ``[b, h, n + c, n_obs]``.

    A row's real queries are consecutive tokens after its left padding, so "at least ``a`` newer"
    is a suffix of the chunk's queries: one reverse cumulative sum over the queries, read at each
    key's first qualifying query, gives every window's sum (instead of one masked pass per window).
    ``p_mean [b, h, c, n + c]`` is zero for padding queries and for keys a query does not observe.
    :func:`_observed_sums_reference` is the direct form; a test holds them together.
    """
    b, h, c, nk = p_mean.shape
    suffix = torch.cat([p_mean.flip(2).cumsum(2).flip(2), p_mean.new_zeros(b, h, 1, nk)], 2)  # [b, h, c + 1, nk]
    first_real = c - valid.long().sum(1)  # chunk position of each row's first real query
    thr = torch.tensor([window - o for o in obs_windows], device=p_mean.device).view(1, 1, -1, 1)
    start = (first_real - n_real).view(b, 1, 1, 1) + key_idx.unsqueeze(2) + thr  # [b, h, nobs, nk]
    sums = suffix.gather(2, start.clamp(0, c))  # [b, h, nobs, nk]
    return sums.transpose(2, 3)


def _observed_sums_reference(p_mean, key_idx, n_real, valid, window: int, obs_windows) -> torch.Tensor:
    """The direct form of :func:`_observed_sums`: one masked sum over the queries per window."""
    c = p_mean.shape[2]
    new_idx = torch.where(valid, n_real.unsqueeze(1) + valid.long().cumsum(1) - 1, -1)
    age = new_idx.view(-1, 1, c, 1) - key_idx.unsqueeze(2)  # [b, h, c, nk]
    return torch.stack([(p_mean * (age >= window - o)).sum(dim=2) for o in obs_windows], -1)


NAN_CHECK_EVERY = 64  # steady decode steps between checks of a heuristic policy's scores for NaN


def _tick(timer: dict[str, float], phase: str, t0: float) -> float:
    now = time.perf_counter()
    timer[phase] = timer.get(phase, 0.0) + now - t0
    return now


def _check_padding(valid: torch.Tensor, n_real: torch.Tensor) -> None:
    """Only left padding: a row's padding must come before any of its real tokens."""
    started = (n_real > 0).unsqueeze(1) | (valid.long().cumsum(1) > 0)
    if (started & ~valid).any():
        raise ValueError(
            "KVpopCache needs left padding: found a padding token after a real token in a row. "
            "Set tokenizer.padding_side = 'left'."
        )


class KVpopCache(Cache):
    """Bounded KV cache: ``B = sinks + window + k`` slots per KV head in every layer.

    Example::

        cache = kvpop.KVpopCache(model.config, budget=512, window=64)  # policy="kvpop": the shipped mLSTM scorer
        model.generate(**inputs, cache=cache, max_new_tokens=2000)

    The default policy ``"kvpop"`` loads the scorer shipped for SmolLM2-135M-Instruct; on any other
    model it raises ``ScorerMismatchError`` (train one with ``kvpop train`` and pass ``path=``, or
    name a heuristic policy such as ``"h2o"``).

    ``compile=True`` runs the decode steady state (every slot held, one token per step) as code
    compiled by inductor (``kvpop.fused``; on the CPU called directly, on CUDA through
    ``torch.compile``): the first step compiles for a few seconds, later steps spend less time
    outside the model's own matmuls; without a working compiler it warns and runs eagerly. The
    decisions are the same either way.

    Creating the cache switches ``model.config``'s attention implementation to ``"kvpop"``
    and leaves it so: for any other cache (or none) that routing is a no-op, bit for bit, also
    after this cache is gone. ``kvpop.detach(model.config)`` restores the previous name.
    """

    def __init__(
        self,
        config,
        budget: int | None = None,
        *,
        k: int | None = None,
        compression: float | None = None,
        reference_length: int | None = None,
        window: int | None = None,
        sinks: int = 4,
        policy: str | Policy = DEFAULT_POLICY,
        lam: float | None = None,
        prefill_chunk: int | None = None,
        eviction: EvictionConfig | None = None,
        compile: bool = False,
        **policy_kwargs,
    ):
        check_full_attention(config)
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        if eviction is not None and any(v is not None for v in (budget, k, compression, reference_length, window)):
            raise ValueError("give either eviction=EvictionConfig(...) or budget/k/compression/window, not both")
        pol = get_policy(policy, **policy_kwargs)
        if eviction is None:
            # unset window / lam: the policy's own (a learned scorer's trained settings), else the defaults
            if window is None and k is None and (budget is not None or compression is not None):
                b = budget if compression is None else budget_of_compression(compression, reference_length)
                if isinstance(b, int) and not isinstance(b, bool) and b >= 1:
                    window = pol.default_window(b)
                    if window is not None and sinks + window >= b:  # does not fit this budget: the library default
                        window = None
            if lam is None:
                lam = pol.default_lam() or 0.0
            eviction = EvictionConfig.from_budget(
                budget,
                k=k,
                compression=compression,
                reference_length=reference_length,
                window=window,
                sinks=sinks,
                lam=lam,
                prefill_chunk=prefill_chunk,
            )
        check = getattr(pol, "check_settings", None)
        note = check(eviction) if check is not None else None
        if note:
            warnings.warn(note, ScorerSettingsWarning, stacklevel=2)
        if not pol.uses_long_range and eviction.k > 0:
            # equal budget, all of it recency: StreamingLLM with a longer window
            eviction = EvictionConfig(
                sinks=eviction.sinks,
                window=eviction.window + eviction.k,
                k=0,
                lam=eviction.lam,
                prefill_chunk=eviction.prefill_chunk,
            )
        pol.validate(config, eviction)
        self.eviction, self.policy = eviction, pol
        num_layers = attention_shape(config).num_layers
        super().__init__(layers=[KVpopLayer(eviction, pol, i) for i in range(num_layers)])
        attach(config)
        text = config.get_text_config(decoder=True)
        for layer in self.layers:
            layer.model_config = text
            layer.compile = compile

    @property
    def budget(self) -> int:
        return self.eviction.budget

    def kv_bytes(self) -> int:
        """Bytes of keys and values held now, all layers."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def __repr__(self) -> str:
        e = self.eviction
        return f"KVpopCache(sinks={e.sinks}, window={e.window}, k={e.k}, budget={e.budget}, policy={self.policy!r})"


def make_cache(
    model,
    policy: str | Policy = DEFAULT_POLICY,
    *,
    budget: int | None = None,
    k: int | None = None,
    compression: float | None = None,
    reference_length: int | None = None,
    window: int | None = None,
    sinks: int = 4,
    lam: float | None = None,
    prefill_chunk: int | None = None,
    eviction: EvictionConfig | None = None,
    compile: bool = False,
    **policy_kwargs,
) -> KVpopCache | None:
    """A cache for ``model`` under ``policy``: ``None`` for ``"dense"`` (transformers' own cache).

    The one place that builds a cache from a policy name (``kvpop.generate``, the evaluation,
    the benchmarks, the CLI and the vLLM plugin all call it). Unlike ``KVpopCache(model.config, ...)``
    it has the model, so a learned policy also checks its checkpoint's weight hash, not only the
    config. ``model`` may also be just a config (a ``PretrainedConfig``, e.g. a serving engine's,
    which has no transformers model): then only the config part is checked, as by ``KVpopCache``.
    ``policy_kwargs`` go to the policy factory (e.g. ``path=`` a scorer checkpoint, ``seed=``).
    """
    if isinstance(policy, str) and policy == DENSE:
        return None
    config = model if isinstance(model, PretrainedConfig) else model.config
    if isinstance(policy, str) and policy in LEARNED_POLICIES and config is not model:
        policy_kwargs.setdefault("model", model)
    return KVpopCache(
        config, budget, k=k, compression=compression, reference_length=reference_length, window=window,
        sinks=sinks, policy=policy, lam=lam, prefill_chunk=prefill_chunk, eviction=eviction, compile=compile,
        **policy_kwargs,
    )  # fmt: skip
