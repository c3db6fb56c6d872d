"""Building blocks of the evaluation: budgets, policies by name, teacher-forced metrics.

Teacher-forced evaluation under a policy is ONE forward of the whole document through a fresh
:class:`kvpop.KVpopCache` (the chunked prefill equals token-by-token feeding). To keep memory
at ``O(S * hidden)`` instead of ``O(S * vocab)``, the decoder's hidden states are kept and the
LM head is applied a chunk of positions at a time when the metrics are computed; the dense
run's hidden states are what :class:`DenseCache` stores per document.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import KVpopCache, make_cache
from ..compat import cache_kwargs
from ..config import EvictionConfig, attention_shape
from ..policies import DENSE, POLICIES, TEACHER_FORCED_ONLY, policy_names

ORACLE = TEACHER_FORCED_ONLY[0]
ALL_POLICIES = tuple(policy_names())


class PolicyUnavailable(RuntimeError):
    """A policy is not registered / cannot be built here; the harness records it as skipped."""


def policy_available(name: str) -> str | None:
    """``None`` when ``name`` can be evaluated here, else the reason it cannot."""
    if name == DENSE:
        return None
    if name == ORACLE:
        try:
            from ..capture import collect  # noqa: F401
            from ..policies.oracle import OraclePolicy  # noqa: F401
        except ImportError as exc:
            return f"oracle needs kvpop.capture.collect and kvpop.policies.oracle.OraclePolicy ({exc})"
        return None
    if name not in POLICIES:
        return f"policy {name!r} is not registered (known: {', '.join(sorted(POLICIES))})"
    return None


@torch.no_grad()
def oracle_targets(model, input_ids: Tensor, window: int) -> list[Tensor]:
    """Per-layer log future-attention targets ``[1, kv_heads, S]`` of ``input_ids`` (1-D or [1, S])."""
    return oracle_targets_multi(model, input_ids, [window])[window]


@torch.no_grad()
def oracle_targets_multi(model, input_ids: Tensor, windows) -> dict[int, list[Tensor]]:
    """``{window: per-layer targets [1, kv_heads, S]}`` for several windows from ONE captured forward.

    Runs the decoder only (no LM head over the whole sequence) under ``kvpop.capture.capturing``;
    only the targets are kept.
    """
    from ..capture import capturing

    ws = sorted({int(w) for w in windows})
    if not ws:
        return {}
    ids = input_ids.view(1, -1).to(model.device)
    dec, _ = _decoder_and_head(model)
    with capturing(model, window=ws[0], extra_windows=ws[1:]) as state:
        (dec or model)(input_ids=ids, use_cache=False)
    caps = state.result()
    n_layers = attention_shape(model.config).num_layers
    if len(caps) != n_layers:
        raise RuntimeError(f"captured {len(caps)} attention layers of {n_layers}; cannot build the oracle")
    out = {w: [c.targets.get(w, c.target if w == ws[0] else None) for c in caps] for w in ws}
    for w, ts in out.items():
        if any(t is None for t in ts):
            raise RuntimeError(f"the capture returned no targets for window {w}")
    return out


def make_policy(name: str, model, input_ids: Tensor | None, eviction: EvictionConfig):
    """A policy name or instance for :func:`kvpop.make_cache` (``None`` for dense).

    ``"oracle"`` computes the true targets of ``input_ids`` (the whole sequence the cache will
    see, e.g. prompt + dense continuation) with ``kvpop.capture.collect`` and builds an
    ``OraclePolicy``. Raises :class:`PolicyUnavailable` for anything not available.
    """
    reason = policy_available(name)
    if reason is not None:
        raise PolicyUnavailable(reason)
    if name == DENSE:
        return None
    if name == ORACLE:
        from ..policies.oracle import OraclePolicy

        if input_ids is None:
            raise PolicyUnavailable("oracle needs the whole sequence in advance")
        return OraclePolicy(oracle_targets(model, input_ids, eviction.window))
    return name


def policy_cache(
    model, name: str, input_ids: Tensor | None, eviction: EvictionConfig, **policy_kwargs
) -> KVpopCache | None:
    """:func:`kvpop.make_cache` for policy ``name`` (None for dense), with anything that keeps the
    policy from being built here (a learned scorer missing or for another model) raised as
    :class:`PolicyUnavailable`; ``policy_kwargs`` go to the policy factory (e.g. ``path=``)."""
    policy = make_policy(name, model, input_ids, eviction)
    if policy is None:
        return None
    try:
        return make_cache(model, policy, eviction=eviction, **policy_kwargs)
    except (TypeError, ValueError, KeyError, OSError, RuntimeError) as exc:
        raise PolicyUnavailable(f"cannot build policy {name!r}: {exc}") from exc


# ------------------------------------------------------------------------------ forward passes


def _decoder_and_head(model):
    get_dec = getattr(model, "get_decoder", None)
    dec = get_dec() if get_dec is not None else None
    head = model.get_output_embeddings()
    if dec is None or head is None:
        return None, None
    return dec, head


@torch.no_grad()
def hidden_states(model, input_ids: Tensor, cache=None) -> Tensor:
    """Final hidden states ``[S, hidden]`` of one document (1-D ids), in one forward."""
    ids = input_ids.view(1, -1).to(model.device)
    dec, _ = _decoder_and_head(model)
    if dec is None:
        raise RuntimeError("model has no get_decoder()/get_output_embeddings(); cannot evaluate")
    out = dec(input_ids=ids, **cache_kwargs(cache), use_cache=cache is not None)
    return out.last_hidden_state[0]


def logits_of(model, hidden: Tensor) -> Tensor:
    _, head = _decoder_and_head(model)
    return head(hidden).float()


def doc_key(input_ids: Tensor) -> str:
    ids = input_ids.detach().to("cpu", torch.long).contiguous().view(-1)
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()


class DenseCache:
    """Dense results per document, shared by all policies and budgets.

    Hidden states of a prefix of a stored document are a slice of the stored ones (causal
    model), so a continuation / agreement prompt cut from an LM document costs no new forward.
    Dense greedy generations are kept too (:meth:`generation`).
    """

    def __init__(self) -> None:
        self._store: dict[str, tuple[Tensor, Tensor, float]] = {}  # key -> (ids, hidden, wall)
        self._gen: dict[tuple, Tensor] = {}
        self.wall_s = 0.0

    def get(self, model, input_ids: Tensor) -> tuple[Tensor, float]:
        """``(hidden [S, H], wall seconds of the dense forward)``."""
        ids = input_ids.view(-1).cpu()
        key = doc_key(ids)
        if key in self._store:
            return self._store[key][1], self._store[key][2]
        for full, h, wall in self._store.values():
            if full.numel() >= ids.numel() and torch.equal(full[: ids.numel()], ids):
                return h[: ids.numel()], 0.0
        import time

        t0 = time.perf_counter()
        h = hidden_states(model, ids, None)
        wall = time.perf_counter() - t0
        self.wall_s += wall
        self._store[key] = (ids, h, wall)
        return h, wall

    def generation(self, key: tuple, make) -> Tensor:
        if key not in self._gen:
            import time

            t0 = time.perf_counter()
            self._gen[key] = make()
            self.wall_s += time.perf_counter() - t0
        return self._gen[key]

    def __len__(self) -> int:
        return len(self._store)


# ------------------------------------------------------------------------------ metrics


@dataclass
class Sums:
    """Additive statistics over scored positions (so documents pool exactly)."""

    n: int = 0
    nll_dense: float = 0.0
    nll_policy: float = 0.0
    kl: float = 0.0
    top1: float = 0.0

    def add(self, other: Sums) -> Sums:
        return Sums(
            self.n + other.n,
            self.nll_dense + other.nll_dense,
            self.nll_policy + other.nll_policy,
            self.kl + other.kl,
            self.top1 + other.top1,
        )

    def metrics(self) -> dict:
        """nll (per token), ppl, retention = ppl_dense / ppl_policy, mean KL(dense||policy), top-1 agreement."""
        if self.n == 0:
            nan = float("nan")
            return {"n_tokens": 0, "nll_dense": nan, "nll_policy": nan, "ppl_dense": nan, "ppl_policy": nan,
                    "retention": nan, "kl": nan, "top1_agreement": nan}  # fmt: skip
        nd, npol = self.nll_dense / self.n, self.nll_policy / self.n
        return {
            "n_tokens": self.n,
            "nll_dense": nd,
            "nll_policy": npol,
            "ppl_dense": math.exp(nd),
            "ppl_policy": math.exp(npol),
            "retention": math.exp(nd - npol),
            "kl": self.kl / self.n,
            "top1_agreement": self.top1 / self.n,
        }


def sums_from_logits(dense_logits: Tensor, policy_logits: Tensor, targets: Tensor) -> Sums:
    """Sums over positions: ``*_logits [n, V]`` predict ``targets [n]``."""
    ld = F.log_softmax(dense_logits.double(), -1)
    lp = ld if policy_logits is dense_logits else F.log_softmax(policy_logits.double(), -1)
    t = targets.view(-1, 1).to(ld.device)
    kl = (ld.exp() * (ld - lp)).sum(-1)
    return Sums(
        n=int(t.shape[0]),
        nll_dense=float(-ld.gather(1, t).sum()),
        nll_policy=float(-lp.gather(1, t).sum()),
        kl=float(kl.sum()),
        top1=float((dense_logits.argmax(-1) == policy_logits.argmax(-1)).double().sum()),
    )


def score_range(seq_len: int, score_from: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` whose logits are scored (position p predicts token p + 1)."""
    return max(0, score_from), seq_len - 1


