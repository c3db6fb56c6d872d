"""``kvpop eval tasks``: task accuracy under a bounded KV cache (HumanEval pass@1, RULER-style retrieval).

Every policy generates greedily from the task's prompt with its cache bounded to ``B`` slots per KV
head from the first token on, and the answer is scored: HumanEval by running the extracted function
against the problem's tests in a sandboxed process (:mod:`kvpop.evaluate.humaneval`), the RULER tasks
by RULER's ``string_match_all`` (:mod:`kvpop.evaluate.ruler`). Dense always runs first: it is the
reference of the table, the oracle's future (its targets are captured over prompt + the dense answer,
as in ``kvpop eval``), and what ``--budgets auto`` sizes the budgets from: ``B = round((1 - c) * L)``
with ``L`` the mean dense sequence length (prompt + generated tokens) of the task's cases and ``c``
each ``--compressions`` value (0.75 and 0.875).

Records and resuming reuse :mod:`kvpop.evaluate.store`: one JSON line per finished unit (task, case,
policy, budget), fsynced as it ends, in ``OUT/records/<tag>.jsonl``; a rerun skips the units already
there. ``OUT/run.json`` holds the model's fingerprint (:func:`kvpop.checkpoint.model_fingerprint`) and
the eviction settings: another model or other settings refuse the folder. Each record also keeps its
task's settings (context length, new tokens, seed, prompt version) and the SHA-1 of its prompt tokens;
a record that disagrees with the current run is an error, never silently reused. ``--shard I/N`` runs
every N-th case of each task (dense, the oracle and every budget of a case stay in one process).
``--report DIR...`` rebuilds ``results.json``, ``table.md`` and ``tasks.png`` from records alone.

Batching: the cases of one (task, policy, budget) run ``--batch-size`` at a time, left-padded (a
:class:`kvpop.KVpopCache` keeps padding out of its slots). The oracle runs one case at a time (its
targets belong to one sequence). A batched row can differ from the same case alone in the last bits
of float arithmetic (padded attention), so ``--batch-size 1`` (the default) is the exactly
reproducible setting; each record says which batch size made it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .options import add_eviction_arguments, add_run_switches, add_scorer_argument, given_fields
from .ruler import RULER_TASKS, SPECS

__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_TASKS",
    "TASKS",
    "SuiteConfig",
    "build_cases",
    "case_record",
    "generate_batch",
    "main",
    "markdown",
    "report",
    "run_suite",
    "summarize",
]

SCHEMA = "kvpop-tasks/1"
TASKS = ("humaneval", *RULER_TASKS)
DEFAULT_TASKS = ("humaneval", "niah_single", "niah_multikey", "niah_multivalue", "vt")
DEFAULT_POLICIES = ("dense", "streaming", "tova", "h2o", "snapkv", "kvpop-mlp", "kvpop-mlstm", "oracle")
DENSE, ORACLE, REFERENCE = "dense", "oracle", "streaming"
LABEL = {
    "humaneval": "HumanEval pass@1",
    "niah_single": "NIAH single (number)",
    "niah_single_uuid": "NIAH single (UUID)",
    "niah_multikey": "NIAH multi-key",
    "niah_multivalue": "NIAH multi-value",
    "vt": "Variable tracking",
}


@dataclass
class SuiteConfig:
    """What ``kvpop eval tasks`` runs; the fields that change a record are in :meth:`task_settings`
    and the folder's fingerprint (:func:`fingerprint`)."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    budgets: tuple[int, ...] = ()  # empty: auto, from the dense sequence lengths and compressions
    compressions: tuple[float, ...] = (0.75, 0.875)
    cases: int | None = None  # per task; None: every HumanEval problem of the split, ruler_cases RULER cases
    ruler_cases: int = 25
    context_length: int = 4096  # RULER: prompt + max new tokens
    ruler_max_new_tokens: int | None = None  # None: each RULER task's own (ruler.SPECS)
    humaneval_max_new_tokens: int = 384
    humaneval_split: str = "all"  # or kvpop's fixed split of the problem ids (the shipped scorers saw "train")
    timeout_s: float = 10.0  # per HumanEval program
    sinks: int = 4
    window: int | None = None  # None: each policy's own
    window_fraction: float | None = None
    lam: float | None = None
    seed: int = 0
    batch_size: int = 1
    policy_kwargs: dict | None = None
    skip_unavailable: bool = False
    bootstrap: int = 2000
    corpus_root: dict | None = None  # corpus name -> folder (the essay filler's paul_graham, tests)

    def validate(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"unknown task(s) {', '.join(bad)}; tasks: {', '.join(TASKS)}")
        if any(int(b) < 1 for b in self.budgets):
            raise ValueError(f"budgets must be >= 1, got {list(self.budgets)}")
        if not self.budgets and not all(0.0 < c < 1.0 for c in self.compressions):
            raise ValueError(f"compressions must be in (0, 1), got {list(self.compressions)}")
        if self.cases is not None and self.cases < 1:
            raise ValueError("cases must be >= 1")
        if self.batch_size < 1:
            raise ValueError("batch size must be >= 1")
        if self.humaneval_split not in ("all", "train", "validation", "test"):
            raise ValueError(f"humaneval split must be all, train, validation or test, got {self.humaneval_split!r}")

    def n_cases(self, task: str) -> int | None:
        if self.cases is not None:
            return self.cases
        return None if task == "humaneval" else self.ruler_cases

    def max_new_tokens(self, task: str) -> int:
        if task == "humaneval":
            return self.humaneval_max_new_tokens
        return self.ruler_max_new_tokens or SPECS[task].max_new_tokens

    def task_settings(self, task: str) -> dict:
        """What a record of ``task`` depends on besides the model, the eviction settings and its case."""
        from .humaneval import PROMPT_VERSION
        from .ruler import TEMPLATE_VERSION

        if task == "humaneval":
            return {
                "max_new_tokens": self.max_new_tokens(task),
                "prompt_version": PROMPT_VERSION,
                "timeout_s": self.timeout_s,
            }
        return {
            "context_length": self.context_length,
            "max_new_tokens": self.max_new_tokens(task),
            "seed": self.seed,
            "template_version": TEMPLATE_VERSION,
        }


