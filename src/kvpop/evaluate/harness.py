"""The evaluation grid: tasks x policies x budgets x domains -> ``results.json`` (+ plots, table).

From Python::

    from kvpop.evaluate import EvalConfig, run_eval
    results = run_eval(model, tokenizer, EvalConfig(tasks=("lm",), policies=("dense", "knorm")),
                       documents={"mine": [ids1, ids2]}, out="runs/x")

``documents`` (token ids per named source) replaces the built-in corpora; every such source is
in domain ``"user"``. Without it, the test splits of the named corpora are used, in domain
``"in_domain"`` (the corpora the evaluated scorer was trained on: :func:`in_domain_corpora`) or
``"out_of_domain"``. Needle and multi-key cases use Paul Graham essays as filler (``filler=``
another text: domain ``"user"``).

With ``out`` the run is resumable and splittable (:mod:`kvpop.evaluate.store`): every finished
unit (item, policy, budget) is appended to ``out/records/<tag>.jsonl``; a rerun skips the units
already there; ``shard=(i, n)`` runs the i-th of n deterministic parts (whole items, balanced by
cost); :func:`merge` combines folders. ``results.json`` is always rebuilt from all the records.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..checkpoint import (
    DEFAULT_SCORERS,
    WEIGHTS_SAMPLED_KEY,
    ScorerMismatchError,
    default_scorer_path,
    model_fingerprint,
    read_header,
    shipped_scorers,
)
from ..config import EvictionConfig, TrainedSettings, resolve_eviction
from ..data import SPLITS, list_corpora, load_documents, long_documents, read_user_documents
from ..names import POLICY_TO_KIND
from ..policies import ALIAS, KIND_TO_POLICY, default_policy
from ..policies.learned import ADAPTER_ATTR
from ..validate import parse_shard
from .core import ALL_POLICIES, PolicyUnavailable, concrete_policies
from .grid import (
    SHARED_DIR,
    Item,
    ItemContext,
    Settings,
    SharedStore,
    available_policies,
    item_cost,
    partition,
    units_of,
)
from .plots import plot_results
from .quality import default_continuation_tokens
from .report import markdown_report, text_table
from .stats import aggregate
from .store import (
    ADAPTER_KEY,
    FILE_HASH_KEY,
    WEIGHTS_KEY,
    RecordStore,
    Session,
    check_fingerprint,
    load_dirs,
    unit_key,
)
from .tasks import DEFAULT_TASKS, TASKS, TEXT_TASKS, multikey_cases, needle_cases


@functools.cache
def shipped_training_corpora() -> tuple[str, ...]:
    """The corpora the shipped scorers were trained on (read from their checkpoints on first use; () if
    none can be read): what a run's domains default to (a run labels them by :func:`in_domain_corpora`)."""
    for path in DEFAULT_SCORERS.values():
        try:
            corpora = read_header(path).get("meta", {}).get("corpora")
        except (FileNotFoundError, ValueError):
            continue
        if corpora:
            return tuple(corpora)
    return ()


RESUME_HINT = "rerun the same command to continue"  # ends a session's note when it stopped with units left
SCHEMA_VERSION = 2


