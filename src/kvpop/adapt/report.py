"""``kvpop compare-adapted``: the adaptation report over the test splits, resumable and splittable.

The documents are the evaluation corpora's test documents (the same as ``kvpop eval``: 4,096
tokens, 2 per corpus by default). One unit is one row of :class:`~kvpop.adapt.quality.Comparison`
(adapted kvpop, base kvpop, StreamingLLM+, StreamingLLM, the adapted models dense) on one
document at every budget, against the base model's dense outputs. A unit's additive sums go to
one JSON line when it ends (``kvpop.evaluate.store.RecordStore``), so a killed run resumes and
``--shard i/n`` processes share the folder. A unit's key holds a hash of the bundle its row runs,
so ``--rows`` can run the base-model rows before the adapters are final, and a changed bundle
reruns only its own rows. Every finished process rewrites ``results.json``, ``table.md`` and
``adapt.png`` from the records of the current bundles.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from .. import models
from ..config import budget_of_compression
from ..evaluate import harness
from ..evaluate.plotting import pyplot, save_figure
from ..evaluate.quality import Sums, doc_key, wins
from ..evaluate.stats import bootstrap_pooled, sums_from_dict, sums_to_dict
from ..evaluate.store import RecordStore, StoreMismatch, shard_tag
from ..files import atomic_write
from ..validate import parse_shard
from .config import ROW_ORDER
from .quality import Comparison

LABELS = {
    "adapted kvpop": "kvpop, adapted",
    "base kvpop": "kvpop, base model",
    "adapted streaming": "StreamingLLM+ (adapted under the window)",
    "base streaming": "StreamingLLM, base model",
    "adapted dense": "kvpop-adapted model, dense",
    "streaming+ dense": "StreamingLLM+ model, dense",
}
SUBJECT = "adapted kvpop"  # the per-document win/loss counts are of this row against each other row
DOMAINS = ("in_domain", "out_of_domain", "all")


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _check(args) -> tuple[list[int], tuple[int, int] | None]:
    for name in ("bundle", "streaming_bundle"):
        path = getattr(args, name)
        if path is not None and not (Path(path) / "kvpop_adapter.json").is_file():
            raise FileNotFoundError(
                f"--{name.replace('_', '-')}: {path} is not a kvpop adapter bundle (no kvpop_adapter.json)"
            )
    if args.doc_tokens < 2:
        raise ValueError(f"--doc-tokens must be >= 2, got {args.doc_tokens}")
    if args.docs < 1:
        raise ValueError(f"--docs must be >= 1, got {args.docs}")
    budgets = []
    for c in args.compression:
        if not 0.0 < c < 1.0:
            raise ValueError(f"--compression values must be in (0, 1), got {c}")
        budgets.append(budget_of_compression(c, args.doc_tokens))
    return budgets, parse_shard(args.shard)


# ------------------------------------------------------------------------------ aggregation


def _entry(per: list[Sums], mine: list[Sums] | None, n_boot: int) -> dict:
    """Pooled metrics of one row, the bootstrap interval over documents and, with ``mine`` (the same
    documents under adapted kvpop), the per-document wins and losses of adapted kvpop against it."""
    m = Sums.pool(per).metrics()
    entry = {k: m[k] for k in ("retention", "kl", "top1_agreement", "n_tokens")}
    entry["ci"] = bootstrap_pooled(per, n_boot=n_boot)
    if mine is not None:
        w = wins([s.retention for s in mine], [s.retention for s in per])
        entry["subject_wins"], entry["subject_losses"] = w["wins"], w["losses"]
    return entry


def aggregate(records: list[dict], budgets: list[int], n_boot: int = 2000) -> dict:
    """``{domain: {B: {row: metrics + ci + W-L of adapted kvpop vs row}}}`` from unit records: ``lm``
    (positions >= B), and under ``"continuation"`` the last S / 16 predictions when every document's
    record has them (records of units run before compare-adapted scored the continuation do not)."""
    out: dict = {}
    for domain in DOMAINS:
        recs = [r for r in records if domain == "all" or r["domain"] == domain]
        if not recs:
            continue
        out[domain] = {}
        for b in budgets:
            rows = [row for row in ROW_ORDER if all(row in r["sums"].get(str(b), {}) for r in recs)]
            res = {}
            for task, field in (("lm", "sums"), ("continuation", "continuation")):
                have = [row for row in rows if all(row in r.get(field, {}).get(str(b), {}) for r in recs)]
                per = {row: [sums_from_dict(r[field][str(b)][row]) for r in recs] for row in have}
                for row in have:
                    entry = _entry(per[row], per.get(SUBJECT) if row != SUBJECT else None, n_boot)
                    if task == "lm":
                        entry["per_doc"] = [
                            {"doc": f"{r['corpus']}#{r['doc']}", "retention": s.retention}
                            for r, s in zip(recs, per[row], strict=True)
                        ]
                        res[row] = entry
                    else:
                        res[row]["continuation"] = entry
            out[domain][str(b)] = res
        out[domain]["n_docs"] = len(recs)
    return out


def table(results: dict) -> str:
    """Markdown tables per domain: per budget, lm retention [95% CI], KL, adapted kvpop's W-L, and the
    continuation's retention and W-L when the records have it."""
    lines = []
    for domain in DOMAINS:
        agg = results["aggregate"].get(domain)
        if not agg:
            continue
        budgets = [b for b in agg if b != "n_docs"]
        cont = all("continuation" in e for b in budgets for e in agg[b].values())
        cols = "retention [95% CI] | KL | adapted kvpop W-L" + (" | continuation | W-L" if cont else "")
        lines.append(f"### {domain.replace('_', ' ')} ({agg['n_docs']} documents)\n")
        head = "| row | " + " | ".join(f"B = {b}: " + cols for b in budgets) + " |"
        lines += [head, "|---" * (1 + (5 if cont else 3) * len(budgets)) + "|"]
        for row in ROW_ORDER:
            if not all(row in agg[b] for b in budgets):
                continue
            cells = []
            for b in budgets:
                e = agg[b][row]
                cells += [_retention_ci(e), f"{e['kl']:.4f}", _wl(e)]
                if cont:
                    cells += [_retention_ci(e["continuation"]), _wl(e["continuation"])]
            lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _retention_ci(e: dict) -> str:
    ci = e["ci"]["retention"]
    return f"{e['retention']:.4f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{e['retention']:.4f}"


