"""From per-unit records to the table: pooled metrics, bootstrap intervals over documents, wins.

Every record of a teacher-forced document keeps additive sums (``n``, ``nll_dense``,
``nll_policy``, ``kl``, ``top1``) per subset of positions, so any set of documents pools
exactly, and a bootstrap over documents resamples documents (with replacement) and pools their
sums. Wins / losses against StreamingLLM compare the same document (or case) at the same
budget: retention higher / lower (equivalently, the policy's NLL lower / higher: the dense NLL
is the same), correct where streaming is wrong / the reverse.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..policies import DENSE
from .quality import Sums, compare, tally

REFERENCE = "streaming"
TASK_ORDER = ("lm", "continuation", "needle", "multikey", "agreement")
# teacher-forced tasks: (all-token subset, long-dependency subset) of each document record
DOC_SUBSETS = {"lm": ("all", "longdep"), "continuation": ("cont", "cont_longdep")}
SUM_FIELDS = ("n", "nll_dense", "nll_policy", "kl", "top1")


def sums_from_dict(d: dict | None) -> Sums:
    if not d:
        return Sums()
    return Sums(int(d["n"]), float(d["nll_dense"]), float(d["nll_policy"]), float(d["kl"]), float(d["top1"]))


def sums_to_dict(s: Sums) -> dict:
    return {"n": s.n, "nll_dense": s.nll_dense, "nll_policy": s.nll_policy, "kl": s.kl, "top1": s.top1}


# ------------------------------------------------------------------------------ bootstrap


def _resample_counts(n_items: int, n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, n_items]``: how often each item is drawn in each resample (fixed seed: every row
    with the same number of items, in the same order, uses the same resamples)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_items, size=(n_boot, n_items))
    counts = np.zeros((n_boot, n_items))
    np.add.at(counts, (np.repeat(np.arange(n_boot), n_items), idx.ravel()), 1.0)
    return counts


def _interval(values: np.ndarray) -> list[float] | None:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [float(lo), float(hi)]


def bootstrap_pooled(items: list[Sums], n_boot: int = 2000, seed: int = 0) -> dict[str, list[float] | None]:
    """95% percentile intervals of pooled ``retention``, ``kl`` and ``top1_agreement`` over items."""
    keys = ("retention", "kl", "top1_agreement")
    if not items or n_boot < 1:
        return dict.fromkeys(keys)
    a = np.array([[s.n, s.nll_dense, s.nll_policy, s.kl, s.top1] for s in items], dtype=np.float64)
    pooled = _resample_counts(len(items), n_boot, seed) @ a  # [n_boot, 5]
    n = pooled[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        ret = np.exp((pooled[:, 1] - pooled[:, 2]) / n)
        kl = pooled[:, 3] / n
        top1 = pooled[:, 4] / n
    return {"retention": _interval(ret), "kl": _interval(kl), "top1_agreement": _interval(top1)}


def bootstrap_mean(values: list[float], n_boot: int = 2000, seed: int = 0) -> list[float] | None:
    """95% percentile interval of the mean of ``values`` (e.g. 0/1 correctness per case)."""
    if not values or n_boot < 1:
        return None
    v = np.asarray(values, dtype=np.float64)
    return _interval(_resample_counts(len(v), n_boot, seed) @ v / len(v))


# ------------------------------------------------------------------------------ aggregation


def _layout(recs: list[dict]) -> dict:
    r = recs[0]
    return {k: r.get(k) for k in ("budget", "compression", "sinks", "window", "k")}


def _doc_rows(units: list[dict], n_boot: int) -> list[dict]:
    groups = _groups(units)
    rows = []
    for task, (all_key, ld_key) in DOC_SUBSETS.items():
        for (domain, policy, budget), recs in groups.items():
            ref = {u["item_id"]: u for u in groups.get((domain, REFERENCE, budget), [])}
            row = _head(task, domain, policy, recs)
            for label, key in (("metrics", all_key), ("longdep", ld_key)):
                per = [sums_from_dict(u["sums"].get(key)) for u in recs]
                pooled = Sums.pool(per)
                m = pooled.metrics()
                block = {**m, "ci": bootstrap_pooled(per, n_boot)}
                if label == "metrics":
                    row["metrics"] = m
                    row["ci"] = block["ci"]
                else:
                    n_all = sum(sums_from_dict(u["sums"].get(all_key)).n for u in recs)
                    block["fraction"] = pooled.n / n_all if n_all else None
                    block["threshold"] = recs[0].get("longdep_threshold")
                    row["longdep"] = block
            if policy not in (REFERENCE, DENSE) and ref:
                vs = {}
                for label, key in (("all", all_key), ("longdep", ld_key)):
                    out = []
                    for u in recs:
                        r = ref.get(u["item_id"])
                        a, b = sums_from_dict(u["sums"].get(key)), sums_from_dict(r["sums"].get(key)) if r else None
                        if b is None or a.n == 0 or b.n == 0:
                            out.append(None)
                            continue
                        out.append(compare(-a.nll_policy / a.n, -b.nll_policy / b.n))
                    vs[label] = tally(out)
                row["vs_streaming"] = vs
            per_corpus = {}
            for corpus in row["corpora"]:
                cr = [u for u in recs if u["source"] == corpus]
                tot, ld = Sums(), Sums()
                for u in cr:
                    tot = tot.add(sums_from_dict(u["sums"].get(all_key)))
                    ld = ld.add(sums_from_dict(u["sums"].get(ld_key)))
                per_corpus[corpus] = {
                    "n_docs": len(cr),
                    "retention": tot.metrics()["retention"],
                    "kl": tot.metrics()["kl"],
                    "longdep_retention": ld.metrics()["retention"],
                    "longdep_tokens": ld.n,
                }
            row["per_corpus"] = per_corpus
            row["per_item"] = [
                {
                    "item": u["item_id"],
                    "retention": sums_from_dict(u["sums"].get(all_key)).metrics()["retention"],
                    "longdep_retention": sums_from_dict(u["sums"].get(ld_key)).metrics()["retention"],
                    "longdep_tokens": sums_from_dict(u["sums"].get(ld_key)).n,
                }
                for u in recs
            ]
            rows.append(row)
    return rows


def _groups(units: list[dict]) -> dict[tuple, list[dict]]:
    """Unit records by ``(domain, policy, budget)``, each group sorted by item."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for u in units:
        groups[(u["domain"], u["policy"], u["budget"])].append(u)
    return {k: sorted(v, key=lambda u: u["item_id"]) for k, v in groups.items()}


