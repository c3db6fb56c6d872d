"""Retention under the real cache: the one quality probe that ``kvpop train``, ``kvpop adapt``,
``kvpop eval`` and ``kvpop compare-adapted`` call.

A document goes through the model in ONE forward with a fresh cache from :func:`kvpop.make_cache`
(the chunked prefill equals feeding it token by token), and the model's next-token predictions are
scored against a *reference*'s dense predictions of the same document: the same model without a
cache, or, for an adapted model, the base model. Two tasks come from that one forward:

* ``lm``: every position ``p >= B`` (position ``p`` predicts token ``p + 1``), from where the cache
  has had to evict; every position when ``B`` leaves none (the policy equals dense there);
* ``continuation``: the last ``n`` predictions (``n = S / 16`` by default: 256 of a 4,096-token
  document), a continuation after a long context.

The statistics are additive (:class:`Sums`: scored tokens, reference and policy NLL, KL(reference
|| policy), top-1 agreement), so documents pool exactly; retention is ``ppl_reference /
ppl_policy``. Hidden states are kept and the LM head runs :data:`CHUNK` positions at a time, so
memory stays ``O(S * hidden)``, not ``O(S * vocab)``. Per-document wins against another policy
(StreamingLLM) compare retentions of the same document (:func:`wins`).

* :func:`score_document` -- one document's per-position statistics and its two tasks;
* :class:`Probe` -- a set of documents with their reference outputs, scored under a policy at a
  budget (:class:`Scores`: pooled, per document).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..cache import make_cache
from ..compat import cache_kwargs

__all__ = [
    "CHUNK",
    "DenseOutputs",
    "DocumentScore",
    "Probe",
    "Scores",
    "Sums",
    "compare",
    "continuation_start",
    "decoder_and_head",
    "default_continuation_tokens",
    "dense_logprobs",
    "doc_key",
    "hidden_states",
    "lm_start",
    "logits_of",
    "position_stats",
    "score_document",
    "sums_from_logits",
    "sums_over",
    "tally",
    "wins",
]

CHUNK = 256  # positions per LM-head call


# ------------------------------------------------------------------------------ forward passes


def decoder_and_head(model) -> tuple:
    """``(decoder, lm_head)`` of a causal LM (``(None, None)`` when it has no such parts)."""
    get_dec = getattr(model, "get_decoder", None)
    dec = get_dec() if get_dec is not None else None
    head = model.get_output_embeddings()
    if dec is None or head is None:
        return None, None
    return dec, head


@torch.no_grad()
def hidden_states(model, input_ids: Tensor, cache=None) -> Tensor:
    """Final hidden states ``[S, hidden]`` of one document (1-D ids), in one forward (``cache``: the
    bounded cache to run under; ``None``: dense)."""
    ids = input_ids.view(1, -1).to(model.device)
    dec, _ = decoder_and_head(model)
    if dec is None:
        raise RuntimeError("model has no get_decoder()/get_output_embeddings(); cannot evaluate")
    out = dec(input_ids=ids, **cache_kwargs(cache), use_cache=cache is not None)
    return out.last_hidden_state[0]


def logits_of(model, hidden: Tensor) -> Tensor:
    _, head = decoder_and_head(model)
    return head(hidden).float()


def doc_key(input_ids: Tensor) -> str:
    """A document's identity: the SHA-1 of its token ids."""
    ids = input_ids.detach().to("cpu", torch.long).contiguous().view(-1)
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()


