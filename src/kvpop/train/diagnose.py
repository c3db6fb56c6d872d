"""Diagnostics that explain a scorer's gap to the oracle: how good must scores be to beat a window?

``noisy_oracle``: the oracle's own scores (true future attention of the document) plus Gaussian
noise of ``sigma`` times each head's score spread, under the real cache on validation windows.
Retention against the rank correlation of the noisy scores with the truth says what accuracy
the window-exit rule needs to beat StreamingLLM at a budget, and how far a learned scorer with a
given rank correlation should get if its errors were unstructured.

    kvpop diagnose noisy-oracle --budget 512 --docs 4 --sigmas 0 0.5 1 2 --out results/diagnostics

With ``--scorer NAME=PATH`` (default: the shipped scorers) each learned scorer is measured on the
same documents, retention under the cache and the rank correlation of its exit scores with the
truth, and drawn on the same plot: a scorer below the noisy-oracle curve at its rank correlation
makes errors that cost more than unstructured noise does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .. import models
from ..cache import make_cache
from ..capture import collect
from ..checkpoint import load_scorer
from ..evaluate.plotting import pyplot, save_figure
from ..evaluate.quality import DenseOutputs, Sums, hidden_states, score_document, wins
from ..files import atomic_write
from ..policies import LearnedPolicy, OraclePolicy
from .config import TrainConfig
from .data import SequenceSource, capture_example
from .labels import spearman
from .quality import VALIDATION_SEED


def _noisy(targets: list[torch.Tensor], sigma: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in targets:
        t = t.float()
        fin = torch.isfinite(t)
        sd = torch.stack([t[0, h][fin[0, h]].std() for h in range(t.shape[1])]).view(1, -1, 1)
        noise = torch.randn(t.shape, generator=g) * sd * sigma
        out.append(torch.where(fin, t + noise, t))
    return out


def _rank_corr(noisy: list[torch.Tensor], true: list[torch.Tensor], window: int) -> float:
    rhos = []
    for a, b in zip(noisy, true):
        S = b.shape[-1]
        for h in range(b.shape[1]):
            keep = torch.isfinite(b[0, h])
            keep[S - 2 * window :] = False  # too few future queries to carry signal (as the loss)
            if keep.sum() > 2:
                rhos.append(spearman(a[0, h][keep], b[0, h][keep]))
    return sum(rhos) / max(1, len(rhos))


@torch.no_grad()
def noisy_oracle(
    model,
    tokenizer,
    cfg: TrainConfig,
    budget: int,
    sigmas,
    n_docs: int,
    seed: int = 0,
    progress: bool = True,
    scorers: dict[str, str] | None = None,
) -> dict:
    ev = cfg.eviction(budget)
    loaded = {name: load_scorer(path, model=model)[0] for name, path in (scorers or {}).items()}
    learned: dict[str, dict] = {name: {"sums": Sums(), "rank_correlation": [], "per_doc": []} for name in loaded}
    source = SequenceSource(cfg, tokenizer, "validation", seed=VALIDATION_SEED)
    docs = [source.get(j) for j in range(n_docs)]
    dense = DenseOutputs()
    rows = {}
    streaming = Sums()
    per_doc_stream = []
    for _, ids in docs:
        dh, _ = dense.get(model, ids)
        ph = hidden_states(model, ids, make_cache(model, "streaming", budget=budget, sinks=ev.sinks))
        s = score_document(model, ids, dh, ph, budget).lm
        streaming = streaming.add(s)
        per_doc_stream.append(s.metrics()["retention"])
    for di, (corpus, ids) in enumerate(docs):
        dh, _ = dense.get(model, ids)
        if loaded:
            obs = next((sc.config.observed for sc in loaded.values() if sc.config.observed), ())
            ex = capture_example(model, ids.view(1, -1), [ev.window], ev.sinks, obs, [corpus]).float()
            true = list(ex.targets[ev.window])
            for name, sc in loaded.items():
                o = ex.observed.get(ev.window) if sc.config.observed else None
                scores = [
                    sc.forward_layer(i, ex.keys[i], ex.values[i], ev.window, observed=None if o is None else o[i])
                    for i in range(len(true))
                ]
                cache = make_cache(
                    model,
                    LearnedPolicy(sc, source=str(scorers[name])),
                    budget=budget,
                    window=ev.window,
                    sinks=ev.sinks,
                    lam=ev.lam,
                )
                s = score_document(model, ids, dh, hidden_states(model, ids, cache), budget).lm
                r = learned[name]
                r["sums"] = r["sums"].add(s)
                r["rank_correlation"].append(_rank_corr(scores, true, ev.window))
                r["per_doc"].append(s.metrics()["retention"])
                if progress:
                    print(f"[noisy-oracle] doc {di} {name}: retention {s.metrics()['retention']:.4f}", file=sys.stderr)
        else:
            true = [c.target for c in collect(model, ids.view(1, -1), window=ev.window)]
        for sigma in sigmas:
            t0 = time.perf_counter()
            noisy = _noisy(true, sigma, seed + di) if sigma > 0 else true
            cache = make_cache(model, OraclePolicy(noisy), budget=budget, window=ev.window, sinks=ev.sinks, lam=ev.lam)
            s = score_document(model, ids, dh, hidden_states(model, ids, cache), budget).lm
            r = rows.setdefault(str(sigma), {"sums": Sums(), "rank_correlation": [], "per_doc": []})
            r["sums"] = r["sums"].add(s)
            r["rank_correlation"].append(_rank_corr(noisy, true, ev.window))
            r["per_doc"].append(s.metrics()["retention"])
            if progress:
                print(
                    f"[noisy-oracle] doc {di} sigma {sigma}: retention {s.metrics()['retention']:.4f} "
                    f"({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                )
    out = {
        "budget": budget,
        "window": ev.window,
        "sinks": ev.sinks,
        "docs": n_docs,
        "streaming": streaming.metrics()["retention"],
        "streaming_per_doc": per_doc_stream,
        "sigmas": {},
    }
    for sigma, r in rows.items():
        m = r["sums"].metrics()
        out["sigmas"][sigma] = {
            "retention": m["retention"],
            "kl": m["kl"],
            "rank_correlation": sum(r["rank_correlation"]) / len(r["rank_correlation"]),
            "per_doc": r["per_doc"],
            "wins_vs_streaming": wins(r["per_doc"], per_doc_stream)["wins"],
        }
    out["scorers"] = {}
    for name, r in learned.items():
        m = r["sums"].metrics()
        out["scorers"][name] = {
            "path": str(scorers[name]),
            "retention": m["retention"],
            "kl": m["kl"],
            "rank_correlation": sum(r["rank_correlation"]) / len(r["rank_correlation"]),
            "per_doc": r["per_doc"],
            "wins_vs_streaming": wins(r["per_doc"], per_doc_stream)["wins"],
        }
    return out


def plot_noisy_oracle(result: dict, path: Path, scorers: dict | None = None) -> None:
    fig, ax = pyplot().subplots(figsize=(5.5, 4))
    pts = sorted((v["rank_correlation"], v["retention"], s) for s, v in result["sigmas"].items())
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="oracle + noise")
    for rc, ret, s in pts:
        ax.annotate(f"σ={s}", (rc, ret), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.axhline(result["streaming"], color="gray", ls="--", label="StreamingLLM")
    for name, (rc, ret) in (scorers or {}).items():
        ax.plot([rc], [ret], "s", label=name)
    ax.set_xlabel("rank correlation of scores with true future attention")
    ax.set_ylabel("retention (ppl_dense / ppl_policy)")
    ax.set_title(f"What the rule needs: B={result['budget']}, window {result['window']}, {result['docs']} docs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def run(args, scorers: dict[str, str]) -> int:
    """``kvpop diagnose noisy-oracle`` once its arguments are parsed and checked (:mod:`kvpop.cli.diagnose`):
    the measurement, ``noisy_oracle.json`` and its plot in ``args.out``, the summary printed."""
    cfg = TrainConfig(
        budgets=(args.budget,), window_fraction=args.window_fraction, seq_len=args.seq_len, model=args.model
    )
    cfg.validate()
    model, tok = models.load_model(args.model, progress=False)
    t0 = time.perf_counter()
    res = noisy_oracle(model, tok, cfg, args.budget, args.sigmas, args.docs, scorers=scorers)
    res["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "noisy_oracle.json", lambda tmp: Path(tmp).write_text(json.dumps(res, indent=1)))
    plot_noisy_oracle(
        res, out / "noisy_oracle.png", {n: (v["rank_correlation"], v["retention"]) for n, v in res["scorers"].items()}
    )
    print(json.dumps({k: v for k, v in res.items() if k != "streaming_per_doc"}, indent=1, default=str))
    return 0
