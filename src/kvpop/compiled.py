"""Compiling a cache's decode step: inductor's code for ``kvpop.step``'s steady functions.

:class:`CompiledStep` (one per cache) owns the decision and the bookkeeping: whether the cache
compiles, the compiled step each layer bound to its own buffers, and the fail-safe: only a
failure to *compile* falls back to the eager step, and only before anything was written (each
new input layout is compiled and run once on copies of its inputs, one compilation at a time in
the process); an error of the compiled step itself (a shape bug, out of memory) propagates,
because its in-place writes may have happened and an eager rerun would apply them twice.

Below it, the compiled code (:data:`compiled_code`, a :class:`CodeStore` shared by every cache of
the process: the code of one input layout compiles once): on the CPU inductor's code called directly
(:class:`Direct`, bound per layer by :class:`BoundGraph`), on other devices ``torch.compile``
(:class:`Dynamo`). Tests hold every compiled path to the eager one.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import step as steps

__all__ = [
    "COMPILE_LOCK",
    "STEPS",
    "BoundGraph",
    "CodeStore",
    "CompileFailed",
    "CompiledStep",
    "Direct",
    "Dynamo",
    "compile_default",
    "compiled_code",
]

# One compilation at a time in the process: make_fx's tracer patches module globals and dynamo keeps
# per-process state, so two threads compiling at once failed (3 runs in 7: "CURRENT_PATCHER is None").
COMPILE_LOCK = threading.RLock()
STEPS = {"decode_tail": steps.decode_tail, "decode_learned": steps.decode_learned, "decode_scored": steps.decode_scored}


class CompileFailed(RuntimeError):
    """The compiler (or the compiled step's first run, on copies of its inputs) failed: nothing the
    caller holds was written, so the eager step may run instead."""


# Steady decode steps a layer runs eagerly before its step is compiled, when the cache was not told to compile
# (``compile=None``): compiling costs seconds once per cache shape, which a short generation never earns back, so a
# generation of fewer steps never waits on the compiler and a long one compiles after these few eager steps.
EAGER_STEPS = 32


def compile_default() -> bool:
    """Whether a cache compiles its decode step when not told: yes, unless ``KVPOP_COMPILE=0`` (the
    test suite sets it, to spend its time on tests rather than on compiling tiny shapes)."""
    return os.environ.get("KVPOP_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


class CodeStore:
    """Compiled code of :data:`STEPS`, one per step and device type, built on first use; the process
    shares one (:data:`compiled_code`), so the code of an input layout compiles once for all caches.

    On the CPU: inductor's code called directly (:class:`Direct`), one graph per input layout,
    which a cache layer binds for its repeated steps (:meth:`Direct.bind`). On other devices:
    ``torch.compile`` with inductor's defaults (Triton kernels on CUDA), ``dynamic=False``
    (decode shapes are static, so each budget and batch compiles once). Raises whatever the
    compiler raises when no backend works here.
    """

    def __init__(self) -> None:
        self.code: dict[tuple[str, str], object] = {}

    def __call__(self, fn_name: str, device_type: str = "cpu"):
        key = (fn_name, device_type)
        code = self.code.get(key)
        if code is None:
            with COMPILE_LOCK:
                code = self.code.get(key)
                if code is None:
                    code = self.code[key] = self._make(STEPS[fn_name], device_type)
        return code

    @staticmethod
    def _make(fn, device_type: str):
        if device_type != "cpu":
            return Dynamo(fn)
        # a C++ wrapper (less Python per call) and single-threaded kernels: the tensors of one decode
        # step are too small for a parallel region to pay for itself (measured: ~25 us less per layer
        # at 2 threads); the matmuls still use torch's threads. Memory planning: the ~25 intermediates
        # of a step share one allocation (measured in the model: 0.4 ms less per decode step)
        return Direct(fn, {"cpp_wrapper": True, "cpp.threads": 1, "memory_planning": True})


compiled_code = CodeStore()


@dataclass(slots=True)
class _LayerBinding:
    """A layer's compiled step with its own tensors bound, and what it was bound with: the layer uses
    it while these are still the same objects."""

    step: BoundGraph
    spec: steps.StepSpec
    state: object  # the policy state (updated in place by the step)
    observed: Tensor | None  # the window statistics (idem)
    kernel: tuple | None  # the learned policy's decode kernel (None: a pure score function)


class CompiledStep:
    """One cache's compiled decode step (``KVpopCache(compile=...)``).

    ``run`` calls a step of :data:`STEPS` compiled, or eagerly when this cache does not compile or
    compiling failed here; ``bound`` / ``bind`` keep, per layer, the compiled CPU step with
    everything but the new token's tensors fixed (:class:`BoundGraph`); ``forget`` drops a layer's when
    its buffers change. ``compiler`` is where compiled code comes from (:data:`compiled_code`;
    tests give a failing one). ``status`` says what ran, for ``kvpop generate``.
    """

    def __init__(self, enabled: bool, compiler: Callable = compiled_code, eager_steps: int = 0) -> None:
        self.enabled, self.compiler = enabled, compiler
        self.eager_steps = eager_steps  # steady steps per layer run eagerly first (:data:`EAGER_STEPS`)
        self.error: str | None = None  # why this cache runs eagerly after all (compiling failed)
        self.ran = False  # a compiled step ran
        self.bound: dict[int, _LayerBinding] = {}
        self._ready: dict[int, set[str]] = {}  # per layer: steps prepared for its current buffers
        self._steps: dict[int, int] = {}  # per layer: steady steps run

    @property
    def active(self) -> bool:
        return self.enabled and self.error is None

    def status(self) -> str:
        """``"compiled"``, ``"eager"`` (not asked), ``"eager (compiling failed: ...)"``, or
        ``"compiled (not reached)"`` when no steady decode step ran yet."""
        if not self.enabled:
            return "eager"
        if self.error is not None:
            return f"eager (compiling failed: {self.error})"
        if not self.ran and self._steps:
            return f"eager (the step compiles after {self.eager_steps} decode steps)"
        return "compiled" if self.ran else "compiled (not reached)"

    def forget(self, layer_idx: int) -> None:
        """A layer's buffers changed: its bound step and prepared steps are stale."""
        self.bound.pop(layer_idx, None)
        self._ready.pop(layer_idx, None)

    def run(self, layer_idx: int, name: str, args: tuple, device_type: str):
        """``kvpop.step.<name>(*args)``, compiled when this cache compiles.

        Only a failure to compile falls back to the eager function, and only before the step wrote
        anything: the step is first compiled for these inputs (``prepare``: compiling and a first
        run on copies of the inputs), then run. When the eager step then succeeds, the compiler is
        what failed: this cache runs eagerly from then on, with one warning; when it fails too, its
        error is raised and compilation stays on.
        """
        if not self.active or self._eager_first(layer_idx):
            return STEPS[name](*args)
        try:
            code = self._prepared(layer_idx, name, args, device_type)
        except CompileFailed as exc:  # nothing written yet
            out = STEPS[name](*args)  # an error here is the step's own, not the compiler's
            self.error = str(exc)
            warnings.warn(
                f"compiling the decode step failed ({self.error}); running it eagerly", RuntimeWarning, stacklevel=4
            )
            return out
        self.ran = True
        return code(*args)

    def _eager_first(self, layer_idx: int) -> bool:
        """Whether this steady step of the layer is one of its first :attr:`eager_steps` (run eagerly)."""
        n = self._steps.get(layer_idx, 0)
        self._steps[layer_idx] = n + 1
        return n < self.eager_steps

    def _prepared(self, layer_idx: int, name: str, args: tuple, device_type: str):
        try:
            code = self.compiler(name, device_type)
        except CompileFailed:
            raise
        except Exception as exc:  # no inductor, no backend for this device: nothing ran
            raise CompileFailed(f"{type(exc).__name__}: {exc}") from exc
        ready = self._ready.setdefault(layer_idx, set())
        if name not in ready:  # once per layer and set of buffers (reset by forget)
            prepare = getattr(code, "prepare", None)
            if prepare is not None:
                prepare(args)
            ready.add(name)
        return code

    def bind(self, layer_idx: int, name: str, args: tuple, dynamic: tuple, spec, state, observed, kernel) -> None:
        """Keep the compiled step just run with everything but ``dynamic`` bound, for the layer's next
        steps (CPU only: other devices go through ``torch.compile``)."""
        self.bound.pop(layer_idx, None)
        eager_run = self._steps.get(layer_idx, 0) <= self.eager_steps  # the step just run was an eager one
        if not self.active or eager_run or dynamic[0].device.type != "cpu":
            return
        bind = getattr(self.compiler(name, "cpu"), "bind", None)
        step = None if bind is None else bind(args, dynamic)
        if step is not None:
            self.bound[layer_idx] = _LayerBinding(step, spec, state, observed, kernel)


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
    in the model than it seems (:class:`BoundGraph`).
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

    def bind(self, args: tuple, dynamic: tuple[Tensor, ...]) -> BoundGraph | None:
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
        return BoundGraph(run, tensors, positions)

    def _graph(self, template: tuple, tensors: list[Tensor]):
        """``(run, out_template)`` for this layout, compiled on first use (one compilation at a time in
        the process: :data:`COMPILE_LOCK`); a layout that failed to compile raises its
        :class:`CompileFailed` again."""
        key = _layout_key(template, tensors)
        graph = self.graphs.get(key)
        if graph is None:
            with COMPILE_LOCK:
                graph = self.graphs.get(key)  # another thread may have compiled it meanwhile
                if graph is None:
                    try:
                        graph = self.graphs[key] = self._build(template, tensors)
                    except CompileFailed as exc:
                        graph = self.graphs[key] = exc  # not tried again: other caches fail fast
        if isinstance(graph, CompileFailed):
            raise graph
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


class BoundGraph:
    """One :class:`Direct` graph with all its inputs fixed but a few (:meth:`Direct.bind`): a cache
    layer's steady step, where only the query, key, value and token index are new each step.

    Why: in the model, every Python operation of the per-layer call costs several times what it
    costs in a hot loop (the LLM's weights stream through the caches between two calls), and
    flattening and checking ~20 arguments was about 1 ms of a 41 ms decode step of SmolLM2.
    ``fits`` checks the new tensors only; the caller guarantees that the fixed ones are unchanged
    (same objects, not resized in place) and drops the ``BoundGraph`` when it replaces any of them.
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
