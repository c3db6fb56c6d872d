"""The evaluation grid: tasks x policies x budgets x domains -> ``results.json`` (+ plots).

From Python::

    from kvpop.evaluate import EvalConfig, run_eval
    results = run_eval(model, tokenizer, EvalConfig(tasks=("lm",), policies=("dense", "knorm")),
                       documents={"mine": [ids1, ids2]}, out="runs/x")

``documents`` (token ids per named source) replaces the built-in corpora; every such source is
in domain ``"user"``. Without it, the test splits of the named corpora are used, in domain
``"in_domain"`` (:data:`IN_DOMAIN`, the corpora the shipped scorer trained on) or
``"out_of_domain"``.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..config import EvictionConfig
from .core import ALL_POLICIES, DENSE, DenseCache, PolicyUnavailable, Sums, policy_available
from .tasks import TASKS, agreement_doc, continuation_doc, lm_doc, needle_case, needle_cases


def _shipped_training_corpora() -> tuple[str, ...]:
    """In-domain = the corpora the shipped scorer was trained on (read from its checkpoint)."""
    from ..checkpoint import DEFAULT_SCORERS, read_header

    for path in DEFAULT_SCORERS.values():
        try:
            corpora = read_header(path).get("meta", {}).get("corpora")
        except (FileNotFoundError, ValueError):
            continue
        if corpora:
            return tuple(corpora)
    return ("shakespeare", "paul_graham", "wikipedia")  # what `kvpop train` uses by default


IN_DOMAIN = _shipped_training_corpora()
SCHEMA_VERSION = 1


@dataclass
class EvalConfig:
    tasks: tuple[str, ...] = TASKS
    policies: tuple[str, ...] = ALL_POLICIES
    compressions: tuple[float, ...] = (0.75, 0.875, 0.9375)
    reference_length: int = 4096
    sinks: int = 4
    docs: int = 2  # documents per corpus (or per user source)
    doc_tokens: int = 4096  # lm documents; continuation/agreement prompts are cut from them
    continuation_context: int | None = None  # default 3/4 of doc_tokens (3072)
    continuation_tokens: int | None = None  # default doc_tokens / 16 (256)
    agreement_tokens: int = 256
    agreement_prompt: int | None = None  # default doc_tokens - agreement_tokens
    needle_lengths: tuple[int, ...] = (2048, 4096, 8000)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    corpora: tuple[str, ...] | None = None  # default: the six evaluation corpora (kvpop.data.EVALUATION_CORPORA)
    corpus_root: dict | None = None  # corpus name -> root folder (tests, custom installs)
    seed: int = 0
    policy_kwargs: dict | None = (
        None  # policy name -> factory kwargs, e.g. {"kvpop": {"path": "scorer.safetensors"}}
    )

    def budgets(self) -> list[EvictionConfig]:
        """One resolved budget per compression (``EvictionConfig.from_budget``: the one resolver)."""
        return [
            EvictionConfig.from_budget(compression=c, reference_length=self.reference_length, sinks=self.sinks)
            for c in self.compressions
        ]

    def context(self) -> int:
        return self.continuation_context or (3 * self.doc_tokens) // 4

    def cont_tokens(self) -> int:
        return self.continuation_tokens or max(1, self.doc_tokens // 16)

    def prompt_tokens(self) -> int:
        return self.agreement_prompt or max(1, self.doc_tokens - self.agreement_tokens)


def quick_config(**overrides) -> EvalConfig:
    """A preset that finishes in minutes on a laptop CPU: lm only, 1 doc per corpus of 1024 tokens,
    compression 0.875 of the document length (B = 128), a few policies."""
    cfg = {
        "tasks": ("lm",),
        "policies": ("dense", "streaming", "tova", "knorm", "oracle", "kvpop-mlp", "kvpop"),
        "compressions": (0.875,),
        "reference_length": 1024,
        "docs": 1,
        "doc_tokens": 1024,
    }
    cfg.update(overrides)
    return EvalConfig(**cfg)


# ------------------------------------------------------------------------------ documents


def _domain(corpus: str) -> str:
    return "in_domain" if corpus in IN_DOMAIN else "out_of_domain"


def corpus_documents(tokenizer, cfg: EvalConfig, notes: list[str]) -> list[tuple[str, str, list[Tensor]]]:
    """``[(domain, corpus, [ids...])]`` from the test splits of the corpora."""
    from ..data import list_corpora, long_documents

    out = []
    for name in cfg.corpora or list_corpora(evaluation_only=True):
        root = (cfg.corpus_root or {}).get(name)
        try:
            docs = long_documents(tokenizer, name, cfg.doc_tokens, split="test", max_docs=cfg.docs, root=root)
        except (FileNotFoundError, ValueError) as exc:
            notes.append(f"corpus {name!r} skipped: {exc}")
            continue
        if not docs:
            notes.append(f"corpus {name!r} skipped: no test document of {cfg.doc_tokens} tokens")
            continue
        out.append((_domain(name), name, docs))
    return out


def user_documents(tokenizer, path, cfg: EvalConfig) -> tuple[list[Tensor], str]:
    """Token ids of the user's documents (folder of .txt or .jsonl), and their joined text (needle filler)."""
    from ..data import long_documents, read_user_documents

    docs = read_user_documents(path)
    ids = long_documents(tokenizer, docs, cfg.doc_tokens, max_docs=cfg.docs, concat=False)
    if not ids:  # short documents: join consecutive ones
        ids = long_documents(tokenizer, docs, cfg.doc_tokens, max_docs=cfg.docs, concat=True)
    return ids, "\n\n".join(d.text.strip() for d in docs)


