"""``kvpop`` command line: thin argument parsing over the library's modules."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .policies import DEFAULT_POLICY, KIND_TO_POLICY, policy_names

EVICTION_POLICIES = policy_names(teacher_forced=False)  # dense + every policy that can generate
BENCHMARKS = ("targets", "generate", "overhead", "prefill", "gpu", "vllm")
DEMO_QUESTION = "In one sentence, what is the main advice of the essay above?"


def load_model_quietly(name_or_path=None, adapter=None, merge: bool = False):
    """``kvpop.load_model`` for the command line: kvpop's one-time conversion messages, but not
    transformers' per-load "Loading weights" bar (noise on every run)."""
    from transformers.utils import logging as hf_logging

    from .models import load_model

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load_model(name_or_path, progress=True, adapter=adapter, merge=merge)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def policy_for_scorer(path: str, policy: str | None = None) -> str:
    """The learned policy a scorer checkpoint belongs to (its kind, read from the file's header)."""
    from .checkpoint import scorer_kind

    name = KIND_TO_POLICY[scorer_kind(path)]
    if policy is not None and policy != name:
        raise ValueError(f"--scorer {path} is a {scorer_kind(path)} scorer (policy {name}); it cannot serve --policy {policy}")
    return name


def demo_prompt(target_chars: int = 24_000) -> str:
    """A built-in long prompt: the Paul Graham essay of the corpus's test split closest to
    ``target_chars`` characters (~6k tokens), then a question about it."""
    from .data import load_documents

    docs = load_documents("paul_graham", "test")
    if not docs:
        raise ValueError("the paul_graham corpus has no test essay")
    doc = min(docs, key=lambda d: (abs(len(d.text) - target_chars), d.id))
    return doc.text.strip() + "\n\n" + DEMO_QUESTION


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
    p.add_argument("--window", type=int, default=None,
                   help="protected recent window (default: the learned scorer's trained window, else B // 8)")
    p.add_argument("--sinks", type=int, default=4, help="attention sinks kept forever (default 4)")
    p.add_argument("--lam", type=float, default=None,
                   help="recency tilt of the priority r(t) + lam * t (default: the scorer's trained lam, else 0)")


def _budget_kwargs(args, default_budget: int | None = 512) -> dict:
    if args.compression is not None:
        return {"compression": args.compression, "reference_length": args.reference_length, "window": args.window, "sinks": args.sinks}
    return {"budget": args.budget if args.budget is not None else default_budget, "window": args.window, "sinks": args.sinks}


def _cache_kwargs(args) -> dict:
    return {**_budget_kwargs(args), "lam": args.lam}


def cmd_info(args) -> int:
    import torch

    from .attention import detach
    from .cache import make_cache
    from .checkpoint import ScorerMismatchError
    from .config import EvictionConfig
    from .models import model_summary

    model, _ = load_model_quietly(args.model)
    summary = model_summary(model.config, dtype=torch.float32)
    # the split a cache with this policy would use (a learned scorer's trained window and lam)
    policy = args.policy or DEFAULT_POLICY
    try:
        cache = make_cache(model, policy, **_cache_kwargs(args))
    except ScorerMismatchError:
        if args.policy is not None:
            raise
        policy = "knorm"  # no shipped scorer for this model: show the library's default split
        cache = make_cache(model, policy, **_cache_kwargs(args))
    detach(model.config)
    ev: EvictionConfig = cache.eviction
    per_token = summary["kv_bytes_per_token"]
    summary["budget"] = {"policy": policy, "sinks": ev.sinks, "window": ev.window, "k": ev.k, "B": ev.budget, "lam": ev.lam}
    summary["kv_bytes_bounded"] = per_token * ev.budget
    for n in (1024, 4096, 8192):
        summary[f"kv_bytes_dense_{n}"] = per_token * n
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key in ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
        print(f"{key:>24}: {summary[key]}")
    print(f"{'KV bytes / token':>24}: {_human(per_token)} (fp32)")
    print(f"{'budget':>24}: B={ev.budget} (sinks {ev.sinks} + window {ev.window} + k {ev.k}, lam {ev.lam:g}; policy {policy}) -> {_human(per_token * ev.budget)} per sequence, however long")
    for n in (1024, 4096, 8192):
        saved = 1 - min(ev.budget, n) / n
        print(f"{'dense at ' + str(n):>24}: {_human(per_token * n)}  (budget saves {saved:.0%})")
    return 0


