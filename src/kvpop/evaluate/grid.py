"""Items, units and their execution: what one ``kvpop eval`` process runs.

An *item* is one document (teacher-forced ``lm`` + ``continuation``), one needle case, one
multi-key case or one agreement prompt; a *unit* is (item, policy, budget). What several
policies of an item share (the dense forward, the window-only dense forward of each budget for
the long-dependency tokens, the oracle's captured targets for every window, the dense greedy
answer) is computed once per process in :class:`ItemContext`, so a shard takes whole items. With
an output folder it is also kept on disk until the item's last unit is recorded, so a run stopped
mid-item (``--time-limit``, a kill) resumes without recomputing it (at 32k tokens on Gemma 3 the
dense and window-only runs alone take ~30 min on one core).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..checkpoint import default_scorer_path
from ..config import TrainedSettings, resolve_eviction
from ..files import atomic_write
from ..names import POLICY_TO_KIND
from ..policies import Policy
from .core import (
    DENSE,
    ORACLE,
    PolicyUnavailable,
    build_cache,
    cache_record,
    nll_positions,
    oracle_targets_multi,
    policy_available,
    window_only_hidden,
)
from .quality import continuation_start, dense_logprobs, doc_key, hidden_states, lm_start, score_document
from .stats import sums_to_dict
from .store import unit_key
from .tasks import agreement_result, greedy, multikey_result, needle_result

LOGP_CACHE_BYTES = 2 << 30  # dense log-probs of a document kept in float64 up to this size (4k tokens: 1.5 GB)
SHARED_DIR = "shared"  # an output folder's subfolder of shared runs (SharedStore) of unfinished items
GEN_TOKENS = {"needle": 24, "multikey": 24}  # greedy answer length (digits are single tokens in SmolLM2)


@dataclass
class Item:
    kind: str  # "doc" | "needle" | "multikey" | "agreement"
    source: str  # corpus / user source / filler name
    domain: str
    index: str
    ids: Tensor  # the document, or the prompt
    case: object = None  # NeedleCase / MultiKeyCase
    sha1: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.ids = self.ids.view(-1).cpu()
        self.sha1 = doc_key(self.ids)

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.source}/{self.index}"


@dataclass
class Settings:
    """What a unit's result depends on besides the item, policy and budget."""

    sinks: int = 4
    window: int | None = None
    window_fraction: float | None = None  # window = round(fraction * B), room left for the sinks (when window is None)
    lam: float | None = None  # recency tilt for every policy (None: each policy's own)
    longdep_threshold: float = 0.5
    continuation_tokens: int = 256
    agreement_tokens: int = 256
    reference_length: int = 4096
    budgets: tuple[int, ...] = ()  # every budget of the run (the oracle captures all windows at once)
    policy_kwargs: dict = field(default_factory=dict)
    # policy instances by (name, scorer file), each made once per run: a learned scorer's checkpoint is read
    # and the model's weights hashed once per file, not once per unit (a cache built from an instance does neither)
    resolved: dict = field(default_factory=dict, repr=False, compare=False)
    picked: dict = field(default_factory=dict, repr=False, compare=False)  # (name, budget) -> its scorer file

    def policy(self, model, name: str, budget: int) -> str | Policy:
        """Policy ``name`` for :func:`kvpop.evaluate.core.build_cache`: the instance its first cache resolved
        (with ``policy_kwargs[name]``; one per shipped scorer file, since the budget picks among a model's
        shipped scorers), the name itself for dense and the oracle (built per item)."""
        if name in (DENSE, ORACLE) or policy_available(name) is not None:
            return name
        if (name, budget) not in self.picked:
            self.picked[name, budget] = self.scorer_file(model, name, budget)
        key = (name, self.picked[name, budget])
        if key not in self.resolved:
            self.resolved[key] = build_cache(
                model,
                name,
                budget,
                sinks=self.sinks,
                window=self.window_for(budget),
                lam=self.lam,
                **self.policy_kwargs.get(name, {}),
            ).policy
        return self.resolved[key]

    def scorer_file(self, model, name: str, budget: int) -> Path | None:
        """The shipped scorer a learned policy given no file reads at ``budget`` (None: not a learned policy,
        or given its scorer)."""
        kind = POLICY_TO_KIND.get(name)
        given = self.policy_kwargs.get(name) or {}
        if kind is None or given.get("path") is not None or given.get("scorer") is not None:
            return None
        try:
            return default_scorer_path(kind, getattr(model, "config", None), budget=budget)
        except (ValueError, FileNotFoundError):
            return None

    def cache(self, model, name: str, budget: int | None, oracle=None):
        """The cache of policy ``name`` at ``budget`` under these settings (``None`` for dense): the instance
        :meth:`policy` resolved; ``oracle``: the oracle's targets (:func:`kvpop.evaluate.core.build_cache`)."""
        return build_cache(
            model,
            self.policy(model, name, budget),
            budget,
            sinks=self.sinks,
            window=self.window_for(budget),
            oracle=oracle,
            lam=self.lam,
        )

    def window_for(self, budget: int) -> int | None:
        """The protected window of every policy at ``budget``: ``window``, else the one resolver's rule at
        ``window_fraction`` of ``B`` (leaving room for the sinks); None: each policy's own default."""
        if self.window is None and self.window_fraction is None:
            return None
        return TrainedSettings(window=self.window, window_fraction=self.window_fraction).window_at(budget, self.sinks)