def default_filler(cfg: EvalConfig) -> str:
    """Paul Graham essays (test split first, then the others) as needle filler."""
    from ..data import load_documents

    root = (cfg.corpus_root or {}).get("paul_graham")
    texts = []
    for split in ("test", "validation", "train"):
        texts += [d.text.strip() for d in load_documents("paul_graham", split, root=root)]
    return "\n\n".join(texts)


# ------------------------------------------------------------------------------ the grid


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if not k.startswith("_")}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _budget_fields(b: EvictionConfig | None, compression: dict) -> dict:
    if b is None:
        return {"budget": None, "window": None, "sinks": None, "compression": 0.0}
    return {"budget": b.budget, "window": b.window, "sinks": b.sinks, "compression": compression[b]}


@torch.no_grad()
def run_eval(
    model,
    tokenizer,
    cfg: EvalConfig | None = None,
    *,
    documents: dict[str, list[Tensor]] | None = None,
    filler: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    plots: bool = True,
) -> dict:
    """Run the grid and return the results dict (also written to ``out/results.json`` + plots)."""
    from tqdm.auto import tqdm

    cfg = cfg or EvalConfig()
    for t in cfg.tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; tasks: {', '.join(TASKS)}")
    t_start = time.perf_counter()
    notes: list[str] = []
    skipped: dict[str, str] = {}
    policies = []
    for p in cfg.policies:
        reason = policy_available(p)
        if reason is None:
            policies.append(p)
        else:
            skipped[p] = reason
    budgets = cfg.budgets()
    compression = dict(zip(budgets, cfg.compressions))  # what each budget stands for, for the records

    if documents is not None:
        sources = [("user", name, [d.view(-1).cpu() for d in ds]) for name, ds in documents.items()]
    else:
        sources = corpus_documents(tokenizer, cfg, notes)

    # work units: (task, domain, corpus, item, policy, budget)
    units = []
    cases = []
    for task in cfg.tasks:
        if task == "needle":
            try:
                cases = needle_cases(
                    tokenizer, filler if filler is not None else default_filler(cfg),
                    cfg.needle_lengths, cfg.needle_depths, cfg.seed,
                )  # fmt: skip
            except (FileNotFoundError, ValueError) as exc:
                notes.append(f"needle skipped: {exc}")
                continue
            dom = "user" if documents is not None or filler is not None else "needle"
            items = [(dom, "needle", c) for c in cases]
        else:
            items = [(dom, corpus, d) for dom, corpus, ds in sources for d in ds]
        for dom, corpus, item in items:
            for p in policies:
                for b in [None] if p == DENSE and task in ("needle", "agreement") else budgets:
                    units.append((task, dom, corpus, item, p, b))

    dense = DenseCache()
    per_item: dict[tuple, list] = {}  # (task, policy, budget, domain) -> [(corpus, result)]
    bar = tqdm(units, desc="kvpop eval", disable=not progress, dynamic_ncols=True)
    for task, dom, corpus, item, p, b in bar:
        bar.set_postfix_str(f"{task} {corpus} {p} B={b.budget if b else '-'}")
        if p in skipped:  # a policy that failed to build once is not retried
            continue
        kw = dict((cfg.policy_kwargs or {}).get(p, {}))
        try:
            if task == "lm":
                r = lm_doc(model, item, p, b, dense, **kw)
            elif task == "continuation":
                n = cfg.context() + cfg.cont_tokens()
                if item.numel() < n:
                    raise ValueError(f"continuation needs {n} tokens, document has {item.numel()}")
                r = continuation_doc(model, item[:n], cfg.context(), p, b, dense, **kw)
            elif task == "agreement":
                r = agreement_doc(model, tokenizer, item[: cfg.prompt_tokens()], cfg.agreement_tokens, p,
                                  b or budgets[0], dense, **kw)  # fmt: skip
            else:
                r = needle_case(model, tokenizer, item, p, b or budgets[0], dense, **kw)
        except PolicyUnavailable as exc:
            skipped.setdefault(p, str(exc))
            policies = [q for q in policies if q != p]
            continue
        r["corpus"] = corpus
        per_item.setdefault((task, p, b, dom), []).append(r)
    bar.close()

    records = [_aggregate(task, p, b, dom, rs, compression) for (task, p, b, dom), rs in per_item.items()]
    results = {
        "schema_version": SCHEMA_VERSION,
        "config": _clean(asdict(cfg)),
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "in_domain": list(IN_DOMAIN),
        "policies": policies,
        "skipped_policies": skipped,
        "notes": notes,
        "records": [_clean(r) for r in records],
        "dense_wall_s": dense.wall_s,
        "wall_s": time.perf_counter() - t_start,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    }
    if out is not None:
        write_results(results, out, plots=plots)
    return results