class DenseOutputs:
    """Dense results per document (final hidden states and greedy generations, not a KV cache), shared by
    all policies and budgets.

    Hidden states of a prefix of a stored document are a slice of the stored ones (causal
    model), so a continuation / agreement prompt cut from an LM document costs no new forward.
    Dense greedy generations are kept too (:meth:`generation`).
    """

    def __init__(self) -> None:
        self._store: dict[str, tuple[Tensor, Tensor, float]] = {}  # key -> (ids, hidden, wall)
        self._gen: dict[tuple, Tensor] = {}
        self.wall_s = 0.0

    def put(self, input_ids: Tensor, hidden: Tensor, wall: float = 0.0) -> None:
        """Keep a document's dense hidden states computed elsewhere (e.g. read back from disk)."""
        ids = input_ids.view(-1).cpu()
        self._store[doc_key(ids)] = (ids, hidden, wall)

    def get(self, model, input_ids: Tensor) -> tuple[Tensor, float]:
        """``(hidden [S, H], wall seconds of the dense forward)``."""
        ids = input_ids.view(-1).cpu()
        key = doc_key(ids)
        if key in self._store:
            return self._store[key][1], self._store[key][2]
        for full, h, _ in self._store.values():
            if full.numel() >= ids.numel() and torch.equal(full[: ids.numel()], ids):
                return h[: ids.numel()], 0.0
        t0 = time.perf_counter()
        h = hidden_states(model, ids, None)
        wall = time.perf_counter() - t0
        self.wall_s += wall
        self._store[key] = (ids, h, wall)
        return h, wall

    def generation(self, key: tuple, make) -> Tensor:
        if key not in self._gen:
            t0 = time.perf_counter()
            self._gen[key] = make()
            self.wall_s += time.perf_counter() - t0
        return self._gen[key]

    def __len__(self) -> int:
        return len(self._store)


# ------------------------------------------------------------------------------ statistics


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

    @staticmethod
    def pool(parts) -> Sums:
        total = Sums()
        for s in parts:
            total = total.add(s)
        return total

    def metrics(self) -> dict:
        """nll (per token), ppl, retention = ppl_dense / ppl_policy, mean KL(dense||policy), top-1 agreement."""
        if self.n == 0:
            nan = float("nan")
            return {
                "n_tokens": 0,
                "nll_dense": nan,
                "nll_policy": nan,
                "ppl_dense": nan,
                "ppl_policy": nan,
                "retention": nan,
                "kl": nan,
                "top1_agreement": nan,
            }
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

    @property
    def retention(self) -> float:
        return self.metrics()["retention"]


def _stats(ld: Tensor, lp: Tensor, targets: Tensor, same: bool) -> dict[str, Tensor]:
    """Per-position float64 statistics from reference and policy log-probabilities ``[n, V]``."""
    t = targets.view(-1, 1).to(ld.device)
    n = t.shape[0]
    return {
        "nll_dense": -ld.gather(1, t)[:, 0].cpu(),
        "nll_policy": -lp.gather(1, t)[:, 0].cpu(),
        "kl": torch.zeros(n, dtype=torch.float64) if same else (ld.exp() * (ld - lp)).sum(-1).cpu(),
        "top1": torch.ones(n, dtype=torch.float64) if same else (ld.argmax(-1) == lp.argmax(-1)).double().cpu(),
    }


def sums_over(stats: dict[str, Tensor], mask: Tensor | None = None) -> Sums:
    """:class:`Sums` of per-position statistics over the positions where ``mask`` is true (all if None)."""

    def s(name: str) -> float:
        v = stats[name]
        return float(v.sum() if mask is None else v[mask].sum())

    n = int(stats["nll_dense"].numel() if mask is None else mask.sum())
    return Sums(n, s("nll_dense"), s("nll_policy"), s("kl"), s("top1"))


def sums_from_logits(dense_logits: Tensor, policy_logits: Tensor, targets: Tensor) -> Sums:
    """Sums over positions: ``*_logits [n, V]`` predict ``targets [n]``."""
    ld = F.log_softmax(dense_logits.double(), -1)
    same = policy_logits is dense_logits
    lp = ld if same else F.log_softmax(policy_logits.double(), -1)
    return sums_over(_stats(ld, lp, targets, same))


@torch.no_grad()
def dense_logprobs(model, dense_hidden: Tensor, lo: int, hi: int, chunk: int = CHUNK) -> Tensor:
    """float64 log-softmax ``[hi - lo, V]`` of the dense logits at positions ``[lo, hi)`` (kept per
    document so that each policy's metrics need one LM-head pass, not two)."""
    parts = [
        F.log_softmax(logits_of(model, dense_hidden[a : min(hi, a + chunk)]).double(), -1) for a in range(lo, hi, chunk)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, 0, dtype=torch.float64)