def available_policies(model, names, settings: Settings, budget: int) -> tuple[list[str], dict[str, str]]:
    """(available, {unavailable: reason}): each of ``names`` built once for ``model`` at ``budget`` under
    ``settings`` (:meth:`Settings.policy`: a learned scorer checks it was trained for this model), before
    any long work."""
    ok, bad = [], {}
    for p in dict.fromkeys(names):
        reason = policy_available(p)
        if reason is None and p not in (DENSE, ORACLE):
            try:
                settings.policy(model, p, budget)
            except PolicyUnavailable as exc:
                reason = str(exc)
        if reason is None:
            ok.append(p)
        else:
            bad[p] = reason
    return ok, bad


def units_of(item: Item, policies, budgets) -> list[tuple[str, int | None]]:
    """(policy, budget) pairs of an item; dense once (no budget) for generation tasks."""
    out = []
    for p in policies:
        if p == DENSE and item.kind != "doc":
            out.append((p, None))
        else:
            out += [(p, b) for b in budgets]
    return out


def partition(items: list[Item], costs: list[float], n: int) -> list[int]:
    """Shard (0-based) of each item: longest first onto the least loaded shard, deterministic."""
    order = sorted(range(len(items)), key=lambda i: (-costs[i], items[i].id))
    load = [0.0] * n
    shard = [0] * len(items)
    for i in order:
        s = min(range(n), key=lambda j: (load[j], j))
        shard[i] = s
        load[s] += costs[i]
    return shard


# CPU seconds per token (one thread), measured on SmolLM2-135M with 4,096-token documents on the
# development machine: the forward under any eviction policy (15-20 s), the dense forward, the
# window-only run, the oracle's capture of three windows, and the metrics (LM head, log-softmax,
# KL over the vocabulary) per scored position; greedy answers cost ~0.055 s per token.
# "policy_per_slot": the forward under a policy also grows with the budget (attention over B cached
# keys per token), fitted to committed unit times: 4,096-token documents at B = 256 / 1,024 (~24 /
# ~45 s, results/grid/kvpop-mlp-1M) and 8,000-token ones at B = 384 / 2,048 (~65-110 / ~180-390 s,
# results/grid8k's H2O, TOVA and SnapKV, the spread from the machine's load), where a per-token
# constant alone estimated a seventh to a half of what the 8,000-token units took.
CPU_S_PER_TOKEN = {
    "policy": 4.1e-3,
    "policy_per_slot": 7e-6,
    "dense": 4.0e-3,
    "window": 3.2e-3,
    "capture": 9.6e-3,
    "metrics": 1.7e-3,
    "dense_logp": 1.4e-3,
}
CPU_S_PER_NEW_TOKEN = 0.055


def item_cost(item: Item, units: list[tuple[str, int | None]], settings: Settings | None = None) -> float:
    """Rough CPU seconds of an item's units and shared runs (the constants above): balances shards,
    and ``kvpop eval --dry-run`` prints it."""
    c = CPU_S_PER_TOKEN
    S = item.ids.numel()
    policies = {p for p, _ in units}
    budgets = {b for _, b in units if b is not None}
    n_new = GEN_TOKENS.get(item.kind, settings.agreement_tokens if settings else 256)
    cost = S * c["dense"]
    if ORACLE in policies:
        cost += S * c["capture"]
    if item.kind == "doc":
        cost += S * (c["window"] * len(budgets) + c["dense_logp"])
    else:
        cost += n_new * CPU_S_PER_NEW_TOKEN
    for p, b in units:
        if item.kind == "doc":
            cost += (S - min(b, S - 1)) * c["metrics"] * (0.3 if p == DENSE else 1.0)
        elif p != DENSE:
            cost += n_new * CPU_S_PER_NEW_TOKEN
        if p != DENSE:
            cost += S * (c["policy"] + c["policy_per_slot"] * min(b if b is not None else S, S))
    return cost