def __getattr__(name: str):
    if name == "IN_DOMAIN":  # the shipped scorers' training corpora, read on first use (not at import)
        return shipped_training_corpora()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class EvalConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    policies: tuple[str, ...] = ALL_POLICIES
    compressions: tuple[float, ...] = (0.75, 0.875, 0.9375)
    reference_length: int = 4096
    sinks: int = 4
    window: int | None = None  # one protected window for every policy (overrides window_fraction)
    # None (default): each policy's window from the one resolver (kvpop.config.resolve_eviction), as a user
    # gets it: B / 2 for the heuristics and the oracle, a learned scorer's trained fraction of B (StreamingLLM:
    # the whole budget); a number: window = round(window_fraction * B) for every window-based policy
    window_fraction: float | None = None
    lam: float | None = None  # recency tilt for every policy (None: a learned scorer's trained lam, else 0)
    docs: int = 2  # documents per corpus (or per user source)
    doc_tokens: int = 4096  # lm documents; continuation = their last continuation_tokens predictions
    continuation_tokens: int | None = None  # default doc_tokens / 16 (256)
    longdep_threshold: float = 0.5  # nats: full context beats the window-only run by more -> long-dependency token
    agreement_tokens: int = 256
    needle_lengths: tuple[int, ...] = (2048, 4096, 8000)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    multikey_lengths: tuple[int, ...] = (2048, 4096, 8000)
    multikey_cases: int = 2  # cases per length
    multikey_keys: int = 4  # facts per case
    corpora: tuple[str, ...] | None = None  # default: the six evaluation corpora (kvpop.data.EVALUATION_CORPORA)
    corpus_root: dict | None = None  # corpus name -> root folder (tests, custom installs)
    # the corpora's split the documents come from: "test" for results; "validation" to choose between
    # scorers or settings without looking at the test documents
    split: str = "test"
    seed: int = 0
    # policy name -> factory kwargs, e.g. {"kvpop-mlp": {"path": "scorer.safetensors"}}
    policy_kwargs: dict | None = None
    skip_unavailable: bool = False  # False: a requested policy that cannot be built is an error
    bootstrap: int = 2000  # resamples for the 95% intervals

    def budgets(self) -> list[EvictionConfig]:
        """One resolved budget per compression (:func:`kvpop.config.resolve_eviction`, the one resolver), at
        the window every policy gets (:meth:`Settings.window_for`), else the library default ``B / 2``."""
        rule = TrainedSettings(window=self.window, window_fraction=self.window_fraction)
        return [
            resolve_eviction(
                compression=c, reference_length=self.reference_length, sinks=self.sinks, trained=rule, warn=False
            )
            for c in self.compressions
        ]

    def settings(self) -> Settings:
        """What every unit of this run depends on besides its item, policy and budget."""
        return Settings(
            sinks=self.sinks,
            window=self.window,
            window_fraction=self.window_fraction,
            lam=self.lam,
            longdep_threshold=self.longdep_threshold,
            continuation_tokens=self.cont_tokens(),
            agreement_tokens=self.agreement_tokens,
            reference_length=self.reference_length,
            budgets=tuple(b.budget for b in self.budgets()),
            policy_kwargs=dict(self.policy_kwargs or {}),
        )

    def cont_tokens(self) -> int:
        return self.continuation_tokens or default_continuation_tokens(self.doc_tokens)

    def prompt_tokens(self) -> int:
        return max(1, self.doc_tokens - self.agreement_tokens)


def quick_config(**overrides) -> EvalConfig:
    """A preset that finishes in minutes on a laptop CPU: lm (+ its continuation slice), 1 doc per
    corpus of 1024 tokens, compression 0.875 of the document length (B = 128), a few policies."""
    cfg = {
        "tasks": ("lm", "continuation"),
        "policies": ("dense", "streaming", "tova", "knorm", "oracle", "kvpop-mlp", "kvpop-mlstm"),
        "compressions": (0.875,),
        "reference_length": 1024,
        "docs": 1,
        "doc_tokens": 1024,
    }
    cfg.update(overrides)
    return EvalConfig(**cfg)


# ------------------------------------------------------------------------------ documents


def scorer_corpora(model, policy: str, kwargs: dict) -> tuple[tuple[str, ...] | None, str]:
    """``(corpora, source)``: what the scorer that learned ``policy`` runs on ``model`` was trained on
    (None: it does not say), found the way the policy factory finds the scorer: ``path=`` a
    checkpoint, else the scorer of the adapter bundle ``model`` was loaded with, else the shipped one."""

    if kwargs.get("scorer") is not None:
        return None, "a scorer given in memory"
    path = kwargs.get("path")
    kind = POLICY_TO_KIND[policy]
    bundle = getattr(model, "kvpop_adapter", None)
    if path is None and bundle is not None and bundle.scorer is not None and bundle.scorer.config.kind == kind:
        corpora = (bundle.meta.get("meta") or {}).get("corpora")
        return (None if corpora is None else tuple(corpora)), f"{bundle.path} (adapter bundle)"
    path = path or shipped_scorer_file(getattr(model, "config", None), kind)
    if path is None:
        return None, f"no shipped {kind} scorer fits this model"
    corpora = read_header(path).get("meta", {}).get("corpora")
    return (None if corpora is None else tuple(corpora)), str(path)


