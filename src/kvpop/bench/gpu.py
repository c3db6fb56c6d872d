"""``kvpop bench gpu``: the CUDA checks of issue #14 as one prepared run (JSON + PNG).

**Targets.** The FlexAttention target pass (``future_attention(method="flex")``) against the
same pass done other ways on the same random ``q``/``k`` (SmolLM2-135M shapes: 9 query heads,
3 KV heads, d = 64, window 256): the blocked pass in float64 on the GPU (the reference at every
length), the dense reference (float32, where ``S x S`` per head fits), the blocked pass in
float32, and the CPU fused pass on the host's cores. Each gets its agreement with the reference
(largest and median ``|log target - reference|`` over the keys whose reference target is above
``exp(-80)``, and whether the ``-inf`` keys match) and its median time next to one causal SDPA
forward (float32 and bfloat16), the unit of comparison.

**Decode.** One decode step of kvpop (mLSTM and MLP scorers, eager and compiled), StreamingLLM
and TOVA against the floor (a ``StaticCache`` of ``B`` slots: no scoring, no eviction) and dense
(transformers' ``DynamicCache``, and a ``StaticCache`` sized to the context), at each
``--contexts`` length, on a random-weight model of the embedded model's architecture in
bfloat16 (a step's cost does not depend on the weights' values, and the hub is out of reach).
The learned scorers have the shipped scorers' architecture and weights. Every cache is
prefilled to the context (the floor to under ``B``), then the rows take turns, ``--rounds``
rounds of ``--steps`` steps, each step timed between two device synchronisations; a row's
median step is divided by the floor's and dense's medians of the same context.

Runs on the CPU too, at small sizes (the tests do), where the flex rows are skipped.

    kvpop bench gpu --out results/bench_gpu
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from ..cache import make_cache
from ..checkpoint import default_scorer_path, load_scorer
from ..compat import cache_kwargs
from ..evaluate.plotting import pyplot, save_figure
from ..policies import LearnedPolicy
from ..rope import RopeSpec
from ..scorers import build_scorer
from ..targets import future_attention
from .common import step_row, write_json

SMOLLM2_135M = {  # the embedded model's architecture (its config.json, without the weights)
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
DECODE_ROWS = (
    "floor",
    "dense",
    "dense-static",
    "streaming",
    "tova",
    "tova+compile",
    "kvpop-mlstm",
    "kvpop-mlstm+compile",
    "kvpop-mlp",
    "kvpop-mlp+compile",
)
LOG_FLOOR = -80.0  # targets below exp(-80) are left out of the error (float32 attention underflows there)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int, budget_s: float) -> list[float]:
    """Seconds of ``reps`` calls (fewer once ``budget_s`` is spent), each ended by a device sync;
    the caller has made the first (compiling) call already."""
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return times


def _agreement(x: torch.Tensor, ref: torch.Tensor) -> dict:
    x, ref = x.double().cpu(), ref.double().cpu()
    same_inf = bool(torch.equal(torch.isfinite(x), torch.isfinite(ref)))
    sel = torch.isfinite(ref) & (ref > LOG_FLOOR) & torch.isfinite(x)
    d = (x[sel] - ref[sel]).abs()
    return {
        "max_abs_err": float(d.max()) if d.numel() else float("nan"),
        "median_abs_err": float(d.median()) if d.numel() else float("nan"),
        "compared": int(sel.sum()),
        "same_inf": same_inf,
        "nan": bool(torch.isnan(x).any()),
    }


def _target_runs(q, k, v, device: torch.device, w: int, scale: float) -> dict:
    """name -> (call, device it runs on): the unit (SDPA) and each way of doing the target pass."""
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "sdpa-f32": (lambda: sdpa(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True), device),
        "sdpa-bf16": (
            lambda: sdpa(qd.bfloat16(), kd.bfloat16(), vd.bfloat16(), is_causal=True, scale=scale, enable_gqa=True),
            device,
        ),
        "flex-f32": (lambda: future_attention(qd, kd, w, method="flex"), device),
        "flex-bf16": (lambda: future_attention(qd.bfloat16(), kd.bfloat16(), w, method="flex"), device),
        "blocked-f32": (lambda: future_attention(qd, kd, w, method="blocked", block=1024), device),
        "dense-f32": (lambda: future_attention(qd, kd, w, method="dense"), device),
        "fused-cpu-f32": (lambda: future_attention(q, k, w, method="fused"), torch.device("cpu")),
    }


def targets_part(
    sizes,
    device: torch.device,
    *,
    window: int = 256,
    q_heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    reps: int = 10,
    budget_s: float = 20.0,
    cpu_threads: int | None = None,
    dense_max_gb: float = 48.0,
    log=print,
) -> list[dict]:
    """One row per (S, method); see the module doc."""
    rows: list[dict] = []
    cuda = device.type == "cuda"
    if cuda:  # each (S, dtype, pass) is a new flex graph: leave room above dynamo's default of 8
        from torch._dynamo import config as dynamo_config

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, 64)
    scale = dim**-0.5
    for S in sizes:
        g = torch.Generator().manual_seed(int(S))
        q = torch.randn(1, q_heads, S, dim, generator=g) * 1.5
        k = torch.randn(1, kv_heads, S, dim, generator=g) * 1.5
        v = torch.randn(1, kv_heads, S, dim, generator=g)
        w = min(window, S - 1)
        t0 = time.perf_counter()
        ref = future_attention(
            q.to(device, torch.float64), k.to(device, torch.float64), w, method="blocked", block=1024
        )
        _sync(device)
        rows.append({"S": S, "method": "blocked-f64 (reference)", "time_s": time.perf_counter() - t0})
        runs = _target_runs(q, k, v, device, w, scale)
        for name, (fn, dev) in runs.items():
            row: dict = {"S": S, "method": name, "device": str(dev)}
            if name.startswith("flex") and not cuda:
                row["skipped"] = "flex needs CUDA"
            elif name == "flex-bf16" and S != max(sizes):
                row["skipped"] = "bfloat16 at the longest S only (each shape compiles anew)"
            elif name == "dense-f32" and 4 * q_heads * S * S * 4 > dense_max_gb * 1e9:
                row["skipped"] = f"S x S per head above {dense_max_gb} GB"
            else:
                threads = torch.get_num_threads()
                if dev.type == "cpu" and cpu_threads:
                    torch.set_num_threads(cpu_threads)
                try:
                    _sync(dev)
                    t0 = time.perf_counter()
                    out = fn()  # the values (the first call: it compiles, where it compiles)
                    _sync(dev)
                    first = time.perf_counter() - t0
                    if not name.startswith("sdpa"):
                        row.update(_agreement(out, ref))
                    del out
                    times = _timed(fn, dev, 1 if dev.type == "cpu" and S > 8192 else reps, budget_s)
                    row.update(
                        first_call_s=first,
                        time_s=statistics.median(times),
                        times_s=times,
                        threads=torch.get_num_threads() if dev.type == "cpu" else None,
                    )
                except Exception as exc:  # noqa: BLE001 (one failing method must not lose the others)
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    row["traceback"] = traceback.format_exc(limit=6)
                finally:
                    torch.set_num_threads(threads)
                    if cuda:
                        torch.cuda.empty_cache()
            rows.append(row)
        unit = {r["method"]: r.get("time_s") for r in rows if r["S"] == S}
        for r in rows:
            if r["S"] == S and r.get("time_s") and "reference" not in r["method"]:
                r["vs_sdpa_f32"] = r["time_s"] / unit["sdpa-f32"] if unit.get("sdpa-f32") else None
        log(_format_targets([r for r in rows if r["S"] == S]))
    return rows


def _format_targets(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "skipped" in r or "error" in r:
            out.append(f"S={r['S']:>6} {r['method']:>24}  {r.get('skipped') or r.get('error')}")
            continue
        err = f"max|err| {r['max_abs_err']:.2e} inf-match {r['same_inf']}" if "max_abs_err" in r else ""
        ratio = f"{r['vs_sdpa_f32']:6.2f}x sdpa-f32" if r.get("vs_sdpa_f32") else ""
        out.append(f"S={r['S']:>6} {r['method']:>24}  {1000 * r['time_s']:9.2f} ms  {ratio}  {err}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# parity: the cache on this device against the CPU
# --------------------------------------------------------------------------------------------

PARITY_POLICIES = ("streaming", "tova", "kvpop-mlstm", "kvpop-mlp")


@torch.no_grad()
def parity_part(
    device: torch.device, *, policies=PARITY_POLICIES, budget: int = 64, prompt: int = 200, steps: int = 64, log=print
) -> list[dict]:
    """The same tiny float32 model and policy on the CPU and on ``device`` (eager and compiled):
    a prompt, then ``steps`` decode steps; the largest logit difference against the CPU run and
    the share of cache slots that hold the same token at the end (near-ties may flip)."""
    from ..testing import random_learned_policy, tiny_model  # test scaffolding: kept out of the CLI's imports

    base = tiny_model("llama", num_hidden_layers=3, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, base.config.vocab_size, (2, prompt + steps), generator=gen)
    rows = []
    for name in policies:
        runs = {}
        variants = [(torch.device("cpu"), False), (device, False), (device, True)]
        for dev, comp in variants[1:] if device.type == "cpu" else variants:
            label = f"{dev.type}{'+compile' if comp else ''}"
            try:
                m = copy.deepcopy(base).to(dev)
                pol = (
                    random_learned_policy(m, "mlp" if name == "kvpop-mlp" else "mlstm", extra=True)
                    if name.startswith("kvpop")
                    else name
                )
                cache = make_cache(m, pol, budget=budget, compile=comp)
                x = ids.to(dev)
                logits = [m(x[:, :prompt], **cache_kwargs(cache)).logits[:, -1].float().cpu()]
                for t in range(prompt, prompt + steps):
                    logits.append(m(x[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1].float().cpu())
                slots = torch.stack([layer.slot_index.cpu() for layer in cache.layers])
                runs[label] = (torch.stack(logits), slots)
            except Exception as exc:  # noqa: BLE001
                rows.append(
                    {
                        "policy": name,
                        "run": label,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(limit=8),
                    }
                )
        ref = runs.get("cpu")
        for label, (lg, slots) in runs.items():
            if label == "cpu" or ref is None:
                continue
            rows.append(
                {
                    "policy": name,
                    "run": label,
                    "max_logit_diff": float((lg - ref[0]).abs().max()),
                    "same_slots": float((slots == ref[1]).float().mean()),
                    "steps": steps,
                    "budget": budget,
                }
            )
    for r in rows:
        log(
            f"parity {r['policy']:>10} {r['run']:>13}: "
            + (
                r["error"]
                if "error" in r
                else f"max |logit diff| {r['max_logit_diff']:.2e}, same slots {r['same_slots']:.3f}"
            )
        )
    return rows


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


def random_model(device: torch.device, dtype: torch.dtype, max_positions: int, **overrides):
    """A random-weight LlamaForCausalLM of the embedded model's architecture."""
    cfg = LlamaConfig(**{**SMOLLM2_135M, **overrides}, max_position_embeddings=max_positions)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def shipped_like_policy(model, kind: str):
    """A learned policy with the shipped scorer's architecture for ``model``: the shipped scorer
    itself when the shapes match (no fingerprint check: the weights here are random), else a
    seeded random init of its configuration (a step's cost is the same)."""
    path = default_scorer_path(kind)
    scorer, meta = load_scorer(path)
    text = model.config
    shape = {"num_layers": text.num_hidden_layers, "kv_heads": text.num_key_value_heads, "head_dim": text.head_dim}
    same = all(getattr(scorer.config, k) == v for k, v in shape.items())
    if not same:
        scorer = build_scorer(dataclasses.replace(scorer.config, **shape))
        if scorer.config.position_free:
            scorer.set_rope(RopeSpec.from_config(text))
    return LearnedPolicy(
        scorer.eval(), source=f"{path} ({'weights' if same else 'random init'})", trained_for=meta.get("trained_for")
    )


