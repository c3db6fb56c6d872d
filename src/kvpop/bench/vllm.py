"""``kvpop bench vllm``: concurrent requests and decode throughput in vLLM, dense against kvpop.

Needs vLLM (``pip install kvpop[vllm]``, see docs/serving.md). Everything is read from vLLM itself,
side by side in one run, each engine in its own process:

* **admission**: at one KV cache space (``--kv-space-mib``, vLLM's ``kv_cache_memory_bytes``, which
  ``VLLM_CPU_KVCACHE_SPACE`` sets in whole GiB), requests of ``L`` tokens (``--lengths``: prompt
  and new tokens) are submitted, more than fit, and the engine is stepped until all are done. Admitted
  concurrency is the largest number of requests that produce a token in the same step (every one
  of them holds its whole context in vLLM's KV blocks at that moment); vLLM's block count, its KV
  usage gauge at that step and its preemption counter are recorded with it.
* **throughput**: ``--concurrency`` requests of ``--throughput-length`` tokens at once (KV space
  ``--throughput-space-mib``, room for all of them dense); once all decode, the wall time of
  ``--decode-steps`` engine steps gives the decode tokens/s over all requests, and the steps before
  them the prefill's seconds. Each engine first serves the same number of short prompts, so that
  compiling kvpop's decode step is not timed as prefill.

    kvpop bench vllm --out results/bench_vllm        # writes .json and .png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from ..evaluate.plotting import pyplot, save_figure
from ..models import convert_gguf, default_gguf_path
from ..policies import POLICIES, TEACHER_FORCED_ONLY
from .common import median, text_ids, write_json

DENSE = "dense"
MAX_NEW = 256  # admission: new tokens per request at most


def _metrics(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in (
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:num_preemptions",
        ):
            out[m.name.removeprefix("vllm:")] = float(getattr(m, "value", 0.0))
    return out


def _prompts(tok, count: int, length: int) -> list[list[int]]:
    """``count`` different prompts of ``length`` tokens of real text (shifted windows of one text)."""
    shift = 97
    ids = text_ids(tok, length + shift * count).view(-1).tolist()
    return [ids[i * shift : i * shift + length] for i in range(count)]


def _engine(args, mode: str, space_mib: int, max_len: int, compile_: bool = False):
    from vllm import LLM

    kw = {}
    if mode != DENSE:
        kw["additional_config"] = {"kvpop": {"budget": args.budget, "policy": mode, "compile": compile_}}
    return LLM(
        model=args.model_dir,
        dtype="float32",
        max_model_len=max_len,
        kv_cache_memory_bytes=space_mib << 20,
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
        enforce_eager=args.eager,
        max_num_batched_tokens=args.batched_tokens,
        **kw,
    )


def _run(llm, prompts, max_tokens: int, on_step=None) -> list[dict]:
    """Submit all ``prompts`` at once and step the engine to the end; one record per step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    base = f"r{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        eng.add_request(base + str(i), TokensPrompt(prompt_token_ids=p), params)
    steps = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        produced = sum(1 for o in outs if o.outputs and len(o.outputs[0].token_ids) > 0)
        rec = {"seconds": dt, "produced": produced, **_metrics(llm)}
        steps.append(rec)
        if on_step is not None:
            on_step(rec)
    return steps