@dataclass
class Case:
    """One prompt of one task, whatever the task."""

    task: str
    index: int  # position in the task's case list (sharding)
    item_id: str
    ids: object  # 1-D LongTensor
    max_new_tokens: int
    payload: object = field(repr=False)  # RulerCase | HumanEvalCase
    sha1: str = ""


# ------------------------------------------------------------------------------ cases


def build_cases(
    tokenizer,
    cfg: SuiteConfig,
    filler: str | None = None,
    problems: list[dict] | None = None,
    notes: list[str] | None = None,
) -> dict[str, list[Case]]:
    """``{task: [Case]}``; ``filler`` (essay text) and ``problems`` (HumanEval rows) replace the defaults."""
    import torch

    from . import humaneval, ruler
    from .quality import doc_key

    notes = notes if notes is not None else []
    out: dict[str, list[Case]] = {}
    for task in cfg.tasks:
        if task == "humaneval":
            probs = problems if problems is not None else humaneval.load_problems()
            raw = humaneval.make_cases(tokenizer, probs, cfg.n_cases(task), cfg.humaneval_split)
        else:
            if filler is None and task != "vt":
                from .harness import default_filler

                filler = default_filler(cfg)
            raw = ruler.make_cases(
                tokenizer, task, filler or "", cfg.n_cases(task), cfg.context_length, cfg.seed, cfg.max_new_tokens(task)
            )
        cases = []
        for i, c in enumerate(raw):
            ids = torch.tensor(c.ids, dtype=torch.long)
            cases.append(Case(task, i, c.item_id, ids, cfg.max_new_tokens(task), c, doc_key(ids)))
        out[task] = cases
    return out


def shard_cases(cases: dict[str, list[Case]], shard: tuple[int, int] | None) -> dict[str, list[Case]]:
    """Every N-th case of each task (whole cases: dense, the oracle and all budgets of a case together)."""
    if shard is None:
        return cases
    i, n = shard
    return {t: [c for c in cs if c.index % n == i - 1] for t, cs in cases.items()}


# ------------------------------------------------------------------------------ fingerprint and checks


def fingerprint(model, cfg: SuiteConfig) -> dict:
    """What every record of a folder depends on: the model (weights included) and the eviction settings."""
    from ..checkpoint import model_fingerprint
    from .harness import content_kwargs

    fp = {
        "schema": SCHEMA,
        "model": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
        "model_fingerprint": model_fingerprint(model),
        "sinks": cfg.sinks,
        "window": cfg.window,
        "window_fraction": cfg.window_fraction,
        "lam": cfg.lam,
        "policy_kwargs": content_kwargs(model, cfg.policy_kwargs),
    }
    return json.loads(json.dumps(fp, default=str))  # as run.json will read it back


def check_records(records: dict[str, dict], cases: dict[str, list[Case]], cfg: SuiteConfig, where) -> None:
    """Refuse records of the selected cases made with other task settings or on other prompt tokens."""
    from .store import StoreMismatch

    by_item = {c.item_id: c for cs in cases.values() for c in cs}
    for rec in records.values():
        case = by_item.get(rec.get("item_id"))
        if case is None:
            continue
        want = cfg.task_settings(case.task)
        if rec.get("task_settings") != want:
            diff = "; ".join(
                f"{k}: {want.get(k)!r} now vs {(rec.get('task_settings') or {}).get(k)!r} there"
                for k in sorted(set(want) | set(rec.get("task_settings") or {}))
                if want.get(k) != (rec.get("task_settings") or {}).get(k)
            )
            raise StoreMismatch(
                f"{where} holds {case.task} records made with other settings ({diff}); use another --out folder"
            )
        if rec.get("prompt_sha1") != case.sha1:
            raise StoreMismatch(
                f"{where}: {rec['key']} was made from other prompt tokens than {case.item_id} now "
                "(another tokenizer, filler or data); use another --out folder"
            )