@torch.no_grad()
def sums_from_hidden(
    model, dense_hidden: Tensor, policy_hidden: Tensor, input_ids: Tensor, score_from: int, chunk: int = 256
) -> Sums:
    lo, hi = score_range(input_ids.numel(), score_from)
    ids = input_ids.view(-1)
    total = Sums()
    for a in range(lo, hi, chunk):
        b = min(hi, a + chunk)
        dl = logits_of(model, dense_hidden[a:b])
        pl = dl if policy_hidden is dense_hidden else logits_of(model, policy_hidden[a:b])
        total = total.add(sums_from_logits(dl, pl, ids[a + 1 : b + 1]))
    return total


@torch.no_grad()
def teacher_forced(
    model,
    input_ids: Tensor,
    policy: str,
    budget: EvictionConfig,
    *,
    score_from: int | None = None,
    dense: DenseCache | None = None,
    policy_kwargs: dict | None = None,
) -> dict:
    """Teacher-forced metrics of one document (1-D ids) under ``policy`` at ``budget``.

    Scored positions are ``p >= score_from`` (default ``budget.budget``: the first position at
    which the cache has had to evict); when that leaves nothing to score (budget >= length), every
    position is scored, and the policy equals dense there. Returns the metrics dict of
    :meth:`Sums.metrics` plus ``scored_from`` and the policy's ``wall_s``.
    """
    import time

    input_ids = input_ids.view(-1).cpu()
    S = input_ids.numel()
    if S < 2:
        raise ValueError("a document needs at least 2 tokens")
    start = budget.budget if score_from is None else score_from
    if start >= S - 1:
        start = 0
    dense = dense if dense is not None else DenseCache()
    dh, _ = dense.get(model, input_ids)
    t0 = time.perf_counter()
    if policy == DENSE:
        ph = dh
    else:
        cache = policy_cache(model, policy, input_ids, budget, **(policy_kwargs or {}))
        ph = hidden_states(model, input_ids, cache)
    sums = sums_from_hidden(model, dh, ph, input_ids, start)
    out = sums.metrics()
    out.update(scored_from=start, wall_s=time.perf_counter() - t0)
    out["_sums"] = sums
    return out


