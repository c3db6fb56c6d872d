"""Rename a policy in the records of ``kvpop eval`` / ``kvpop eval tasks`` output folders.

Folders written before the mLSTM policy was named ``kvpop-mlstm`` call it ``kvpop``, which now names the
model's default learned policy; this rewrites such folders so their tables say what ran:

    python scripts/rename_policy.py results/qwen/tasks-ruler --old kvpop --new kvpop-mlstm
    kvpop eval tasks --report results/qwen/tasks-ruler      # the table again, from the renamed records

Rewrites each record's ``policy`` and ``key``, the scorer hashes in ``run.json`` and the policy lists of
the sessions file; every file is replaced atomically (written beside, then renamed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpop.files import atomic_write


def _write(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _rename_list(xs, old: str, new: str):
    return [new if x == old else x for x in xs] if isinstance(xs, list) else xs


def rename_folder(folder: Path, old: str, new: str) -> int:
    """Rename ``old`` to ``new`` in one output folder; returns the number of records changed."""
    run = folder / "run.json"
    if not run.is_file():
        raise SystemExit(f"{folder}: no run.json (not a kvpop eval output folder)")
    files = {
        f: [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        for f in sorted((folder / "records").glob("*.jsonl"))
    }
    if any(r.get("policy") == new for rs in files.values() for r in rs):
        raise SystemExit(f"{folder}: already holds records of {new!r}; nothing renamed")
    changed = 0
    for f, records in files.items():
        lines = []
        for r in records:
            if r.get("policy") == old:
                r["policy"] = new
                head, _, rest = r["key"].partition(f"|{old}|")
                r["key"] = f"{head}|{new}|{rest}"
                changed += 1
            lines.append(json.dumps(r))
        _write(f, "\n".join(lines) + "\n")
    doc = json.loads(run.read_text())
    fp = doc.get("fingerprint", doc)
    kw = fp.get("policy_kwargs") or {}
    if old in kw:
        if new in kw:
            raise SystemExit(f"{folder}: run.json already records both {old!r} and {new!r}")
        kw[new] = kw.pop(old)
        _write(run, json.dumps(doc, indent=1) + "\n")
    sessions = folder / "sessions.jsonl"
    if sessions.is_file():
        out = []
        for line in sessions.read_text().splitlines():
            if line.strip():
                s = json.loads(line)
                s["policies"] = _rename_list(s.get("policies"), old, new)
                if isinstance(s.get("config"), dict):
                    s["config"]["policies"] = _rename_list(s["config"].get("policies"), old, new)
                out.append(json.dumps(s))
        _write(sessions, "\n".join(out) + "\n")
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    args = p.parse_args(argv)
    if args.old == args.new:
        p.error("--old and --new are the same")
    for d in args.folders:
        print(f"{d}: {rename_folder(d, args.old, args.new)} records renamed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
