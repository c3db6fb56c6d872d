"""Text and Markdown tables of ``results.json`` (the Markdown one is written to ``OUT/table.md``)."""

from __future__ import annotations

from collections import defaultdict

LABEL = {
    "lm": "Teacher-forced LM",
    "continuation": "Continuation (the last predictions of each document)",
    "needle": "Passkey needle",
    "multikey": "Multi-key recall",
    "agreement": "Greedy agreement with dense",
}
# each task's primary metric (the tables and plots lead with it)
PRIMARY = {
    "lm": "retention",
    "continuation": "retention",
    "needle": "accuracy",
    "multikey": "accuracy",
    "agreement": "match_rate",
}
TASK_ORDER = ("lm", "continuation", "needle", "multikey", "agreement")


def _f(x, spec=".3f") -> str:
    return format(x, spec) if isinstance(x, int | float) and not isinstance(x, bool) else "-"


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def _wl(vs: dict | None, key: str = "all") -> str:
    if not vs or key not in vs:
        return "-"
    c = vs[key]
    return f"{c['wins']}-{c['losses']}" + (f" ({c['ties']} tied)" if c["ties"] else "")


def _comp(r) -> str:
    return "dense" if r["budget"] is None else f"{r['compression']:.4g} (B={r['budget']})"


def text_table(results: dict) -> str:
    rows = [
        (
            f"{'task':12} {'domain':13} {'policy':10} {'B':>5} {'wdw':>5} {'primary':>8} {'95% CI':>17} "
            f"{'longdep':>8} {'95% CI':>17} {'n_ld':>6} {'kl':>7} {'W-L vs stream':>14} {'wall_s':>8}"
        )
    ]
    for r in results["records"]:
        m, ld = r["metrics"], r.get("longdep") or {}
        ci = (r.get("ci") or {}).get(PRIMARY[r["task"]])
        vs = r.get("vs_streaming")
        wl = _wl(vs) + (f" / {_wl(vs, 'longdep')}" if vs and "longdep" in vs else "")
        rows.append(
            f"{r['task']:12} {r['domain']:13} {r['policy']:10} {_f(r['budget'], 'd'):>5} {_f(r['window'], 'd'):>5} "
            f"{_f(m.get(PRIMARY[r['task']]), '8.4f'):>8} {_ci(ci):>17} {_f(ld.get('retention'), '8.4f'):>8} "
            f"{_ci((ld.get('ci') or {}).get('retention')):>17} {_f(ld.get('n_tokens'), 'd'):>6} "
            f"{_f(m.get('kl'), '7.4f'):>7} {wl:>14} {_f(r['wall_s'], '8.1f'):>8}"
        )
    if results.get("skipped_policies"):
        rows.append("skipped policies: " + "; ".join(f"{k}: {v}" for k, v in results["skipped_policies"].items()))
    for n in results.get("notes", []):
        rows.append("note: " + n)
    return "\n".join(rows)


