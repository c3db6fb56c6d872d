"""A cache layer's decode step in the steady state, as pure functions of tensors.

Once every slot is held and every row's oldest window token leaves at each step (where a long
generation spends nearly all its steps), one single-token step of a layer is always the same:
read the exiting token, score it, let the rule decide (``rule.decide_one_full``), write the
buffers in place, attend over the ``B`` slots and, for policies that read observed attention,
update the window's statistics. :meth:`KVpopLayer._attend_decode` keeps the general form (warm-up,
rows without exits, any policy) as the reference; these functions are its steady state with the
per-step branching and bookkeeping removed, and with static shapes, so ``torch.compile`` can
fuse them (``KVpopCache(..., compile=True)``): one traced graph serves every layer, because the
scorer weights are arguments (``kvpop.scorers.decode``), not module attributes.

Tests hold both paths, eager and compiled, to the general one.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from . import rule
from .scorers.decode import DecodeSpec, decode_scores

__all__ = ["COMPILE_ERROR", "COMPILE_LOCK", "Bound", "CompileFailed", "Direct", "Dynamo", "StepSpec", "compiled",
           "exit_gather", "steady_learned", "steady_scored", "steady_tail"]

COMPILE_ERROR: str | None = None  # set by the first failed compile: the process then runs these eagerly
# One compilation at a time in the process: make_fx's tracer patches module globals and dynamo keeps
# per-process state, so two threads compiling at once failed (3 runs in 7: "CURRENT_PATCHER is None").
COMPILE_LOCK = threading.RLock()


class CompileFailed(RuntimeError):
    """The compiler (or the compiled step's first run, on copies of its inputs) failed: nothing the
    caller holds was written, so the eager step may run instead."""


@dataclass(frozen=True)
class StepSpec:
    """The shape constants of one cache's steady decode step (the same for all its layers)."""

    sinks: int
    window: int
    k: int
    scaling: float
    lam: float
    obs_windows: tuple[int, ...]  # observation windows of the statistics (empty: none kept)


def exit_gather(spec: StepSpec, K: Tensor, V: Tensor, OBS: Tensor | None, t: Tensor):
    """The exiting token's key, value and observed statistics: ``[b, h, 1, *]`` each (``OBS`` may be None)."""
    s, w = spec.sinks, spec.window
    b, h, _, d = K.shape
    ring_off = (t - s) % w  # ring slot of the exiting token, which the new token takes
    slot = (s + ring_off).view(b, 1, 1, 1)
    ex_k = K.gather(2, slot.expand(b, h, 1, d))
    ex_v = V.gather(2, slot.expand(b, h, 1, V.shape[-1]))
    obs = None if OBS is None else OBS.gather(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1]))
    return ex_k, ex_v, obs


def steady_tail(spec: StepSpec, q: Tensor, k_new: Tensor, v_new: Tensor, K: Tensor, V: Tensor, SI: Tensor,
                LP: Tensor, OBS: Tensor | None, t: Tensor, ex_k: Tensor, ex_v: Tensor, prio: Tensor):
    """Rule, writes and attention of a steady step, after scoring.

    ``K``/``V`` ``[b, h, B + 1, d]``, ``SI [b, h, B + 1]`` and ``LP [b, h, k + 1]`` are the layer's
    buffers (with their trash slot) and ``OBS`` its window statistics (or None), all written IN
    PLACE (a new tensor per step is an allocation and a new object per step, and both cost more
    than the update in a compiled step); ``t [b]`` the new token's index; ``prio [b, h]`` the
    exiting token's score. Returns ``(out [b, 1, hq, d], t + 1)``: the output in the layout the
    model takes and the next token's index (computed here: one eager op less per layer and step).
    """
    s, w, kk = spec.sinks, spec.window, spec.k
    n = s + w + kk
    b, hq, _, d = q.shape
    h = K.shape[1]
    g = hq // h
    ex_idx = t - w
    prio = prio.float()
    if spec.lam:
        prio = prio + spec.lam * ex_idx.view(b, 1).float()
    weakest, accept = rule.decide_one_full(LP[:, :, :kk], SI[:, :, s + w : n], prio, ex_idx.view(b, 1).expand(b, h))
    dst = torch.where(accept, s + w + weakest, n)  # [b, h]; rejected: the trash slot
    # index_put_ with (row, head, slot) indices: torch.compile writes it in place (a scatter_ on a
    # graph input is copied whole)
    bi = torch.arange(b, device=q.device).view(b, 1).expand(b, h)
    hi = torch.arange(h, device=q.device).view(1, h).expand(b, h)
    K.index_put_((bi, hi, dst), ex_k.view(b, h, -1))
    V.index_put_((bi, hi, dst), ex_v.view(b, h, -1))
    SI.index_put_((bi, hi, dst), ex_idx.view(b, 1).expand(b, h))
    LP.index_put_((bi, hi, dst - (s + w)), prio)
    ring_off = (t - s) % w
    slot = (s + ring_off).view(b, 1).expand(b, h)
    K.index_put_((bi, hi, slot), k_new.view(b, h, -1))
    V.index_put_((bi, hi, slot), v_new.view(b, h, -1))
    SI.index_put_((bi, hi, slot), t.view(b, 1).expand(b, h))
    keys, values = K[:, :, :n], V[:, :, :n]
    qg = q.view(b, h, g, d)
    if OBS is None:
        out = torch.nn.functional.scaled_dot_product_attention(qg, keys, values, scale=spec.scaling)
        return out.reshape(b, hq, 1, -1).transpose(1, 2), t + 1
    logits = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * spec.scaling  # [b, h, g, B]
    # sinks and ring hold exactly the tokens still protected: their attention is what is observed
    p_ring = torch.softmax(logits[..., : s + w], -1)[..., s:].mean(2)  # [b, h, w]
    age = t.view(b, 1, 1) - SI[:, :, s : s + w]
    thr = torch.tensor([w - o for o in spec.obs_windows], device=q.device)
    contrib = (age.unsqueeze(-1) >= thr) * p_ring.unsqueeze(-1)  # [b, h, w, n_obs]
    # the new token's ring slot restarts its statistics; the others accumulate
    OBS.scatter_(2, ring_off.view(b, 1, 1, 1).expand(b, h, 1, OBS.shape[-1]), 0.0).add_(contrib)
    out = torch.matmul(torch.softmax(logits, -1).to(values.dtype), values)
    return out.reshape(b, hq, 1, -1).transpose(1, 2), t + 1


