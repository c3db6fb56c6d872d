"""Resumable, splittable runs: one JSON line per finished unit, a rerun skips what is done.

Layout of an output folder::

    OUT/run.json              what the records depend on (model, scorers, doc length, budgets' reference
                              length, sinks, window, thresholds, seed); a run with other settings refuses it
    OUT/records/<tag>.jsonl   one line per finished unit (tag: "main" or "shard-1-of-2")
    OUT/sessions.jsonl        one line per finished process: shard, selection, skipped policies, notes, wall
    OUT/results.json          the aggregate of every record in OUT (rewritten by each finished process)

Each process appends only to its own ``records/<tag>.jsonl`` (a line is flushed and fsynced
when its unit ends; a line cut by a kill is dropped on the next start), and reads every
``records/*.jsonl`` to know what is done, so processes may share a folder or use their own
folders and be merged (:func:`load_dirs`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..files import atomic_write

RUN_FILE = "run.json"
RECORDS_DIR = "records"
SESSIONS_FILE = "sessions.jsonl"


class StoreMismatch(ValueError):
    """An output folder holds records made with other settings."""


def unit_key(item_id: str, policy: str, budget: int | None) -> str:
    return f"{item_id}|{policy}|{budget if budget is not None else '-'}"


def _read_jsonl(path: Path) -> tuple[list[dict], int, bool]:
    """(records, bytes of the valid prefix, whether the file ended in a cut line)."""
    data = path.read_bytes()
    out, good, cut = [], 0, False
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        line = data[pos:end]
        try:
            if line.strip():
                out.append(json.loads(line))
            if nl < 0:
                raise ValueError("no newline")  # a last line without newline was cut by a kill
            good = end
        except ValueError:
            cut = True
            break
        pos = end
    return out, good, cut


def _diff(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b))
    return "; ".join(f"{k}: {a.get(k)!r} here vs {b.get(k)!r} there" for k in keys if a.get(k) != b.get(k))


class RecordStore:
    """Unit records of one output folder (``out=None``: in memory only)."""

    def __init__(self, out: str | Path | None, fingerprint: dict, tag: str = "main") -> None:
        self.out = Path(out) if out is not None else None
        self.fingerprint = fingerprint
        self.tag = tag
        self.records: dict[str, dict] = {}
        self.dropped_lines = 0
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        run = self.out / RUN_FILE
        if run.exists():
            old = json.loads(run.read_text()).get("fingerprint", {})
            if old != fingerprint:
                raise StoreMismatch(
                    f"{self.out} holds results made with other settings ({_diff(fingerprint, old)}); "
                    "use another --out folder (or delete it to start over)"
                )
        else:
            text = json.dumps({"fingerprint": fingerprint}, indent=1) + "\n"
            atomic_write(run, lambda tmp: Path(tmp).write_text(text))
        (self.out / RECORDS_DIR).mkdir(exist_ok=True)
        self.path = self.out / RECORDS_DIR / f"{tag}.jsonl"
        for f in sorted((self.out / RECORDS_DIR).glob("*.jsonl")):
            recs, good, cut = _read_jsonl(f)
            if cut:
                self.dropped_lines += 1
                if f == self.path:  # our own file: cut the broken tail before appending
                    with open(f, "r+b") as fh:
                        fh.truncate(good)
            for r in recs:
                self.records.setdefault(r["key"], r)

    def done(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, rec: dict) -> None:
        self.records[rec["key"]] = rec
        if self.out is None:
            return
        line = json.dumps(rec, allow_nan=False, default=str) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def add_session(self, session: dict) -> None:
        if self.out is None:
            return
        with open(self.out / SESSIONS_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(session, allow_nan=False, default=str) + "\n")


def load_dirs(dirs) -> tuple[dict, list[dict], list[dict]]:
    """(fingerprint, unit records, sessions) of several output folders, which must agree on the
    fingerprint; a unit present in several is kept once (the first folder's).

    ``policy_kwargs`` (e.g. a ``--scorer`` path) must agree only for the policies that two folders
    both ran: one folder's heuristics and another's learned scorer, evaluated with otherwise equal
    settings, merge; the merged fingerprint names the kwargs of every policy some folder ran."""
    fingerprint = None
    kwargs: dict[str, dict] = {}  # policy -> its kwargs, over the folders that ran it
    records: dict[str, dict] = {}
    sessions: list[dict] = []
    for d in dirs:
        d = Path(d)
        run = d / RUN_FILE
        if not run.exists():
            raise FileNotFoundError(f"{d} is not a kvpop eval output folder (no {RUN_FILE})")
        fp = json.loads(run.read_text()).get("fingerprint", {})
        rest = {k: v for k, v in fp.items() if k != "policy_kwargs"}
        if fingerprint is None:
            fingerprint = rest
        elif rest != fingerprint:
            raise StoreMismatch(f"cannot merge {d}: made with other settings ({_diff(rest, fingerprint)})")
        recs = [r for f in sorted((d / RECORDS_DIR).glob("*.jsonl")) for r in _read_jsonl(f)[0]]
        for policy in sorted({r.get("policy") for r in recs} - {None}):
            kw = fp.get("policy_kwargs", {}).get(policy, {})
            if kwargs.setdefault(policy, kw) != kw:
                raise StoreMismatch(f"cannot merge {d}: made with other settings (policy {policy!r} with "
                                    f"{kw!r} here vs {kwargs[policy]!r} there)")  # fmt: skip
        for r in recs:
            records.setdefault(r["key"], r)
        sf = d / SESSIONS_FILE
        if sf.exists():
            sessions += _read_jsonl(sf)[0]
    if fingerprint is not None:
        fingerprint["policy_kwargs"] = {p: kw for p, kw in sorted(kwargs.items()) if kw}
    return fingerprint or {}, list(records.values()), sessions