@torch.no_grad()
def position_stats(
    model,
    dense_hidden: Tensor,
    policy_hidden: Tensor,
    input_ids: Tensor,
    lo: int,
    hi: int,
    chunk: int = CHUNK,
    dense_logp: Tensor | None = None,
    dense_lo: int = 0,
) -> dict[str, Tensor]:
    """Per position ``p`` in ``[lo, hi)`` (position ``p`` predicts token ``p + 1``), float64 vectors:
    ``nll_dense``, ``nll_policy``, ``kl`` (KL(dense || policy)) and ``top1`` (argmax agreement);
    ``model``'s LM head scores both hidden states. ``dense_logp``: :func:`dense_logprobs` from position
    ``dense_lo`` (covering ``[lo, hi)``), else computed."""
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
        for k, v in _stats(ld, lp, ids[a + 1 : b + 1], same).items():
            parts[k].append(v)
    empty = torch.zeros(0, dtype=torch.float64)
    return {k: torch.cat(v) if v else empty for k, v in parts.items()}


# ------------------------------------------------------------------------------ one document


def lm_start(seq_len: int, budget: int) -> int:
    """First scored position of ``lm``: ``B`` (the cache has had to evict from there on), or 0 when
    ``B`` leaves no prediction to score (the policy equals dense there)."""
    return budget if budget < seq_len - 1 else 0