def steady_learned(spec: StepSpec, sspec: DecodeSpec, params: tuple, state, q: Tensor, k_new: Tensor,
                   v_new: Tensor, K: Tensor, V: Tensor, SI: Tensor, LP: Tensor, OBS: Tensor | None, t: Tensor):
    """The whole steady step of a learned policy: read, score (``kvpop.scorers.decode``), rule,
    writes, attention. The scorer's ``state`` (a tuple of tensors the caller owns, or None) is
    updated IN PLACE, like the buffers (:func:`steady_tail`). Returns ``(out, t + 1)``."""
    ex_k, ex_v, obs = exit_gather(spec, K, V, OBS, t)
    new_state, prio = decode_scores(sspec, params, state, k_new, v_new, ex_k, ex_v, t, t - spec.window, obs)
    if state is not None:
        for old, new in zip(state, new_state):
            old.copy_(new)
    return steady_tail(spec, q, k_new, v_new, K, V, SI, LP, OBS, t, ex_k, ex_v, prio)


def steady_scored(spec: StepSpec, score, consts: tuple, q: Tensor, k_new: Tensor, v_new: Tensor, K: Tensor,
                  V: Tensor, SI: Tensor, LP: Tensor, OBS: Tensor | None, t: Tensor):
    """The whole steady step of a policy with a pure score function (``Policy.steady_score``):
    read, ``score(consts, ex_k, ex_v, ex_obs, exit_index)``, rule, writes, attention. Returns
    ``(out, t + 1)``."""
    ex_k, ex_v, obs = exit_gather(spec, K, V, OBS, t)
    prio = score(consts, ex_k, ex_v, obs, t - spec.window).reshape(K.shape[0], K.shape[1])
    return steady_tail(spec, q, k_new, v_new, K, V, SI, LP, OBS, t, ex_k, ex_v, prio)


@functools.cache
def compiled(fn_name: str, device_type: str = "cpu"):
    """One of the steady-step functions compiled for one device type (built on first use, shared
    by all caches).

    On the CPU: inductor's code called directly (:class:`Direct`), one graph per input layout,
    which a cache layer binds for its repeated steps (:meth:`Direct.bind`). On other devices:
    ``torch.compile`` with inductor's defaults (Triton kernels on CUDA), ``dynamic=False``
    (decode shapes are static, so each budget and batch compiles once). Raises whatever the
    compiler raises when no backend works here (the cache then falls back to the eager functions).
    """
    fn = {"steady_tail": steady_tail, "steady_learned": steady_learned, "steady_scored": steady_scored}[fn_name]
    if device_type != "cpu":
        return Dynamo(fn)
    # a C++ wrapper (less Python per call) and single-threaded kernels: the tensors of one decode
    # step are too small for a parallel region to pay for itself (measured: ~25 us less per layer
    # at 2 threads); the matmuls still use torch's threads. Memory planning: the ~25 intermediates
    # of a step share one allocation (measured in the model: 0.4 ms less per decode step)
    return Direct(fn, {"cpp_wrapper": True, "cpp.threads": 1, "memory_planning": True})