def in_domain_corpora(model, cfg: EvalConfig, notes: list[str]) -> tuple[str, ...]:
    """The corpora that count as in domain: those the evaluated learned scorer was trained on (policy
    ``kvpop-mlstm``'s, else ``kvpop-mlp``'s; with ``--scorer`` that checkpoint's, not the shipped one's).
    A run of heuristics only uses the shipped mLSTM scorer's, so it lines up with runs that include
    it. When the other evaluated scorer was trained on other corpora, a note says so."""
    learned = [p for p in ("kvpop-mlstm", "kvpop-mlp") if p in cfg.policies] or ["kvpop-mlstm"]
    found = []
    for p in learned:
        try:
            corpora, source = scorer_corpora(model, p, dict((cfg.policy_kwargs or {}).get(p, {})))
        except (FileNotFoundError, ValueError) as exc:
            notes.append(f"in/out of domain: cannot read the corpora of {p}'s scorer ({exc})")
            continue
        found.append((p, corpora, source))
    if not found or found[0][1] is None:
        why = "it does not record them" if found else "no scorer could be read"
        notes.append(f"every corpus is out of domain: the training corpora of the evaluated scorer are unknown ({why})")
        return ()
    policy, corpora, source = found[0]
    for p, other, src in found[1:]:
        if other is None or set(other) != set(corpora):
            notes.append(
                f"in domain = the corpora {policy}'s scorer ({source}) was trained on: {', '.join(corpora)}; "
                f"{p}'s scorer ({src}) was trained on {', '.join(other) if other else 'unrecorded corpora'}"
            )
    return corpora


def _domain(corpus: str, in_domain: tuple[str, ...]) -> str:
    return "in_domain" if corpus in in_domain else "out_of_domain"


def corpus_documents(
    tokenizer, cfg: EvalConfig, notes: list[str], in_domain: tuple[str, ...] | None = None
) -> list[tuple[str, str, list[Tensor]]]:
    """``[(domain, corpus, [ids...])]`` from the ``cfg.split`` (default test) splits of the corpora (in
    domain: ``in_domain``, by default the shipped scorers' corpora, :func:`shipped_training_corpora`)."""
    in_domain = shipped_training_corpora() if in_domain is None else tuple(in_domain)

    out = []
    for name in cfg.corpora or list_corpora(evaluation_only=True):
        root = (cfg.corpus_root or {}).get(name)
        try:
            docs = long_documents(tokenizer, name, cfg.doc_tokens, split=cfg.split, max_docs=cfg.docs, root=root)
        except (FileNotFoundError, ValueError) as exc:
            notes.append(f"corpus {name!r} skipped: {exc}")
            continue
        if not docs:
            notes.append(f"corpus {name!r} skipped: no {cfg.split} document of {cfg.doc_tokens} tokens")
            continue
        if len(docs) < cfg.docs:
            notes.append(f"corpus {name!r}: only {len(docs)} {cfg.split} document(s) of {cfg.doc_tokens} tokens")
        out.append((_domain(name, in_domain), name, docs))
    return out


def user_documents(tokenizer, path, cfg: EvalConfig) -> tuple[list[Tensor], str]:
    """Token ids of the user's documents (folder of .txt or .jsonl), and their joined text (filler)."""

    docs = read_user_documents(path)
    ids = long_documents(tokenizer, docs, cfg.doc_tokens, max_docs=cfg.docs, concat=False)
    if not ids:  # short documents: join consecutive ones
        ids = long_documents(tokenizer, docs, cfg.doc_tokens, max_docs=cfg.docs, concat=True)
    return ids, "\n\n".join(d.text.strip() for d in docs)


