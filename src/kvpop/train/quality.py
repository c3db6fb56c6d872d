"""Quality under the real cache while training: what model selection is based on.

Loss and decision accuracy do not say whether a scorer keeps more quality than a sliding
window: a scorer can make most keep/evict calls right and still drop the few tokens that
matter. So the run measures what users get (:mod:`kvpop.evaluate.quality`, the probe every command
uses): teacher-forced retention (``ppl_dense / ppl_policy``) of held-out validation windows
under a real :class:`kvpop.KVpopCache` with the scorer being trained, at each training budget,
next to StreamingLLM at the same budget. The best checkpoint by that number is kept
(``best.safetensors``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from ..checkpoint import model_fingerprint
from ..data import round_robin_windows
from ..evaluate.quality import DenseOutputs, Probe, default_continuation_tokens, wins
from ..files import atomic_write
from ..policies import LearnedPolicy
from .config import TrainConfig
from .data import SequenceSource

VALIDATION_SEED = 12345


def validation_windows(tokenizer, cfg: TrainConfig, n: int) -> list[tuple[str, torch.Tensor]]:
    """``n`` validation windows of ``cfg.val_seq_len`` tokens: round-robin over the training corpora
    (each corpus equally, not by size), or from the user's documents' validation split."""
    if n <= 0:
        return []
    if cfg.docs_from:
        source = SequenceSource(cfg, tokenizer, "validation", seed=VALIDATION_SEED, seq_len=cfg.val_seq_len)
        return [source.get(j) for j in range(n)]
    return round_robin_windows(tokenizer, cfg.corpora, cfg.val_seq_len, n, "validation", VALIDATION_SEED)


def continuation_tokens(seq_len: int) -> int:
    """The continuation predictions validation scores: ``seq_len / 16 - 1`` (255 of 4,096), one fewer
    than ``kvpop eval``'s continuation task. Kept so that a resumed run, and the StreamingLLM baseline
    a ``--val-cache`` folder holds, compare the same positions as before."""
    return default_continuation_tokens(seq_len) - 1


class RetentionProbe:
    """Validation windows and their dense runs; retention of a scorer under the real cache.

    Two tasks from one forward per window and budget, as the evaluation scores them: ``lm`` (every
    position after the budget is first full) and ``continuation`` (the last ``seq_len / 16 - 1``
    positions). The selection number is the mean over budgets of both tasks' retention.
    """

    def __init__(
        self, model, tokenizer, cfg: TrainConfig, n_docs: int | None = None, cache_dir: str | os.PathLike | None = None
    ) -> None:
        self.model, self.cfg = model, cfg
        docs = validation_windows(tokenizer, cfg, cfg.val_docs if n_docs is None else n_docs)
        self.dense = DenseOutputs()
        self.probe = Probe(docs, lambda ids: self.dense.get(model, ids)[0], continuation_tokens)
        self._streaming: dict[int, dict] = {}
        # the baseline (dense hidden states, StreamingLLM's results) does not depend on the scorer: runs of a
        # sweep share it through a folder, keyed by the model, the windows and the split settings
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir is not None and docs:
            h = hashlib.sha256(json.dumps(model_fingerprint(model), sort_keys=True).encode())
            for _, ids in docs:
                h.update(ids.numpy().tobytes())
            h.update(f"{cfg.sinks}:{cfg.lam}".encode())  # StreamingLLM ignores lam; kept so old keys still match
            self._key = h.hexdigest()[:16]
            dense = self.cache_dir / f"dense_{self._key}.pt"
            if dense.is_file():
                for (_, ids), hidden in zip(docs, torch.load(dense, weights_only=True), strict=True):
                    self.dense.put(ids, hidden)
            else:
                hidden = [self.dense.get(model, ids)[0] for _, ids in docs]
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(dense, lambda tmp: torch.save(hidden, tmp))

    @property
    def docs(self) -> list[tuple[str, torch.Tensor]]:
        return self.probe.docs

    def _run(self, policy, budget: int) -> dict:
        cfg = self.cfg
        label = (
            f"validation {'StreamingLLM' if policy == 'streaming' else 'scorer'} B={budget}" if cfg.progress else None
        )
        rule = cfg.rule()
        s = self.probe.score(
            self.model,
            policy,
            budget,
            window=rule.window_at(budget, cfg.sinks),
            sinks=cfg.sinks,
            lam=rule.lam_at(budget),
            progress=label,
        )
        m = s.lm().metrics()
        return {
            "retention": m["retention"],
            "kl": m["kl"],
            "continuation": s.continuation().retention,
            "per_doc": s.per_doc_rows("corpus"),
        }

    def streaming(self, budget: int) -> dict:
        if budget not in self._streaming:
            path = None if self.cache_dir is None else self.cache_dir / f"streaming_{self._key}_{budget}.json"
            if path is not None and path.is_file():
                self._streaming[budget] = json.loads(path.read_text())
            else:
                self._streaming[budget] = self._run("streaming", budget)
                if path is not None:
                    text = json.dumps(self._streaming[budget])
                    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
        return self._streaming[budget]

    def __call__(self, scorer, budgets) -> dict:
        """Retention of ``scorer`` per budget on both tasks, with StreamingLLM's and the per-document wins."""
        if not self.docs:
            return {}
        was_training = scorer.training
        policy = LearnedPolicy(scorer.eval())
        out: dict = {}
        try:
            for b in budgets:
                r = self._run(policy, b)
                s = self.streaming(b)
                mine, theirs = r["per_doc"], s["per_doc"]
                out[str(b)] = {
                    **r,
                    "streaming": s["retention"],
                    "streaming_continuation": s["continuation"],
                    "wins_vs_streaming": wins([a["retention"] for a in mine], [c["retention"] for c in theirs])["wins"],
                    "continuation_wins_vs_streaming": wins(
                        [a["continuation"] for a in mine], [c["continuation"] for c in theirs]
                    )["wins"],
                    "docs": len(self.docs),
                }
        finally:
            scorer.train(was_training)
        both = [(out[str(b)]["retention"] + out[str(b)]["continuation"]) / 2 for b in budgets]
        out["mean_retention"] = sum(both) / len(both)
        if not math.isfinite(out["mean_retention"]):
            out["mean_retention"] = float("-inf")
        return out
