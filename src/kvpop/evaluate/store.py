"""Resumable, splittable runs: one JSON line per finished unit, a rerun skips what is done.

Layout of an output folder::

    OUT/run.json              what the records depend on (model and a hash of its weights, scorers and their
                              files' sha256, doc length, budgets' reference length, sinks, window, thresholds,
                              seed); a run with other settings, or other files at the same paths, refuses it
    OUT/records/<tag>.jsonl   one line per finished unit (tag: "main" or "shard-1-of-2")
    OUT/sessions.jsonl        one line per finished process: shard, selection, skipped policies, notes, wall
    OUT/results.json          the aggregate of every record in OUT (rewritten by each finished process)

Each process appends only to its own ``records/<tag>.jsonl`` (a line is flushed and fsynced
when its unit ends; a line cut by a kill is dropped on the next start), and reads every
``records/*.jsonl`` to know what is done, so processes may share a folder or use their own
folders and be merged (:func:`load_dirs`).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

from ..files import atomic_write, check_writable_dir

RUN_FILE = "run.json"
RECORDS_DIR = "records"
SESSIONS_FILE = "sessions.jsonl"
WEIGHTS_KEY = "model_weights"  # fingerprint field: hash of the model's weights (a path alone misses a swapped file)
FILE_HASH_KEY = "sha256"  # in a policy's kwargs: the hash of the scorer file it reads
ADAPTER_KEY = "adapter"  # fingerprint field: the adapter bundle the model was loaded with, and its files' hash
# content hashes that run.json files written before eval recorded them lack: not a mismatch there
CONTENT_KEYS = (WEIGHTS_KEY,)


class StoreMismatch(ValueError):
    """An output folder holds records made with other settings."""


class StoreUnreadable(StoreMismatch):
    """A file of an output folder cannot be read back (empty, cut or edited); a ``StoreMismatch`` so that
    callers which turn a refused folder into one line do the same for this."""


def unit_key(item_id: str, policy: str, budget: int | None) -> str:
    return f"{item_id}|{policy}|{budget if budget is not None else '-'}"


def _read_jsonl(path: Path, key: str | None = None) -> tuple[list[dict], int, bool]:
    """(records, bytes of the valid prefix, whether the file ended in a cut line).

    Only the last line can be cut by a kill (each line is written whole and fsynced); a bad line with
    complete lines after it was damaged otherwise, and dropping it with all that follows would lose
    finished units, so it is an error naming the file and line. ``key``: a field every record has."""
    data = path.read_bytes()
    out, good, cut = [], 0, False
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        line = data[pos:end]
        try:
            if line.strip():
                rec = json.loads(line)
                if not isinstance(rec, dict) or (key is not None and key not in rec):
                    raise ValueError(f"not a record with {key!r}" if key else "not a JSON object")
                out.append(rec)
            if nl < 0:
                raise ValueError("no newline")  # a last line without newline was cut by a kill
            good = end
        except ValueError as exc:
            if data[end:].strip():
                n = data[:pos].count(b"\n") + 1
                raise StoreUnreadable(
                    f"{path}: line {n} is damaged ({exc}); delete that line (its unit is run again) "
                    "or restore the file, then rerun"
                ) from None
            cut = True
            break
        pos = end
    return out, good, cut


def read_run_file(path: str | Path, hint: str) -> dict:
    """The fingerprint in ``run.json`` at ``path``; an empty or broken file is one error naming it
    (``hint``: what to do about it where it is read)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        why = None if isinstance(data, dict) and isinstance(data.get("fingerprint", {}), dict) else "no fingerprint"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        why = str(exc)
    if why is not None:
        what = "empty" if not path.read_bytes().strip() else f"not a kvpop eval run file ({why})"
        raise StoreUnreadable(f"{path} is {what}: it records what the results in {path.parent} were made with; {hint}")
    return data.get("fingerprint", {})


def _run_hint(out: Path) -> str:
    return f"use another --out folder, or delete {out} to start over"