def _wl(e: dict) -> str:
    return f"{e['subject_wins']}-{e['subject_losses']}" if "subject_wins" in e else "-"


def plot(results: dict, path: Path) -> Path:
    plt = pyplot()
    domains = [d for d in DOMAINS if d in results["aggregate"]]
    fig, axes = plt.subplots(1, len(domains), figsize=(5.2 * len(domains), 4.2), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, domain in zip(axes[0], domains, strict=True):
        agg = results["aggregate"][domain]
        budgets = [b for b in agg if b != "n_docs"]
        rows = [r for r in ROW_ORDER if all(r in agg[b] for b in budgets)]
        width = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(budgets))]
            ys = [agg[b][row]["retention"] for b in budgets]
            # a percentile interval over few documents need not contain the pooled value: clip the bars at 0
            lo = [max(0.0, y - (agg[b][row]["ci"]["retention"] or [y, y])[0]) for y, b in zip(ys, budgets, strict=True)]
            hi = [max(0.0, (agg[b][row]["ci"]["retention"] or [y, y])[1] - y) for y, b in zip(ys, budgets, strict=True)]
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=cmap(i), label=LABELS[row])
        ax.set_xticks(range(len(budgets)), [f"B = {b}" for b in budgets])
        low = min(agg[b][r]["retention"] for b in budgets for r in rows)
        ax.set_ylim(max(0.0, low - 0.05), 1.005)
        ax.set_title(f"{domain.replace('_', ' ')} ({agg['n_docs']} docs)")
        ax.set_ylabel("retention vs base model dense")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"LLM adaptation under the bounded cache ({results['settings']['doc_tokens']} tokens)")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    return path


def _current(store: RecordStore, keys: dict[str, tuple]) -> list[dict]:
    """Per-document records (every row's sums) from the unit records of the current bundles."""
    docs: dict[tuple, dict] = {}
    for key, (domain, corpus, j, row) in keys.items():
        rec = store.done(key)
        if rec is None:
            continue
        d = docs.setdefault(
            (domain, corpus, j), {"domain": domain, "corpus": corpus, "doc": j, "sums": {}, "wall_s": 0.0}
        )
        for field in ("sums", "continuation"):
            for b, sums in rec.get(field, {}).items():
                d.setdefault(field, {}).setdefault(b, {})[row] = sums
        d["wall_s"] += rec["wall_s"]
    return sorted(docs.values(), key=lambda r: (r["domain"], r["corpus"], r["doc"]))