def auto_budgets(dense: list[dict], compressions) -> list[int]:
    """``round((1 - c) * mean sequence length)`` of the dense records, largest first."""
    mean = sum(r["seq_len"] for r in dense) / len(dense)
    return sorted({max(1, round((1.0 - c) * mean)) for c in compressions}, reverse=True)


# ------------------------------------------------------------------------------ generation


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens generation stops at (the generation config's, else the tokenizer's end of sequence)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list | tuple) else [eos]) - {None}


def generate_batch(model, tokenizer, prompts: list, max_new_tokens: int, cache=None, stop: set[int] | None = None):
    """Greedy new ids (1-D, up to and including the first stop token) of each prompt, left-padded into one
    batch; ``cache`` None is dense. One prompt is :func:`kvpop.evaluate.tasks.greedy` exactly."""
    import torch

    from .tasks import generate_greedy, pad_id

    n = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), n), pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - p.numel() :] = p
        mask[i, n - p.numel() :] = 1
    out = generate_greedy(model, tokenizer, ids, mask, max_new_tokens, cache)
    stop = stop if stop is not None else eos_ids(model, tokenizer)
    rows = []
    for row in out[:, n:].cpu():
        hits = [j for j, t in enumerate(row.tolist()) if t in stop]
        rows.append(row[: hits[0] + 1] if hits else row)
    return rows


# ------------------------------------------------------------------------------ the run


def case_record(
    case: Case,
    policy: str,
    budget: int | None,
    new,
    text: str,
    cfg: SuiteConfig,
    stop: set[int],
    limits,
    *,
    wall_s: float,
    batch: int = 1,
) -> dict:
    """One unit's record: what ran on which case, how long the answer was, and its score (HumanEval's
    sandboxed run, RULER's string match). ``new``: the generated ids; ``text``: their decoding. Whatever
    generated them (a kvpop cache, dense, another library's cache) adds its own fields."""
    from . import humaneval, ruler
    from .store import unit_key

    rec = {
        "key": unit_key(case.item_id, policy, budget),
        "task": case.task,
        "case": case.index,
        "item_id": case.item_id,
        "policy": policy,
        "budget": budget,
        "prompt_sha1": case.sha1,
        "task_settings": cfg.task_settings(case.task),
        "prompt_tokens": case.ids.numel(),
        "new_tokens": int(new.numel()),
        "seq_len": case.ids.numel() + int(new.numel()),
        "hit_max_new_tokens": int(new.numel()) >= case.max_new_tokens and int(new[-1]) not in stop,
        "batch": batch,
        "wall_s": wall_s,
        "sinks": None,
        "window": None,
        "k": None,
    }
    if case.task == "humaneval":
        rec.update(humaneval.score_completion(case.payload, text, limits))
    else:
        rec.update(ruler.score_answer(case.payload, text))
    return rec


class _Runner:
    """Runs units and appends their records; what dense and the oracle share stays per case here."""

    def __init__(self, model, tokenizer, cfg: SuiteConfig, settings, store, bar) -> None:
        from .humaneval import SandboxLimits

        self.model, self.tokenizer, self.cfg, self.s, self.store, self.bar = model, tokenizer, cfg, settings, store, bar
        self.stop = eos_ids(model, tokenizer)
        self.limits = SandboxLimits(timeout_s=cfg.timeout_s)
        self.ran = 0

    def record(self, case: Case, policy: str, budget: int | None, new, wall_s: float, batch: int, cache) -> dict:
        from .core import cache_record

        text = self.tokenizer.decode(new, skip_special_tokens=True)
        rec = case_record(case, policy, budget, new, text, self.cfg, self.stop, self.limits, wall_s=wall_s, batch=batch)
        if cache is not None:
            rec.update(cache_record(cache))
            rec["compile_status"] = cache.compile_status  # timings differ between a compiled and an eager decode
        if policy == DENSE:
            rec["new_ids"] = [int(t) for t in new]  # the oracle's future after a restart
        return rec

    def run_batch(self, cases: list[Case], policy: str, budget: int | None, oracle=None, max_new: int | None = None):
        t0 = time.perf_counter()
        cache = self.s.cache(self.model, policy, budget, oracle)
        news = generate_batch(
            self.model, self.tokenizer, [c.ids for c in cases], max_new or cases[0].max_new_tokens, cache, self.stop
        )
        wall = (time.perf_counter() - t0) / len(cases)
        for c, new in zip(cases, news):
            self.store.append(self.record(c, policy, budget, new, wall, len(cases), cache))
            self.ran += 1
        if self.bar is not None:
            self.bar.update(len(cases))

    def oracle_targets(self, case: Case, budgets: list[int]):
        import torch

        from ..config import resolve_eviction
        from .core import oracle_targets_multi
        from .store import unit_key

        dense = self.store.done(unit_key(case.item_id, DENSE, None))
        seq = torch.cat([case.ids, torch.tensor(dense["new_ids"], dtype=torch.long)])
        windows = sorted({resolve_eviction(b, sinks=self.s.sinks, window=self.s.window_for(b)).window for b in budgets})
        return oracle_targets_multi(self.model, seq, windows), len(dense["new_ids"])