def default_filler(cfg: EvalConfig) -> str:
    """Paul Graham essays (test split first, then the others) as needle / multi-key filler."""

    root = (cfg.corpus_root or {}).get("paul_graham")
    texts = []
    for split in ("test", "validation", "train"):
        texts += [d.text.strip() for d in load_documents("paul_graham", split, root=root)]
    return "\n\n".join(texts)


# ------------------------------------------------------------------------------ policies


def check_policies(model, cfg: EvalConfig) -> tuple[list[str], dict[str, str]]:
    """(available, {unavailable: reason}): each requested policy is built once for ``model`` at the
    first budget (a learned scorer checks it was trained for this model), before any long work."""
    settings = cfg.settings()
    return available_policies(model, cfg.policies, settings, settings.budgets[0])


def unavailable_message(bad: dict[str, str]) -> str:
    lines = [f"{len(bad)} requested polic{'y is' if len(bad) == 1 else 'ies are'} unavailable:"]
    lines += [f"  {p}: {r}" for p, r in bad.items()]
    lines.append("pass --skip-unavailable to run the others (skip_unavailable=True), or drop them from --policies")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ items


def build_items(
    tokenizer, cfg: EvalConfig, notes: list[str], documents=None, filler=None, in_domain: tuple[str, ...] | None = None
) -> list[Item]:
    items: list[Item] = []
    tasks = set(cfg.tasks)
    if tasks & set(TEXT_TASKS):
        if documents is not None:
            sources = [("user", name, [d.view(-1).cpu() for d in ds]) for name, ds in documents.items()]
        else:
            sources = corpus_documents(tokenizer, cfg, notes, in_domain)
        for dom, corpus, docs in sources:
            for i, d in enumerate(docs):
                if tasks & {"lm", "continuation"}:
                    items.append(Item("doc", corpus, dom, str(i), d))
                if "agreement" in tasks:
                    items.append(Item("agreement", corpus, dom, str(i), d[: cfg.prompt_tokens()]))
    if tasks & {"needle", "multikey"}:
        dom = "user" if filler is not None else "synthetic"
        src = "user_text" if filler is not None else "paul_graham"
        try:
            text = filler if filler is not None else default_filler(cfg)
        except (FileNotFoundError, ValueError) as exc:
            notes.append(f"needle / multikey skipped: no filler text ({exc})")
            text = None
        if text is not None and "needle" in tasks:
            try:
                for c in needle_cases(tokenizer, text, cfg.needle_lengths, cfg.needle_depths, cfg.seed):
                    items.append(Item("needle", src, dom, c.case_id, c.ids, case=c))
            except ValueError as exc:
                notes.append(f"needle skipped: {exc}")
        if text is not None and "multikey" in tasks:
            try:
                for c in multikey_cases(
                    tokenizer, text, cfg.multikey_lengths, cfg.multikey_cases, cfg.multikey_keys, cfg.seed
                ):
                    items.append(Item("multikey", src, dom, c.case_id, c.ids, case=c))
            except ValueError as exc:
                notes.append(f"multikey skipped: {exc}")
    return items


# ------------------------------------------------------------------------------ the run


def _model_name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path) -> str | None:
    """sha256 of a file's bytes (None: no such file): a scorer replaced at the same path is another scorer.
    Cached per file version (size, times, inode), since a process may fingerprint the same files many
    times; not for a file changed in the last seconds, which a replacement within one timestamp tick
    (same size, reused inode) could not be told from."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not os.path.isfile(path):
        return None
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    recent = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < 5_000_000_000
    return _sha256_of.__wrapped__(*key) if recent else _sha256_of(*key)


def files_sha256(named: list[tuple[str, Path]]) -> str:
    """One sha256 over several files: each file's name (as given) and the sha256 of its bytes, in order."""
    h = hashlib.sha256()
    for name, path in named:
        h.update(f"{name}:{file_sha256(path)};".encode())
    return h.hexdigest()


