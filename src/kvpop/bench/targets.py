"""Benchmark of the target pass (``kvpop.targets.future_attention``) on CPU.

For each sequence length ``S``, random post-RoPE-like ``q`` ``[batch, q_heads, S, d]`` and ``k``
``[batch, kv_heads, S, d]`` (SmolLM2-135M shapes by default: 9 query heads, 3 KV heads,
d = 64, batch 1, float32, window 256) go through:

* ``sdpa``       one causal ``torch.nn.functional.scaled_dot_product_attention`` forward over the
                 same ``q``/``k`` (and a random ``v``), GQA enabled: the unit of comparison;
* ``fused``      ``future_attention(method="fused")``: forward LSE pass + transposed pass;
* ``fused+lse``  the same with the row LSE given (as ``kvpop.capture`` does, reusing the LSE of
                 the model's own attention call): the marginal cost on top of the model forward;
* ``blocked``    ``future_attention(method="blocked")`` (pure PyTorch, ``block`` rows at a time;
                 skipped above ``max_blocked_S``);
* ``dense``      the reference (materialises ``S x S`` per head; skipped when its estimated peak,
                 4 tensors of ``batch * q_heads * S * S`` elements, exceeds ``max_dense_gb``).

Time: all methods of one ``S`` run in one subprocess, round-robin (``sdpa, fused, ...`` then
again), after one warm-up call each; ``time_s`` is the *minimum* over ``repeats`` rounds and
``time_median_s`` the median (on a shared machine the minimum is the most reproducible; the
round-robin order exposes every method to the same background load).  Rounds stop early once
the total exceeds ``budget_s`` (at least one timed round).

Memory: each method also runs once in its own fresh subprocess: inputs allocated, kernels loaded
by a tiny warm-up, then ``peak_extra_bytes`` = peak resident set size during the call minus the RSS
just before it.  It is the extra memory the call needs on top of its inputs, as the OS sees it
(allocator caching included); CPU tensors have no allocator statistics in torch, and separate
processes keep the peaks independent of each other.  On Linux the peak is the process's own
high-water mark (``VmHWM``, reset just before the call): ``ru_maxrss`` carries the parent's peak
over a fork, so a worker started from a large process (a test session) reported the parent's
memory as its own.  Elsewhere it is ``ru_maxrss``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..targets import future_attention, row_lse

DEFAULT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
METHODS = ("sdpa", "fused", "fused+lse", "blocked", "dense")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(reset: bool) -> int:
    """Peak RSS: since :func:`_reset_peak` where it worked (``VmHWM``), else ``ru_maxrss`` (since the start of
    the process, and on Linux including the parent's peak at the fork)."""
    if reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _worker(spec: dict) -> dict:
    """Subprocess body.  ``spec["mode"]``: ``"memory"`` (one method) or ``"time"`` (all listed)."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    dtype = getattr(torch, spec["dtype"])
    B, Hq, Hk, S, D = spec["batch"], spec["q_heads"], spec["kv_heads"], spec["S"], spec["dim"]
    window, block = spec["window"], spec["block"]
    scale = D**-0.5

    def inputs(S_):
        g = torch.Generator().manual_seed(0)
        q = (torch.randn(B, Hq, S_, D, generator=g) * 1.5).to(dtype)
        k = (torch.randn(B, Hk, S_, D, generator=g) * 1.5).to(dtype)
        v = torch.randn(B, Hk, S_, D, generator=g).to(dtype)
        return q, k, v

    def make_fn(method, q, k, v, w):
        if method == "sdpa":
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        if method == "fused+lse":
            lse = row_lse(q, k, scale=scale)
            return lambda: future_attention(q, k, w, scale=scale, lse=lse, method="fused")
        return lambda: future_attention(q, k, w, scale=scale, method=method, block=block)

    methods = spec["methods"]
    with torch.no_grad():
        # tiny warm-up: loads kernels / thread pool so that they do not count as peak memory
        tq, tk, tv = inputs(64)
        for m in methods:
            make_fn(m, tq, tk, tv, min(window, 63))()
        del tq, tk, tv
        q, k, v = inputs(S)
        if spec["mode"] == "memory":
            (m,) = methods
            fn = make_fn(m, q, k, v, window)
            base = _rss_bytes()
            reset = _reset_peak()
            t0 = time.perf_counter()
            fn()
            first = time.perf_counter() - t0
            peak = _peak_bytes(reset) - base
            return {"S": S, "method": m, "peak_extra_bytes": max(0, peak), "single_call_s": first}
        fns = {m: make_fn(m, q, k, v, window) for m in methods}
        for fn in fns.values():  # warm-up call each
            fn()
        times = {m: [] for m in methods}
        t_start = time.perf_counter()
        for _ in range(spec["repeats"]):
            for m, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[m].append(time.perf_counter() - t0)
            if time.perf_counter() - t_start > spec["budget_s"]:
                break
    return {m: {"time_s": min(ts), "time_median_s": statistics.median(ts), "times_s": ts} for m, ts in times.items()}


def _run_worker(spec: dict, timeout: float | None) -> dict:
    cmd = [sys.executable, "-m", "kvpop.bench.targets", "--_worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s"}
    if proc.returncode != 0:
        return {"error": " | ".join(proc.stderr.strip().splitlines()[-1:])}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(
    sizes=DEFAULT_SIZES,
    q_heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    batch: int = 1,
    window: int = 256,
    dtype: str = "float32",
    methods=METHODS,
    repeats: int = 3,
    block: int = 1024,
    max_dense_gb: float = 4.0,
    max_blocked_S: int | None = 8192,
    budget_s: float = 120.0,
    threads: int | None = None,
    timeout: float | None = 3600.0,
    out: str | os.PathLike | None = None,
    verbose: bool = True,
) -> dict:
    """Time and measure the target pass for each ``S``; returns (and writes to ``out``) a dict
    ``{"config", "memory", "time", "host", "results": [{"S", "method", "time_s",
    "time_median_s", "ratio_to_sdpa", "peak_extra_bytes", ...} | {"S", "method", "skipped"}]}``."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; expected one of {METHODS}")
    results = []
    elt = max(4, torch.empty((), dtype=getattr(torch, dtype)).element_size())
    for S in sizes:
        S = int(S)
        row: dict[str, dict] = {}
        runnable = []
        for m in methods:
            if m == "dense" and 4 * batch * q_heads * S * S * elt > max_dense_gb * 1e9:
                row[m] = {"S": S, "method": m, "skipped": f"estimated peak > {max_dense_gb} GB"}
            elif m == "blocked" and max_blocked_S is not None and S > max_blocked_S:
                row[m] = {"S": S, "method": m, "skipped": f"S > max_blocked_S={max_blocked_S}"}
            else:
                row[m] = {"S": S, "method": m}
                runnable.append(m)
        base_spec = {
            "S": S,
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "dim": dim,
            "batch": batch,
            "window": min(window, S - 1),
            "dtype": dtype,
            "repeats": repeats,
            "block": block,
            "budget_s": budget_s,
            "threads": threads,
        }
        for m in runnable:
            row[m].update(_run_worker({**base_spec, "mode": "memory", "methods": [m]}, timeout))
        if runnable:
            timed = _run_worker({**base_spec, "mode": "time", "methods": runnable}, timeout)
            for m in runnable:
                row[m].update(timed.get(m, {"error": timed.get("error", "no timing")}))
        base = row.get("sdpa", {}).get("time_s")
        for res in row.values():
            if base and "time_s" in res:
                res["ratio_to_sdpa"] = res["time_s"] / base
        results.extend(row.values())
        if verbose:
            print(_format_rows(list(row.values())), flush=True)
    report = {
        "benchmark": "kvpop.targets.future_attention",
        "config": {
            "sizes": [int(s) for s in sizes],
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "dim": dim,
            "batch": batch,
            "window": window,
            "dtype": dtype,
            "repeats": repeats,
            "block": block,
            "budget_s": budget_s,
            "threads": threads or torch.get_num_threads(),
        },
        "memory": "peak RSS of a fresh subprocess during one call minus its RSS just before (inputs allocated)",
        "time": "min (and median) over round-robin repeats in one subprocess, after one warm-up call each",
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "results": results,
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report


def _format_rows(rows) -> str:
    lines = []
    for r in rows:
        if "time_s" in r:
            ratio = f"{r['ratio_to_sdpa']:.2f}x" if "ratio_to_sdpa" in r else "-"
            mem = r.get("peak_extra_bytes")
            mem_s = f"{mem / 2**20:9.1f} MiB" if mem is not None else "        ?"
            lines.append(
                f"S={r['S']:>6} {r['method']:>10}  min {r['time_s']:8.3f}s  med {r['time_median_s']:8.3f}s"
                f"  {ratio:>7}  peak+{mem_s}"
            )
        else:
            lines.append(f"S={r['S']:>6} {r['method']:>10}  {r.get('skipped') or r.get('error')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpop bench targets", description=__doc__.split("\n")[0])
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--max-dense-gb", type=float, default=4.0)
    p.add_argument("--max-blocked-S", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=120.0, help="stop timing rounds of one S after this")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench_targets.json")
    a = p.parse_args(argv)
    if a._worker:
        print(json.dumps(_worker(json.loads(a._worker))))
        return 0
    run(
        sizes=a.sizes,
        q_heads=a.q_heads,
        kv_heads=a.kv_heads,
        dim=a.dim,
        batch=a.batch,
        window=a.window,
        dtype=a.dtype,
        methods=a.methods,
        repeats=a.repeats,
        block=a.block,
        max_dense_gb=a.max_dense_gb,
        max_blocked_S=a.max_blocked_S,
        budget_s=a.budget_s,
        threads=a.threads,
        out=a.out,
    )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