_TENSOR = object()  # marks where a tensor goes in an argument or result template


def _template(items) -> tuple[tuple, list[Tensor]]:
    """``(template, tensors)``: ``items`` (tensors, None, constants, and tuples / NamedTuples of
    those, one level deep) with every tensor replaced by ``_TENSOR``, and the tensors in order.
    (Not ``torch.utils._pytree``: its flatten alone takes ~10 us a call, a third of what the direct
    call saves.)"""
    template, tensors = [], []
    for a in items:
        if isinstance(a, Tensor):
            template.append(_TENSOR)
            tensors.append(a)
        elif isinstance(a, tuple):
            sub = []
            for x in a:
                if isinstance(x, Tensor):
                    sub.append(_TENSOR)
                    tensors.append(x)
                else:
                    sub.append(x)
            template.append((type(a), tuple(sub)))
        else:
            template.append(a)
    return tuple(template), tensors


def _layout_key(template: tuple, tensors) -> tuple:
    """What a compiled graph is specialised on: the constants and each tensor's device, dtype, shape and strides."""
    return template, tuple((t.device, t.dtype, t.shape, t.stride()) for t in tensors)


def _copies(tensors) -> list[Tensor]:
    """Copies with the same shapes and strides (a trial run writes to these, not to the caller's tensors)."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t) for t in tensors]


def _records_grad(tensors) -> bool:
    """Whether autograd would record an op on ``tensors`` (compiled graphs here are inference-only)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _fill(template: tuple, tensors) -> list:
    """The inverse of :func:`_template`."""
    it = iter(tensors)
    out = []
    for a in template:
        if a is _TENSOR:
            out.append(next(it))
        elif isinstance(a, tuple):  # (tuple type, its template)
            vals = [next(it) if x is _TENSOR else x for x in a[1]]
            out.append(a[0](*vals) if hasattr(a[0], "_fields") else a[0](vals))
        else:
            out.append(a)
    return out


class Direct:
    """``fn`` compiled by inductor for each layout of its inputs and called without dynamo.

    Why: the fused step runs once per layer and token, and in the model (caches cold after the
    LLM's weights went through) dynamo's per-call frame, its guards and wrapper layers, cost more
    than the work it wraps: a bare write-and-attend step took 1.04x the floor's decode step
    through ``torch.compile`` and 1.00x called this way (``kvpop bench overhead`` conditions).

    What dynamo's guards checked, the key here checks: every non-tensor argument (specs, score
    functions, None) by value, and each tensor's device, dtype, shape and strides. A new key traces
    ``fn`` with fake tensors (``make_fx``) and compiles the graph (``compile_fx``, what
    ``torch.compile`` uses); in-place writes to inputs stay in place. ``fn`` must be a pure tensor
    function of its arguments (tensors, None, hashable constants, and tuples of those) returning
    the same kinds; with autograd recording and an input that requires grad it runs eagerly.

    A caller that repeats a call with only a few tensors new (a cache layer's decode step) binds
    the rest once (:meth:`bind`): checking and flattening every argument on each call costs more
    in the model than it seems (:class:`Bound`).
    """

    def __init__(self, fn, options: dict) -> None:
        from torch._inductor.compile_fx import compile_fx  # imported here: a missing compiler fails at first use
        from torch.fx.experimental.proxy_tensor import make_fx

        self.fn, self.options, self.graphs = fn, dict(options), {}
        self._compile_fx, self._make_fx = compile_fx, make_fx

    def __call__(self, *args):
        template, tensors = _template(args)
        if _records_grad(tensors):
            return self.fn(*args)
        run, out_template = self._graph(template, tensors)
        return tuple(_fill(out_template, run(*tensors)))

    def prepare(self, args: tuple) -> None:
        """Compile the graph for ``args`` now, if it is new: raises :class:`CompileFailed` (having written
        nothing) when that fails, so a caller can tell a compile failure from an error of the step."""
        template, tensors = _template(args)
        if not _records_grad(tensors):
            self._graph(template, tensors)

    def bind(self, args: tuple, dynamic: tuple[Tensor, ...]) -> Bound | None:
        """The graph for ``args`` with everything but the ``dynamic`` tensors (which must each be
        one of the tensors in ``args``, once) fixed, for a caller that repeats the call with only
        those replaced; None when that does not hold or ``fn`` returns anything but tensors."""
        template, tensors = _template(args)
        found = [[i for i, x in enumerate(tensors) if x is d] for d in dynamic]
        if any(len(f) != 1 for f in found):  # one missing, or one appearing twice
            return None
        positions = tuple(f[0] for f in found)
        if _records_grad(tensors):
            return None  # __call__ runs these eagerly
        run, out_template = self._graph(template, tensors)
        if any(o is not _TENSOR for o in out_template):
            return None
        return Bound(run, tensors, positions)

    def _graph(self, template: tuple, tensors: list[Tensor]):
        """``(run, out_template)`` for this layout, compiled on first use (one compilation at a time in
        the process: :data:`COMPILE_LOCK`)."""
        key = _layout_key(template, tensors)
        graph = self.graphs.get(key)
        if graph is None:
            with COMPILE_LOCK:
                graph = self.graphs.get(key)  # another thread may have compiled it meanwhile
                if graph is None:
                    graph = self.graphs[key] = self._build(template, tensors)
        return graph

    def _build(self, template: tuple, tensors: list[Tensor]):
        """Trace and compile; then run the graph once on copies of ``tensors``, so that a failure of
        the compiled code's first run also surfaces here, before any of the caller's tensors is written.
        Any failure is a :class:`CompileFailed`."""
        out = {}

        def flat(*ts):
            result = self.fn(*_fill(template, ts))
            out["template"], leaves = _template(result)
            return leaves

        try:
            with torch.no_grad():
                gm = self._make_fx(flat, tracing_mode="fake")(*tensors)
                run = self._compile_fx(gm, list(tensors), config_patches=self.options)
                run(*_copies(tensors))
        except Exception as exc:
            raise CompileFailed(f"{type(exc).__name__}: {exc}") from exc
        return run, out["template"]