def worker(args, part: str, mode: str) -> dict:
    """One engine: ``part`` is ``admission`` or ``throughput``; ``mode`` is ``dense`` or a kvpop policy."""
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    t_start = time.perf_counter()
    if part == "admission":
        llm = _engine(args, mode, args.kv_space_mib, max(args.lengths))
        cache = llm.llm_engine.vllm_config.cache_config
        blocks, block_size = cache.num_gpu_blocks, cache.block_size
        rows = []
        for length in args.lengths:
            # vLLM's block arithmetic says how many fit (one block is vLLM's null block): submit two more
            per_request = 1 if mode != DENSE else math.ceil(length / block_size)
            fit = min((blocks - 1) // per_request, 256)
            count = fit + 2
            # a request is `length` tokens in all: its prompt and enough new tokens that the first
            # admitted is still decoding when the last admitted starts
            max_tokens = min(math.ceil(count * length / args.batched_tokens) + 8, MAX_NEW)
            before = _metrics(llm).get("num_preemptions", 0.0)
            steps = _run(llm, _prompts(tok, count, length - max_tokens), max_tokens)
            peak = max(steps, key=lambda s: s["produced"])
            rows.append(
                {
                    "length": length,
                    "prompt": length - max_tokens,
                    "max_tokens": max_tokens,
                    "submitted": count,
                    "admitted": peak["produced"],
                    "kv_usage_at_peak": peak.get("kv_cache_usage_perc"),
                    "running_at_peak": peak.get("num_requests_running"),
                    "waiting_at_peak": peak.get("num_requests_waiting"),
                    "preemptions": steps[-1].get("num_preemptions", 0.0) - before,
                    "blocks_per_request": per_request,
                    "vllm_block_estimate": fit,
                    "seconds": sum(s["seconds"] for s in steps),
                }
            )
        out = {"num_blocks": blocks, "block_size": block_size, "rows": rows}
    else:
        llm = _engine(args, mode, args.throughput_space_mib, args.throughput_length, compile_=not args.no_compile)
        rows = []
        for count in args.concurrency:
            # the first request decodes while the others prefill: enough new tokens that all of them
            # then decode together for --decode-steps steps; prompt + new tokens = --throughput-length
            new = args.decode_steps + math.ceil(count * args.throughput_length / args.batched_tokens) + 2
            # first the same shapes on short prompts (past B, so kvpop's decode is its steady step): a
            # compiled decode step compiles here, not inside the measured prefill, where the first
            # request decodes while the others prefill
            warm = min(args.throughput_length, max(2 * args.budget, new + 64))
            t_warm = time.perf_counter()
            _run(llm, _prompts(tok, count, warm - new), new)
            t_warm = time.perf_counter() - t_warm
            steps = _run(llm, _prompts(tok, count, args.throughput_length - new), new)
            # decode steps: every request produces a token (the first such step may still hold the
            # last prefill chunk: left out)
            dec = [s for s in steps if s["produced"] == count][1:]
            secs = [s["seconds"] for s in dec]
            rows.append(
                {
                    "count": count,
                    "length": args.throughput_length,
                    "decode_steps": len(dec),
                    "step_seconds_median": median(secs),
                    "tokens_per_s": count / median(secs) if secs else float("nan"),
                    "kv_usage": median([s.get("kv_cache_usage_perc", float("nan")) for s in dec]),
                    "prefill_seconds": sum(s["seconds"] for s in steps) - sum(secs),
                    "warmup_seconds": t_warm,
                }
            )
        out = {"rows": rows}
    cache = llm.llm_engine.vllm_config.cache_config
    out.update(
        part=part,
        mode=mode,
        num_blocks=cache.num_gpu_blocks,
        kv_cache_bytes=cache.kv_cache_memory_bytes,
        max_concurrency_reported=cache.kv_cache_max_concurrency,
        seconds=time.perf_counter() - t_start,
    )
    return out


def plot(results: dict, out: Path) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    adm = results["admission"]
    if not adm:
        a.set_axis_off()
        a.text(0.5, 0.5, "admission not measured (--parts)", ha="center", va="center")
    lengths = [r["length"] for r in adm.get(DENSE, {}).get("rows", [])]
    x = range(len(lengths))
    w = 0.38
    for j, mode in enumerate(adm):
        vals = [r["admitted"] for r in adm[mode]["rows"]]
        bars = a.bar(
            [i + (j - 0.5) * w for i in x], vals, w, label=mode if mode == DENSE else f"{mode} B={results['budget']}"
        )
        a.bar_label(bars, fontsize=8)
    if adm:
        a.set_xticks(list(x), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        a.set_xlabel("request length L (prompt + new tokens)")
        a.set_ylabel("concurrent requests (measured)")
        a.set_title(f"admitted at {results['kv_space_mib']} MiB of KV cache")
        a.legend()
    tp = results["throughput"]
    if not tp:
        b.set_axis_off()
        b.text(0.5, 0.5, "throughput not measured (--parts)", ha="center", va="center")
    for mode in tp:
        rows = tp[mode]["rows"]
        b.plot(
            [r["count"] for r in rows],
            [r["tokens_per_s"] for r in rows],
            "o-",
            label=mode if mode == DENSE else f"{mode} B={results['budget']}",
        )
    b.set_xlabel(f"concurrent {results['throughput_length']}-token requests")
    b.set_ylabel("decode tokens/s (all requests)")
    if tp:
        b.set_title("decode throughput")
        b.legend()
    fig.tight_layout()
    return save_figure(fig, out)


def _parse(argv):
    p = argparse.ArgumentParser(prog="kvpop bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--policy", default="kvpop-mlstm", help="kvpop policy served against dense (default kvpop-mlstm)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--lengths", default="2048,4096,8192", help="admission: prompt lengths L")
    p.add_argument("--kv-space-mib", type=int, default=512, help="admission: KV cache space of every engine")
    p.add_argument("--concurrency", default="4,8", help="throughput: concurrent requests")
    p.add_argument("--throughput-length", type=int, default=8192)
    p.add_argument("--throughput-space-mib", type=int, default=3584, help="throughput: KV space (room for all, dense)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batched-tokens", type=int, default=4096, help="vLLM max_num_batched_tokens")
    p.add_argument("--eager", action="store_true", help="vLLM enforce_eager (default: vLLM's CPU compilation)")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="throughput: run kvpop's decode step eagerly (default: compiled, compile=true)",
    )
    p.add_argument(
        "--parts",
        default="admission,throughput",
        help="what to measure: admission, throughput (decode tokens/s and the prefill before it), or both",
    )
    p.add_argument("--out", default="results/bench_vllm")
    p.add_argument("--_worker", nargs=3, default=None, help=argparse.SUPPRESS)  # part, mode, result file
    p.add_argument("--_model_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    if not args.parts or any(x not in ("admission", "throughput") for x in args.parts):
        p.error(f"--parts must be admission, throughput or both (comma-separated), got {','.join(args.parts)!r}")
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.concurrency = [int(x) for x in args.concurrency.split(",")]
    except ValueError as exc:
        p.error(f"--lengths / --concurrency must be comma-separated ints ({exc})")
    for name in (
        "budget",
        "kv_space_mib",
        "throughput_length",
        "throughput_space_mib",
        "decode_steps",
        "batched_tokens",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.lengths) < 1 or min(args.concurrency) < 1:
        p.error("--lengths and --concurrency must be >= 1")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args._worker:
        args.model_dir = args._model_dir
        part, mode, result = args._worker
        Path(result).write_text(json.dumps(worker(args, part, mode)))  # a file: vLLM prints to stdout too
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvpop bench vllm needs vLLM in this environment: pip install 'kvpop[vllm]' (docs/serving.md)")
    if args.policy not in POLICIES or args.policy in TEACHER_FORCED_ONLY:
        raise SystemExit(f"--policy must be a servable kvpop policy, got {args.policy!r}")
    model_dir = args.model or str(convert_gguf(default_gguf_path(), progress=False))
    if not Path(model_dir, "config.json").is_file():
        raise SystemExit(f"--model must be a model folder with config.json, got {model_dir!r}")
    limit = json.loads(Path(model_dir, "config.json").read_text()).get("max_position_embeddings")
    longest = max(*args.lengths, args.throughput_length)
    if limit is not None and longest > limit:
        raise SystemExit(
            f"--lengths / --throughput-length reach {longest} tokens; the model has max_position_embeddings={limit}"
        )
    if min(args.lengths) <= MAX_NEW or args.throughput_length <= 2 * args.decode_steps:
        raise SystemExit(
            f"--lengths must exceed {MAX_NEW} and --throughput-length 2 x --decode-steps (a request's "
            "length is its prompt and its new tokens)"
        )
    t0 = time.perf_counter()
    results = {
        "model": model_dir,
        "policy": args.policy,
        "budget": args.budget,
        "kv_space_mib": args.kv_space_mib,
        "throughput_space_mib": args.throughput_space_mib,
        "throughput_length": args.throughput_length,
        "batched_tokens": args.batched_tokens,
        "eager": args.eager,
        "kvpop_compile_in_throughput": not args.no_compile,
        "admission": {},
        "throughput": {},
    }
    passthrough = [
        "--policy",
        args.policy,
        "--budget",
        str(args.budget),
        "--lengths",
        ",".join(map(str, args.lengths)),
        "--kv-space-mib",
        str(args.kv_space_mib),
        "--concurrency",
        ",".join(map(str, args.concurrency)),
        "--throughput-length",
        str(args.throughput_length),
        "--throughput-space-mib",
        str(args.throughput_space_mib),
        "--decode-steps",
        str(args.decode_steps),
        "--batched-tokens",
        str(args.batched_tokens),
        *(["--eager"] if args.eager else []),
        *(["--no-compile"] if args.no_compile else []),
    ]
    for part in args.parts:
        for mode in (DENSE, args.policy):
            print(f"[bench vllm] {part}: {mode} ...", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp, "result.json")
                cmd = [
                    sys.executable,
                    "-m",
                    "kvpop.bench.vllm",
                    "--_worker",
                    part,
                    mode,
                    str(result),
                    "--_model_dir",
                    model_dir,
                    *passthrough,
                ]
                env = {
                    **os.environ,
                    "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                }
                env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the space is set per engine (kv_cache_memory_bytes)
                res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if res.returncode != 0 or not result.is_file():
                    raise SystemExit(f"{part} {mode} failed ({res.returncode}):\n{res.stderr[-5000:]}")
                results[part][mode] = json.loads(result.read_text())
    table = []
    adm = results["admission"]
    for d, k in zip(adm.get(DENSE, {}).get("rows", []), adm.get(args.policy, {}).get("rows", [])):
        table.append(
            {
                "length": d["length"],
                "dense": d["admitted"],
                "kvpop": k["admitted"],
                "ratio": k["admitted"] / max(1, d["admitted"]),
                "L_over_B": d["length"] / args.budget,
            }
        )
    tp = []
    thr = results["throughput"]
    for d, k in zip(thr.get(DENSE, {}).get("rows", []), thr.get(args.policy, {}).get("rows", [])):
        tp.append(
            {
                "count": d["count"],
                "dense_tokens_per_s": d["tokens_per_s"],
                "kvpop_tokens_per_s": k["tokens_per_s"],
                "ratio": k["tokens_per_s"] / d["tokens_per_s"],
                # the engine steps before every request decodes: the prompts' prefill
                "dense_prefill_s": d["prefill_seconds"],
                "kvpop_prefill_s": k["prefill_seconds"],
                "prefill_vs_dense": d["prefill_seconds"] / k["prefill_seconds"],
            }
        )
    results["table"] = {"admission": table, "throughput": tp}
    results["wall_seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    write_json(results, out.with_suffix(".json"))
    plot(results, out.with_suffix(".png"))
    for row in table:
        print(
            f"L={row['length']:>5}  admitted dense {row['dense']:>3}  {args.policy}@{args.budget} {row['kvpop']:>3}  "
            f"x{row['ratio']:.1f} (L/B = {row['L_over_B']:.0f})"
        )
    for row in tp:
        print(
            f"{row['count']} x {args.throughput_length} tokens: decode {row['dense_tokens_per_s']:.1f} tok/s dense, "
            f"{row['kvpop_tokens_per_s']:.1f} tok/s {args.policy}  x{row['ratio']:.2f}; prefill "
            f"{row['dense_prefill_s']:.1f} s dense, {row['kvpop_prefill_s']:.1f} s {args.policy} "
            f"({row['prefill_vs_dense']:.2f}x dense's speed)"
        )
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')} in {results['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