def default_continuation_tokens(seq_len: int) -> int:
    """``seq_len / 16`` predictions (256 of a 4,096-token document), at least one."""
    return max(1, seq_len // 16)


def continuation_start(seq_len: int, tokens: int) -> int:
    """First scored position of ``continuation``: the last ``tokens`` predictions."""
    return max(0, seq_len - 1 - tokens)


@dataclass
class DocumentScore:
    """Per-position statistics of one document from position ``lo`` (:func:`position_stats`), and
    where its two tasks start."""

    lo: int
    stats: dict[str, Tensor]
    lm_from: int
    continuation_from: int

    @property
    def positions(self) -> Tensor:
        return torch.arange(self.lo, self.lo + self.stats["nll_dense"].numel())

    def sums(self, start: int, mask: Tensor | None = None) -> Sums:
        """Positions ``>= start`` (and, with ``mask`` over :attr:`positions`, where it is true)."""
        keep = self.positions >= start
        return sums_over(self.stats, keep if mask is None else keep & mask)

    @property
    def lm(self) -> Sums:
        return self.sums(self.lm_from)

    @property
    def continuation(self) -> Sums:
        return self.sums(self.continuation_from)


@torch.no_grad()
def score_document(
    model,
    input_ids: Tensor,
    reference_hidden: Tensor,
    hidden: Tensor,
    budget: int,
    continuation_tokens: int | None = None,
    *,
    dense_logp: Tensor | None = None,
    dense_lo: int = 0,
) -> DocumentScore:
    """One document's ``lm`` (from :func:`lm_start`) and ``continuation`` (the last
    ``continuation_tokens`` predictions, default :func:`default_continuation_tokens`) from its hidden
    states under a policy (``hidden``) against the reference's (``reference_hidden``), ``model``'s LM
    head scoring both. ``budget=0`` scores every position (a dense run against the reference)."""
    S = input_ids.numel()
    n = default_continuation_tokens(S) if continuation_tokens is None else continuation_tokens
    lm_from, cont_from = lm_start(S, budget), continuation_start(S, n)
    lo = min(lm_from, cont_from)
    stats = position_stats(
        model, reference_hidden, hidden, input_ids, lo, S - 1, dense_logp=dense_logp, dense_lo=dense_lo
    )
    return DocumentScore(lo, stats, lm_from, cont_from)


# ------------------------------------------------------------------------------ wins


def compare(a: float | None, b: float | None, tol: float = 1e-9) -> int | None:
    """+1 if ``a`` is better (higher) than ``b``, -1 if worse, 0 if equal within ``tol`` (relative)."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    if abs(a - b) <= tol * max(1.0, abs(a), abs(b)):
        return 0
    return 1 if a > b else -1


def tally(outcomes) -> dict[str, int]:
    """Wins, losses and ties of :func:`compare` outcomes (``None``, a missing pair, is left out of ``n``)."""
    o = [x for x in outcomes if x is not None]
    return {"wins": o.count(1), "losses": o.count(-1), "ties": o.count(0), "n": len(o)}


def wins(mine, theirs) -> dict[str, int]:
    """Per-item wins, losses and ties of ``mine`` against ``theirs`` (paired values, higher is better)."""
    return tally(compare(a, b) for a, b in zip(mine, theirs, strict=True))


# ------------------------------------------------------------------------------ a set of documents


@dataclass
class Scores:
    """One policy at one budget over a probe's documents."""

    labels: list[str]
    docs: list[DocumentScore]

    def lm(self, start: int | None = None) -> Sums:
        """``lm`` pooled over the documents (``start``: from that position instead, e.g. a dense run
        scored from each budget)."""
        return Sums.pool(d.lm if start is None else d.sums(start) for d in self.docs)

    def continuation(self) -> Sums:
        return Sums.pool(d.continuation for d in self.docs)

    def per_doc(self, task: str = "lm") -> list[float]:
        return [getattr(d, task).retention for d in self.docs]

    def per_doc_rows(self, key: str = "corpus") -> list[dict]:
        """One row per document, ``{key: label, "retention": lm, "continuation": continuation}``."""
        return [
            {key: label, "retention": lm, "continuation": cont}
            for label, lm, cont in zip(self.labels, self.per_doc("lm"), self.per_doc("continuation"), strict=True)
        ]


class Probe:
    """Documents and their reference outputs; :meth:`score` runs a model under a policy on each.

    ``docs``: ``(label, ids)`` pairs (1-D ids). ``reference``: a function from a document's ids to the
    reference's dense hidden states (computed once per document, on first use). ``continuation_tokens``:
    a function of the document length (default :func:`default_continuation_tokens`).
    """

    def __init__(
        self,
        docs: list[tuple[str, Tensor]],
        reference: Callable[[Tensor], Tensor],
        continuation_tokens: Callable[[int], int] = default_continuation_tokens,
    ) -> None:
        self.docs = [(label, ids.view(-1).cpu()) for label, ids in docs]
        self.reference = reference
        self.continuation_tokens = continuation_tokens
        self._ref: list[Tensor | None] = [None] * len(self.docs)

    def reference_hidden(self, i: int) -> Tensor:
        if self._ref[i] is None:
            self._ref[i] = self.reference(self.docs[i][1])
        return self._ref[i]

    @torch.no_grad()
    def score(self, model, policy, budget: int, *, progress: str | None = None, **cache_kwargs) -> Scores:
        """Every document through ``model`` under ``policy`` (a name or a :class:`kvpop.Policy`; ``None``:
        dense, scored from position 0 with ``budget=0``) at ``budget`` slots per KV head
        (``cache_kwargs``: ``window``, ``sinks``, ``lam`` for :func:`kvpop.make_cache`), scored by
        ``model``'s LM head against the reference. ``progress``: the label of a progress bar over the
        documents (a validation pass can take half an hour on a CPU), none if ``None``."""
        out = []
        docs = tqdm(self.docs, desc=progress, leave=False, disable=progress is None)
        for i, (_, ids) in enumerate(docs):
            cache = None if policy is None else make_cache(model, policy, budget=budget, **cache_kwargs)
            hidden = hidden_states(model, ids, cache)
            out.append(
                score_document(
                    model, ids, self.reference_hidden(i), hidden, budget, self.continuation_tokens(ids.numel())
                )
            )
        return Scores([label for label, _ in self.docs], out)
