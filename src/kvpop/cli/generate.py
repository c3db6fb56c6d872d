"""``kvpop info`` and ``kvpop generate`` (with ``--compare``): their parsers, checks and commands.

The parsers and every check that the argument values alone decide load no torch, transformers or model
code (those load inside the command functions), so a bad argument is refused before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..config import BudgetArgs, budget_of_compression
from ..names import ALIAS, DEFAULT_POLICY, GENERATE_POLICIES
from ..validate import check_int
from .compare import compare, human_bytes, table
from .options import model_position_limit

EVICTION_POLICIES = list(GENERATE_POLICIES)  # dense + every policy that can generate
DEMO_QUESTION = "In one sentence, what is the main advice of the essay above?"
DEFAULT_BUDGET = 512
# the int arguments and their least values: one checker for all (--seed takes any int)
INT_ARGUMENTS = {"max_new_tokens": 1, "budget": 1, "reference_length": 1, "window": 1, "sinks": 0}


def demo_prompt(target_chars: int = 24_000) -> str:
    """A built-in long prompt: the Paul Graham essay of the corpus's test split closest to
    ``target_chars`` characters (~6k tokens), then a question about it."""
    from ..data import load_documents

    docs = load_documents("paul_graham", "test")
    if not docs:
        raise ValueError("the paul_graham corpus has no test essay")
    doc = min(docs, key=lambda d: (abs(len(d.text) - target_chars), d.id))
    return doc.text.strip() + "\n\n" + DEMO_QUESTION


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )


def _add_budget(p: argparse.ArgumentParser, default_budget: int | None = DEFAULT_BUDGET) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--budget", type=int, default=None, help=f"slots per KV head B = sinks + window + k (default {default_budget})"
    )
    g.add_argument("--compression", type=float, default=None, help="compression r in (0, 1) of --reference-length")
    p.add_argument("--reference-length", type=int, default=4096, help="L for --compression (default 4096)")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="protected recent window (default: a learned scorer's trained fraction of B, else B / 2)",
    )
    p.add_argument("--sinks", type=int, default=4, help="attention sinks kept forever (default 4)")
    p.add_argument(
        "--lam",
        type=float,
        default=None,
        help="recency tilt of the priority r(t) + lam * t (default: the scorer's trained lam, else 0)",
    )


def _budget_kwargs(args, default_budget: int | None = DEFAULT_BUDGET) -> dict:
    if args.compression is not None:
        return {
            "compression": args.compression,
            "reference_length": args.reference_length,
            "window": args.window,
            "sinks": args.sinks,
        }
    budget = args.budget if args.budget is not None else default_budget
    return {"budget": budget, "window": args.window, "sinks": args.sinks}


def _cache_kwargs(args) -> dict:
    return {**_budget_kwargs(args), "lam": args.lam}


def _stated_budget(args) -> tuple[int, str]:
    """``(B, how the command line stated it)``, for messages that name the argument."""
    if args.compression is not None:
        budget = budget_of_compression(args.compression, args.reference_length)
        return budget, f"--compression {args.compression:g} of --reference-length {args.reference_length} (B={budget})"
    if args.budget is not None:
        return args.budget, f"--budget {args.budget}"
    return DEFAULT_BUDGET, f"the default --budget {DEFAULT_BUDGET}"


def _check_text(name: str, text: str) -> str:
    """``text`` if it is UTF-8 encodable; argv and a text stream carry undecodable bytes as lone surrogates,
    which the tokenizer would reject only after the model loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        raise ValueError(f"{name} is not UTF-8 text: {what} at character {exc.start}") from exc
    return text


