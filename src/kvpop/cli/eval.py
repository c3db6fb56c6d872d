"""``kvpop eval``: run the evaluation grid and write ``results.json`` + PNG plots + ``table.md`` to ``--out``.

Resumable: every finished unit is appended to ``OUT/records/``; rerunning the same command skips
what is done. ``--shard I/N`` runs one of N deterministic parts (processes may share ``--out``);
``--merge DIR... --out OUT`` combines folders without running anything.
"""

from __future__ import annotations

import argparse
import math
import operator
import sys
import time
from typing import TYPE_CHECKING

from ..data import SPLITS
from ..evaluate.options import add_eviction_arguments, add_run_switches, add_scorer_argument, given_fields
from ..evaluate.store import StoreMismatch, check_out
from ..evaluate.tasks import DEFAULT_TASKS, MULTIKEY_NAMES, TASKS, TEXT_TASKS
from ..files import check_writable_dir
from ..names import ALL_POLICIES

if TYPE_CHECKING:
    from ..evaluate.harness import EvalConfig

# every numeric argument's range (argparse dest -> conditions), checked by one checker before any model loads
NUMBER_LIMITS: dict[str, tuple[tuple[str, float], ...]] = {
    "compression": ((">", 0), ("<", 1)),
    "reference_length": ((">=", 1),),
    "sinks": ((">=", 0),),
    "window": ((">=", 1),),
    "window_fraction": ((">=", 0), ("<=", 1)),  # 0: each policy's own window
    "lam": ((">=", 0),),
    "docs": ((">=", 1),),
    "doc_tokens": ((">=", 2),),  # one prediction at least
    "continuation_tokens": ((">=", 1),),
    "longdep_threshold": ((">=", 0),),
    "needle_lengths": ((">=", 1),),
    "needle_depths": ((">=", 0), ("<=", 1)),
    "multikey_lengths": ((">=", 1),),
    "multikey_cases": ((">=", 1),),
    "multikey_keys": ((">=", 1), ("<=", len(MULTIKEY_NAMES))),
    "agreement_tokens": ((">=", 1),),
    "bootstrap": ((">=", 0),),  # 0: no intervals
    "max_minutes": ((">", 0),),
}
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
# argument dest -> EvalConfig field, for the arguments given (the same name but --compression)
CONFIG_FIELDS = {
    name: name
    for name in (
        "tasks",
        "policies",
        "reference_length",
        "sinks",
        "window",
        "docs",
        "window_fraction",
        "lam",
        "doc_tokens",
        "continuation_tokens",
        "longdep_threshold",
        "corpora",
        "split",
        "needle_lengths",
        "needle_depths",
        "multikey_lengths",
        "multikey_cases",
        "multikey_keys",
        "agreement_tokens",
        "seed",
        "bootstrap",
    )
} | {"compression": "compressions"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpop eval",
        description="Evaluate KV-cache policies at equal budget: teacher-forced LM over all tokens and over "
        "long-dependency tokens (retention, KL, top-1, 95%% bootstrap intervals over documents, per-document "
        "wins/losses against StreamingLLM), continuation, passkey needle (lengths x depths), multi-key recall, "
        "greedy agreement. Writes OUT/results.json, OUT/table.md and OUT/<task>.png. Resumable (rerun the same "
        "command) and splittable (--shard I/N, --merge). Task accuracy (HumanEval pass@1, RULER-style retrieval) "
        "is its own subcommand: `kvpop eval tasks --help`.",
    )
    p.add_argument(
        "--task",
        "--tasks",
        dest="tasks",
        nargs="+",
        choices=TASKS,
        help=f"default: {' '.join(DEFAULT_TASKS)} (lm includes the long-dependency tokens; continuation "
        "shares lm's forward)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        help=f"default: {' '.join(ALL_POLICIES)}; one that cannot be built is an error unless --skip-unavailable",
    )
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="run the available policies and list the others as skipped (default: exit with an error)",
    )
    p.add_argument(
        "--compression",
        nargs="+",
        type=float,
        help="compression ratios of --reference-length (default 0.75 0.875 0.9375)",
    )
    p.add_argument("--reference-length", type=int, help="L in B = (1 - compression) L (default 4096)")
    add_eviction_arguments(p)
    p.add_argument("--docs", type=int, help="documents per corpus / user source (default 2)")
    p.add_argument("--doc-tokens", type=int, help="tokens per LM document (default 4096)")
    p.add_argument("--continuation-tokens", type=int, help="continuation = the last N predictions (default doc/16)")
    p.add_argument(
        "--longdep-threshold",
        type=float,
        help="nats by which the full context must beat the window-only run (default 0.5)",
    )
    p.add_argument("--corpora", nargs="+", help="built-in corpora (default: the six evaluation corpora)")
    p.add_argument(
        "--split",
        choices=SPLITS,
        help="which split of the corpora the documents come from (default test; validation to choose "
        "between scorers or settings without looking at the test documents)",
    )
    p.add_argument(
        "--docs-from",
        help="a folder of .txt files or a .jsonl with 'text': evaluate on these instead "
        "(lm, long-dependency tokens and continuation by default)",
    )
    p.add_argument("--needle-lengths", nargs="+", type=int, help="needle prompt lengths (default 2048 4096 8000)")
    p.add_argument("--needle-depths", nargs="+", type=float, help="needle depths (default 0.1 0.5 0.9)")
    p.add_argument("--multikey-lengths", nargs="+", type=int, help="multi-key prompt lengths (default 2048 4096 8000)")
    p.add_argument("--multikey-cases", type=int, help="multi-key cases per length (default 2)")
    p.add_argument("--multikey-keys", type=int, help="facts per multi-key case (default 4)")
    p.add_argument("--agreement-tokens", type=int, help="greedy tokens for the agreement task (default 256)")
    p.add_argument("--seed", type=int, help="seed of the needle / multi-key cases (default 0)")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the intervals (default 2000)")
    add_scorer_argument(p)
    p.add_argument("--model", help="model folder / .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output folder (records of finished units are kept there)")
    p.add_argument("--shard", metavar="I/N", help="run the I-th of N parts (whole documents / cases, balanced)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run nothing: print the items, units (done / to run) and estimated CPU hours per shard "
        "(with --shard I/N: of all N shards)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="combine the records of these output folders into --out (no model, nothing run); "
        "--task, --compression, --policies, --needle-lengths and --multikey-lengths, when "
        "given, limit what goes in",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="preset: lm (+ continuation), 1 doc/corpus of 1024 tokens, compression 0.875 of 1024, 7 policies",
    )
    add_run_switches(p)
    return p