def _adapter_fingerprint(model) -> dict | None:
    """The adapter bundle ``model`` was loaded with (None: none) and one hash of all its files: its LoRA
    weights change the outputs, and the base-weight hash reads through them."""
    bundle = getattr(model, ADAPTER_ATTR, None)
    folder = getattr(bundle, "path", None) or getattr(getattr(model, "config", None), ADAPTER_ATTR, None)
    if not folder:
        return None
    folder = Path(folder)
    files = sorted(x for x in folder.rglob("*") if x.is_file())
    return {
        "path": str(folder),
        FILE_HASH_KEY: files_sha256([(f.relative_to(folder).as_posix(), f) for f in files])[:16],
    }


def shipped_scorer_file(config, kind: str) -> Path | None:
    """The shipped ``kind`` scorer a learned policy on a model of ``config`` reads when given no file (the
    one trained for that model, as :class:`~kvpop.policies.LearnedPolicy` picks it), or None if none fits."""
    try:
        return default_scorer_path(kind, config)
    except (ScorerMismatchError, FileNotFoundError):
        return None


def shipped_scorers_sha256(config, kind: str) -> str | None:
    """One sha256 for every shipped ``kind`` scorer of a model of ``config`` (None: none fits): the file's own
    when it is the only one, else a hash of each file's name and sha256 (a scorer for other budgets beside
    the default, :func:`kvpop.checkpoint.shipped_scorers`). Which file a budget reads is the selection's, so
    a change to any file of the set makes earlier results stale."""
    try:
        paths = shipped_scorers(kind, config)
    except (ScorerMismatchError, FileNotFoundError):
        return None
    return file_sha256(paths[0]) if len(paths) == 1 else files_sha256([(p.name, p) for p in paths])


def content_kwargs(model, policy_kwargs: dict | None) -> dict:
    """``policy_kwargs`` as strings, with the sha256 of the scorer files each learned policy reads (``path=``,
    or the set shipped for this model, :func:`shipped_scorers_sha256`; every learned policy's, so the
    fingerprint does not depend on which policies a run selects), and under the alias ``kvpop`` the entry
    of the policy it names on ``model``: a folder made when ``kvpop`` named another scorer (before it was
    the model's default learned policy, it was the mLSTM) is refused, not read as today's ``kvpop``. The
    fingerprints of ``kvpop eval`` and ``kvpop eval tasks``."""
    given = policy_kwargs or {}
    kwargs = {k: {a: str(b) for a, b in v.items()} for k, v in given.items()}
    for kind, policy in KIND_TO_POLICY.items():
        kw = given.get(policy) or {}
        if kw.get("scorer") is not None:  # a scorer in memory: no file
            continue
        path = kw.get("path")
        digest = file_sha256(path) if path else shipped_scorers_sha256(getattr(model, "config", None), kind)
        if digest is not None:
            kwargs[policy] = {**kwargs.get(policy, {}), FILE_HASH_KEY: digest}
    default = default_policy(model)
    if default in kwargs:
        kwargs[ALIAS] = kwargs[default]
    return dict(sorted(kwargs.items()))