class SharedStore:
    """The shared runs of one item on disk (``folder/<kind>-<sha1 of its tokens>/``), each tensor file
    written atomically; the output folder's fingerprint already fixes the model and settings. Removed
    with :meth:`drop` once the item is done."""

    def __init__(self, folder: str | Path, item: Item) -> None:
        self.dir = Path(folder) / f"{item.kind}-{item.sha1}"

    def get(self, name: str) -> dict[str, Tensor] | None:
        """The stored run, or None when absent or unreadable (damaged: it is a cache, computed again)."""
        f = self.dir / f"{name}.safetensors"
        if not f.exists():
            return None
        try:
            return load_file(str(f))
        except (SafetensorError, OSError):
            f.unlink(missing_ok=True)
            return None

    def put(self, name: str, tensors: dict[str, Tensor]) -> None:
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        atomic_write(self.dir / f"{name}.safetensors", lambda tmp: save_file(tensors, tmp))

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class ItemContext:
    """What the units of one item share, computed on first use (and read from / written to ``shared``,
    a :class:`SharedStore`, when given)."""

    def __init__(self, model, tokenizer, item: Item, settings: Settings, shared: SharedStore | None = None) -> None:
        self.model, self.tokenizer, self.item, self.s = model, tokenizer, item, settings
        self.shared = shared
        self._dense_hidden: Tensor | None = None
        self._dense_logp: tuple[int, Tensor] | None = None
        self._window_nll: dict[int, Tensor] = {}
        self._oracle: dict[int, list[Tensor]] | None = None
        self._dense_new: Tensor | None = None
        self.shared_wall_s = 0.0

    def _timed(self, fn):
        t0 = time.perf_counter()
        out = fn()
        self.shared_wall_s += time.perf_counter() - t0
        return out

    def _kept(self, name: str, compute, device=None) -> dict[str, Tensor]:
        """``compute()`` (a dict of tensors, timed as shared work), or what an earlier process stored
        (moved to ``device``, where ``compute`` leaves them)."""
        if self.shared is not None and (got := self.shared.get(name)) is not None:
            return got if device is None else {k: v.to(device) for k, v in got.items()}
        out = self._timed(compute)
        if self.shared is not None:
            self.shared.put(name, out)
        return out

    def dense_hidden(self) -> Tensor:
        if self._dense_hidden is None:
            self._dense_hidden = self._kept(
                "dense_hidden", lambda: {"h": hidden_states(self.model, self.item.ids, None)}, self.model.device
            )["h"]
        return self._dense_hidden

    def dense_logp(self, lo: int, hi: int) -> tuple[int, Tensor | None]:
        """(first position, dense log-probs from it to ``hi``), kept for the item when it fits in
        :data:`LOGP_CACHE_BYTES`; it starts at the lowest position any budget of the run scores."""
        if self._dense_logp is None or self._dense_logp[0] > lo:
            first = min([lo, *(min(b, hi) for b in self.s.budgets), max(0, hi - self.s.continuation_tokens)])
            if (hi - first) * self.model.config.vocab_size * 8 > LOGP_CACHE_BYTES:
                return lo, None
            self._dense_logp = (first, self._timed(lambda: dense_logprobs(self.model, self.dense_hidden(), first, hi)))
        return self._dense_logp

    def window_nll(self, budget: int) -> Tensor:
        """NLL at every position ``[0, S - 1)`` of the window-only dense run: sinks + the last
        ``budget - sinks`` tokens (the context StreamingLLM keeps at this budget)."""
        if budget not in self._window_nll:
            ids = self.item.ids
            sinks = min(self.s.sinks, budget - 1)

            def run():
                h = window_only_hidden(self.model, ids, sinks, budget - sinks)
                return {"nll": nll_positions(self.model, h, ids, 0, ids.numel() - 1)}

            self._window_nll[budget] = self._kept(f"window_nll-s{sinks}-b{budget}", run)["nll"]
        return self._window_nll[budget]

    def sequence(self) -> Tensor:
        """The whole sequence the cache will see (the oracle's capture): the document, or prompt + dense answer."""
        if self.item.kind == "doc":
            return self.item.ids
        return torch.cat([self.item.ids, self.dense_new()])

    def oracle(self) -> dict[int, list[Tensor]]:
        if self._oracle is None:
            windows = sorted(
                {resolve_eviction(b, sinks=self.s.sinks, window=self.s.window_for(b)).window for b in self.s.budgets}
            )

            def run():
                t = oracle_targets_multi(self.model, self.sequence(), windows)
                return {f"w{w}.l{i}": x for w, xs in t.items() for i, x in enumerate(xs)}

            flat = self._kept("oracle-" + "-".join(map(str, windows)), run, self.model.device)
            n = len(flat) // len(windows)
            self._oracle = {w: [flat[f"w{w}.l{i}"] for i in range(n)] for w in windows}
        return self._oracle

    def n_new(self) -> tuple[int, bool]:
        if self.item.kind == "agreement":
            return self.s.agreement_tokens, True
        return GEN_TOKENS[self.item.kind], False

    def dense_new(self) -> Tensor:
        if self._dense_new is None:
            n, force = self.n_new()
            self._dense_new = self._kept(
                f"dense_new-{n}", lambda: {"ids": greedy(self.model, self.tokenizer, self.item.ids, n, None, force)}
            )["ids"]
        return self._dense_new

    def cache(self, policy: str, budget: int):
        return self.s.cache(self.model, policy, budget, self.oracle() if policy == ORACLE else None)

    # -------------------------------------------------------------------------- units

    def run(self, policy: str, budget: int | None) -> dict:
        item = self.item
        rec = {
            "key": unit_key(item.id, policy, budget),
            "kind": item.kind,
            "item_id": item.id,
            "source": item.source,
            "domain": item.domain,
            "item": item.index,
            "doc_sha1": item.sha1,
            "tokens": item.ids.numel(),
            "policy": policy,
            "budget": budget,
            "compression": None if budget is None else 1.0 - budget / self.s.reference_length,
            "sinks": None,
            "window": None,
            "k": None,
        }
        shared0 = self.shared_wall_s
        if item.kind == "doc":
            self.dense_hidden()
            self.window_nll(budget)
        else:
            self.dense_new()
        if policy == ORACLE:
            self.oracle()
        rec["shared_wall_s"] = self.shared_wall_s - shared0  # dense / window-only / capture runs done for this unit
        t0 = time.perf_counter()
        cache = None if policy == DENSE else self.cache(policy, budget)
        if cache is not None:
            rec.update(cache_record(cache))
        if item.kind == "doc":
            rec.update(self._doc(cache, budget))
        else:
            if cache is None:
                new = self.dense_new()
            else:
                n, force = self.n_new()
                if policy == ORACLE:  # its targets cover prompt + the dense answer, no further
                    n = min(n, self.dense_new().numel())
                new = greedy(self.model, self.tokenizer, item.ids, n, cache, force)
            if item.kind == "needle":
                rec.update(needle_result(self.tokenizer, item.case, new))
            elif item.kind == "multikey":
                rec.update(multikey_result(self.tokenizer, item.case, new))
            else:
                rec.update(agreement_result(self.dense_new(), new))
        rec["wall_s"] = time.perf_counter() - t0
        return rec

    def _doc(self, cache, budget: int) -> dict:
        """``lm`` and ``continuation`` of the probe (:func:`kvpop.evaluate.quality.score_document`), each over all
        its positions and over the long-dependency tokens (where the full context beats the window-only
        run by more than the threshold)."""
        ids = self.item.ids
        S = ids.numel()
        dh = self.dense_hidden()
        ph = dh if cache is None else hidden_states(self.model, ids, cache)
        lo_all, lo_cont = lm_start(S, budget), continuation_start(S, self.s.continuation_tokens)
        first, logp = self.dense_logp(min(lo_all, lo_cont), S - 1)
        doc = score_document(
            self.model, ids, dh, ph, budget, self.s.continuation_tokens, dense_logp=logp, dense_lo=first
        )
        gain = self.window_nll(budget)[doc.lo : S - 1] - doc.stats["nll_dense"]
        longdep = gain > self.s.longdep_threshold
        sums = {
            "all": doc.sums(doc.lm_from),
            "longdep": doc.sums(doc.lm_from, longdep),
            "cont": doc.sums(doc.continuation_from),
            "cont_longdep": doc.sums(doc.continuation_from, longdep),
        }
        return {
            "scored_from": doc.lm_from,
            "continuation_from": doc.continuation_from,
            "longdep_threshold": self.s.longdep_threshold,
            "sums": {k: sums_to_dict(v) for k, v in sums.items()},
        }
