"""KVpop cache layers running on per-request pages that a serving engine owns.

A serving engine (vLLM) keeps KV memory in fixed-size blocks that it hands to a request when it
is admitted and takes back when it finishes. A KVpop layer needs a constant footprint per request:
the ``B`` slots of every KV head and a little bookkeeping, whatever the request's length. So one
request's whole state of one layer is one page of :attr:`PageLayout.page_bytes` bytes:

==============  ===============  =======  =====================================================
region          shape            dtype    what
==============  ===============  =======  =====================================================
``keys``        ``[h, B, d]``    model    the slots' keys (post-RoPE, as cached)
``values``      ``[h, B, dv]``   model    the slots' values
``slot_index``  ``[h, B]``       int32    token index each slot holds, ``-1`` = empty
``lr_prio``     ``[h, k]``       float32  frozen priority of each long-range slot
``observed``    ``[h, w, n]``    float32  attention statistics of the window (attention policies)
``n_real``      ``[1]``          int64    tokens the page has seen (checked against the engine)
``state.i``     per policy       float32  the policy's per-request state (the mLSTM's C, n, m)
==============  ===============  =======  =====================================================

Nothing of a request lives outside its pages, so the engine's own accounting is the whole story
and finishing a request frees all of it.

One engine step of one layer (:func:`step_layer`) runs :meth:`kvpop.KVpopLayer.attend` itself,
not a copy of it: the step's requests are split into groups that take the code path a
``KVpopCache`` takes for a single sequence (:func:`plan_step`), each group's pages are gathered
into a :class:`kvpop.state.LayerState`, the layer attends, and what changed is written back (of the
slots, only those whose token index changed). Prefill chunks are cut at multiples of the layer's
prefill chunk, as ``KVpopCache`` cuts a prompt, so the decisions are the rule's whatever chunks
the engine's scheduler makes (and, when its chunks end on such multiples, the same computation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import KVpopLayer
from ..policies import map_state
from ..state import LayerState

_ALIGN = 16  # bytes: every region starts on such a boundary, so every dtype view of it is legal


@dataclass(frozen=True)
class Region:
    """One named part of a page: ``shape`` elements of ``dtype`` from byte ``offset``."""

    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _leaves(state) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_state(state, lambda t: out.append(t) or t)
    return out


class PageLayout:
    """Where one request's state of one ``KVpopLayer`` lies in its page.

    ``kv_heads``/``head_dim``/``value_dim``/``dtype``: the layer's cache geometry. The policy state's
    regions come from the policy's own fresh state (``Policy.init_state``), so any policy whose
    state is tensors with the batch on dim 0 fits.
    """

    def __init__(self, layer: KVpopLayer, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype):
        cfg = layer.cfg
        self.budget, self.k = cfg.budget, cfg.k
        self.kv_heads, self.head_dim, self.value_dim, self.dtype = kv_heads, head_dim, value_dim, dtype
        self.stores_observed = bool(layer.policy.needs_attention)
        template = layer.new_state(1, kv_heads, head_dim, value_dim, dtype, "cpu")
        self._state_template = template.policy_state
        self._observed_shape = tuple(template.observed.shape[1:])
        h, n = kv_heads, cfg.budget
        parts: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("keys", dtype, (h, n, head_dim)),
            ("values", dtype, (h, n, value_dim)),
            ("slot_index", torch.int32, (h, n)),
            ("lr_prio", torch.float32, (h, cfg.k)),
        ]
        if self.stores_observed:
            parts.append(("observed", torch.float32, self._observed_shape))
        parts.append(("n_real", torch.int64, (1,)))
        self.state_names = []
        for i, leaf in enumerate(_leaves(template.policy_state)):
            self.state_names.append(f"state.{i}")
            parts.append((f"state.{i}", leaf.dtype, tuple(leaf.shape[1:])))
        regions, offset = {}, 0
        for name, dt, shape in parts:
            regions[name] = Region(name, offset, dt, shape)
            offset += -(-regions[name].nbytes // _ALIGN) * _ALIGN
        self.regions: dict[str, Region] = regions
        self.page_bytes = offset

    def nbytes(self) -> dict[str, int]:
        """Bytes per region of one page (``keys``/``values`` are the ``B`` slots; the rest is bookkeeping)."""
        return {name: r.nbytes for name, r in self.regions.items()}

    def view(self, pool: torch.Tensor, name: str) -> torch.Tensor:
        """Region ``name`` of every page of ``pool`` (``[num_pages, page_bytes]`` uint8, any page
        stride): a typed view ``[num_pages, *shape]`` into the pool's own memory."""
        r = self.regions[name]
        size = pool.element_size()
        if (
            pool.dtype != torch.uint8
            or pool.dim() != 2
            or pool.shape[1] < self.page_bytes
            or pool.stride(1) != 1
            or size != 1
        ):
            raise ValueError(
                f"pool must be [num_pages, >= {self.page_bytes}] uint8 with contiguous pages, "
                f"got {tuple(pool.shape)} {pool.dtype} stride {pool.stride()}"
            )
        return pool[:, r.offset : r.offset + r.nbytes].view(r.dtype).view(pool.shape[0], *r.shape)

    def fresh(self, layer: KVpopLayer, rows: int, device) -> LayerState:
        """The state of ``rows`` requests that have seen nothing yet (their pages are not read)."""
        return layer.new_state(rows, self.kv_heads, self.head_dim, self.value_dim, self.dtype, device)

    def gather(self, pool: torch.Tensor, pages: torch.Tensor, seen: torch.Tensor) -> tuple[LayerState, torch.Tensor]:
        """The state held in ``pages`` (``[R]`` page numbers) as a new ``LayerState``, and the slot
        indices as read (``[R, h, B]`` int32, for :meth:`write`). ``seen [R]``: the tokens the engine
        says each request has seen; a page that disagrees is refused (it was not written by the
        step before, e.g. a page handed to a new request without a fresh start)."""
        rows = pages.numel()
        # everything after the keys and values (small) in one copy; the regions are views of it
        base = self.regions["slot_index"].offset
        tail = pool[:, base : self.page_bytes].index_select(0, pages)

        def take(name: str) -> torch.Tensor:
            r = self.regions[name]
            return tail[:, r.offset - base : r.offset - base + r.nbytes].view(r.dtype).view(rows, *r.shape)

        stored = take("n_real").view(rows)
        if not torch.equal(stored, seen.to(stored.dtype)):
            raise RuntimeError(
                f"kvpop: a request's page holds the state after {stored.tolist()} tokens, but the engine "
                f"says it has seen {seen.tolist()}; the page was not written by this request's previous step"
            )
        n, h = self.budget, self.kv_heads
        # keys and values straight into the layer's buffers (with their scratch slot), one copy per row:
        # half the memory traffic of a gather followed by a concatenation
        keys = torch.empty(rows, h, n + 1, self.head_dim, dtype=self.dtype, device=pool.device)
        values = torch.empty(rows, h, n + 1, self.value_dim, dtype=self.dtype, device=pool.device)
        keys[:, :, n].zero_()
        values[:, :, n].zero_()
        pk, pv = self.view(pool, "keys"), self.view(pool, "values")
        for row, page in enumerate(pages.tolist()):
            keys[row, :, :n].copy_(pk[page])
            values[row, :, :n].copy_(pv[page])
        before = take("slot_index")
        if self.stores_observed:
            observed = take("observed")  # the layer may update it in place: it is this step's copy
        else:  # not read by a policy that does not observe attention: a fresh zero tensor
            observed = torch.zeros(rows, *self._observed_shape, dtype=torch.float32, device=pool.device)
        leaves = iter([take(name) for name in self.state_names])
        state = map_state(self._state_template, lambda _t: next(leaves))
        n_real = seen.to(device=pool.device, dtype=torch.long).clone()
        buffers = LayerState(
            k=keys,
            v=values,
            slot_index=_with_scratch(before.long(), LayerState.ROWS["slot_index"]),
            lr_prio=_with_scratch(take("lr_prio"), LayerState.ROWS["lr_prio"]),
            observed=observed,
            n_real=n_real,
            policy_state=state,
            min_real=int(n_real.min()),
        )
        return buffers, before

    def write(self, pool: torch.Tensor, pages: torch.Tensor, buffers: LayerState, before: torch.Tensor | None) -> None:
        """Write ``buffers`` (rows in the order of ``pages``) back to their pages. ``before``: the slot
        indices :meth:`gather` read; only slots whose index changed get their key and value written
        (a slot with the same token holds the same key and value). ``None``: write all slots."""
        n, kk = self.budget, self.k
        index = buffers.slot_index[:, :, :n]
        if before is None:
            self.view(pool, "keys").index_copy_(0, pages, buffers.k[:, :, :n])
            self.view(pool, "values").index_copy_(0, pages, buffers.v[:, :, :n])
        else:
            row, head, slot = (index != before).nonzero(as_tuple=True)
            if row.numel():
                page = pages[row]
                self.view(pool, "keys")[page, head, slot] = buffers.k[row, head, slot]
                self.view(pool, "values")[page, head, slot] = buffers.v[row, head, slot]
        self.view(pool, "slot_index").index_copy_(0, pages, index.to(torch.int32))
        self.view(pool, "lr_prio").index_copy_(0, pages, buffers.lr_prio[:, :, :kk])
        if self.stores_observed:
            self.view(pool, "observed").index_copy_(0, pages, buffers.observed)
        self.view(pool, "n_real").index_copy_(0, pages, buffers.n_real.view(-1, 1))
        for name, leaf in zip(self.state_names, _leaves(buffers.policy_state), strict=True):
            self.view(pool, name).index_copy_(0, pages, leaf)