def config_from_args(args) -> EvalConfig:
    from ..evaluate.harness import EvalConfig, quick_config
    from ..policies.learned import scorer_policy_kwargs

    over = given_fields(args, CONFIG_FIELDS)
    if over.get("window_fraction") == 0:
        over["window_fraction"] = None  # each policy's own default window
    if getattr(args, "skip_unavailable", False):
        over["skip_unavailable"] = True
    if args.scorer:
        over["policy_kwargs"] = scorer_policy_kwargs(args.scorer)
    if getattr(args, "docs_from", None) and "tasks" not in over:
        over["tasks"] = ("lm", "continuation")
    if args.quick:
        if "doc_tokens" in over and "reference_length" not in over:
            over["reference_length"] = over["doc_tokens"]  # compression of the document length
        return quick_config(**over)
    return EvalConfig(**over)


def check_numbers(args) -> None:
    """Each numeric argument (each value of a list) against :data:`NUMBER_LIMITS`: a bad one is one error
    naming its own flag, before any model loads (not a message about another argument later)."""
    for dest, limits in NUMBER_LIMITS.items():
        values = getattr(args, dest, None)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and not (math.isfinite(v) and all(_OPS[op](v, bound) for op, bound in limits)):
                rule = " and ".join(f"{op} {bound:g}" for op, bound in limits)
                raise ValueError(f"--{dest.replace('_', '-')} must be {rule}, got {v}")


def _err(msg: str) -> int:
    print(f"kvpop eval: error: {msg}", file=sys.stderr)
    return 2