def fingerprint(model, cfg: EvalConfig) -> dict:
    """What every unit record depends on besides its item, policy and budget: the settings, and the
    content behind the paths (a hash of the model's weights, the scorer files' sha256, an adapter
    bundle's files), so files replaced at the same path are not taken for the old ones (the split only
    when it is not the test split, so folders made before the split was an option still resume and merge)."""
    fp = {
        "schema_version": SCHEMA_VERSION,
        "model": _model_name(model),
        WEIGHTS_KEY: model_fingerprint(model)[WEIGHTS_SAMPLED_KEY],
        "reference_length": cfg.reference_length,
        "sinks": cfg.sinks,
        "window": cfg.window,
        "window_fraction": cfg.window_fraction,
        "lam": cfg.lam,
        "doc_tokens": cfg.doc_tokens,
        "continuation_tokens": cfg.cont_tokens(),
        "longdep_threshold": cfg.longdep_threshold,
        "agreement_tokens": cfg.agreement_tokens,
        "multikey_keys": cfg.multikey_keys,
        "seed": cfg.seed,
        "policy_kwargs": content_kwargs(model, cfg.policy_kwargs),
    }
    if cfg.split != "test":
        fp["split"] = cfg.split
    adapter = _adapter_fingerprint(model)
    if adapter is not None:
        fp[ADAPTER_KEY] = adapter
    return fp


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
    shard: tuple[int, int] | str | None = None,
    max_units: int | None = None,
    time_limit_s: float | None = None,
    notes: list[str] | None = None,
    dry_run: bool = False,
) -> dict:
    """Run (this shard of) the grid and return the results dict (also ``out/results.json`` + plots).

    Raises :class:`PolicyUnavailable` before any long work when a requested policy cannot be
    built, unless ``cfg.skip_unavailable`` (then it is listed in ``skipped_policies``).
    ``max_units`` / ``time_limit_s``: stop early (after the unit in progress); rerun to continue.
    ``dry_run``: run nothing; return the plan (items, units, done, estimated CPU hours per shard).
    """
    cfg = cfg or EvalConfig()
    for t in cfg.tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; tasks: {', '.join(TASKS)}")
    if cfg.split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {cfg.split!r}")
    shard = parse_shard(shard)
    policies, policy_kwargs = concrete_policies(model, cfg.policies, cfg.policy_kwargs)
    cfg = replace(cfg, policies=policies, policy_kwargs=policy_kwargs or cfg.policy_kwargs)
    budgets = [b.budget for b in cfg.budgets()]
    session = Session(shard)
    notes = list(notes or [])
    policies, skipped = check_policies(model, cfg)
    if skipped and not cfg.skip_unavailable:
        raise PolicyUnavailable(unavailable_message(skipped))
    fp = fingerprint(model, cfg)
    store = RecordStore(None if dry_run else out, fp, session.tag)
    if dry_run and out is not None and check_fingerprint(out, fp) is not None:  # its records serve this run
        _, done_units, _ = load_dirs([out])
        store.records = {u["key"]: u for u in done_units}

    in_domain = in_domain_corpora(model, cfg, notes) if documents is None else ()
    items = build_items(tokenizer, cfg, notes, documents, filler, in_domain)
    settings = cfg.settings()
    plan = [(it, units_of(it, policies, budgets)) for it in items]
    costs = [item_cost(it, u, settings) for it, u in plan]
    if dry_run:
        return _dry_run(plan, costs, store, shard, policies, skipped, notes)
    if shard is not None:
        owner = partition(items, costs, shard[1])
        plan = [pu for pu, s in zip(plan, owner) if s == shard[0] - 1]
    todo = []
    n_done = 0
    for it, units in plan:
        for p, b in units:
            rec = store.done(unit_key(it.id, p, b))
            if rec is None:
                todo.append((it, p, b))
                continue
            if rec.get("doc_sha1") != it.sha1:
                raise ValueError(
                    f"{out}: unit {rec['key']} was computed on different tokens than {it.id} now "
                    "(other data, tokenizer or settings); use another --out folder"
                )
            n_done += 1
    if progress:
        where = "" if shard is None else f" (shard {shard[0]}/{shard[1]})"
        print(
            f"[kvpop eval] {len(plan)} items, {n_done + len(todo)} units{where}: {n_done} done before, "
            f"{len(todo)} to run",
            flush=True,
        )
    left: dict[str, int] = {}  # units of each item still to run
    for it, _, _ in todo:
        left[it.id] = left.get(it.id, 0) + 1
    ran, stopped, interrupted = 0, None, True
    ctx = None
    bar = tqdm(todo, desc="kvpop eval", disable=not progress, dynamic_ncols=True)
    try:
        for it, p, b in bar:
            if max_units is not None and ran >= max_units:
                stopped = f"stopped after {ran} units (max_units)"
                break
            if time_limit_s is not None and time.perf_counter() - session.t_start > time_limit_s:
                stopped = f"stopped after {time.perf_counter() - session.t_start:.0f}s (time limit), {ran} units run"
                break
            left[it.id] -= 1
            if p not in skipped:
                if ctx is None or ctx.item is not it:
                    ctx = None  # free the previous item's tensors first
                    shared = None if out is None else SharedStore(Path(out) / SHARED_DIR, it)
                    ctx = ItemContext(model, tokenizer, it, settings, shared)
                bar.set_postfix_str(f"{it.id} {p} B={b if b is not None else '-'}")
                try:
                    store.append(ctx.run(p, b))
                    ran += 1
                except PolicyUnavailable as exc:
                    if not cfg.skip_unavailable:
                        raise
                    skipped.setdefault(p, str(exc))
                    policies = [q for q in policies if q != p]
            if left[it.id] == 0 and ctx is not None and ctx.item is it and ctx.shared is not None:
                ctx.shared.drop()  # the item is done: its shared runs are not needed again
        interrupted = False
    finally:
        bar.close()
        remaining = len(todo) - ran
        if stopped:
            notes.append(f"{stopped}; {remaining} units of this run remain: {RESUME_HINT}")
        line = session.record(
            interrupted=interrupted,
            tasks=cfg.tasks,
            policies=policies,
            budgets=budgets,
            skipped=skipped,
            notes=notes,
            units_run=ran,
            units_done_before=n_done,
            units_remaining=remaining,
            in_domain=list(in_domain),
            threads=torch.get_num_threads(),
            python=platform.python_version(),
            torch=torch.__version__,
        )
        store.add_session(line)
    _, units, sessions = store.collected(line)
    results = build_results(units, sessions, fp, cfg=cfg)
    if out is not None:
        write_results(results, out, plots=plots)
    return results