def _check_args(args, bounded: bool) -> None:
    """Every check that the argument values alone decide, in one place, before any model loads (one line
    naming the argument, exit code 2): the ints through one checker, the --prompt text, exclusive options,
    and for a bounded cache (``bounded``) the budget's numbers and split."""
    ints = {
        name: least
        for name, least in INT_ARGUMENTS.items()
        if hasattr(args, name) and (bounded or name == "max_new_tokens")
    }
    kw = _cache_kwargs(args)
    try:
        for name, least in ints.items():
            check_int("--" + name.replace("_", "-"), getattr(args, name), least)
        if bounded:
            BudgetArgs(**kw).checked()  # the numbers: --compression, --lam
            if kw.get("compression") is not None:
                budget_of_compression(kw["compression"], kw["reference_length"])
    except (TypeError, ValueError) as exc:  # "lam must be ..." -> "--lam must be ..."
        name, _, rest = str(exc).partition(" ")
        raise ValueError(f"--{name.replace('_', '-')} {rest}" if name in kw else str(exc)) from exc
    if bounded:
        budget, stated = _stated_budget(args)
        if args.window is not None and budget < args.sinks + args.window:
            raise ValueError(
                f"budget={budget} is smaller than sinks + window = {args.sinks} + {args.window} "
                f"({stated}, --sinks {args.sinks}, --window {args.window})"
            )
        if args.window is None and args.sinks >= budget:
            raise ValueError(
                f"--sinks {args.sinks} leaves no slot for the recent window in {stated}: give "
                "--sinks below B, or a larger --budget"
            )
    if getattr(args, "adapter", None) is not None and args.base_model:
        raise ValueError("--adapter and --base-model exclude each other")
    if getattr(args, "prompt", None) is not None:
        if not args.prompt:
            raise ValueError("--prompt is empty: give some text")
        _check_text("--prompt", args.prompt)


def _check_budget_fits(args) -> None:
    """The budget against the model's position limit, read from its config.json without loading the weights:
    a budget past it would allocate slots the model never reaches."""
    found = model_position_limit(args.model)
    budget, stated = _stated_budget(args)
    if found is not None and budget > found[0]:
        limit, config = found
        raise ValueError(
            f"{stated} exceeds the model's position limit max_position_embeddings={limit} ({config}): "
            f"give a budget <= {limit}, or --policy dense"
        )


def cmd_info(args) -> int:
    _check_args(args, bounded=True)
    _check_budget_fits(args)
    from .. import attention, cache, checkpoint, models

    model, _ = models.load_model_quietly(args.model)
    summary = models.model_summary(model.config)
    # the split a cache with this policy would use (a learned scorer's trained window and lam)
    policy = _named(args.policy) or DEFAULT_POLICY
    try:
        kv_cache = cache.make_cache(model, policy, **_cache_kwargs(args))
    except checkpoint.ScorerMismatchError:
        if args.policy is not None:
            raise
        policy = "knorm"  # no shipped scorer for this model: show the library's default split
        kv_cache = cache.make_cache(model, policy, **_cache_kwargs(args))
    attention.detach(model.config)
    ev = kv_cache.eviction
    per_token = summary["kv_bytes_per_token"]
    summary["budget"] = {
        "policy": policy,
        "sinks": ev.sinks,
        "window": ev.window,
        "k": ev.k,
        "B": ev.budget,
        "lam": ev.lam,
    }
    bounded = models.kv_bytes_at(model.config, ev.budget, budget=ev.budget)  # with the sliding layers' windows, if any
    summary["kv_bytes_bounded"] = bounded
    for n in (1024, 4096, 8192):
        summary[f"kv_bytes_dense_{n}"] = models.kv_bytes_at(model.config, n)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for key in ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
        print(f"{key:>24}: {summary[key]}")
    print(f"{'KV bytes / token':>24}: {human_bytes(per_token)} (fp32)")
    print(
        f"{'budget':>24}: B={ev.budget} (sinks {ev.sinks} + window {ev.window} + k {ev.k}, lam {ev.lam:g}; "
        f"policy {policy}) -> {human_bytes(bounded)} per sequence, however long"
    )
    if summary["sliding_window"] is not None:
        print(
            f"{'sliding layers':>24}: {summary['num_layers'] - len(summary['full_attention_layers'])} keep their own "
            f"window of {summary['sliding_window']}; full-attention layers {summary['full_attention_layers']}"
        )
    for n in (1024, 4096, 8192):
        dense = models.kv_bytes_at(model.config, n)
        saved = 1 - min(models.kv_bytes_at(model.config, n, budget=min(ev.budget, n)), dense) / dense
        print(f"{'dense at ' + str(n):>24}: {human_bytes(dense)}  (budget saves {saved:.0%})")
    return 0