def check_out(out: str | Path, write: bool = True) -> None:
    """What an output folder alone decides, checked before any model loads: it can be written (or made;
    ``OSError`` naming it otherwise; only with ``write``) and its ``run.json``, if any, can be read back."""
    out = Path(out)
    if write:
        check_writable_dir(out, "--out")
        if (out / RECORDS_DIR).is_dir():
            check_writable_dir(out / RECORDS_DIR, "--out")
    if (out / RUN_FILE).exists():
        read_run_file(out / RUN_FILE, _run_hint(out))


def _known(fp: dict, other: dict) -> dict:
    """``fp`` without the content hashes that ``other`` does not record, so folders made before eval hashed
    the model's weights and scorer files still resume and merge (their run.json takes the hashes then);
    and without a scorer's path where both record its hash: the bytes decide, not how the path was
    written (relative or absolute, or the same file copied elsewhere)."""
    out = {k: v for k, v in fp.items() if k not in CONTENT_KEYS or k in other}
    kw, other_kw = fp.get("policy_kwargs"), other.get("policy_kwargs") or {}
    if isinstance(kw, dict):
        out["policy_kwargs"] = {}
        for p, v in kw.items():
            if isinstance(v, dict):
                theirs = other_kw.get(p) or {}
                drop = {"path"} if FILE_HASH_KEY in v and FILE_HASH_KEY in theirs else {FILE_HASH_KEY}
                v = {a: b for a, b in v.items() if a not in drop}
                if not v:
                    continue
            out["policy_kwargs"][p] = v
    return out


def same_fingerprint(a: dict, b: dict) -> bool:
    """Whether records made under fingerprint ``b`` serve a run under ``a`` (hashes only one records aside)."""
    return _known(a, b) == _known(b, a)


def _explain(here: dict, there: dict) -> str:
    """Why ``here`` (this run) cannot use records made under ``there``: files that changed at the same
    path (the model's weights, a scorer file, an adapter bundle), then other settings."""
    a, b = _known(here, there), _known(there, here)
    changed = []
    if a.get(WEIGHTS_KEY) != b.get(WEIGHTS_KEY):
        changed.append(
            f"the weights of model {here.get('model')!r}: hash {a.pop(WEIGHTS_KEY)} here vs {b.pop(WEIGHTS_KEY)} there"
        )
    ad, bd = a.get(ADAPTER_KEY), b.get(ADAPTER_KEY)
    if isinstance(ad, dict) and isinstance(bd, dict) and ad.get("path") == bd.get("path") and ad != bd:
        changed.append(
            f"the files of adapter bundle {ad.get('path')}: hash {ad.get(FILE_HASH_KEY)} here vs "
            f"{bd.get(FILE_HASH_KEY)} there"
        )
        a.pop(ADAPTER_KEY), b.pop(ADAPTER_KEY)
    ka, kb = dict(a.get("policy_kwargs") or {}), dict(b.get("policy_kwargs") or {})
    here_kw = here.get("policy_kwargs") or {}
    for p in sorted(set(ka) & set(kb)):
        va, vb = ka[p], kb[p]
        if not (isinstance(va, dict) and isinstance(vb, dict)) or va.get(FILE_HASH_KEY) == vb.get(FILE_HASH_KEY):
            continue
        ra, rb = ({x: y for x, y in v.items() if x != FILE_HASH_KEY} for v in (va, vb))
        if ra == rb:
            changed.append(
                f"the scorer file {here_kw.get(p, {}).get('path') or 'shipped with kvpop'} of policy {p}: sha256 "
                f"{str(va[FILE_HASH_KEY])[:16]} here vs {str(vb[FILE_HASH_KEY])[:16]} there"
            )
            ka[p], kb[p] = ra, rb
    a["policy_kwargs"], b["policy_kwargs"] = ka, kb
    parts = [f"other files at the same paths ({'; '.join(changed)})"] if changed else []
    settings = _diff(a, b)
    if settings or not parts:
        parts.append(f"other settings ({settings})")
    return "made with " + " and ".join(parts)