class Dynamo:
    """``torch.compile(fn, dynamic=False, fullgraph=True)`` (devices other than the CPU: Triton kernels
    on CUDA), with :meth:`prepare` as :class:`Direct`'s: a caller compiles a new input layout under
    :data:`COMPILE_LOCK` with a first run on copies of the inputs, before the step touches its own
    tensors, and then calls the compiled function directly (no per-call work added here)."""

    def __init__(self, fn) -> None:
        self.fn = torch.compile(fn, dynamic=False, fullgraph=True)
        self.ready: set = set()

    def __call__(self, *args):
        return self.fn(*args)

    def prepare(self, args: tuple) -> None:
        template, tensors = _template(args)
        key = _layout_key(template, tensors)
        if key in self.ready:
            return
        with COMPILE_LOCK:
            if key in self.ready:
                return
            try:
                self.fn(*_fill(template, _copies(tensors)))
            except Exception as exc:
                raise CompileFailed(f"{type(exc).__name__}: {exc}") from exc
            self.ready.add(key)


class Bound:
    """One :class:`Direct` graph with all its inputs fixed but a few (:meth:`Direct.bind`): a cache
    layer's steady step, where only the query, key, value and token index are new each step.

    Why: in the model, every Python operation of the per-layer call costs several times what it
    costs in a hot loop (the LLM's weights stream through the caches between two calls), and
    flattening and checking ~20 arguments was about 1 ms of a 41 ms decode step of SmolLM2.
    ``fits`` checks the new tensors only; the caller guarantees that the fixed ones are unchanged
    (same objects, not resized in place) and drops the ``Bound`` when it replaces any of them.
    """

    __slots__ = ("device", "flat", "layouts", "positions", "run")

    def __init__(self, run, tensors: list[Tensor], positions: tuple[int, ...]) -> None:
        self.run, self.flat, self.positions = run, list(tensors), positions
        self.layouts = tuple((tensors[i].shape, tensors[i].stride(), tensors[i].dtype) for i in positions)
        self.device = tensors[positions[0]].device if positions else None

    def fits(self, *dynamic: Tensor) -> bool:
        """Whether new tensors, the first ``len(dynamic)`` of :meth:`Direct.bind`'s dynamic ones
        (a caller may leave out one it makes itself), have the bound shapes, strides and dtypes and
        need no autograd. Only the first one's device is checked: they come from one model."""
        for x, (shape, stride, dtype) in zip(dynamic, self.layouts):
            if x.shape != shape or x.stride() != stride or x.dtype != dtype:
                return False
        if dynamic and dynamic[0].device != self.device:
            return False
        return not _records_grad(dynamic)

    def __call__(self, *dynamic: Tensor) -> list[Tensor]:
        """The graph's results (``fn``'s tensors, in order) with ``dynamic`` in place of the bound ones."""
        flat = self.flat
        for i, x in zip(self.positions, dynamic):
            flat[i] = x
        return self.run(*flat)