def _with_scratch(x: torch.Tensor, fill) -> torch.Tensor:
    """``x [R, h, n, ...]`` with one more (scratch) entry on dim 2."""
    pad = x.new_full((x.shape[0], x.shape[1], 1, *x.shape[3:]), fill)
    return torch.cat([x, pad], dim=2)


@dataclass(frozen=True)
class Request:
    """One request's part of an engine step: its page, where its new tokens sit in the step's
    flattened batch, how many tokens it had seen before, and whether they are still its prompt."""

    page: int
    start: int
    length: int
    seen: int
    prefill: bool


@dataclass(frozen=True)
class Group:
    """Requests of a step that run through the layer together (see :func:`plan_step`)."""

    decode: bool
    pages: torch.Tensor  # [R] long
    seen: torch.Tensor  # [R] long
    tokens: torch.Tensor | None  # decode: [R] the new token's position in the step
    pieces: tuple[tuple[int, int], ...]  # prefill (one request): [start, end) of each piece in the step
    fresh: bool  # prefill from the first token: start from a fresh state, read nothing


def plan_step(requests: Sequence[Request], budget: int, chunk: int, device="cpu") -> list[Group]:
    """Split one engine step's requests into groups that take the code path a ``KVpopCache`` takes
    for each of them alone, so the results are those of a single-sequence cache:

    * decode rows (one new token, past the prompt), batched, in two groups: those whose slots are
      all held (``seen >= budget``: the steady step) and those still filling up;
    * each prefill chunk on its own, cut into pieces that end at multiples of ``chunk`` (the
      pieces ``KVpopCache`` cuts a whole prompt into), always through the chunk path.

    Computed once per step; every layer uses it.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    decode: dict[bool, list[Request]] = {False: [], True: []}
    groups: list[Group] = []
    for r in requests:
        if r.length < 1:
            continue
        if r.length == 1 and not r.prefill and r.seen > 0:
            decode[r.seen >= budget].append(r)
            continue
        pieces, a, end = [], r.seen, r.seen + r.length
        while a < end:
            b = min(end, (a // chunk + 1) * chunk)
            pieces.append((r.start + a - r.seen, r.start + b - r.seen))
            a = b
        groups.append(
            Group(
                False,
                torch.tensor([r.page], device=device),
                torch.tensor([r.seen], device=device),
                None,
                tuple(pieces),
                r.seen == 0,
            )
        )
    for rows in decode.values():
        if rows:
            groups.append(
                Group(
                    True,
                    torch.tensor([r.page for r in rows], device=device),
                    torch.tensor([r.seen for r in rows], device=device),
                    torch.tensor([r.start for r in rows], device=device),
                    (),
                    False,
                )
            )
    return groups


def step_layer(
    layer: KVpopLayer,
    layout: PageLayout,
    pool: torch.Tensor,
    groups: Sequence[Group],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scaling: float,
) -> None:
    """One layer's attention for one engine step, on the requests' pages.

    ``query [T, hq, d]``, ``key [T, h, d]``, ``value [T, h, dv]``: the step's new tokens (post-RoPE),
    requests side by side as in ``groups`` (:func:`plan_step`); ``out [T, hq, dv]`` gets the
    attention output of every token the groups cover. ``pool [num_pages, page_bytes]`` uint8 holds
    the pages (``layout``); each group's pages are read, advanced by ``layer.attend`` and written back.
    """
    try:
        for g in groups:
            if g.decode:
                t = g.tokens
                buffers, before = layout.gather(pool, g.pages, g.seen)
                layer.fast_decode = True
                layer.load(buffers)
                o = layer.attend(query[t].unsqueeze(2), key[t].unsqueeze(2), value[t].unsqueeze(2), None, scaling)
                out[t] = o[:, 0].to(out.dtype)
            else:
                if g.fresh:
                    buffers, before = layout.fresh(layer, 1, pool.device), None
                else:
                    buffers, before = layout.gather(pool, g.pages, g.seen)
                layer.fast_decode = False  # a prompt's single-token piece too: KVpopCache runs prompts as chunks
                layer.load(buffers)
                for a, b in g.pieces:
                    qc = query[a:b].transpose(0, 1).unsqueeze(0)
                    kc = key[a:b].transpose(0, 1).unsqueeze(0)
                    vc = value[a:b].transpose(0, 1).unsqueeze(0)
                    out[a:b] = layer.attend(qc, kc, vc, None, scaling)[0].to(out.dtype)
            # the layer lets go of the gathered copies: between steps a request's state is its pages only
            layout.write(pool, g.pages, layer.unload(), before)
    finally:
        layer.fast_decode = True
        if layer.is_initialized:  # an error mid-step: drop the copies all the same
            layer.unload()