def check_fingerprint(out: str | Path, fingerprint: dict) -> dict | None:
    """The fingerprint in ``out/run.json`` (None: no such file), after checking that its records serve
    a run under ``fingerprint`` (:class:`StoreMismatch` saying what differs otherwise)."""
    out = Path(out)
    run = out / RUN_FILE
    if not run.exists():
        return None
    old = read_run_file(run, _run_hint(out))
    if not same_fingerprint(fingerprint, old):
        raise StoreMismatch(
            f"{out} holds results {_explain(fingerprint, old)}; use another --out folder (or delete it to start over)"
        )
    return old


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
        old = check_fingerprint(self.out, fingerprint)
        if old is None or (old != fingerprint and _known(fingerprint, old) == old):
            # new, or made before the content hashes were recorded: record them now
            text = json.dumps({"fingerprint": fingerprint}, indent=1) + "\n"
            atomic_write(run, lambda tmp: Path(tmp).write_text(text))
        (self.out / RECORDS_DIR).mkdir(exist_ok=True)
        self.path = self.out / RECORDS_DIR / f"{tag}.jsonl"
        for f in sorted((self.out / RECORDS_DIR).glob("*.jsonl")):
            recs, good, cut = _read_jsonl(f, key="key")
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

    def collected(self, session: dict) -> tuple[dict, list[dict], list[dict]]:
        """``(fingerprint, unit records, sessions)`` a run's summary is made from: everything in the output
        folder (other processes' records and sessions too, :func:`load_dirs`), or without a folder this
        process's own (``session``: its line)."""
        if self.out is None:
            return self.fingerprint, list(self.records.values()), [session]
        return load_dirs([self.out])


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
        fp = read_run_file(run, f"restore it, or delete {d} and run it again")
        rest = {k: v for k, v in fp.items() if k != "policy_kwargs"}
        if fingerprint is None:
            fingerprint = rest
        elif not same_fingerprint(rest, fingerprint):
            raise StoreMismatch(f"cannot merge {d}: {_explain(rest, fingerprint)}")
        else:
            fingerprint = {**rest, **fingerprint}  # keeps the hashes either folder records
        recs = [r for f in sorted((d / RECORDS_DIR).glob("*.jsonl")) for r in _read_jsonl(f, key="key")[0]]
        for policy in sorted({r.get("policy") for r in recs} - {None}):
            kw = (fp.get("policy_kwargs") or {}).get(policy, {})
            have = kwargs.setdefault(policy, kw)
            if not same_fingerprint({"policy_kwargs": {policy: kw}}, {"policy_kwargs": {policy: have}}):
                why = _explain({"policy_kwargs": {policy: kw}}, {"policy_kwargs": {policy: have}})
                raise StoreMismatch(f"cannot merge {d}: {why}")
            kwargs[policy] = {**kw, **have}
        for r in recs:
            records.setdefault(r["key"], r)
        sf = d / SESSIONS_FILE
        if sf.exists():
            sessions += _read_jsonl(sf)[0]
    if fingerprint is not None:
        fingerprint["policy_kwargs"] = {p: kw for p, kw in sorted(kwargs.items()) if kw}
    return fingerprint or {}, list(records.values()), sessions


def shard_tag(shard: tuple[int, int] | None) -> str:
    """The name of a process's records file: ``main``, or ``shard-I-of-N`` for shard ``(I, N)``."""
    return "main" if shard is None else f"shard-{shard[0]}-of-{shard[1]}"


class Session:
    """One process's part of an evaluation run: its shard and records tag (:func:`shard_tag`), when it
    started; :meth:`record` is its line of the sessions file."""

    def __init__(self, shard: tuple[int, int] | None) -> None:
        self.shard = shard
        self.tag = shard_tag(shard)
        self.started = datetime.datetime.now().isoformat(timespec="seconds")
        self.t_start = time.perf_counter()

    def record(self, *, interrupted: bool, tasks, policies, budgets, skipped, notes, units_run: int, **extra) -> dict:
        """The session as its sessions file keeps it: what ran, when, for how long, what stopped it;
        ``extra`` adds a command's own fields."""
        return {
            "tag": self.tag,
            "shard": None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}",
            "started": self.started,
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "wall_s": time.perf_counter() - self.t_start,
            "interrupted": interrupted,
            "tasks": list(tasks),
            "policies": policies,
            "budgets": budgets,
            "skipped_policies": skipped,
            "notes": notes,
            "units_run": units_run,
            **extra,
        }