def _dry_run(plan, costs, store, shard, policies, skipped, notes) -> dict:
    """What a run would do: per shard, items, units (done / to run) and estimated CPU hours to run."""
    n = shard[1] if shard is not None else 1
    owner = partition([it for it, _ in plan], costs, n) if n > 1 else [0] * len(plan)
    shards = []
    for s in range(n):
        mine = [(pu, c) for pu, c, o in zip(plan, costs, owner) if o == s]
        units = sum(len(u) for (_, u), _ in mine)
        done = sum(1 for (it, u), _ in mine for p, b in u if store.done(unit_key(it.id, p, b)))
        todo_cost = sum(
            c * (1 - sum(1 for p, b in u if store.done(unit_key(it.id, p, b))) / max(1, len(u))) for (it, u), c in mine
        )
        kinds: dict[str, int] = {}
        for (it, _), _ in mine:
            kinds[it.kind] = kinds.get(it.kind, 0) + 1
        shards.append(
            {
                "shard": f"{s + 1}/{n}",
                "items": len(mine),
                "items_by_kind": kinds,
                "units": units,
                "done": done,
                "cpu_hours_total": sum(c for _, c in mine) / 3600,
                "cpu_hours_to_run": todo_cost / 3600,
            }
        )
    return {"dry_run": True, "policies": policies, "skipped_policies": skipped, "notes": notes, "shards": shards}