def _batches(cases: list[Case], size: int) -> list[list[Case]]:
    """Batches of similar prompt lengths (less padding), in a deterministic order."""
    ordered = sorted(cases, key=lambda c: (c.ids.numel(), c.index)) if size > 1 else cases
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def run_suite(
    model,
    tokenizer,
    cfg: SuiteConfig | None = None,
    *,
    out: str | Path | None = None,
    shard: tuple[int, int] | str | None = None,
    progress: bool = True,
    plots: bool = True,
    filler: str | None = None,
    problems: list[dict] | None = None,
    time_limit_s: float | None = None,
    notes: list[str] | None = None,
) -> dict:
    """Run (this shard of) the suite; returns the summary (also ``out/results.json``, ``table.md``, ``tasks.png``).

    Raises :class:`kvpop.evaluate.core.PolicyUnavailable` before any generation when a requested policy
    cannot be built, unless ``cfg.skip_unavailable``; :class:`kvpop.evaluate.store.StoreMismatch` when
    ``out`` holds records made otherwise."""
    import torch
    from tqdm.auto import tqdm

    from ..validate import parse_shard
    from .core import PolicyUnavailable, concrete_policies
    from .grid import Settings, available_policies
    from .harness import unavailable_message
    from .store import RecordStore, Session, load_dirs, unit_key

    cfg = cfg or SuiteConfig()
    cfg.validate()
    policies, policy_kwargs = concrete_policies(model, cfg.policies, cfg.policy_kwargs)
    cfg = replace(cfg, policies=policies, policy_kwargs=policy_kwargs or cfg.policy_kwargs)
    shard = parse_shard(shard)
    session = Session(shard)
    notes = list(notes or [])
    settings = Settings(
        sinks=cfg.sinks,
        window=cfg.window,
        window_fraction=cfg.window_fraction,
        lam=cfg.lam,
        budgets=tuple(cfg.budgets),
        policy_kwargs=dict(cfg.policy_kwargs or {}),
    )
    policies, skipped = available_policies(
        model, (DENSE, *cfg.policies), settings, min(cfg.budgets) if cfg.budgets else 64
    )
    if skipped and not cfg.skip_unavailable:
        raise PolicyUnavailable(unavailable_message(skipped))
    fp = fingerprint(model, cfg)
    store = RecordStore(out, fp, session.tag)
    all_cases = build_cases(tokenizer, cfg, filler, problems, notes)
    check_records(store.records, all_cases, cfg, out)
    mine = shard_cases(all_cases, shard)

    def todo(cases, policy, budget):
        return [c for c in cases if store.done(unit_key(c.item_id, policy, budget)) is None]

    n_dense = sum(len(todo(cs, DENSE, None)) for cs in mine.values())
    bar = tqdm(total=n_dense, desc="kvpop eval tasks", disable=not progress, dynamic_ncols=True)
    runner = _Runner(model, tokenizer, cfg, settings, store, bar)
    budgets: dict[str, list[int]] = {}
    stopped, interrupted = None, True

    def out_of_time() -> bool:
        return time_limit_s is not None and time.perf_counter() - session.t_start > time_limit_s

    try:
        for task, cases in mine.items():  # dense first: the reference, the oracle's future, the auto budgets
            for batch in _batches(todo(cases, DENSE, None), cfg.batch_size):
                if out_of_time():
                    raise _Stop
                bar.set_postfix_str(f"{task} dense")
                runner.run_batch(batch, DENSE, None)
        for task, cases in all_cases.items():
            if cfg.budgets:
                budgets[task] = sorted(set(cfg.budgets), reverse=True)
                continue
            recs = store.records if out is None else {u["key"]: u for u in load_dirs([out])[1]}
            dense = [recs.get(unit_key(c.item_id, DENSE, None)) for c in cases]
            if any(r is None for r in dense):
                missing = sum(r is None for r in dense)
                notes.append(
                    f"{task}: --budgets auto waits for the dense records of {missing} case(s) that other "
                    "shards run; rerun this shard when they are done"
                )
                continue
            budgets[task] = auto_budgets(dense, cfg.compressions)
            mean = sum(r["seq_len"] for r in dense) / len(dense)
            notes.append(
                f"{task}: mean dense sequence {mean:.1f} tokens -> budgets "
                + ", ".join(f"B={b} ({1 - b / mean:.1%} compression)" for b in budgets[task])
            )
            if progress:
                print(f"[kvpop eval tasks] {notes[-1]}", flush=True)
        evicting = [p for p in policies if p != DENSE]
        bar.total = n_dense + sum(len(todo(mine[t], p, b)) for t in budgets for p in evicting for b in budgets[t])
        bar.refresh()
        for task, bs in budgets.items():
            for policy in evicting:
                if policy == ORACLE:  # one case at a time: its targets are the case's own future
                    for case in mine[task]:
                        left = [b for b in bs if store.done(unit_key(case.item_id, ORACLE, b)) is None]
                        if not left:
                            continue
                        if out_of_time():
                            raise _Stop
                        bar.set_postfix_str(f"{task} oracle")
                        targets, n_dense_new = runner.oracle_targets(case, bs)
                        for b in left:
                            runner.run_batch(
                                [case], ORACLE, b, oracle=targets, max_new=max(1, min(case.max_new_tokens, n_dense_new))
                            )
                    continue
                for b in bs:
                    for batch in _batches(todo(mine[task], policy, b), cfg.batch_size):
                        if out_of_time():
                            raise _Stop
                        bar.set_postfix_str(f"{task} {policy} B={b}")
                        try:
                            runner.run_batch(batch, policy, b)
                        except PolicyUnavailable as exc:  # e.g. a budget too small for the policy's layout
                            if not cfg.skip_unavailable:
                                raise
                            skipped.setdefault(f"{policy}@B={b}", str(exc))
                            break
        interrupted = False
    except _Stop:
        stopped = f"stopped after {time.perf_counter() - session.t_start:.0f}s (time limit), {runner.ran} units run"
        notes.append(f"{stopped}; rerun the same command to continue")
        interrupted = False
    finally:
        bar.close()
        line = session.record(
            interrupted=interrupted,
            tasks=cfg.tasks,
            policies=policies,
            budgets=budgets,
            skipped=skipped,
            notes=notes,
            units_run=runner.ran,
            config=_jsonable(asdict(cfg)),
            threads=torch.get_num_threads(),
            device=str(model.device),
        )
        store.add_session(line)
    fp_all, units, sessions = store.collected(line)
    results = summarize(units, sessions, fp_all, n_boot=cfg.bootstrap)
    if out is not None:
        write_summary(results, out, plots=plots)
    return results


