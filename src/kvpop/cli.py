"""``kvpop`` command line: thin argument parsing over the library's modules."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .adapt.cli import main as adapt_main
from .adapt.report import main as report_main
from .adapters import read_bundle_meta
from .attention import detach
from .bench import generate as bench_generate
from .bench import gpu as bench_gpu
from .bench import overhead as bench_overhead
from .bench import prefill as bench_prefill
from .bench import targets as bench_targets
from .bench import vllm as bench_vllm
from .cache import make_cache
from .checkpoint import ScorerMismatchError, default_adapter_path
from .compare import compare, human_bytes, table
from .config import BudgetArgs, EvictionConfig, budget_of_compression
from .data import load_documents
from .evaluate.cli import main as eval_main
from .generate import generate
from .models import kv_bytes_at, model_summary
from .options import load_model_quietly, policy_for_scorer
from .policies import DEFAULT_POLICY, policy_names
from .serving.vllm.serve import main as serve_main
from .train.cli import main as train_main
from .train.diagnose import main as diagnose_main

EVICTION_POLICIES = policy_names(teacher_forced=False)  # dense + every policy that can generate
BENCHMARKS = {"targets": bench_targets.main, "generate": bench_generate.main, "overhead": bench_overhead.main,
              "prefill": bench_prefill.main, "gpu": bench_gpu.main,
              "vllm": bench_vllm.main}  # fmt: skip
SUBCOMMANDS = {"train": train_main, "eval": eval_main, "diagnose": diagnose_main, "adapt": adapt_main,
               "compare-adapted": report_main, "serve": serve_main}  # fmt: skip
DEMO_QUESTION = "In one sentence, what is the main advice of the essay above?"


def demo_prompt(target_chars: int = 24_000) -> str:
    """A built-in long prompt: the Paul Graham essay of the corpus's test split closest to
    ``target_chars`` characters (~6k tokens), then a question about it."""
    docs = load_documents("paul_graham", "test")
    if not docs:
        raise ValueError("the paul_graham corpus has no test essay")
    doc = min(docs, key=lambda d: (abs(len(d.text) - target_chars), d.id))
    return doc.text.strip() + "\n\n" + DEMO_QUESTION


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")


def _add_budget(p: argparse.ArgumentParser, default_budget: int | None = 512) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--budget", type=int, default=None, help=f"slots per KV head B = sinks + window + k (default {default_budget})")
    g.add_argument("--compression", type=float, default=None, help="compression r in (0, 1) of --reference-length")
    p.add_argument("--reference-length", type=int, default=4096, help="L for --compression (default 4096)")
    p.add_argument("--window", type=int, default=None,
                   help="protected recent window (default: a learned scorer's trained fraction of B, else B / 2)")
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
    _check_args(args)
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
    bounded = kv_bytes_at(model.config, ev.budget, budget=ev.budget)  # with the sliding layers' windows, if any
    summary["kv_bytes_bounded"] = bounded
    for n in (1024, 4096, 8192):
        summary[f"kv_bytes_dense_{n}"] = kv_bytes_at(model.config, n)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key in ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
        print(f"{key:>24}: {summary[key]}")
    print(f"{'KV bytes / token':>24}: {human_bytes(per_token)} (fp32)")
    print(f"{'budget':>24}: B={ev.budget} (sinks {ev.sinks} + window {ev.window} + k {ev.k}, lam {ev.lam:g}; policy {policy}) -> {human_bytes(bounded)} per sequence, however long")
    if summary["sliding_window"] is not None:
        print(f"{'sliding layers':>24}: {summary['num_layers'] - len(summary['full_attention_layers'])} keep their own "
              f"window of {summary['sliding_window']}; full-attention layers {summary['full_attention_layers']}")
    for n in (1024, 4096, 8192):
        dense = kv_bytes_at(model.config, n)
        saved = 1 - min(kv_bytes_at(model.config, n, budget=min(ev.budget, n)), dense) / dense
        print(f"{'dense at ' + str(n):>24}: {human_bytes(dense)}  (budget saves {saved:.0%})")
    return 0


def _read_prompt(args) -> str:
    if args.demo_prompt:
        return demo_prompt()
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--prompt-file {args.prompt_file}: {getattr(exc, 'strerror', None) or exc}") from exc
        if not text.strip():
            raise ValueError(f"--prompt-file {args.prompt_file} is empty")
        return text
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text")
    return args.prompt


def _check_args(args) -> None:
    """The arguments a command can check alone, before the model loads (one line, exit code 2)."""
    kw = _cache_kwargs(args)
    try:
        BudgetArgs(**kw).checked()
        if kw.get("budget") is not None and kw.get("window") is not None and kw["budget"] < kw["sinks"] + kw["window"]:
            raise ValueError(f"budget={kw['budget']} is smaller than sinks + window = {kw['sinks']} + {kw['window']}")
        if kw.get("compression") is not None:
            budget_of_compression(kw["compression"], kw["reference_length"])
    except (TypeError, ValueError) as exc:  # "reference_length must be ..." -> "--reference-length must be ..."
        name, _, rest = str(exc).partition(" ")
        raise ValueError(f"--{name.replace('_', '-')} {rest}" if name in kw else str(exc)) from exc
    if getattr(args, "max_new_tokens", 1) < 1:
        raise ValueError(f"--max-new-tokens must be a positive int, got {args.max_new_tokens}")


def _generate_adapter(args, policy: str | None):
    """The adapter bundle `kvpop generate` loads: --adapter, else the shipped one for the embedded
    model when no policy is named (``None``) or the named one is the learned policy its scorer
    serves, unless --base-model. (Another learned policy by name runs on the base model: the
    bundle's LoRA was adapted under its own scorer's mask.)"""
    if args.adapter is not None:
        if args.base_model:
            raise ValueError("--adapter and --base-model exclude each other")
        return args.adapter
    if args.base_model or args.model is not None or args.scorer is not None:
        return None
    try:
        default_adapter_path()
    except FileNotFoundError:  # no bundle shipped: the base model
        return None
    return "default" if policy is None or _bundle_policy("default", DEFAULT_POLICY) == policy else None


def _bundle_policy(adapter, default: str) -> str:
    """The learned policy an adapter bundle's scorer serves (``default`` for a bundle without one)."""
    folder = default_adapter_path() if str(adapter) == "default" else Path(adapter)
    scorer = read_bundle_meta(folder).get("scorer")
    return policy_for_scorer(str(folder / scorer)) if scorer else default