# ------------------------------------------------------------------------------ per-position statistics


@torch.no_grad()
def dense_logprobs(model, dense_hidden: Tensor, lo: int, hi: int, chunk: int = 256) -> Tensor:
    """float64 log-softmax ``[hi - lo, V]`` of the dense logits at positions ``[lo, hi)`` (kept per
    document so that each policy's metrics need one LM-head pass, not two)."""
    parts = [F.log_softmax(logits_of(model, dense_hidden[a : min(hi, a + chunk)]).double(), -1)
             for a in range(lo, hi, chunk)]  # fmt: skip
    return torch.cat(parts) if parts else torch.zeros(0, 0, dtype=torch.float64)


@torch.no_grad()
def position_stats(
    model, dense_hidden: Tensor, policy_hidden: Tensor, input_ids: Tensor, lo: int, hi: int, chunk: int = 256,
    dense_logp: Tensor | None = None, dense_lo: int = 0,
) -> dict[str, Tensor]:  # fmt: skip
    """Per position ``p`` in ``[lo, hi)`` (position ``p`` predicts token ``p + 1``), float64 vectors:
    ``nll_dense``, ``nll_policy``, ``kl`` (KL(dense || policy)) and ``top1`` (argmax agreement).
    ``dense_logp``: :func:`dense_logprobs` from position ``dense_lo`` (covering ``[lo, hi)``), else computed."""
    ids = input_ids.view(-1)
    same = policy_hidden is dense_hidden
    parts: dict[str, list[Tensor]] = {"nll_dense": [], "nll_policy": [], "kl": [], "top1": []}
    for a in range(lo, hi, chunk):
        b = min(hi, a + chunk)
        if dense_logp is not None:
            ld = dense_logp[a - dense_lo : b - dense_lo]
        else:
            ld = F.log_softmax(logits_of(model, dense_hidden[a:b]).double(), -1)
        lp = ld if same else F.log_softmax(logits_of(model, policy_hidden[a:b]).double(), -1)
        t = ids[a + 1 : b + 1].view(-1, 1).to(ld.device)
        parts["nll_dense"].append(-ld.gather(1, t)[:, 0].cpu())
        parts["nll_policy"].append(-lp.gather(1, t)[:, 0].cpu())
        parts["kl"].append(torch.zeros(b - a, dtype=torch.float64) if same else (ld.exp() * (ld - lp)).sum(-1).cpu())
        parts["top1"].append(torch.ones(b - a, dtype=torch.float64) if same
                             else (ld.argmax(-1) == lp.argmax(-1)).double().cpu())  # fmt: skip
    empty = torch.zeros(0, dtype=torch.float64)
    return {k: torch.cat(v) if v else empty for k, v in parts.items()}