class _Stop(Exception):
    """The time limit: stop starting units (the records so far are kept)."""


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x if isinstance(x, str | int | float | bool) or x is None else str(x)


# ------------------------------------------------------------------------------ summary


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def scorers_read(units: list[dict]) -> dict[str, dict[str, list[int]]]:
    """``{policy: {scorer file: budgets}}``: which scorer checkpoint each learned policy read at which
    budgets (a model may ship one per budget range), the file named by its folder and name."""
    out: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for u in units:
        if u.get("scorer") and u.get("budget") is not None:
            path = Path(str(u["scorer"]))
            out[u["policy"]][f"{path.parent.name}/{path.name}"].add(int(u["budget"]))
    return {p: {f: sorted(b) for f, b in sorted(files.items())} for p, files in sorted(out.items())}


def summarize(units: list[dict], sessions: list[dict], fp: dict, n_boot: int = 2000) -> dict:
    """Rows (task, policy, budget) from unit records alone: mean score with a 95% bootstrap interval over
    cases, the score relative to dense on the same cases, per-case wins / losses / ties against
    StreamingLLM at the same budget, mean sequence length and seconds per case."""
    from .quality import compare, tally
    from .stats import bootstrap_mean

    by_task: dict[str, list[dict]] = defaultdict(list)
    for u in units:
        by_task[u["task"]].append(u)
    rows, dense_len = [], {}
    order = {p: i for i, p in enumerate(DEFAULT_POLICIES)}
    for task in sorted(by_task, key=lambda t: TASKS.index(t) if t in TASKS else len(TASKS)):
        recs = by_task[task]
        dense = {u["item_id"]: u for u in recs if u["policy"] == DENSE}
        mean_len = _mean([u["seq_len"] for u in dense.values()])
        dense_len[task] = mean_len
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for u in recs:
            groups[(u["policy"], u["budget"])].append(u)
        for (policy, budget), rs in sorted(
            groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][0], -(kv[0][1] or 0))
        ):
            rs = sorted(rs, key=lambda u: u["item_id"])
            scores = [float(u["score"]) for u in rs if u.get("score") is not None]
            paired = [(u["score"], dense[u["item_id"]]["score"]) for u in rs if u["item_id"] in dense]
            d_mean = _mean([d for _, d in paired])
            rel = _mean([s for s, _ in paired]) / d_mean if paired and d_mean else None
            row = {
                "task": task,
                "policy": policy,
                "budget": budget,
                "n_cases": len(rs),
                "compression": None if budget is None or not mean_len else 1.0 - budget / mean_len,
                "score": _mean(scores),
                "ci": bootstrap_mean(scores, n_boot),
                "relative_to_dense": rel,
                "mean_seq_len": _mean([u["seq_len"] for u in rs]),
                "mean_new_tokens": _mean([u["new_tokens"] for u in rs]),
                "hit_max_new_tokens": sum(bool(u.get("hit_max_new_tokens")) for u in rs),
                "s_per_case": _mean([u.get("wall_s") for u in rs]),
                "window": rs[0].get("window"),
                "sinks": rs[0].get("sinks"),
            }
            if task == "humaneval":
                row["passed"] = sum(bool(u.get("passed")) for u in rs)
                row["status"] = dict(sorted(_count(u.get("status") for u in rs).items()))
            if policy not in (DENSE, REFERENCE) and budget is not None:
                ref = {u["item_id"]: u for u in groups.get((REFERENCE, budget), [])}
                if ref:
                    row["vs_streaming"] = tally(
                        compare(u["score"], ref[u["item_id"]]["score"]) if u["item_id"] in ref else None for u in rs
                    )
            rows.append(row)
    present = {u["policy"] for u in units}
    policies = [p for p in DEFAULT_POLICIES if p in present] + sorted(present - set(DEFAULT_POLICIES))
    skipped: dict[str, str] = {}
    notes: list[str] = []
    for s in sessions:
        for p, r in (s.get("skipped_policies") or {}).items():
            if p not in present:
                skipped.setdefault(p, r)
        notes += [n for n in s.get("notes", []) if n not in notes]
    auto = {t: {f"{c:g}": max(1, round((1.0 - c) * L)) for c in (0.75, 0.875)} for t, L in dense_len.items() if L}
    return {
        "scorers": scorers_read(units),
        "schema": SCHEMA,
        "model": fp.get("model"),
        "fingerprint": fp,
        "policies": policies,
        "tasks": list(by_task),
        "dense_mean_seq_len": dense_len,
        "auto_budgets": auto,
        "rows": rows,
        "skipped_policies": skipped,
        "notes": notes,
        "sessions": sessions,
        "units": sorted(units, key=lambda u: u["key"]),
        "wall_s": sum(s.get("wall_s", 0.0) for s in sessions),
    }