def _read_prompt(args) -> str:
    """The prompt text: a file or standard input is read as bytes and decoded as UTF-8 here, so a bad byte
    is one line naming the argument before the model loads (--prompt is checked with the other values)."""
    if args.demo_prompt:
        return demo_prompt()
    if args.prompt_file is None:
        return args.prompt
    name = f"--prompt-file {args.prompt_file}"
    try:
        if args.prompt_file == "-":
            stream = getattr(sys.stdin, "buffer", None)  # a replaced sys.stdin may be text only
            raw = stream.read() if stream is not None else sys.stdin.read()
        else:
            raw = Path(args.prompt_file).read_bytes()
        text = raw.decode("utf-8") if isinstance(raw, bytes) else _check_text(name, raw)
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}") from exc
    if not text.strip():
        raise ValueError(f"{name} is empty")
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as a text-mode read


def _generate_adapter(args, policy: str | None) -> str | None:
    """The adapter bundle `kvpop generate --policy POLICY` loads (``None``: no policy named)."""
    return _compare_adapter(args, [policy])


def _compare_adapter(args, names: list[str | None]) -> str | None:
    """The one model a command runs every policy on: --adapter; else, on the embedded model with its shipped
    bundle (no --model, --scorer or --base-model), the adapted model when a policy runs that it serves -- none
    named, dense, or the learned policy its scorer serves (an mLSTM bundle: ``kvpop-mlstm``, an MLP bundle:
    ``kvpop-mlp``) -- and no other learned policy (the bundle's LoRA was adapted under its own scorer's mask,
    so the other one runs on the base model, with every row); else the base model (``None``). So dense alone,
    the default policy and a dense row of --compare run the same model."""
    if args.adapter is not None:
        if args.base_model:
            raise ValueError("--adapter and --base-model exclude each other")
        return args.adapter
    if args.base_model or args.model is not None or args.scorer is not None:
        return None
    from .. import checkpoint, policies

    try:
        checkpoint.default_adapter_path()
    except FileNotFoundError:  # no bundle shipped: the base model
        return None
    served = _bundle_policy("default", DEFAULT_POLICY)
    if any(p in policies.LEARNED_POLICIES and p != served for p in names):
        return None
    return "default" if any(p in (None, "dense", served) for p in names) else None


def _named(policy: str | None) -> str | None:
    """A ``--policy`` as the policy it names: ``None`` for the alias kvpop (the model's default learned policy,
    what a run that names none runs)."""
    return None if policy == ALIAS else policy


def _default_learned(args, adapter: str | None) -> str:
    """The learned policy kvpop names in a ``--compare`` list: the --scorer's, else the adapter bundle's
    scorer's, else :data:`kvpop.names.DEFAULT_POLICY` (what ``kvpop generate`` without --policy runs)."""
    if args.scorer is not None:
        from ..policies.learned import policy_for_scorer

        return policy_for_scorer(args.scorer)
    return DEFAULT_POLICY if adapter is None else _bundle_policy(adapter, DEFAULT_POLICY)


def _bundle_policy(adapter, default: str) -> str:
    """The learned policy an adapter bundle's scorer serves (``default`` for a bundle without one)."""
    from .. import bundle, checkpoint
    from ..policies.learned import policy_for_scorer

    folder = checkpoint.default_adapter_path() if str(adapter) == "default" else Path(adapter)
    scorer = bundle.read_bundle_meta(folder).get("scorer")
    return policy_for_scorer(str(folder / scorer)) if scorer else default