def _os_message(exc: OSError) -> str:
    """An ``OSError`` as one line naming its file, without the ``[Errno N]`` prefix."""
    what = exc.strerror or str(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given and given[0] == "tasks":  # task accuracy (HumanEval, RULER): its own options, `kvpop eval tasks --help`
        from ..evaluate.suite import main as tasks_main

        return tasks_main(list(given[1:]))
    args = build_parser().parse_args(argv)
    # the evaluation (torch, the model code) loads once the arguments parsed: --help and a bad one answer at once
    from ..evaluate.core import PolicyUnavailable
    from ..evaluate.harness import merge, parse_shard, run_eval, table, unit_filter, user_documents
    from ..models import load_model_quietly

    t0 = time.perf_counter()
    if args.merge:
        try:
            keep = unit_filter(
                tasks=args.tasks,
                compressions=args.compression,
                policies=args.policies,
                needle_lengths=args.needle_lengths,
                multikey_lengths=args.multikey_lengths,
            )
            check_writable_dir(args.out, "--out")
            results = merge(args.merge, args.out, plots=not args.no_plots, keep=keep)
        except (StoreMismatch, ValueError) as exc:
            return _err(str(exc))
        except OSError as exc:
            return _err(_os_message(exc))
        print(table(results))
        print(
            f"merged {len(args.merge)} folder(s): {len(results['units'])} units -> {args.out}/results.json, "
            f"{args.out}/table.md"
        )
        return 0
    try:
        check_numbers(args)
        cfg = config_from_args(args)
        cfg.budgets()  # validate before loading anything
        if args.shard:
            try:
                parse_shard(args.shard)
            except ValueError as exc:
                raise ValueError(f"--{exc}" if str(exc).startswith("shard") else str(exc)) from None
        check_out(args.out, write=not args.dry_run)
    except (TypeError, ValueError) as exc:
        return _err(str(exc))
    except OSError as exc:
        return _err(_os_message(exc))
    model, tokenizer = load_model_quietly(args.model)
    documents = filler = None
    notes: list[str] = []
    if args.docs_from:
        try:
            ids, user_text = user_documents(tokenizer, args.docs_from, cfg)
        except (FileNotFoundError, ValueError) as exc:
            return _err(str(exc))
        text_tasks = [t for t in cfg.tasks if t in TEXT_TASKS]
        if text_tasks and not ids:
            return _err(f"no document of {cfg.doc_tokens} tokens in {args.docs_from} (lower --doc-tokens)")
        documents = {"user": ids}
        notes.append(
            f"--docs-from {args.docs_from}: {', '.join(text_tasks) or 'no text task'} on {len(ids)} "
            f"document(s) of {cfg.doc_tokens} tokens (lm includes the long-dependency tokens)"
        )
        synthetic = [t for t in ("needle", "multikey") if t in cfg.tasks]
        if synthetic:
            filler = user_text
            notes.append(f"{' and '.join(synthetic)}: synthetic retrieval cases built with YOUR text as filler")
        else:
            notes.append(
                "needle and multi-key recall are synthetic retrieval tasks, not run on your text "
                "(ask with --task needle multikey to use your text as their filler)"
            )
        if "agreement" not in cfg.tasks:
            notes.append("greedy agreement with dense not run (ask with --task agreement)")
        for n in notes:
            print(f"[kvpop eval] {n}", flush=True)
    try:
        results = run_eval(
            model,
            tokenizer,
            cfg,
            documents=documents,
            filler=filler,
            out=args.out,
            progress=not args.no_progress,
            plots=not args.no_plots,
            shard=args.shard,
            time_limit_s=None if args.max_minutes is None else 60.0 * args.max_minutes,
            notes=notes,
            dry_run=args.dry_run,
        )
    except PolicyUnavailable as exc:
        return _err(str(exc))
    except (StoreMismatch, ValueError) as exc:
        return _err(str(exc))
    except OSError as exc:  # a folder made read-only, a full disk: one line, not a traceback
        return _err(_os_message(exc))
    if args.dry_run:
        for s in results["shards"]:
            print(
                f"shard {s['shard']}: {s['items']} items {s['items_by_kind']}, {s['units']} units "
                f"({s['done']} done), ~{s['cpu_hours_to_run']:.2f} CPU hours to run "
                f"(~{s['cpu_hours_total']:.2f} in all; one thread, estimated)"
            )
        for n in results["notes"]:
            print(f"note: {n}")
        return 0
    print(table(results))
    last = results["sessions"][-1] if results.get("sessions") else {}
    left = last.get("units_remaining", 0)
    print(
        f"wrote {args.out}/results.json ({len(results['units'])} units, {len(results['records'])} rows) and "
        f"{args.out}/table.md in {time.perf_counter() - t0:.1f}s"
        + (f"; {left} units of this run remain: rerun the same command to continue" if left else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