def _aggregate(task: str, policy: str, b: EvictionConfig | None, domain: str, rs: list[dict],
               compression: dict) -> dict:  # fmt: skip
    rec = {"task": task, "policy": policy, "domain": domain, **_budget_fields(b, compression)}
    rec["corpora"] = sorted({r["corpus"] for r in rs})
    rec["wall_s"] = sum(r["wall_s"] for r in rs)
    rec["n_items"] = len(rs)
    if task in ("lm", "continuation"):
        total = Sums()
        by_corpus: dict[str, Sums] = {}
        for r in rs:
            total = total.add(r["_sums"])
            by_corpus[r["corpus"]] = by_corpus.get(r["corpus"], Sums()).add(r["_sums"])
        rec["metrics"] = total.metrics()
        rec["per_corpus"] = {c: s.metrics() for c, s in sorted(by_corpus.items())}
    elif task == "agreement":
        n = sum(r["n_tokens"] for r in rs)
        rec["metrics"] = {
            "n_tokens": n,
            "match_rate": sum(r["match_rate"] * r["n_tokens"] for r in rs) / n if n else float("nan"),
            "prefix_match": sum(r["prefix_match"] for r in rs) / len(rs),
        }
    else:
        rec["metrics"] = {"accuracy": sum(r["correct"] for r in rs) / len(rs), "n_cases": len(rs)}
        rec["cases"] = [{k: v for k, v in r.items() if k != "corpus"} for r in rs]
    if task in ("lm", "continuation", "agreement"):
        rec["per_item"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rs]
    return rec


def write_results(results: dict, out: str | Path, plots: bool = True) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1, allow_nan=False, default=str))
    if plots:
        from .plots import plot_results

        results["plots"] = [str(p) for p in plot_results(results, out)]
        path.write_text(json.dumps(results, indent=1, allow_nan=False, default=str))
    return path


# ------------------------------------------------------------------------------ table

PRIMARY = {"lm": "retention", "continuation": "retention", "needle": "accuracy", "agreement": "match_rate"}


def table(results: dict) -> str:
    """A plain-text summary: one row per record."""
    rows = [
        f"{'task':13} {'domain':14} {'policy':10} {'B':>5} {'compr':>6} {'primary':>8} {'kl':>8} {'top1':>6} {'ppl':>9} {'wall_s':>7}"
    ]
    for r in results["records"]:
        m = r["metrics"]

        def f(x, spec):
            return format(x, spec) if isinstance(x, int | float) else "-"

        rows.append(
            f"{r['task']:13} {r['domain']:14} {r['policy']:10} {f(r['budget'], '5d'):>5} {f(r['compression'], '6.4f'):>6} "
            f"{f(m.get(PRIMARY[r['task']]), '8.4f'):>8} {f(m.get('kl'), '8.4f'):>8} {f(m.get('top1_agreement'), '6.3f'):>6} "
            f"{f(m.get('ppl_policy'), '9.3f'):>9} {f(r['wall_s'], '7.1f'):>7}"
        )
    if results.get("skipped_policies"):
        rows.append("skipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped_policies"].items()))
    for n in results.get("notes", []):
        rows.append("note: " + n)
    return "\n".join(rows)
