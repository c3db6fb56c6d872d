"""Bring ``kvpop eval`` / ``kvpop eval tasks`` folders up to the scorers shipped now, keeping the records
that are still right.

An evaluation folder fingerprints the shipped scorers a learned policy given no ``--scorer`` reads (all of
them for the folder's model: the default and any shipped beside it for other budgets). When a scorer for
other budgets ships beside the default, every earlier folder is refused on resume, although most of its
records were made by the default at budgets where the default still serves. This keeps those: for each
learned policy recorded without a path, a record stays when the file the policy reads at the record's
budget now (:func:`kvpop.checkpoint.default_scorer_path`) has the sha256 the folder recorded (the bytes the
record was made with); every other record of that policy moves to ``records/stale/`` (kept, never read), so
rerunning the folder's command computes exactly those again. Then the folder records the hash of today's
set. A folder made with a scorer that no longer ships is left alone, as the record of that scorer.
``run.json`` and each records file are replaced atomically.

    python scripts/rehash_scorers.py results/qwen/tasks-humaneval-b55 results/qwen/tasks-ruler-vt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpop.checkpoint import default_scorer_path, shipped_scorers
from kvpop.evaluate.harness import file_sha256, shipped_scorers_sha256
from kvpop.evaluate.store import RECORDS_DIR, RUN_FILE
from kvpop.files import atomic_write
from kvpop.policies import ALIAS, KIND_TO_POLICY


def _write_lines(path: Path, lines: list[str]) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text("".join(line + "\n" for line in lines)))


def rehash_folder(folder: Path) -> dict[str, int]:
    """Rewrite ``folder``; returns ``{policy: records set aside}`` for each policy whose hash changed."""
    from transformers import AutoConfig

    run = folder / RUN_FILE
    if not run.is_file():
        raise SystemExit(f"{folder}: no {RUN_FILE} (not a kvpop eval output folder)")
    doc = json.loads(run.read_text())
    fp = doc.get("fingerprint", doc)
    config = AutoConfig.from_pretrained(fp["model"], local_files_only=True)
    kw = fp.get("policy_kwargs") or {}
    stale_policies, changed = {}, {}
    for kind, policy in KIND_TO_POLICY.items():
        entry = kw.get(policy)
        if not isinstance(entry, dict) or "path" in entry or "sha256" not in entry:
            continue
        now = shipped_scorers_sha256(config, kind)
        if now is None or entry["sha256"] == now:
            continue
        if entry["sha256"] not in {file_sha256(p) for p in shipped_scorers(kind, config)}:
            continue  # made with a scorer that no longer ships: left as the record of that scorer
        stale_policies[policy] = (kind, entry["sha256"])
        changed[policy] = 0
        for name in (policy, ALIAS):
            if kw.get(name) == entry:
                kw[name] = {**entry, "sha256": now}
    if not changed:
        return changed
    reads: dict[tuple[str, int | None], str | None] = {}  # (kind, budget) -> sha256 of the file it reads now
    for records in sorted((folder / RECORDS_DIR).glob("*.jsonl")):
        keep, stale = [], []
        for line in records.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            kind, recorded = stale_policies.get(rec.get("policy"), (None, None))
            if kind is None:
                keep.append(line)
                continue
            budget = rec.get("budget")
            if (kind, budget) not in reads:
                reads[kind, budget] = file_sha256(default_scorer_path(kind, config, budget=budget))
            ok = reads[kind, budget] == recorded
            (keep if ok else stale).append(line)
            changed[rec["policy"]] += not ok
        if stale:
            aside = folder / RECORDS_DIR / "stale" / records.name
            aside.parent.mkdir(exist_ok=True)
            before = aside.read_text().splitlines() if aside.is_file() else []
            _write_lines(aside, before + stale)
            _write_lines(records, keep)
    atomic_write(run, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    args = p.parse_args(argv)
    for folder in args.folders:
        changed = rehash_folder(folder)
        said = ", ".join(f"{p} ({n} records set aside)" for p, n in changed.items())
        print(f"{folder}: {said or 'already right'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
