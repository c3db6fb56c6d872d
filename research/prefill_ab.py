"""Prefill throughput of the current chunk step against the one at an earlier revision, in one process.

Both versions of ``kvpop/step.py`` (each with its own revision's ``kvpop/observed.py``), or with
``--swap mlstm`` of the mLSTM scorer's methods (``kvpop/scorers/mlstm.py``), run on the same model,
prompt and thread count, alternating round by round so that machine noise hits both alike; dense is
timed beside them, and every policy gets one untimed warm-up prefill first. Only that code is swapped,
so the difference is that change alone. ``--swap inference`` runs today's code with and without the
inference mode that a ``no_grad`` prefill's chunk steps run in (``kvpop.cache``). Every forward forms
the last position's logits only (``logits_to_keep=1``, as ``generate()``'s prefill).

    python research/prefill_ab.py --old-rev e1548a0 --out results/prefill_ab
    python research/prefill_ab.py --swap mlstm --old-rev HEAD --policies kvpop-mlp@512,kvpop-mlstm@512
    python research/prefill_ab.py --swap inference --policies h2o@512,kvpop-mlp@512 --out results/prefill_ab_inference

Writes OUT.json (seconds per round, medians, ratios to dense) and prints one line per row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-rev", help="git revision whose code is the baseline (--swap step or mlstm)")
    p.add_argument(
        "--swap",
        choices=("step", "mlstm", "inference"),
        default="step",
        help="the chunk step, the mLSTM's methods, or the chunk steps with and without inference mode",
    )
    p.add_argument("--policies", default="h2o@512,kvpop-mlp@512,kvpop-mlstm@512")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/prefill_ab")
    args = p.parse_args(argv)
    if args.swap != "inference" and not args.old_rev:
        p.error(f"--swap {args.swap} compares with --old-rev REV; give one")

    import kvpop.cache as cache_mod
    from kvpop.bench.common import cache_for_spec, text_ids
    from kvpop.compat import cache_kwargs
    from kvpop.models import load_model_quietly

    def load_old(name: str):
        """``src/kvpop/<name>.py`` at the old revision, as a module of its own."""
        src = subprocess.run(
            ["git", "show", f"{args.old_rev}:src/kvpop/{name}.py"], check=True, capture_output=True, text=True
        ).stdout
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location(f"kvpop.{name.replace('/', '.')}_baseline", f.name)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    if args.swap == "step":
        # the chunk statistics live in observed.py: the baseline step uses that revision's, so the names
        # its step imports from there are lent to the current module while the old step loads
        import kvpop.observed as observed_now

        observed_old = load_old("observed")
        lent = [n for n in observed_old.__all__ if not hasattr(observed_now, n)]
        for n in lent:
            setattr(observed_now, n, getattr(observed_old, n))
        old = load_old("step")
        for n in lent:
            delattr(observed_now, n)
        for n in observed_old.__all__:
            if hasattr(old, n):
                setattr(old, n, getattr(observed_old, n))
        steps = {"now": cache_mod.prefill_chunk, args.old_rev: old.prefill_chunk}

        def use(version: str) -> None:
            cache_mod.prefill_chunk = steps[version]
    elif args.swap == "inference":
        # the same code; "autograd": the chunk steps without inference mode (as before it shipped)
        import contextlib

        @contextlib.contextmanager
        def off():
            yield False

        steps = {"now": cache_mod._light_mode, "autograd": off}

        def use(version: str) -> None:
            cache_mod._light_mode = steps[version]
    else:
        from kvpop.scorers.mlstm import KVpopMLSTM

        def methods(cls) -> dict:
            return {k: v for k, v in vars(cls).items() if callable(v) or isinstance(v, staticmethod)}

        old_cls = load_old("scorers/mlstm").KVpopMLSTM
        steps = {"now": methods(KVpopMLSTM), args.old_rev: methods(old_cls)}
        steps[args.old_rev].pop("__init__")  # instances are built by the current class

        def use(version: str) -> None:
            for k, v in steps[version].items():
                setattr(KVpopMLSTM, k, v)

    model, tok = load_model_quietly(args.model)
    ids = text_ids(tok, args.length)
    rows = [("dense", "now")] + [(pol, v) for pol in args.policies.split(",") for v in steps]
    times: dict[str, list[float]] = {f"{pol} [{v}]": [] for pol, v in rows}
    with torch.no_grad():
        for r in range(args.repeats + 1):
            for pol, v in rows:
                use(v)
                cache = cache_for_spec(model, pol)
                t0 = time.perf_counter()
                model(ids if r else ids[:, :1024], **cache_kwargs(cache), logits_to_keep=1)
                if r:
                    times[f"{pol} [{v}]"].append(time.perf_counter() - t0)
    use("now")
    dense = statistics.median(times["dense [now]"])
    out = {"length": args.length, "threads": torch.get_num_threads(), "old_rev": args.old_rev, "swap": args.swap}
    out["rows"] = []
    for name, ts in times.items():
        med = statistics.median(ts)
        out["rows"].append({"row": name, "seconds": ts, "median_s": med, "throughput_vs_dense": dense / med})
        print(f"{name:>32}: {args.length / med:6.0f} tok/s  {dense / med:.2f}x dense")
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