def _policy_kwargs(args, policy: str) -> dict:
    """What the policy factory gets from the command line: the --scorer checkpoint for the policy it
    serves, the random policy's seed."""
    from ..policies.learned import policy_for_scorer

    if args.scorer is not None and policy == policy_for_scorer(args.scorer):
        return {"path": args.scorer}
    return {"seed": args.seed} if policy == "random" else {}


def _which_model(adapter: str | None) -> str:
    """What the status lines call the model that ran."""
    return "base" if adapter is None else "adapted"


def _load(args, adapter):
    """The model once (LoRA merged into the weights: the same model, no adapter layers on the decode path),
    and a status line that says which model it is (base or adapted)."""
    from ..models import load_model_quietly

    t0 = time.perf_counter()
    model, tok = load_model_quietly(args.model, adapter=adapter, merge=adapter is not None)
    print(f"[kvpop] model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if adapter is not None:
        print(
            f"[kvpop] adapted model: {model.kvpop_adapter.path} (LoRA + its scorer; --base-model for the base model)",
            file=sys.stderr,
        )
    else:
        print(f"[kvpop] base model: {args.model or 'the embedded model'} (no adapter bundle)", file=sys.stderr)
    return model, tok


def _compare_policies(args) -> list[str]:
    policies = list(dict.fromkeys(p.strip() for p in args.compare.split(",") if p.strip()))
    bad = [p for p in policies if p not in EVICTION_POLICIES]
    if bad or not policies:
        raise ValueError(
            f"--compare: unknown policy {bad[0]!r}; choose from {', '.join(EVICTION_POLICIES)}"
            if bad
            else "--compare: give at least one policy, e.g. dense,streaming,kvpop"
        )
    if args.policy is not None:
        raise ValueError("--compare and --policy exclude each other (--compare names every policy to run)")
    return policies


def cmd_compare(args) -> int:
    """``kvpop generate --compare P1,P2,...``: the same prompt under each policy, one model, one table."""
    policies = _compare_policies(args)
    bounded = any(p != "dense" for p in policies)
    _check_args(args, bounded)
    prompt = _read_prompt(args)
    if bounded:
        _check_budget_fits(args)
    if args.scorer is not None:
        from ..policies.learned import policy_for_scorer

        policy_for_scorer(args.scorer)  # a readable scorer checkpoint, before the model loads
    adapter = _compare_adapter(args, [_named(p) for p in policies])
    policies = list(dict.fromkeys(_default_learned(args, adapter) if p == ALIAS else p for p in policies))
    model, tok = _load(args, adapter)
    outcomes = compare(
        model,
        tok,
        prompt,
        policies,
        cache_kwargs={**_cache_kwargs(args), "compile": args.compile},
        policy_kwargs={p: _policy_kwargs(args, p) for p in policies},
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
    )
    r = outcomes[0].result
    caches = ", ".join(f"{o.policy}: {o.result.cache!r}" for o in outcomes if o.result.cache is not None)
    print(
        f"[kvpop] model={_which_model(adapter)}; prompt {r.prompt_tokens:,} tokens; up to {args.max_new_tokens} "
        f"new tokens per policy; {caches or 'dense only'}",
        file=sys.stderr,
    )
    print(table(outcomes))
    return 0


def cmd_generate(args) -> int:
    if args.compare is not None:
        return cmd_compare(args)
    bounded = args.policy != "dense"
    _check_args(args, bounded)
    prompt = _read_prompt(args)
    if bounded:
        _check_budget_fits(args)
    named = _named(args.policy)  # kvpop: the policy a run names none of
    if args.scorer is not None:
        from ..policies.learned import policy_for_scorer

        policy = policy_for_scorer(args.scorer, named)
    else:
        policy = named or DEFAULT_POLICY
    adapter = _generate_adapter(args, named)
    if adapter is not None and named is None and args.scorer is None:
        policy = _bundle_policy(adapter, policy)  # the bundle's scorer decides (an MLP bundle serves kvpop-mlp)
    policy_kwargs = _policy_kwargs(args, policy)
    from ..generate import generate

    model, tok = _load(args, adapter)
    kwargs = {} if policy == "dense" else _cache_kwargs(args)
    if policy != "dense":
        kwargs["compile"] = args.compile
    res = generate(
        model,
        tok,
        prompt,
        policy=policy,
        policy_kwargs=policy_kwargs,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        **kwargs,
    )
    print(res.text)
    where = f" {res.cache!r}" if res.cache is not None else ""
    print(f"[kvpop] model={_which_model(adapter)} policy={policy}{where}", file=sys.stderr)
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
        note = (
            f"; the {res.cache.budget} slots are allocated up front, so the bound pays off past "
            f"{res.cache.budget} tokens"
        )
    parts = ""
    if res.cache is not None and len(res.cache.bounded) < len(res.cache.layers):
        parts = (
            f" (full-attention layers {human_bytes(res.cache.kv_bytes('bounded'))} + sliding layers "
            f"{human_bytes(res.cache.kv_bytes('sliding'))})"
        )
    print(
        f"[kvpop] KV cache held {human_bytes(res.kv_bytes)}{parts} vs {human_bytes(res.dense_kv_bytes)} dense "
        f"({res.kv_bytes / max(1, res.dense_kv_bytes):.1%}){note}",
        file=sys.stderr,
    )
    return 0


def add_parsers(sub) -> None:
    """The ``info`` and ``generate`` subcommands, added to the top-level parser's subparsers ``sub``."""
    pi = sub.add_parser("info", help="model config, KV bytes per token, what a budget saves")
    _add_model(pi)
    _add_budget(pi)
    pi.add_argument(
        "--policy",
        choices=[n for n in EVICTION_POLICIES if n != "dense"],
        default=None,
        help=f"show the budget split this policy uses (a learned scorer: its trained window and lam; "
        f"default {DEFAULT_POLICY}, or the library default on a model without a shipped scorer)",
    )
    pi.add_argument("--json", action="store_true", help="print JSON")

    pg = sub.add_parser("generate", help="generate text with a bounded KV cache; prints KV held vs dense and tokens/s")
    _add_model(pg)
    src = pg.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': standard input)")
    src.add_argument(
        "--demo-prompt",
        action="store_true",
        help="a built-in long prompt: a ~6k-token Paul Graham essay (paul_graham corpus) and a question",
    )
    pg.add_argument("--max-new-tokens", type=int, default=64)
    pg.add_argument(
        "--policy",
        choices=EVICTION_POLICIES,
        default=None,
        help=f"eviction policy (default, and {ALIAS}: the model's default learned policy: on the embedded "
        f"model, the policy of the shipped adapted bundle's scorer, kvpop-mlp; else {DEFAULT_POLICY}, the "
        "shipped MLP scorer; with --scorer: its kind). dense runs the same model as the default: the adapted "
        "bundle on the embedded model, unless --base-model",
    )
    _add_budget(pg)
    pg.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    pg.add_argument(
        "--scorer",
        metavar="PATH",
        default=None,
        help="a scorer checkpoint (.safetensors from kvpop train); its kind picks kvpop-mlp or kvpop-mlstm",
    )
    pg.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    pg.add_argument(
        "--adapter",
        metavar="DIR",
        default=None,
        help="an adapter bundle (kvpop adapt) to load onto the model; its scorer serves the learned policy",
    )
    pg.add_argument(
        "--base-model",
        action="store_true",
        help="on the embedded model, with the default policy, the learned policy the shipped adapted "
        "bundle's scorer serves, or dense: use the base model (and its scorer), not the bundle "
        "(another learned policy by name runs on the base model anyway); the status lines say "
        "which model ran",
    )
    pg.add_argument(
        "--compare",
        metavar="P1,P2,...",
        default=None,
        help="answer the same prompt under each of these policies (e.g. dense,streaming,kvpop) with one "
        "model load, and print one table: answer, KV held, prefill and decode tok/s, compiled or not",
    )
    pg.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the cache's steady decode step (default: on where a compiler works, a few seconds "
        "once, faster steps after; --no-compile: eager)",
    )