def _head(task: str, domain: str, policy: str, recs: list[dict]) -> dict:
    """What every row starts with: its task, domain, policy, layout, items, corpora and wall time."""
    return {
        "task": task,
        "domain": domain,
        "policy": policy,
        **_layout(recs),
        "n_items": len(recs),
        "corpora": sorted({u["source"] for u in recs}),
        "wall_s": sum(u.get("wall_s") or 0.0 for u in recs),
    }


def _vs_streaming(groups: dict, key: tuple, recs: list[dict], value) -> dict | None:
    """Per-item wins / losses / ties of ``value(unit)`` against StreamingLLM's on the same item and budget."""
    domain, policy, budget = key
    if policy in (REFERENCE, DENSE):
        return None
    ref = {u["item_id"]: u for u in groups.get((domain, REFERENCE, budget), [])}
    if not ref:
        return None
    return {"all": tally([compare(value(u), value(ref[u["item_id"]])) if u["item_id"] in ref else None for u in recs])}


def _choice_rows(task: str, units: list[dict], n_boot: int) -> list[dict]:
    """needle / multikey: accuracy over cases, per length (and depth), wins vs streaming per case."""
    groups = _groups(units)
    rows = []
    for key, recs in groups.items():
        correct = [1.0 if u["correct"] else 0.0 for u in recs]
        row = {
            **_head(task, *key[:2], recs),
            "metrics": {"accuracy": sum(correct) / len(correct), "n_cases": len(correct)},
            "ci": {"accuracy": bootstrap_mean(correct, n_boot)},
        }
        by_len: dict[int, list[float]] = defaultdict(list)
        for u, c in zip(recs, correct):
            by_len[u["length"]].append(c)
        row["by_length"] = {str(L): {"accuracy": sum(v) / len(v), "n": len(v)} for L, v in sorted(by_len.items())}
        if task == "multikey":
            row["metrics"]["other_key_rate"] = sum(bool(u.get("other_key")) for u in recs) / len(recs)
        row["cases"] = [
            {
                k: u.get(k)
                for k in (
                    "item_id",
                    "length",
                    "depth",
                    "case",
                    "tokens",
                    "correct",
                    "answer",
                    "expected",
                    "passkey",
                    "asked_depth",
                )
                if k in u
            }
            for u in recs
        ]
        vs = _vs_streaming(groups, key, recs, lambda u: float(u["correct"]))
        if vs is not None:
            row["vs_streaming"] = vs
        rows.append(row)
    return rows


def _agreement_rows(units: list[dict], n_boot: int) -> list[dict]:
    groups = _groups(units)
    rows = []
    for key, recs in groups.items():
        n = sum(u["n_tokens"] for u in recs)
        rates = [u["match_rate"] for u in recs if u["match_rate"] is not None]
        row = {
            **_head("agreement", *key[:2], recs),
            "metrics": {
                "n_tokens": n,
                "match_rate": sum(u["match_rate"] * u["n_tokens"] for u in recs) / n if n else None,
                "prefix_match": sum(u["prefix_match"] for u in recs) / len(recs),
            },
            "ci": {"match_rate": bootstrap_mean(rates, n_boot)},
        }
        vs = _vs_streaming(groups, key, recs, lambda u: u["match_rate"])
        if vs is not None:
            row["vs_streaming"] = vs
        rows.append(row)
    return rows


def _order(policies: list[str]):
    def key(row):
        p = row["policy"]
        t = TASK_ORDER.index(row["task"]) if row["task"] in TASK_ORDER else len(TASK_ORDER)
        return (
            t,
            row["domain"],
            policies.index(p) if p in policies else len(policies),
            p,
            row["budget"] if row["budget"] is not None else -1,
        )

    return key


def aggregate(units: list[dict], *, tasks=None, policies: list[str] | None = None, n_boot: int = 2000) -> list[dict]:
    """Rows ``(task, domain, policy, budget)`` from unit records (``tasks``: which to report)."""
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for u in units:
        by_kind[u["kind"]].append(u)
    rows: list[dict] = []
    if by_kind.get("doc"):
        rows += [r for r in _doc_rows(by_kind["doc"], n_boot) if tasks is None or r["task"] in tasks]
    for task in ("needle", "multikey"):
        if by_kind.get(task):
            rows += _choice_rows(task, by_kind[task], n_boot)
    if by_kind.get("agreement"):
        rows += _agreement_rows(by_kind["agreement"], n_boot)
    order = list(policies or [])
    rows.sort(key=_order(order))
    return rows
