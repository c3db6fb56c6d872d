"""Shared pieces of the benchmarks: policy specs, text to feed, memory readings, JSON/PNG output."""

from __future__ import annotations

import json
import os
import resource
import statistics
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from .. import data
from ..cache import make_cache


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def step_row(name: str, step_ms: float, floor_ms: float, dense_ms: float, steps: int) -> dict:
    """A decode-step row of the benchmarks: the median step and its ratios to the floor's and to dense's."""
    return {
        "name": name,
        "step_ms": step_ms,
        "vs_floor": step_ms / floor_ms,
        "vs_dense": step_ms / dense_ms,
        "overhead_share": 1 - floor_ms / step_ms,
        "steps": steps,
    }


def parse_policy(spec: str) -> tuple[str, int | None]:
    """``"dense"``, ``"floor@B"`` or ``"name@B"`` (e.g. ``kvpop-mlp@512``; ``kvpop-mlstm@512+compile`` compiles
    the steady decode step; ``kvpop-mlp@2048/1024`` prefills in pieces of 1,024, see :func:`prefill_chunk_of`).
    Returns (name, budget); the ``+compile`` suffix stays on the name."""
    if spec == "dense":
        return "dense", None
    if "@" not in spec:
        raise ValueError(f"policy spec must be 'dense', 'floor@budget' or 'name@budget', got {spec!r}")
    name = spec.split("@", 1)[0] + ("+compile" if spec.endswith("+compile") else "")
    return name, int(_budget_field(spec).split("/", 1)[0])


def prefill_chunk_of(spec: str) -> int | None:
    """The prefill piece of a spec ``name@B/C`` (``C``), or None for the cache's default."""
    field = _budget_field(spec) if "@" in spec else ""
    return int(field.split("/", 1)[1]) if "/" in field else None


def _budget_field(spec: str) -> str:
    """What follows ``@`` in a spec, without ``+compile``: ``B`` or ``B/C``."""
    return spec.split("@", 1)[1].removesuffix("+compile")


def cache_for_spec(model, spec: str):
    """The cache a benchmark spec stands for: a ``DynamicCache`` for ``dense`` (so its bytes can be
    read), a ``StaticCache`` of ``B`` slots for ``floor@B`` (the physical floor: attention over ``B``
    slots, no scoring, no eviction; it holds at most ``B`` tokens), else :func:`kvpop.make_cache`
    with that policy and budget."""
    name, budget = parse_policy(spec)
    if name == "dense":
        return DynamicCache(config=model.config)
    if name == "floor":
        return StaticCache(config=model.config, max_cache_len=budget)
    base = name.removesuffix("+compile")
    return make_cache(model, base, budget=budget, compile=base != name, prefill_chunk=prefill_chunk_of(spec))


def kv_bytes(cache) -> int:
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.keys is not None)


def text_ids(tokenizer, n: int) -> torch.Tensor:
    """``n`` token ids of real text (Python docs, else the CPython stdlib), ``[1, n]``."""
    for corpus in ("python_docs", "python_code", "shakespeare"):
        try:
            docs = data.long_documents(tokenizer, corpus, n, split="test", max_docs=1, concat=True)
        except (FileNotFoundError, ValueError):
            continue
        if docs:
            return docs[0].view(1, -1)
    raise RuntimeError(f"no corpus has a {n}-token test document; install the data packages (scripts/setup.sh)")


def write_json(obj: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))
    return path