def write(records: list[dict], budgets: list[int], settings: dict, out: Path) -> dict:
    results = {
        "settings": settings,
        "aggregate": aggregate(records, budgets),
        "documents": records,
        "wall_seconds_total": sum(r["wall_s"] for r in records),
    }
    text = json.dumps(results, indent=1, allow_nan=True) + "\n"
    atomic_write(out / "results.json", lambda tmp: Path(tmp).write_text(text))
    (out / "table.md").write_text(table(results) + "\n")
    if results["aggregate"]:
        plot(results, out / "adapt.png")
    return results


def run(args) -> int:
    """``kvpop compare-adapted`` once its arguments are parsed (:mod:`kvpop.cli.compare_adapted`)."""
    try:
        budgets, shard = _check(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvpop compare-adapted: error: {exc}", file=sys.stderr)
        return 2
    model, tokenizer = models.load_model(args.model, progress=not args.no_progress)
    cmp = Comparison(
        model,
        args.bundle,
        budgets,
        streaming_bundle=args.streaming_bundle,
        base_scorer=args.base_scorer,
        merge=args.merge,
    )
    notes: list[str] = []
    ecfg = harness.EvalConfig(
        docs=args.docs, doc_tokens=args.doc_tokens, corpora=tuple(args.corpora) if args.corpora else None
    )
    items = [
        (domain, corpus, j, ids)
        for domain, corpus, docs in harness.corpus_documents(tokenizer, ecfg, notes)
        for j, ids in enumerate(docs)
    ]
    shas = {r: ("base" if src is None else _sha(src)) for r, (_, _, src) in cmp.rows.items()}
    settings = {
        **cmp.settings,
        "budgets": budgets,
        "doc_tokens": args.doc_tokens,
        "docs_per_corpus": args.docs,
        "row_weights": shas,
        "model": str(getattr(model.config, "_name_or_path", "")),
    }
    fingerprint = {k: settings[k] for k in ("budgets", "doc_tokens", "windows", "sinks", "lam", "base_scorer", "model")}
    out = Path(args.out)
    tag = shard_tag(shard)
    try:
        store = RecordStore(out, fingerprint, tag=tag)
    except StoreMismatch as exc:
        print(f"kvpop compare-adapted: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    def key(corpus, j, ids, row):
        return f"{corpus}#{j}:{doc_key(ids)}|{row}|{shas[row]}"

    keys = {key(c, j, ids, r): (d, c, j, r) for d, c, j, ids in items for r in cmp.rows}
    rows = [r for r in cmp.rows if args.rows is None or r in args.rows]
    mine = [it for i, it in enumerate(items) if shard is None or i % shard[1] == shard[0] - 1]
    todo = [(it, [r for r in rows if store.done(key(it[1], it[2], it[3], r)) is None]) for it in mine]
    todo = [(it, rs) for it, rs in todo if rs]
    print(
        f"{len(items)} documents, {len(mine)} in this shard, {sum(len(rs) for _, rs in todo)} of "
        f"{len(mine) * len(rows)} units to run",
        file=sys.stderr,
    )
    bar = tqdm(total=sum(len(rs) for _, rs in todo), desc="compare-adapted", disable=args.no_progress)
    for (domain, corpus, j, ids), rs in todo:
        t0 = time.perf_counter()
        bh = cmp.base_hidden(ids)
        shared = time.perf_counter() - t0  # the base model's dense pass, charged to the document's first row
        for r in rs:
            t0 = time.perf_counter()
            scores = cmp.row(r, ids, bh)
            store.append(
                {
                    "key": key(corpus, j, ids, r),
                    "domain": domain,
                    "corpus": corpus,
                    "doc": j,
                    "row": r,
                    "sums": {str(b): sums_to_dict(s.lm) for b, s in scores.items()},
                    "continuation": {str(b): sums_to_dict(s.continuation) for b, s in scores.items()},
                    "wall_s": time.perf_counter() - t0 + shared,
                }
            )
            shared = 0.0
            bar.update(1)
    bar.close()
    store = RecordStore(out, fingerprint, tag=tag)  # re-read: other shards may have finished units meanwhile
    results = write(_current(store, keys), budgets, {**settings, "notes": notes}, out)
    print(table(results))
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'adapt.png'}", file=sys.stderr)
    return 0
