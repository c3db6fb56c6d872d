"""``kvpop`` command line: thin argument parsing over the library's modules."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .policies import policy_names

EVICTION_POLICIES = policy_names(teacher_forced=False)  # dense + every policy that can generate


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")


def _add_budget(p: argparse.ArgumentParser, default_budget: int | None = 512) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--budget", type=int, default=None, help=f"slots per KV head B = sinks + window + k (default {default_budget})")
    g.add_argument("--compression", type=float, default=None, help="compression r in (0, 1) of --reference-length")
    p.add_argument("--reference-length", type=int, default=4096, help="L for --compression (default 4096)")
    p.add_argument("--window", type=int, default=None, help="protected recent window (default B // 8)")
    p.add_argument("--sinks", type=int, default=4, help="attention sinks kept forever (default 4)")


def _budget_kwargs(args, default_budget: int | None = 512) -> dict:
    if args.compression is not None:
        return {"compression": args.compression, "reference_length": args.reference_length, "window": args.window, "sinks": args.sinks}
    return {"budget": args.budget if args.budget is not None else default_budget, "window": args.window, "sinks": args.sinks}


def cmd_info(args) -> int:
    import torch

    from .config import EvictionConfig
    from .models import load_model, model_summary

    model, _ = load_model(args.model)
    summary = model_summary(model.config, dtype=torch.float32)
    ev = EvictionConfig.from_budget(**_budget_kwargs(args))
    per_token = summary["kv_bytes_per_token"]
    summary["budget"] = {"sinks": ev.sinks, "window": ev.window, "k": ev.k, "B": ev.budget}
    summary["kv_bytes_bounded"] = per_token * ev.budget
    for n in (1024, 4096, 8192):
        summary[f"kv_bytes_dense_{n}"] = per_token * n
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key in ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
        print(f"{key:>24}: {summary[key]}")
    print(f"{'KV bytes / token':>24}: {_human(per_token)} (fp32)")
    print(f"{'budget':>24}: B={ev.budget} (sinks {ev.sinks} + window {ev.window} + k {ev.k}) -> {_human(per_token * ev.budget)} per sequence, however long")
    for n in (1024, 4096, 8192):
        saved = 1 - min(ev.budget, n) / n
        print(f"{'dense at ' + str(n):>24}: {_human(per_token * n)}  (budget saves {saved:.0%})")
    return 0


def cmd_generate(args) -> int:
    from .generate import generate
    from .models import load_model
    from .policies import get_policy

    t0 = time.perf_counter()
    model, tok = load_model(args.model, progress=True)
    print(f"[kvpop] model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    kwargs = {} if args.policy == "dense" else _budget_kwargs(args)
    policy = args.policy
    if args.policy == "random":
        policy = get_policy("random", seed=args.seed)
    elif args.policy in ("kvpop", "kvpop-mlp"):
        # the shipped scorer for the embedded model, or --scorer PATH; refused if trained for another model
        policy = get_policy(args.policy, path=args.scorer, model=model)
    t0 = time.perf_counter()
    res = generate(model, tok, args.prompt, policy=policy, max_new_tokens=args.max_new_tokens, chat=args.chat, **kwargs)
    dt = time.perf_counter() - t0
    print(res.text)
    where = f" {res.cache!r}" if res.cache is not None else ""
    note = ""
    if res.cache is not None and res.kv_bytes > res.dense_kv_bytes:
        note = f"; the {res.cache.budget} slots are allocated up front, so the bound pays off past {res.cache.budget} tokens"
    print(
        f"[kvpop] policy={args.policy}{where}: {res.new_tokens} tokens in {dt:.1f}s; KV held {_human(res.kv_bytes)} "
        f"vs dense {_human(res.dense_kv_bytes)} ({res.kv_bytes / max(1, res.dense_kv_bytes):.0%}){note}",
        file=sys.stderr,
    )
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(f"kvpop.bench.{args.what}").main(rest) or 0


def cmd_train(rest: list[str]) -> int:
    from .train import main as train_main

    return train_main(rest)


def cmd_eval(rest: list[str]) -> int:
    from .evaluate.cli import main as eval_main

    return eval_main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop", description="Fixed-size KV cache by learned eviction (KVpop).")
    sub = p.add_subparsers(dest="command", required=True)

    pi = sub.add_parser("info", help="model config, KV bytes per token, what a budget saves")
    _add_model(pi)
    _add_budget(pi)
    pi.add_argument("--json", action="store_true", help="print JSON")

    pg = sub.add_parser("generate", help="generate text with a bounded KV cache")
    _add_model(pg)
    pg.add_argument("--prompt", required=True)
    pg.add_argument("--max-new-tokens", type=int, default=64)
    pg.add_argument("--policy", choices=EVICTION_POLICIES, default="knorm")
    _add_budget(pg)
    pg.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    pg.add_argument("--scorer", default=None, help="scorer checkpoint for --policy kvpop/kvpop-mlp (default: the shipped one)")
    pg.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    pb = sub.add_parser("bench", help="benchmarks (write JSON); options after the name go to the benchmark")
    pb.add_argument("what", choices=["targets", "generate", "overhead", "prefill"])
    sub.add_parser("train", help="train a KVpop scorer (see `kvpop train --help`)", add_help=False)
    sub.add_parser("eval", help="evaluate policies and budgets (see `kvpop eval --help`)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "eval"):
        return cmd_train(argv[1:]) if argv[0] == "train" else cmd_eval(argv[1:])
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "info":
            return cmd_info(args)
        if args.command == "generate":
            return cmd_generate(args)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"kvpop: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