def sums_over(stats: dict[str, Tensor], mask: Tensor | None = None) -> Sums:
    """:class:`Sums` of :func:`position_stats` over the positions where ``mask`` is true (all if None)."""

    def s(name: str) -> float:
        v = stats[name]
        return float(v.sum() if mask is None else v[mask].sum())

    n = int(stats["nll_dense"].numel() if mask is None else mask.sum())
    return Sums(n, s("nll_dense"), s("nll_policy"), s("kl"), s("top1"))


@torch.no_grad()
def nll_positions(model, hidden: Tensor, input_ids: Tensor, lo: int, hi: int, chunk: int = 256) -> Tensor:
    """Per-position NLL (float64) of ``hidden`` ``[S, H]`` predicting ``input_ids[p + 1]``, ``p`` in ``[lo, hi)``."""
    ids = input_ids.view(-1)
    out = []
    for a in range(lo, hi, chunk):
        b = min(hi, a + chunk)
        lp = F.log_softmax(logits_of(model, hidden[a:b]).double(), -1)
        out.append(-lp.gather(1, ids[a + 1 : b + 1].view(-1, 1).to(lp.device))[:, 0].cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def window_only_hidden(model, input_ids: Tensor, sinks: int, window: int) -> Tensor:
    """Final hidden states ``[S, H]`` of a dense forward in which every position sees only the
    ``sinks`` first tokens and its ``window`` most recent ones (a sliding-window causal mask with
    attention sinks, ``kvpop.mask.masked_eviction`` with ``k = 0``, no cache).

    The sinks matter: without them SmolLM2-135M loses its attention sink and a window of 512
    raised the NLL of 45% of the tokens of a 4,096-token essay by more than 0.5 nats (7.8% with
    4 sinks), which would flag nearly every token as long-range."""
    from ..mask import masked_eviction

    dec, _ = _decoder_and_head(model)
    if dec is None:
        raise RuntimeError("model has no get_decoder(); cannot evaluate")
    ids = input_ids.view(1, -1).to(model.device)
    with masked_eviction(model, None, sinks=sinks, window=window, k=0):
        return dec(input_ids=ids, use_cache=False).last_hidden_state[0]


def build_cache(model, name: str, budget: int, *, sinks: int = 4, window: int | None = None,
                oracle: dict[int, list[Tensor]] | None = None, lam: float | None = None,
                **policy_kwargs) -> KVpopCache | None:  # fmt: skip
    """The cache of policy ``name`` at ``budget`` slots per KV head (``None`` for dense).

    ``window=None`` is passed through to :func:`kvpop.make_cache`, so every policy gets its own
    default (StreamingLLM: ``sinks`` + a window of the rest of the budget); the resolved layout is
    ``cache.eviction``. ``oracle``: ``{window: targets}`` (:func:`oracle_targets_multi`) holding the
    oracle's window (``EvictionConfig.from_budget(budget, window=window, sinks=sinks).window``).
    Anything that keeps the policy from being built is raised as :class:`PolicyUnavailable`.
    """
    reason = policy_available(name)
    if reason is not None:
        raise PolicyUnavailable(reason)
    if name == DENSE:
        return None
    try:
        if name == ORACLE:
            from ..policies.oracle import OraclePolicy

            ev = EvictionConfig.from_budget(budget, window=window, sinks=sinks, lam=lam or 0.0)
            if oracle is None or ev.window not in oracle:
                raise PolicyUnavailable(f"oracle needs the targets of window {ev.window} (the whole sequence in advance)")
            return make_cache(model, OraclePolicy(oracle[ev.window]), eviction=ev)
        return make_cache(model, name, budget=budget, window=window, sinks=sinks, lam=lam, **policy_kwargs)
    except PolicyUnavailable:
        raise
    except (TypeError, ValueError, KeyError, OSError, RuntimeError) as exc:
        raise PolicyUnavailable(f"cannot build policy {name!r}: {exc}") from exc


def oracle_window(budget: int, sinks: int, window: int | None) -> int:
    return EvictionConfig.from_budget(budget, window=window, sinks=sinks).window
