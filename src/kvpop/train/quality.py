"""Quality under the real cache while training: what model selection is based on.

Loss and decision accuracy do not say whether a scorer keeps more quality than a sliding
window: a scorer can make most keep/evict calls right and still drop the few tokens that
matter. So the run measures what users get: teacher-forced retention (``ppl_dense /
ppl_policy``) of held-out validation windows under a real :class:`kvpop.KVpopCache` with the
scorer being trained, at each training budget, next to StreamingLLM at the same budget. The
best checkpoint by that number is kept (``best.safetensors``).
"""

from __future__ import annotations

import math

import torch

from ..cache import make_cache
from ..evaluate.core import DenseCache, Sums, hidden_states, sums_from_hidden
from ..policies import LearnedPolicy
from .config import TrainConfig
from .data import SequenceSource

VALIDATION_SEED = 12345


class RetentionProbe:
    """Validation windows (from the validation split of the training data) and their dense runs."""

    def __init__(self, model, tokenizer, cfg: TrainConfig, n_docs: int | None = None) -> None:
        self.model, self.cfg = model, cfg
        n = cfg.val_docs if n_docs is None else n_docs
        source = SequenceSource(cfg, tokenizer, "validation", seed=VALIDATION_SEED)
        self.docs = [source.get(j) for j in range(n)]
        self.dense = DenseCache()
        self._streaming: dict[int, dict] = {}

    @torch.no_grad()
    def _run(self, policy, budget: int) -> dict:
        cfg = self.cfg
        total, per_doc = Sums(), []
        for corpus, ids in self.docs:
            dh, _ = self.dense.get(self.model, ids)
            cache = make_cache(self.model, policy, budget=budget, window=cfg.window_for(budget), sinks=cfg.sinks,
                               lam=cfg.lam)  # fmt: skip
            ph = hidden_states(self.model, ids, cache)
            sums = sums_from_hidden(self.model, dh, ph, ids, budget)
            total = total.add(sums)
            per_doc.append({"corpus": corpus, "retention": sums.metrics()["retention"]})
        m = total.metrics()
        return {"retention": m["retention"], "kl": m["kl"], "per_doc": per_doc}

    def streaming(self, budget: int) -> dict:
        if budget not in self._streaming:
            self._streaming[budget] = self._run("streaming", budget)
        return self._streaming[budget]

    def __call__(self, scorer, budgets) -> dict:
        """Retention of ``scorer`` per budget, with StreamingLLM's and the per-document wins."""
        if not self.docs:
            return {}
        was_training = scorer.training
        policy = LearnedPolicy(scorer.eval())
        out: dict = {}
        try:
            for b in budgets:
                r = self._run(policy, b)
                s = self.streaming(b)
                wins = sum(a["retention"] > c["retention"] for a, c in zip(r["per_doc"], s["per_doc"]))
                out[str(b)] = {**r, "streaming": s["retention"], "wins_vs_streaming": wins, "docs": len(self.docs)}
        finally:
            scorer.train(was_training)
        out["mean_retention"] = sum(out[str(b)]["retention"] for b in budgets) / len(budgets)
        if not math.isfinite(out["mean_retention"]):
            out["mean_retention"] = float("-inf")
        return out
