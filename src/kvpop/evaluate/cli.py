"""``kvpop eval``: run the evaluation grid and write ``results.json`` + PNG plots to ``--out``."""

from __future__ import annotations

import argparse
import sys
import time

from .core import ALL_POLICIES
from .harness import EvalConfig, quick_config, run_eval, table, user_documents
from .tasks import TASKS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpop eval",
        description="Evaluate KV-cache policies at equal budget: teacher-forced LM (retention, KL, top-1), "
        "continuation, passkey needle, greedy agreement. Writes OUT/results.json and OUT/<task>.png.",
    )
    p.add_argument(
        "--task", "--tasks", dest="tasks", nargs="+", choices=TASKS, help=f"default: all ({', '.join(TASKS)})"
    )
    p.add_argument(
        "--policies", nargs="+", help=f"default: {' '.join(ALL_POLICIES)} (unregistered ones are skipped)"
    )
    p.add_argument(
        "--compression",
        nargs="+",
        type=float,
        help="compression ratios of --reference-length (default 0.75 0.875 0.9375)",
    )
    p.add_argument("--reference-length", type=int, help="L in B = (1 - compression) L (default 4096)")
    p.add_argument("--sinks", type=int, help="sink tokens (default 4); window = B // 8")
    p.add_argument("--docs", type=int, help="documents per corpus / user source (default 2)")
    p.add_argument("--doc-tokens", type=int, help="tokens per LM document (default 4096)")
    p.add_argument("--corpora", nargs="+", help="built-in corpora (default: all)")
    p.add_argument(
        "--docs-from", help="a folder of .txt files or a .jsonl with 'text': evaluate on these instead"
    )
    p.add_argument(
        "--needle-lengths", nargs="+", type=int, help="needle prompt lengths (default 2048 4096 8000)"
    )
    p.add_argument("--needle-depths", nargs="+", type=float, help="needle depths (default 0.1 0.5 0.9)")
    p.add_argument("--agreement-tokens", type=int, help="greedy tokens for the agreement task (default 256)")
    p.add_argument(
        "--scorer",
        action="append",
        metavar="PATH",
        help="a scorer checkpoint to evaluate instead of the shipped one (repeatable, one per kind); its kind, "
        "read from the file, decides whether it is policy kvpop (mlstm) or kvpop-mlp (mlp)",
    )
    p.add_argument("--model", help="model folder / .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--quick",
        action="store_true",
        help="preset: lm only, 1 doc/corpus of 1024 tokens, compression 0.875 of 1024, a few policies",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    return p


def config_from_args(args) -> EvalConfig:
    over = {}
    for name, key in [
        ("tasks", "tasks"), ("policies", "policies"), ("compression", "compressions"),
        ("reference_length", "reference_length"), ("sinks", "sinks"), ("docs", "docs"),
        ("doc_tokens", "doc_tokens"), ("corpora", "corpora"), ("needle_lengths", "needle_lengths"),
        ("needle_depths", "needle_depths"), ("agreement_tokens", "agreement_tokens"),
    ]:  # fmt: skip
        v = getattr(args, name)
        if v is not None:
            over[key] = tuple(v) if isinstance(v, list) else v
    if args.scorer:
        from ..cli import policy_for_scorer

        kw: dict = {}
        for path in args.scorer:
            name = policy_for_scorer(path)
            if name in kw:
                raise ValueError(f"two --scorer checkpoints of policy {name}: {kw[name]['path']} and {path}")
            kw[name] = {"path": path}
        over["policy_kwargs"] = kw
    if args.quick:
        if "doc_tokens" in over and "reference_length" not in over:
            over["reference_length"] = over["doc_tokens"]  # compression of the document length
        return quick_config(**over)
    return EvalConfig(**over)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        cfg.budgets()  # validate before loading anything
    except (TypeError, ValueError, OSError) as exc:
        print(f"kvpop eval: error: {exc}", file=sys.stderr)
        return 2
    from ..cli import load_model_quietly

    t0 = time.perf_counter()
    model, tokenizer = load_model_quietly(args.model)
    documents = filler = None
    if args.docs_from:
        try:
            ids, filler = user_documents(tokenizer, args.docs_from, cfg)
        except (FileNotFoundError, ValueError) as exc:
            print(f"kvpop eval: error: {exc}", file=sys.stderr)
            return 2
        if not ids and set(cfg.tasks) - {"needle"}:
            print(f"kvpop eval: error: no document of {cfg.doc_tokens} tokens in {args.docs_from} "
                  "(lower --doc-tokens)", file=sys.stderr)  # fmt: skip
            return 2
        documents = {"user": ids}
    results = run_eval(
        model, tokenizer, cfg, documents=documents, filler=filler, out=args.out,
        progress=not args.no_progress, plots=not args.no_plots,
    )  # fmt: skip
    print(table(results))
    print(
        f"wrote {args.out}/results.json ({len(results['records'])} records) in {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