def build_results(
    units: list[dict], sessions: list[dict], fp: dict, cfg: EvalConfig | None = None, n_boot: int | None = None
) -> dict:
    """The results dict from unit records alone (also after merging folders)."""
    skipped: dict[str, str] = {}
    notes: list[str] = []
    tasks: list[str] = []
    latest = {s.get("tag"): i for i, s in enumerate(sessions)}
    for i, s in enumerate(sessions):
        for p, r in (s.get("skipped_policies") or {}).items():
            skipped.setdefault(p, r)
        # a "units remain" note is stale once a later process of the same shard has run
        notes += [
            n
            for n in s.get("notes", [])
            if n not in notes and not (n.endswith(RESUME_HINT) and latest[s.get("tag")] != i)
        ]
        tasks += [t for t in s.get("tasks", []) if t not in tasks]
    present = {u["policy"] for u in units}
    policies = [p for p in ALL_POLICIES if p in present] + sorted(present - set(ALL_POLICIES))
    skipped = {p: r for p, r in skipped.items() if p not in present}
    n_boot = n_boot if n_boot is not None else (cfg.bootstrap if cfg is not None else 2000)
    doc_tasks = [t for t in ("lm", "continuation") if t in tasks] or None
    rows = aggregate(units, tasks=doc_tasks, policies=policies, n_boot=n_boot)
    units = sorted(units, key=lambda u: u["key"])
    return {
        "schema_version": SCHEMA_VERSION,
        "config": {**fp, **({"selection": _clean(asdict(cfg))} if cfg is not None else {})},
        "model": fp.get("model"),
        "in_domain": _in_domain_of(sessions, units),
        "policies": policies,
        "skipped_policies": skipped,
        "notes": notes,
        "records": [_clean(r) for r in rows],
        "units": [_clean(u) for u in units],
        "sessions": sessions,
        "wall_s": sum(s.get("wall_s", 0.0) for s in sessions),
        "unit_wall_s": sum((u.get("wall_s") or 0.0) + (u.get("shared_wall_s") or 0.0) for u in units),
    }


def _in_domain_of(sessions: list[dict], units: list[dict]) -> list[str]:
    """The in-domain corpora a run's sessions used (the latest that says; older sessions did not
    record it: then the corpora of the units labelled in domain)."""
    for s in reversed(sessions):
        if s.get("in_domain") is not None:
            return list(s["in_domain"])
    return sorted({u["source"] for u in units if u.get("domain") == "in_domain"})


_TASK_KINDS = {"lm": "doc", "continuation": "doc", "needle": "needle", "multikey": "multikey", "agreement": "agreement"}


def unit_filter(tasks=None, compressions=None, policies=None, needle_lengths=None, multikey_lengths=None):
    """A predicate on unit records that keeps the part of a grid these options name (None: no limit);
    ``merge`` uses it so that a committed table can be exactly one grid while the run folders
    already hold more (e.g. longer needles still running)."""
    kinds = None if tasks is None else {_TASK_KINDS[t] for t in tasks}
    comps = None if compressions is None else [float(c) for c in compressions]
    lengths = {"needle": needle_lengths, "multikey": multikey_lengths}

    def keep(u: dict) -> bool:
        if kinds is not None and u.get("kind") not in kinds:
            return False
        if policies is not None and u.get("policy") not in policies:
            return False
        c = u.get("compression")
        if comps is not None and c is not None and not any(abs(c - x) < 1e-9 for x in comps):
            return False
        allowed = lengths.get(u.get("kind"))
        return allowed is None or u.get("length") in allowed

    return keep


def merge(dirs, out: str | Path, plots: bool = True, keep=None) -> dict:
    """Combine the records of several output folders (same settings) into ``out/results.json`` + plots;
    ``keep`` (see :func:`unit_filter`) limits which unit records go in."""
    fp, units, sessions = load_dirs(dirs)
    if keep is not None:
        units = [u for u in units if keep(u)]
    results = build_results(units, sessions, fp)
    results["merged_from"] = [str(d) for d in dirs]
    write_results(results, out, plots=plots)
    return results


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_results(results: dict, out: str | Path, plots: bool = True) -> Path:
    """``out/results.json`` and ``out/table.md`` (atomically), then the plots; a plotting failure is
    reported in ``results["plot_error"]`` and never loses the results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"

    def dump() -> None:
        tmp = out / f".results.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(results, indent=1, allow_nan=False, default=str))
        tmp.replace(path)

    md = out / f".table.md.{os.getpid()}.tmp"
    md.write_text(markdown_report(results))
    md.replace(out / "table.md")
    dump()
    if plots:
        try:
            results["plots"] = sorted(p.name for p in plot_results(results, out))
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the pictures
            results["plot_error"] = f"{type(exc).__name__}: {exc}"
            print(f"[kvpop eval] warning: plotting failed ({results['plot_error']})", flush=True)
        dump()
    return path


def table(results: dict) -> str:
    return text_table(results)