def _make_cache(model, row: str, budget: int, length: int):
    if row == "floor":
        return StaticCache(config=model.config, max_cache_len=budget)
    if row == "dense":
        return DynamicCache(config=model.config)
    if row == "dense-static":
        return StaticCache(config=model.config, max_cache_len=length)
    name = row.removesuffix("+compile")
    policy = (
        shipped_like_policy(model, {"kvpop-mlstm": "mlstm", "kvpop-mlp": "mlp"}[name])
        if name.startswith("kvpop")
        else name
    )
    return make_cache(model, policy, budget=budget, compile=row.endswith("+compile"))


@torch.no_grad()
def decode_part(
    contexts,
    device: torch.device,
    *,
    rows=DECODE_ROWS,
    budget: int = 512,
    batch: int = 1,
    steps: int = 8,
    rounds: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    prefill_chunk: int = 4096,
    model_overrides: dict | None = None,
    log=print,
    on_result=None,
) -> list[dict]:
    """One dict per context: ``{"context", "floor_ms", "dense_ms", "rows": [...]}``."""
    total = steps * rounds
    if budget <= total + 2:
        raise ValueError(f"budget must exceed steps x rounds + 2 = {total + 2} (the floor's static cache fills)")
    longest = max(contexts) + len(contexts) * (total + 1) + 8
    model = random_model(device, dtype, longest, **(model_overrides or {}))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, longest), generator=gen).to(device)

    def feed(cache, start: int, stop: int) -> None:
        for a in range(start, stop, prefill_chunk):
            model(ids[:, a : min(stop, a + prefill_chunk)], **cache_kwargs(cache), logits_to_keep=1)

    state: dict[str, dict] = {}
    results = []
    for ctx in contexts:
        live: dict[str, dict] = {}
        errors: list[dict] = []  # rows that failed at this context (the others still run)
        for row in rows:
            try:
                if row in ("floor", "dense-static") or row not in state:  # these two are sized per context
                    state[row] = {"cache": _make_cache(model, row, budget, ctx + total + 2), "pos": 0}
                st = state[row]
                target = budget - total - 1 if row == "floor" else ctx
                _sync(device)
                t0 = time.perf_counter()
                feed(st["cache"], st["pos"], target)
                _sync(device)
                st["prefill_s"] = time.perf_counter() - t0
                st["prefilled"] = target - st["pos"]
                st["pos"] = target
                t0 = time.perf_counter()
                model(ids[:, st["pos"] : st["pos"] + 1], **cache_kwargs(st["cache"]))  # first step (compiles, if asked)
                _sync(device)
                st["first_s"] = time.perf_counter() - t0
                st["pos"] += 1
                st["times"] = []
                live[row] = st
            except Exception as exc:  # noqa: BLE001 (a failing row is reported, the others still run)
                errors.append(
                    {"name": row, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
                )
                state.pop(row, None)
                log(f"ctx {ctx} {row}: {errors[-1]['error']}")
        for _ in range(rounds):
            for row, st in live.items():
                for _ in range(steps):
                    _sync(device)
                    t0 = time.perf_counter()
                    model(ids[:, st["pos"] : st["pos"] + 1], **cache_kwargs(st["cache"]))
                    _sync(device)
                    st["times"].append(time.perf_counter() - t0)
                    st["pos"] += 1
        floor = 1000 * statistics.median(live["floor"]["times"]) if "floor" in live else math.nan
        dense = 1000 * statistics.median(live["dense"]["times"]) if "dense" in live else math.nan
        out_rows = []
        for row, st in live.items():
            step = 1000 * statistics.median(st["times"])
            out_rows.append(
                {
                    **step_row(row, step, floor, dense, len(st["times"])),
                    "first_step_s": st["first_s"],
                    "prefill_s": st["prefill_s"],
                    "prefill_tokens": st["prefilled"],
                    "compile_status": getattr(st["cache"], "compile_status", None),
                }
            )
        out_rows += errors
        res = {"context": ctx, "budget": budget, "batch": batch, "floor_ms": floor, "dense_ms": dense, "rows": out_rows}
        if device.type == "cuda":
            res["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        results.append(res)
        log(_format_decode(res))
        if on_result is not None:
            on_result(results)
    return results


def _format_decode(res: dict) -> str:
    out = [f"context {res['context']}, B = {res['budget']}, batch {res['batch']}"]
    for r in res["rows"]:
        if "error" in r:
            out.append(f"  {r['name']:>18}: {r['error']}")
        else:
            out.append(
                f"  {r['name']:>18}: {r['step_ms']:7.2f} ms  {r['vs_floor']:5.2f}x floor  "
                f"{r['vs_dense']:5.2f}x dense  first {r['first_step_s']:6.2f} s  prefill {r['prefill_s']:6.2f} s"
            )
    return "\n".join(out)


def plot(result: dict, out: Path) -> Path:
    """Decode step against the context (one panel per batch run) and the target pass's times."""
    plt = pyplot()
    dec = result.get("decode") or []
    tg = [r for r in result.get("targets") or [] if r.get("time_s") and "reference" not in r["method"]]
    panels = [p for p, has in (("decode", dec), ("targets", tg)) if has]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=False):
        if panel == "decode":
            palette = [
                "tab:blue",
                "tab:orange",
                "tab:green",
                "tab:purple",
                "tab:brown",
                "tab:pink",
                "tab:olive",
                "tab:cyan",
                "tab:gray",
                "gold",
            ]  # no red: dense is red
            for i, n in enumerate(DECODE_ROWS):
                pts = [
                    (d["context"], r["step_ms"]) for d in dec for r in d["rows"] if r["name"] == n and "step_ms" in r
                ]
                if pts:
                    style = {"floor": {"color": "k", "ls": "--"}, "dense": {"color": "tab:red", "ls": "--"}}.get(
                        n, {"color": palette[i % len(palette)], "ls": ":" if n == "dense-static" else "-"}
                    )
                    ax.plot(*zip(*pts, strict=True), marker="o", label=n, **style)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("median decode step (ms)")
            ax.set_ylim(bottom=0)
            ax.set_title(
                f"decode, B = {dec[0]['budget']}, batch {dec[0]['batch']} ({result['device_name']})", fontsize=9
            )
        else:
            for m in sorted({r["method"] for r in tg}):
                pts = [(r["S"], r["time_s"] * 1000) for r in tg if r["method"] == m]
                ax.plot(*zip(*pts, strict=True), marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length S")
            ax.set_ylabel("median time (ms)")
            ax.set_title("target pass (future attention) vs one causal SDPA forward", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out.with_suffix(".png")
    save_figure(fig, path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpop bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="8192,16384,32768", help="target-pass lengths ('' to skip)")
    p.add_argument("--contexts", default="8192,16384,32768", help="decode contexts ('' to skip)")
    p.add_argument("--rows", default=",".join(DECODE_ROWS))
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--window", type=int, default=256, help="target-pass window")
    p.add_argument("--reps", type=int, default=10, help="timed calls per target method")
    p.add_argument("--cpu-threads", type=int, default=None, help="threads of the CPU fused pass (default: all)")
    p.add_argument("--parity", default=",".join(PARITY_POLICIES), help="policies of the parity check ('' to skip)")
    p.add_argument("--model", default="{}", help="JSON overrides of the model config (e.g. a larger model)")
    p.add_argument("--out", default="results/bench_gpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    contexts = [int(s) for s in a.contexts.split(",") if s]
    rows = [r for r in a.rows.split(",") if r]
    bad = [r for r in rows if r not in DECODE_ROWS]
    if bad:
        raise SystemExit(f"--rows: unknown {bad}; expected some of {list(DECODE_ROWS)}")
    if contexts and "floor" not in rows:
        raise SystemExit("--rows must include 'floor' (every row is divided by it)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    out = Path(a.out)
    result = {
        "command": "kvpop bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "options": vars(a),
        "targets": [],
        "decode": [],
    }
    result["transformers"] = transformers.__version__
    t_start = time.perf_counter()

    def save() -> None:
        result["wall_s"] = time.perf_counter() - t_start
        write_json(result, out.with_suffix(".json"))

    parity = [x for x in a.parity.split(",") if x]
    if parity:
        result["parity"] = parity_part(device, policies=parity)
        save()
    if sizes:
        result["targets"] = targets_part(sizes, device, window=a.window, reps=a.reps, cpu_threads=a.cpu_threads)
        save()
    if contexts:
        result["decode"] = decode_part(
            contexts,
            device,
            rows=rows,
            budget=a.budget,
            batch=a.batch,
            steps=a.steps,
            rounds=a.rounds,
            model_overrides=json.loads(a.model),
            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            on_result=lambda res: (result.__setitem__("decode", res), save()),
        )
    save()  # each decode row records its cache's compile_status ("eager (compiling failed: ...)" when it fell back)
    print(f"wrote {out.with_suffix('.json')} and {plot(result, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