def _read_prompt(args) -> str:
    if args.demo_prompt:
        return demo_prompt()
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return sys.stdin.read()
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt


def _generate_adapter(args, policy: str):
    """The adapter bundle `kvpop generate` loads: --adapter, else the shipped one for the embedded
    model under the default learned policy (its own scorer), unless --base-model."""
    from .checkpoint import default_adapter_path

    if args.adapter is not None:
        if args.base_model:
            raise ValueError("--adapter and --base-model exclude each other")
        return args.adapter
    if args.base_model or args.model is not None or args.scorer is not None or policy != DEFAULT_POLICY:
        return None
    try:
        default_adapter_path()
    except FileNotFoundError:  # no bundle shipped: the base model
        return None
    return "default"


def cmd_generate(args) -> int:
    from .generate import generate

    if args.scorer is not None:
        policy = policy_for_scorer(args.scorer, args.policy)
        policy_kwargs = {"path": args.scorer}
    else:
        policy = args.policy or DEFAULT_POLICY
        policy_kwargs = {"seed": args.seed} if policy == "random" else {}
    adapter = _generate_adapter(args, policy)
    prompt = _read_prompt(args)
    t0 = time.perf_counter()
    # LoRA merged into the weights: the same model, no adapter layers on the decode path
    model, tok = load_model_quietly(args.model, adapter=adapter, merge=adapter is not None)
    print(f"[kvpop] model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if adapter is not None:
        print(f"[kvpop] adapted model: {model.kvpop_adapter.path} (LoRA + its scorer; --base-model for the base "
              "model)", file=sys.stderr)  # fmt: skip
    kwargs = {} if policy == "dense" else _cache_kwargs(args)
    if policy != "dense":
        kwargs["compile"] = args.compile
    res = generate(model, tok, prompt, policy=policy, policy_kwargs=policy_kwargs, max_new_tokens=args.max_new_tokens,
                   chat=args.chat, **kwargs)  # fmt: skip
    print(res.text)
    where = f" {res.cache!r}" if res.cache is not None else ""
    print(f"[kvpop] policy={policy}{where}", file=sys.stderr)
    pre = f" ({res.prefill_tokens_per_s:,.0f} tok/s)" if res.prefill_tokens_per_s else ""
    dec = f" ({res.decode_tokens_per_s:.1f} tok/s)" if res.decode_tokens_per_s else ""
    print(
        f"[kvpop] prompt {res.prompt_tokens:,} tokens in {res.prefill_s or 0:.1f}s{pre}; "
        f"generated {res.new_tokens} tokens in {res.decode_s or 0:.1f}s{dec}",
        file=sys.stderr,
    )
    note = ""
    if res.cache is not None and res.kv_bytes > res.dense_kv_bytes:
        note = f"; the {res.cache.budget} slots are allocated up front, so the bound pays off past {res.cache.budget} tokens"
    print(
        f"[kvpop] KV cache held {_human(res.kv_bytes)} vs {_human(res.dense_kv_bytes)} dense "
        f"({res.kv_bytes / max(1, res.dense_kv_bytes):.1%}){note}",
        file=sys.stderr,
    )
    return 0


def cmd_bench(what: str, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(f"kvpop.bench.{what}").main(rest) or 0


def cmd_train(rest: list[str]) -> int:
    from .train import main as train_main

    return train_main(rest)


def cmd_adapt(rest: list[str]) -> int:
    from .adapt import main as adapt_main

    return adapt_main(rest)


def cmd_diagnose(rest: list[str]) -> int:
    from .train.diagnose import main as diagnose_main

    return diagnose_main(rest)


def cmd_compare_adapted(rest: list[str]) -> int:
    from .adapt.report import main as report_main

    return report_main(rest)


def cmd_serve(rest: list[str]) -> int:
    from .serving.vllm.serve import main as serve_main

    return serve_main(rest)


def cmd_eval(rest: list[str]) -> int:
    from .evaluate.cli import main as eval_main

    return eval_main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop", description="Fixed-size KV cache by learned eviction (KVpop).")
    sub = p.add_subparsers(dest="command", required=True)

    pi = sub.add_parser("info", help="model config, KV bytes per token, what a budget saves")
    _add_model(pi)
    _add_budget(pi)
    pi.add_argument("--policy", choices=[n for n in EVICTION_POLICIES if n != "dense"], default=None,
                    help=f"show the budget split this policy uses (a learned scorer: its trained window and lam; "
                         f"default {DEFAULT_POLICY}, or the library default on a model without a shipped scorer)")
    pi.add_argument("--json", action="store_true", help="print JSON")

    pg = sub.add_parser("generate", help="generate text with a bounded KV cache; prints KV held vs dense and tokens/s")
    _add_model(pg)
    src = pg.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': standard input)")
    src.add_argument("--demo-prompt", action="store_true",
                     help="a built-in long prompt: a ~6k-token Paul Graham essay (paul_graham corpus) and a question")  # fmt: skip
    pg.add_argument("--max-new-tokens", type=int, default=64)
    pg.add_argument("--policy", choices=EVICTION_POLICIES, default=None,
                    help=f"eviction policy (default: {DEFAULT_POLICY}, the shipped mLSTM scorer; with --scorer: its kind)")  # fmt: skip
    _add_budget(pg)
    pg.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    pg.add_argument("--scorer", metavar="PATH", default=None,
                    help="a scorer checkpoint (.safetensors from kvpop train); its kind picks kvpop or kvpop-mlp")  # fmt: skip
    pg.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    pg.add_argument("--adapter", metavar="DIR", default=None,
                    help="an adapter bundle (kvpop adapt) to load onto the model; its scorer serves the learned policy")
    pg.add_argument("--base-model", action="store_true",
                    help="with the default policy on the embedded model: use the base model and its scorer, not the "
                         "shipped adapted bundle")  # fmt: skip
    pg.add_argument("--compile", action="store_true",
                    help="compile the cache's steady decode step (a few seconds once, faster steps after)")

    pb = sub.add_parser("bench", help="benchmarks (write JSON); `kvpop bench NAME --help` for a benchmark's options")
    pb.add_argument("what", choices=BENCHMARKS)
    sub.add_parser("train", help="train a KVpop scorer (see `kvpop train --help`)", add_help=False)
    sub.add_parser("adapt", help="adapt the LLM to the bounded cache with LoRA (see `kvpop adapt --help`)",
                   add_help=False)  # fmt: skip
    sub.add_parser("compare-adapted", add_help=False,
                   help="retention of the adapted model vs the base model under kvpop and StreamingLLM(+) on the "
                        "test splits (see `kvpop compare-adapted --help`)")  # fmt: skip
    sub.add_parser("diagnose", help="diagnostics of the learned scorer (see `kvpop diagnose noisy-oracle --help`)",
                   add_help=False)  # fmt: skip
    sub.add_parser("eval", help="evaluate policies and budgets (see `kvpop eval --help`)", add_help=False)
    sub.add_parser("serve", add_help=False,
                   help="vLLM's OpenAI-compatible server with kvpop layers (needs kvpop[vllm]; see `kvpop serve --help`)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "eval", "diagnose", "adapt", "compare-adapted", "serve"):
        run = {"train": cmd_train, "eval": cmd_eval, "diagnose": cmd_diagnose, "adapt": cmd_adapt,
               "compare-adapted": cmd_compare_adapted, "serve": cmd_serve}[argv[0]]
        return run(argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:  # the benchmark parses (and --help) its own options
        return cmd_bench(argv[1], argv[2:])
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            return cmd_info(args)
        if args.command == "generate":
            return cmd_generate(args)
    except (ValueError, OSError, ImportError) as exc:
        print(f"kvpop: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