def _count(xs) -> dict:
    out: dict = defaultdict(int)
    for x in xs:
        out[str(x)] += 1
    return dict(out)


def _f(x, spec=".3f") -> str:
    return format(x, spec) if isinstance(x, int | float) and not isinstance(x, bool) else "-"


def _budget_label(row: dict, mean_len) -> str:
    if row["budget"] is None:
        return "dense"
    c = f", {row['compression']:.1%} of {mean_len:.0f}" if row.get("compression") is not None else ""
    return f"B={row['budget']}{c}"


def markdown(results: dict) -> str:
    """Table 1 (per task and budget, each policy's score and its fraction of dense), then per task the
    details: 95% interval over cases, wins-losses-ties against StreamingLLM per case, lengths, time."""
    rows, policies = results["rows"], results["policies"]
    cell = {(r["task"], r["policy"], r["budget"]): r for r in rows}
    lines = [
        f"# Task accuracy under a bounded KV cache — {results.get('model')}",
        "",
        (
            "Score: HumanEval pass@1 (greedy); RULER tasks: string_match_all (fraction of the expected values "
            "in the answer). Cell: absolute score (relative to dense on the same cases). B: KV slots per KV head; "
            "compression of the mean dense sequence length (prompt + generated tokens)."
        ),
        "",
        "| task | budget | " + " | ".join(policies) + " |",
        "|---|---|" + "---|" * len(policies),
    ]
    for task in results["tasks"]:
        mean_len = results["dense_mean_seq_len"].get(task)
        budgets = sorted({r["budget"] for r in rows if r["task"] == task and r["budget"] is not None}, reverse=True)
        dense = cell.get((task, DENSE, None))
        for b in budgets:
            some = next(r for r in rows if r["task"] == task and r["budget"] == b)
            out = [LABEL.get(task, task), _budget_label(some, mean_len or 0)]
            for p in policies:
                r = dense if p == DENSE else cell.get((task, p, b))
                if r is None or r["score"] is None:
                    out.append("-")
                elif p == DENSE or r.get("relative_to_dense") is None:
                    out.append(_f(r["score"]))
                else:
                    out.append(f"{_f(r['score'])} ({r['relative_to_dense']:.0%})")
            lines.append("| " + " | ".join(out) + " |")
        if not budgets and dense is not None:
            lines.append(
                f"| {LABEL.get(task, task)} | dense only | "
                + " | ".join(_f(dense["score"]) if p == DENSE else "-" for p in policies)
                + " |"
            )
    for task in results["tasks"]:
        trs = [r for r in rows if r["task"] == task]
        mean_len = results["dense_mean_seq_len"].get(task)
        n = max(r["n_cases"] for r in trs)
        head = f"## {LABEL.get(task, task)} ({n} cases; mean dense sequence {_f(mean_len, '.1f')} tokens)"
        auto = results.get("auto_budgets", {}).get(task)
        if auto:
            head += "\n\nBudgets that compress it by " + " and ".join(
                f"{float(c):.1%}: B = {b}" for c, b in auto.items()
            )
        cols = [
            "policy",
            "budget",
            "score [95% CI]",
            "rel. to dense",
            "W-L-T vs streaming",
            "n",
            "mean seq",
            "hit max new",
            "s/case",
        ]
        lines += ["", head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in trs:
            ci = f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r.get("ci") else ""
            vs = r.get("vs_streaming")
            wl = f"{vs['wins']}-{vs['losses']}-{vs['ties']}" if vs else "-"
            rel = f"{r['relative_to_dense']:.1%}" if r.get("relative_to_dense") is not None else "-"
            lines.append(
                f"| {r['policy']} | {_budget_label(r, mean_len or 0)} | {_f(r['score'])}{ci} | {rel} | {wl} "
                f"| {r['n_cases']} | {_f(r['mean_seq_len'], '.1f')} | {r['hit_max_new_tokens']} "
                f"| {_f(r['s_per_case'], '.2f')} |"
            )
    if results.get("skipped_policies"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped_policies"].items())]
    read = [
        f"{policy}: " + "; ".join(f"{f} at B = {', '.join(map(str, bs))}" for f, bs in files.items())
        for policy, files in (results.get("scorers") or {}).items()
    ]
    lines += [""] + [f"- scorer read by {r}" for r in read] + [f"- note: {n}" for n in results.get("notes", [])]
    return "\n".join(lines).rstrip() + "\n"


def plot(results: dict, out: str | Path) -> Path | None:
    """``tasks.png``: score against compression per task, one line per policy (95% interval as error
    bars), dense as a dashed line."""
    from .plotting import pyplot, save_figure

    tasks = results["tasks"]
    if not tasks:
        return None
    plt = pyplot()
    cols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    colors = {p: cmap(i % 10) for i, p in enumerate(results["policies"])}
    for ax, task in zip(axes.ravel(), tasks):
        trs = [r for r in results["rows"] if r["task"] == task and r["score"] is not None]
        for p in results["policies"]:
            pts = sorted(
                (
                    (r["compression"] or 0.0, r["score"], r.get("ci"))
                    for r in trs
                    if r["policy"] == p and r["budget"] is not None
                ),
                key=lambda t: t[0],
            )
            if p == DENSE:
                d = next((r for r in trs if r["policy"] == DENSE), None)
                if d is not None:
                    ax.axhline(d["score"], color="k", ls="--", lw=1, label="dense")
                continue
            if not pts:
                continue
            dodge = 0.004 * (results["policies"].index(p) - len(results["policies"]) / 2)  # overlapping points
            xs, ys = [t[0] + dodge for t in pts], [t[1] for t in pts]
            err = [
                [max(0.0, y - (c[0] if c else y)) for _, y, c in pts],
                [max(0.0, (c[1] if c else y) - y) for _, y, c in pts],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", ms=4, capsize=3, label=p, color=colors[p])
        ax.set_title(LABEL.get(task, task))
        ax.set_xlabel("compression (1 - B / mean dense length)")
        ax.set_ylabel("score")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(tasks) :]:
        ax.axis("off")
    handles, labels = axes.ravel()[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save_figure(fig, Path(out) / "tasks.png")


def write_summary(results: dict, out: str | Path, plots: bool = True) -> Path:
    """``out/results.json`` and ``out/table.md`` (atomically), then ``out/tasks.png``; a plotting failure
    is noted in the results, never loses them."""
    from ..files import atomic_write, write_json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    atomic_write(out / "table.md", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    if plots:
        try:
            plot(results, out)
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
            results["plot_error"] = f"{type(exc).__name__}: {exc}"
            print(f"[kvpop eval tasks] warning: plotting failed ({results['plot_error']})", flush=True)
    write_json(out / "results.json", results)
    return out / "results.json"


def report(dirs, out: str | Path | None = None, plots: bool = True, n_boot: int = 2000) -> dict:
    """Rebuild the summary from the records of one or more output folders (same model and settings)."""
    from .store import load_dirs

    fp, units, sessions = load_dirs(dirs)
    if fp.get("schema") != SCHEMA:
        raise ValueError(f"{dirs[0]} is not a `kvpop eval tasks` folder (schema {fp.get('schema')!r})")
    results = summarize(units, sessions, fp, n_boot=n_boot)
    write_summary(results, out or dirs[0], plots=plots)
    return results


# ------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpop eval tasks",
        description="Task accuracy under a bounded KV cache: HumanEval pass@1 (the function run against its "
        "tests in a sandboxed process) and RULER-style retrieval in essay filler with the question last "
        "(niah_single, niah_single_uuid, niah_multikey, niah_multivalue, vt; score = RULER's string_match_all). "
        "Greedy, the chat template, eviction from the first token on. Dense runs first (the reference, the "
        "oracle's future, and --budgets auto). Writes OUT/results.json, OUT/table.md (Table 1: per task and "
        "budget, each policy's score and its fraction of dense; details with 95%% bootstrap intervals over cases "
        "and per-case wins/losses against StreamingLLM) and OUT/tasks.png. Resumable (rerun the same command), "
        "splittable (--shard I/N); --report DIR rebuilds the summary from the records.",
    )
    p.add_argument("--tasks", nargs="+", choices=TASKS, help=f"default: {' '.join(DEFAULT_TASKS)}")
    p.add_argument("--policies", nargs="+", help=f"default: {' '.join(DEFAULT_POLICIES)} (dense always runs)")
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="run the policies that can be built and list the others as skipped (default: error)",
    )
    p.add_argument(
        "--budgets",
        nargs="+",
        default=["auto"],
        metavar="B|auto",
        help="KV slots per KV head, or 'auto' (default): per task, B = round((1 - c) * the mean dense "
        "sequence length) for each --compressions c",
    )
    p.add_argument("--compressions", nargs="+", type=float, help="with --budgets auto (default 0.75 0.875)")
    p.add_argument("--cases", type=int, help="cases per task (default: every HumanEval problem, 25 per RULER task)")
    p.add_argument("--context-length", type=int, help="RULER prompt + new tokens (default 4096)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="RULER answer length for every RULER task (default: niah 32, uuid / multi-value 64, vt 48)",
    )
    p.add_argument("--humaneval-max-new-tokens", type=int, help="default 384")
    p.add_argument(
        "--humaneval-split",
        choices=("all", "train", "validation", "test"),
        help="problems of kvpop's fixed split of the HumanEval ids (default all; the shipped scorers were "
        "trained on the human_eval corpus' train split)",
    )
    p.add_argument("--timeout", type=float, help="seconds per HumanEval program (default 10)")
    add_eviction_arguments(p)
    p.add_argument("--seed", type=int, help="seed of the RULER cases (default 0)")
    p.add_argument(
        "--batch-size",
        type=int,
        help="cases generated together per policy and budget, left-padded (default 1: exactly "
        "reproducible; the oracle always runs one at a time)",
    )
    add_scorer_argument(p)
    p.add_argument(
        "--model",
        help="model folder / .gguf / embedded name (default: the embedded SmolLM2-135M-Instruct, "
        "base model with the shipped scorers, as `kvpop eval`)",
    )
    p.add_argument("--out", help="output folder (records of finished units are kept there); required unless --report")
    p.add_argument("--shard", metavar="I/N", help="run every N-th case of each task, starting at the I-th")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="DIR",
        help="rebuild results.json, table.md and tasks.png from the records of these folders (into --out, "
        "default the first folder); loads no model",
    )
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the intervals (default 2000)")
    add_run_switches(p)
    return p


# argument dest -> SuiteConfig field, for the arguments given (the same name but two)
CONFIG_FIELDS = {
    name: name
    for name in (
        "tasks",
        "policies",
        "compressions",
        "cases",
        "context_length",
        "humaneval_max_new_tokens",
        "humaneval_split",
        "sinks",
        "window",
        "window_fraction",
        "lam",
        "seed",
        "batch_size",
        "bootstrap",
    )
} | {"max_new_tokens": "ruler_max_new_tokens", "timeout": "timeout_s"}


def config_from_args(args) -> SuiteConfig:
    over = given_fields(args, CONFIG_FIELDS)
    budgets = [b.lower() for b in args.budgets]
    if budgets != ["auto"]:
        try:
            over["budgets"] = tuple(int(b) for b in budgets)
        except ValueError:
            raise ValueError(f"--budgets takes integers or 'auto' alone, got {' '.join(args.budgets)}") from None
    if args.skip_unavailable:
        over["skip_unavailable"] = True
    if args.scorer:
        from ..policies.learned import scorer_policy_kwargs

        over["policy_kwargs"] = scorer_policy_kwargs(args.scorer)
    cfg = SuiteConfig(**over)
    cfg.validate()
    return cfg


def _err(msg: str) -> int:
    print(f"kvpop eval tasks: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.report:
        try:
            results = report(args.report, args.out, plots=not args.no_plots, n_boot=args.bootstrap or 2000)
        except (FileNotFoundError, ValueError) as exc:
            return _err(str(exc))
        print(markdown(results))
        print(f"rebuilt from {len(results['units'])} records -> {args.out or args.report[0]}/results.json, table.md")
        return 0
    if not args.out:
        return _err("--out is required (or --report DIR)")
    try:
        cfg = config_from_args(args)
        from ..validate import parse_shard

        shard = parse_shard(args.shard)
    except (TypeError, ValueError, OSError) as exc:
        return _err(str(exc))
    from ..models import load_model_quietly
    from .core import PolicyUnavailable
    from .store import StoreMismatch

    model, tokenizer = load_model_quietly(args.model)
    try:
        results = run_suite(
            model,
            tokenizer,
            cfg,
            out=args.out,
            shard=shard,
            progress=not args.no_progress,
            plots=not args.no_plots,
            time_limit_s=None if args.max_minutes is None else 60.0 * args.max_minutes,
        )
    except (PolicyUnavailable, StoreMismatch, FileNotFoundError, ValueError) as exc:
        return _err(str(exc))
    print(markdown(results))
    print(
        f"wrote {args.out}/results.json ({len(results['units'])} records), table.md, tasks.png in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