def _by(rows, *keys):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def _domains(rows: list[dict]):
    """``(budgets, compression per budget, [(domain, its rows, {(policy, budget): row}, policies)])``."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None}, reverse=True)
    comps = {r["budget"]: r["compression"] for r in rows}
    per = [
        (domain, recs, {(r["policy"], r["budget"]): r for r in recs}, list(dict.fromkeys(r["policy"] for r in recs)))
        for (domain,), recs in sorted(_by(rows, "domain").items())
    ]
    return budgets, comps, per


def _table_head(title: str, head: list[str]) -> list[str]:
    """A Markdown table's title line and header."""
    return [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def _doc_tables(task: str, rows: list[dict]) -> list[str]:
    lines = []
    budgets, comps, per = _domains(rows)
    for domain, recs, cell, policies in per:
        head = ["policy"]
        for b in budgets:
            c = f"{comps[b]:.4g}"
            head += [f"{c}: all tokens", f"{c}: long-dep tokens", f"{c}: W-L vs streaming (all / long-dep)"]
        lines += _table_head(
            f"**{LABEL[task]} — {domain}** ({recs[0]['n_items']} documents; retention = ppl_dense / "
            "ppl_policy, [95% bootstrap CI over documents])",
            head,
        )
        for p in policies:
            row = [p]
            for b in budgets:
                r = cell.get((p, b))
                if r is None:
                    row += ["-", "-", "-"]
                    continue
                ld = r.get("longdep") or {}
                row.append(f"{_f(r['metrics'].get('retention'))} {_ci((r.get('ci') or {}).get('retention'))}")
                row.append(f"{_f(ld.get('retention'))} {_ci((ld.get('ci') or {}).get('retention'))}")
                vs = r.get("vs_streaming")
                row.append(f"{_wl(vs)} / {_wl(vs, 'longdep')}" if vs else "-")
            lines.append("| " + " | ".join(row) + " |")
        dense = [cell.get((DENSE_NAME, b)) for b in budgets]
        counts = [
            f"B={b}: {d['longdep']['n_tokens']} of {d['metrics']['n_tokens']} scored tokens"
            for b, d in zip(budgets, dense)
            if d and d.get("longdep")
        ]
        if counts:
            thr = next((d["longdep"].get("threshold") for d in dense if d and d.get("longdep")), None)
            lines += [
                "",
                f"Long-dependency tokens (dense NLL with full context lower by > {thr} nats than with "
                f"sinks + the last B - sinks tokens): " + "; ".join(counts) + ".",
            ]
        lines.append("")
    return lines


DENSE_NAME = "dense"


def _choice_tables(task: str, rows: list[dict]) -> list[str]:
    lines = []
    budgets, comps, per = _domains(rows)
    for domain, recs, cell, policies in per:
        lengths = sorted({int(L) for r in recs for L in r.get("by_length", {})})
        head = ["policy"] + [f"{comps[b]:.4g} (B={b})" for b in budgets]
        lines += _table_head(
            f"**{LABEL[task]} — {domain}** (accuracy over {recs[0]['n_items']} cases [95% bootstrap CI]; "
            f"by length {'/'.join(map(str, lengths))}; W-L vs streaming per case)",
            head,
        )
        for p in policies:
            row = [p]
            for b in budgets:
                r = cell.get((p, b)) or cell.get((p, None))
                if r is None:
                    row.append("-")
                    continue
                bl = "/".join(_f(r["by_length"].get(str(L), {}).get("accuracy"), ".2f") for L in lengths)
                vs = r.get("vs_streaming")
                row.append(
                    f"{_f(r['metrics']['accuracy'], '.2f')} {_ci((r.get('ci') or {}).get('accuracy'))} "
                    f"({bl}){'; ' + _wl(vs) if vs else ''}"
                )
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines


def _agreement_tables(rows: list[dict]) -> list[str]:
    lines = []
    for (domain,), recs in sorted(_by(rows, "domain").items()):
        lines += [
            f"**{LABEL['agreement']} — {domain}**",
            "",
            "| policy | compression | match rate | prefix match | W-L |",
            "|---|---|---|---|---|",
        ]
        for r in recs:
            m = r["metrics"]
            lines.append(
                f"| {r['policy']} | {_comp(r)} | {_f(m.get('match_rate'))} "
                f"{_ci((r.get('ci') or {}).get('match_rate'))} | {_f(m.get('prefix_match'))} | "
                f"{_wl(r.get('vs_streaming'))} |"
            )
        lines.append("")
    return lines


def markdown_report(results: dict) -> str:
    lines = [f"# kvpop eval: {results.get('model')}", ""]
    sessions = results.get("sessions", [])
    lines.append(
        f"{len(results.get('units', []))} units; {len(sessions)} process run(s), "
        f"{results.get('wall_s', 0.0) / 3600:.2f} h of process wall time in all "
        f"({results.get('unit_wall_s', 0.0) / 3600:.2f} h in the units and the dense / window-only / oracle runs "
        "they share)."
    )
    lines.append("")
    recs = results["records"]
    for task in TASK_ORDER:
        rows = [r for r in recs if r["task"] == task]
        if not rows:
            continue
        if task in ("lm", "continuation"):
            lines += _doc_tables(task, rows)
        elif task == "agreement":
            lines += _agreement_tables(rows)
        else:
            lines += _choice_tables(task, rows)
    if results.get("skipped_policies"):
        lines += ["Skipped policies:", ""] + [f"- {k}: {v}" for k, v in results["skipped_policies"].items()] + [""]
    if results.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in results["notes"]] + [""]
    return "\n".join(lines)