def _policy_kwargs(args, policy: str) -> dict:
    """What the policy factory gets from the command line: the --scorer checkpoint for the policy it
    serves, the random policy's seed."""
    if args.scorer is not None and policy == policy_for_scorer(args.scorer):
        return {"path": args.scorer}
    return {"seed": args.seed} if policy == "random" else {}


def _load(args, adapter):
    """The model once (LoRA merged into the weights: the same model, no adapter layers on the decode path)."""
    t0 = time.perf_counter()
    model, tok = load_model_quietly(args.model, adapter=adapter, merge=adapter is not None)
    print(f"[kvpop] model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if adapter is not None:
        print(f"[kvpop] adapted model: {model.kvpop_adapter.path} (LoRA + its scorer; --base-model for the base "
              "model)", file=sys.stderr)  # fmt: skip
    return model, tok


def _compare_policies(args) -> list[str]:
    policies = list(dict.fromkeys(p.strip() for p in args.compare.split(",") if p.strip()))
    bad = [p for p in policies if p not in EVICTION_POLICIES]
    if bad or not policies:
        raise ValueError(f"--compare: unknown policy {bad[0]!r}; choose from {', '.join(EVICTION_POLICIES)}" if bad
                         else "--compare: give at least one policy, e.g. dense,streaming,kvpop")  # fmt: skip
    if args.policy is not None:
        raise ValueError("--compare and --policy exclude each other (--compare names every policy to run)")
    if args.scorer is not None:
        policy_for_scorer(args.scorer)  # a readable scorer checkpoint, before the model loads
    return policies


def _compare_adapter(args, policies: list[str]):
    """The bundle ``--compare`` loads: ``--adapter``, else the shipped adapted bundle when the policy its
    scorer serves is among the compared ones (as `kvpop generate` would load it: an mLSTM bundle for
    ``kvpop``, an MLP bundle for ``kvpop-mlp``); every row then runs the adapted model."""
    return next((a for p in policies if (a := _generate_adapter(args, p)) is not None), None)


def cmd_compare(args) -> int:
    """``kvpop generate --compare P1,P2,...``: the same prompt under each policy, one table."""
    policies = _compare_policies(args)
    if any(p != "dense" for p in policies):
        _check_args(args)
    prompt = _read_prompt(args)
    model, tok = _load(args, _compare_adapter(args, policies))
    outcomes = compare(model, tok, prompt, policies, cache_kwargs={**_cache_kwargs(args), "compile": args.compile},
                       policy_kwargs={p: _policy_kwargs(args, p) for p in policies},
                       max_new_tokens=args.max_new_tokens, chat=args.chat)  # fmt: skip
    r = outcomes[0].result
    print(f"[kvpop] prompt {r.prompt_tokens:,} tokens; up to {args.max_new_tokens} new tokens per policy; "
          f"{', '.join(f'{o.policy}: {o.result.cache!r}' for o in outcomes if o.result.cache is not None) or 'dense only'}",
          file=sys.stderr)  # fmt: skip
    print(table(outcomes))
    return 0


def cmd_generate(args) -> int:
    if args.compare is not None:
        return cmd_compare(args)
    if args.scorer is not None:
        policy = policy_for_scorer(args.scorer, args.policy)
    else:
        policy = args.policy or DEFAULT_POLICY
    adapter = _generate_adapter(args, args.policy)
    if adapter is not None and args.policy is None and args.scorer is None:
        policy = _bundle_policy(adapter, policy)  # the bundle's scorer decides (an MLP bundle serves kvpop-mlp)
    policy_kwargs = _policy_kwargs(args, policy)
    if policy != "dense":
        _check_args(args)
    prompt = _read_prompt(args)
    model, tok = _load(args, adapter)
    kwargs = {} if policy == "dense" else _cache_kwargs(args)
    if policy != "dense":
        kwargs["compile"] = args.compile
    res = generate(model, tok, prompt, policy=policy, policy_kwargs=policy_kwargs, max_new_tokens=args.max_new_tokens,
                   chat=args.chat, **kwargs)  # fmt: skip
    print(res.text)
    where = f" {res.cache!r}" if res.cache is not None else ""
    print(f"[kvpop] policy={policy}{where}", file=sys.stderr)
    if res.compile_status is not None:
        print(f"[kvpop] decode step: {res.compile_status}", file=sys.stderr)
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
    parts = ""
    if res.cache is not None and len(res.cache.bounded) < len(res.cache.layers):
        parts = (f" (full-attention layers {human_bytes(res.cache.kv_bytes('bounded'))} + sliding layers "
                 f"{human_bytes(res.cache.kv_bytes('sliding'))})")  # fmt: skip
    print(
        f"[kvpop] KV cache held {human_bytes(res.kv_bytes)}{parts} vs {human_bytes(res.dense_kv_bytes)} dense "
        f"({res.kv_bytes / max(1, res.dense_kv_bytes):.1%}){note}",
        file=sys.stderr,
    )
    return 0


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
                    help=f"eviction policy (default: on the embedded model, the policy of the shipped adapted bundle's scorer, "
                         f"kvpop-mlp; else {DEFAULT_POLICY}, the shipped MLP scorer; with --scorer: its kind)")  # fmt: skip
    _add_budget(pg)
    pg.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    pg.add_argument("--scorer", metavar="PATH", default=None,
                    help="a scorer checkpoint (.safetensors from kvpop train); its kind picks kvpop or kvpop-mlp")  # fmt: skip
    pg.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    pg.add_argument("--adapter", metavar="DIR", default=None,
                    help="an adapter bundle (kvpop adapt) to load onto the model; its scorer serves the learned policy")
    pg.add_argument("--base-model", action="store_true",
                    help="with the policy the shipped adapted bundle's scorer serves (the default) on the embedded model: "
                         "use the base model and its scorer, not the bundle (another learned policy by name runs on the "
                         "base model anyway)")  # fmt: skip
    pg.add_argument("--compare", metavar="P1,P2,...", default=None,
                    help="answer the same prompt under each of these policies (e.g. dense,streaming,kvpop) with one "
                         "model load, and print one table: answer, KV held, prefill and decode tok/s, compiled or not")
    pg.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the cache's steady decode step (default: on where a compiler works, a few seconds "
                         "once, faster steps after; --no-compile: eager)")

    pb = sub.add_parser("bench", help="benchmarks (write JSON); `kvpop bench NAME --help` for a benchmark's options")
    pb.add_argument("what", choices=list(BENCHMARKS))
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
    if argv and argv[0] in SUBCOMMANDS:  # the subcommand parses (and --help) its own options
        return SUBCOMMANDS[argv[0]](argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return BENCHMARKS[argv[1]](argv[2:]) or 0
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
