"""Quality of an adapted model, always against the BASE model's dense outputs.

The adapted model is a slightly different model, so the number users care about is how close
*adapted + bounded cache* comes to *base + dense*: teacher-forced retention ``ppl_base_dense /
ppl_policy`` and ``KL(base dense || policy)`` under a real :class:`kvpop.KVpopCache`
(:func:`kvpop.make_cache`), over the positions after the budget first filled. Next to it, the
adapted model's own dense retention (how far the adapter moved the model; it should stay within
about 1%).

* :class:`AdaptProbe` -- validation during ``kvpop adapt`` (model selection, ``best/``);
* :class:`Comparison` / :func:`compare_adapted` -- the report table: adapted kvpop, adapted
  streaming, base kvpop, base streaming, adapted dense, from a base model and a bundle, through
  the public API (``kvpop compare-adapted`` runs it over the test splits).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..bundle import load_adapter_bundle, read_bundle_meta
from ..cache import make_cache
from ..checkpoint import load_scorer
from ..config import TrainedSettings, resolve_eviction
from ..evaluate.quality import DocumentScore, Probe, Scores, Sums, hidden_states, score_document
from ..policies import LearnedPolicy
from ..train.data import SequenceSource
from ..train.quality import VALIDATION_SEED
from ..validate import parse_shard
from .config import AdaptConfig
from .lora import base_model

__all__ = ["AdaptProbe", "Comparison", "compare_adapted", "merge_validations"]


def _metrics(sums: Sums) -> dict:
    m = sums.metrics()
    return {k: m[k] for k in ("retention", "kl", "top1_agreement", "ppl_dense", "ppl_policy", "n_tokens")}


def _both_tasks(s: Scores, key: str, windows: list[int] | None = None) -> dict:
    """lm metrics, ``continuation`` metrics and the per-document rows of one policy at one budget.
    With ``windows`` (the validation windows' indices) each row also keeps its index and its additive
    sums, so that shards of a validation pool exactly (:func:`merge_validations`)."""
    rows = s.per_doc_rows(key)
    if windows is not None:
        for row, j, d in zip(rows, windows, s.docs, strict=True):
            row["window"] = j
            row["sums"] = {"lm": asdict(d.lm), "continuation": asdict(d.continuation)}
    return {**_metrics(s.lm()), "continuation": _metrics(s.continuation()), "per_doc": rows}


def merge_validations(parts: list[dict]) -> dict:
    """One validation from the validations of disjoint shards of the same windows (each made by an
    :class:`AdaptProbe` with ``shard=``): every window's sums pooled in window order, so the result is
    what one unsharded pass reports, to the last bit."""
    if not parts:
        raise ValueError("no validations to merge")
    keys = {k for k in parts[0] if k not in ("mean_retention", "dense")}
    if any({k for k in q if k not in ("mean_retention", "dense")} != keys for q in parts):
        raise ValueError("the validations to merge were made at different budgets")
    budgets = sorted(keys, key=int)
    for q in parts:
        for b in budgets:
            if any("sums" not in r for r in q[b]["per_doc"]):
                raise ValueError("a validation to merge has no per-window sums (made before validations kept them)")
    seen = [r["window"] for q in parts for r in q[budgets[0]]["per_doc"]]
    if len(seen) != len(set(seen)):
        raise ValueError(f"the shards overlap: windows {sorted(j for j in set(seen) if seen.count(j) > 1)} twice")

    def rows(get) -> list[dict]:
        return sorted((r for q in parts for r in get(q)), key=lambda r: r["window"])

    def pool(rs: list[dict], part: str) -> Sums:
        return Sums.pool(Sums(**r["sums"][part]) for r in rs)

    out: dict = {}
    for b in budgets:
        rs = rows(lambda q, b=b: q[b]["per_doc"])
        out[b] = {**_metrics(pool(rs, "lm")), "continuation": _metrics(pool(rs, "continuation")), "per_doc": rs}
    if all("dense" in q for q in parts):
        rs = rows(lambda q: q["dense"]["per_doc"])
        for b in budgets:
            out[b]["dense_retention"] = pool(rs, b).retention
        out["dense"] = {**_metrics(pool(rs, "all")), "per_doc": rs}
    mean = sum(out[b]["retention"] for b in budgets) / len(budgets)
    out["mean_retention"] = mean if math.isfinite(mean) else float("-inf")
    return out


class AdaptProbe:
    """Validation windows (validation split of the training data) and the base model's dense runs.

    Each budget reports ``lm`` (the selection criterion: ``mean_retention`` is its mean over the
    budgets, as in every stored baseline) and ``continuation`` (the last ``S/16`` predictions of each
    window, from the same passes), each with per-window values and sums.

    ``shard=(I, N)``: only windows ``j`` with ``j % N == I - 1`` (the windows go round robin over the
    corpora, so each shard spans them); :func:`merge_validations` pools the shards' reports into the
    unsharded one, so a validation of an hour can run on several cores at once."""

    def __init__(
        self,
        model,
        tokenizer,
        cfg: AdaptConfig,
        frozen=None,
        n_docs: int | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.model, self.frozen, self.cfg = model, frozen, cfg
        n = cfg.val_docs if n_docs is None else n_docs
        i, k = parse_shard(shard) or (1, 1)
        self.windows = [j for j in range(n) if j % k == i - 1]
        source = SequenceSource(cfg, tokenizer, "validation", seed=VALIDATION_SEED)
        self.probe = Probe([source.get(j) for j in self.windows], self._base_hidden)

    @torch.no_grad()
    def _base_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        with base_model(self.model, self.frozen) as m:
            return hidden_states(m, ids, None)

    @property
    def docs(self) -> list[tuple[str, torch.Tensor]]:
        return self.probe.docs

    def _policy(self, scorer):
        return "streaming" if self.cfg.mask == "streaming" else LearnedPolicy(scorer)

    @torch.no_grad()
    def _run(self, m, policy, dense: bool) -> dict:
        cfg = self.cfg
        budgets = cfg.validation_budgets()
        out: dict = {}
        for b in budgets:
            ev = cfg.eviction(b)
            label = f"validation B={b}" if cfg.progress else None
            s = self.probe.score(m, policy, b, window=ev.window, sinks=ev.sinks, lam=ev.lam, progress=label)
            out[str(b)] = _both_tasks(s, "corpus", self.windows)
        if dense:
            d: Scores = self.probe.score(m, None, 0, progress="validation dense" if cfg.progress else None)  # vs base
            for b in budgets:
                out[str(b)]["dense_retention"] = d.lm(start=b).retention
            rows = [
                {
                    "corpus": label,
                    "retention": doc.lm.retention,
                    "continuation": doc.continuation.retention,
                    "window": j,
                    "sums": {"all": asdict(doc.lm), **{str(b): asdict(doc.sums(b)) for b in budgets}},
                }
                for label, j, doc in zip(d.labels, self.windows, d.docs, strict=True)
            ]
            out["dense"] = {**_metrics(d.lm()), "per_doc": rows}
        mean = sum(out[str(b)]["retention"] for b in budgets) / len(budgets)
        out["mean_retention"] = mean if math.isfinite(mean) else float("-inf")
        return out

    def __call__(self, scorer) -> dict:
        """The adapted model under its mask's policy (the current scorer) and dense, vs the base dense."""
        if not self.docs:
            return {}
        was = scorer.training if scorer is not None else False
        try:
            return self._run(self.model, self._policy(scorer), dense=True)
        finally:
            if scorer is not None:
                scorer.train(was)

    def baseline(self, scorer) -> dict:
        """The base model under the same policy (where the run starts from)."""
        if not self.docs:
            return {}
        with base_model(self.model, self.frozen) as m:
            return self._run(m, self._policy(scorer), dense=False)

    def describe(self, q: dict) -> str:
        parts = [
            f"B={b} retention {q[str(b)]['retention']:.4f} (KL {q[str(b)]['kl']:.4f})"
            + (f" continuation {q[str(b)]['continuation']['retention']:.4f}" if "continuation" in q[str(b)] else "")
            for b in self.cfg.validation_budgets()
        ]
        if "dense" in q:
            parts.append(f"adapted dense retention {q['dense']['retention']:.4f} (KL {q['dense']['kl']:.4f})")
        return ", ".join(parts) + " vs base dense"


# --------------------------------------------------------------------------------------------
# the report table
# --------------------------------------------------------------------------------------------


class Comparison:
    """The report's models and policies, built once; :meth:`document` scores one document.

    ``base_model``: the plain base model (left untouched: each bundle goes onto a copy).
    ``bundle``: a kvpop adapter bundle with a scorer (``kvpop adapt --mask kvpop``).
    ``budgets``: default the bundle's. ``streaming_bundle``: the StreamingLLM+ control (``kvpop
    adapt --mask streaming``); "adapted streaming" uses its adapter (else the kvpop bundle's
    adapter under StreamingLLM). ``base_scorer``: the scorer for "base kvpop" (a path or a
    ``ScorerStack``; default the scorer the bundle was trained from, if that file is still there,
    else the bundle's own scorer). ``windows`` ``{budget: window}``, ``sinks``, ``lam``: default
    what the bundle was trained for. ``merge=True`` merges the LoRA weights into copies of the
    base model (faster; equal up to float rounding).
    """

    def __init__(
        self,
        base_model,
        bundle,
        budgets=None,
        *,
        streaming_bundle=None,
        base_scorer=None,
        windows: dict | None = None,
        sinks: int | None = None,
        lam: float | None = None,
        merge: bool = False,
    ) -> None:
        header = read_bundle_meta(bundle)
        tf = header.get("meta", {}).get("trained_for") or {}
        self.budgets = [int(b) for b in (budgets or tf.get("budgets") or [])]
        if not self.budgets:
            raise ValueError("give budgets (the bundle records none)")
        self.sinks = int(tf.get("sinks", 4) if sinks is None else sinks)
        # what the bundle was trained for (its tilt may scale with the budget: lam_scale / B), unless lam= was given
        self.rule = TrainedSettings.from_meta(tf) or TrainedSettings()
        if lam is not None:
            self.rule = replace(self.rule, lam=float(lam), lam_scale=None)
        windows = windows or {}
        self.windows = {
            b: int(windows[b])
            if b in windows
            else resolve_eviction(b, sinks=self.sinks, trained=self.rule, warn=False).window
            for b in self.budgets
        }
        self.base_model = base_model.eval()
        adapted = load_adapter_bundle(copy.deepcopy(base_model), bundle, merge=merge)
        if adapted.scorer is None:
            raise ValueError(f"{bundle} has no scorer (a --mask streaming bundle?); pass it as streaming_bundle=")
        adapted_scorer = adapted.scorer.to(base_model.device)
        stream_model = adapted.model
        if streaming_bundle is not None:
            stream_model = load_adapter_bundle(copy.deepcopy(base_model), streaming_bundle, merge=merge).model
        base_source = "the bundle's own scorer"
        if base_scorer is None:
            start = (header.get("meta", {}).get("trained_from") or {}).get("scorer")
            if start and Path(start).is_file():
                base_scorer, base_source = start, str(start)
            else:
                base_scorer = adapted_scorer
        if isinstance(base_scorer, (str, Path)):
            base_source = str(base_scorer)
            base_scorer, _ = load_scorer(base_scorer, model=base_model)
        elif base_scorer is not adapted_scorer:
            base_source = "given ScorerStack"
        base_scorer = base_scorer.to(base_model.device)
        bundle = Path(bundle)
        stream_source = Path(streaming_bundle) if streaming_bundle is not None else bundle
        # row -> (model, policy or None for dense, the bundle whose weights it runs or None for the base model)
        self.rows = {
            "adapted kvpop": (adapted.model, LearnedPolicy(adapted_scorer), bundle),
            "adapted streaming": (stream_model, "streaming", stream_source),
            "base kvpop": (base_model, LearnedPolicy(base_scorer), None),
            "base streaming": (base_model, "streaming", None),
            "adapted dense": (adapted.model, None, bundle),
        }
        if streaming_bundle is not None:
            self.rows["streaming+ dense"] = (stream_model, None, stream_source)
        self.settings = {
            "windows": {str(b): w for b, w in self.windows.items()},
            "sinks": self.sinks,
            "lam": self.rule.lam,
            "lam_scale": self.rule.lam_scale,
            "bundle": str(bundle),
            "streaming_bundle": None if streaming_bundle is None else str(streaming_bundle),
            "base_scorer": base_source,
            "merged": merge,
        }

    @torch.no_grad()
    def base_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The base model's dense hidden states: what every row is scored against."""
        return hidden_states(self.base_model, ids.view(-1).cpu(), None)

    @torch.no_grad()
    def row(self, name: str, ids: torch.Tensor, base_hidden: torch.Tensor) -> dict[int, DocumentScore]:
        """``{budget: DocumentScore}`` of one row on one document against the base model's dense outputs
        (:func:`kvpop.evaluate.quality.score_document`: ``lm`` over positions ``>= B``, ``continuation`` over the
        last ``S / 16`` predictions, as ``kvpop eval``'s tasks; a dense row at each budget too)."""
        ids = ids.view(-1).cpu()
        m, policy, _ = self.rows[name]
        dense = hidden_states(m, ids, None) if policy is None else None
        out: dict[int, DocumentScore] = {}
        for b in self.budgets:
            if policy is None:
                ph = dense
            else:
                stream = policy == "streaming"
                cache = make_cache(
                    m,
                    policy,
                    budget=b,
                    window=b - self.sinks if stream else self.windows[b],
                    sinks=self.sinks,
                    lam=0.0 if stream else self.rule.lam_at(b),
                )
                ph = hidden_states(m, ids, cache)
            out[b] = score_document(self.base_model, ids, base_hidden, ph, b)
        return out

    def document(self, ids: torch.Tensor) -> dict[int, dict[str, DocumentScore]]:
        """``{budget: {row: DocumentScore}}`` of one document (every row, see :meth:`row`)."""
        bh = self.base_hidden(ids)
        per_row = {r: self.row(r, ids, bh) for r in self.rows}
        return {b: {r: per_row[r][b] for r in self.rows} for b in self.budgets}


@torch.no_grad()
def compare_adapted(base_model, bundle, docs, budgets=None, **options) -> dict:
    """Retention of the adapted and the base model under kvpop and StreamingLLM, and the adapted
    model dense, all against the BASE model's dense outputs, on ``docs`` (1-D token-id tensors, or
    ``(label, ids)`` pairs); the other arguments, and the keyword ``options`` (``streaming_bundle``,
    ``base_scorer``, ``windows``, ``sinks``, ``lam``, ``merge``), as :class:`Comparison`. ``kvpop compare-adapted``
    is the resumable, splittable command over the test splits.

    Returns ``{"budgets": {"B": {row: lm metrics + "continuation" (its metrics) + "per_doc"}},
    "settings": {...}}``; rows: ``adapted kvpop``, ``adapted streaming``, ``base kvpop``, ``base
    streaming``, ``adapted dense`` (and ``streaming+ dense`` with ``streaming_bundle``).
    """
    cmp = Comparison(base_model, bundle, budgets, **options)
    docs = [d if isinstance(d, tuple) else (f"doc{i}", d) for i, d in enumerate(docs)]
    scores: dict[int, dict[str, list[DocumentScore]]] = {b: {r: [] for r in cmp.rows} for b in cmp.budgets}
    for _, ids in docs:
        for b, rows in cmp.document(ids).items():
            for r, d in rows.items():
                scores[b][r].append(d)
    labels = [label for label, _ in docs]
    result = {}
    for b in cmp.budgets:
        result[str(b)] = {}
        for r in cmp.rows:
            result[str(b)][r] = _both_tasks(Scores(labels, scores[b][r]), "doc")
    return {"budgets": result, "settings": {**cmp.settings, "docs": labels}}
