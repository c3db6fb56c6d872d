"""kvpress's presses on kvpop's own task cases: a reference row for ``kvpop eval tasks``.

Runs in the virtualenv ``scripts/setup_kvpress.sh`` builds (kvpress 0.5 pins transformers<5.3), with kvpop
installed beside it for the cases, the scoring and the record store, so the rows merge into kvpop's table:

    .venv-kvpress/bin/python scripts/kvpress_tasks.py --like results/qwen/tasks-ruler \\
        --out results/qwen/tasks-kvpress-ruler --presses expected snapkv
    kvpop eval tasks --report results/qwen/tasks-ruler results/qwen/tasks-kvpress-ruler

``--like DIR`` is a ``kvpop eval tasks`` folder: the same model (its weights' fingerprint is checked), the
same cases (rebuilt from its settings) and, by default, the budgets its records ran at.

How a budget B maps onto kvpress (kvpress compresses a prompt once, kvpop bounds the cache at every step):
- RULER (the question after the context): the press compresses the context before the question to
  ``B - len(question tokens)`` tokens (kvpress's own pipeline: context with the press, then the question
  and a greedy answer without it), so the cache holds B entries when the question is read and grows by the
  answer's tokens after it.
- HumanEval (the prompt is short, the sequence grows while generating): kvpress's ``PrefillDecodingPress``:
  the prompt compressed to ``B - interval`` if it is longer, then a ``DecodingPress`` that compresses
  the cache back to ``B - interval`` every ``interval`` generated tokens, so it never holds more than B.
Each record keeps the most KV entries a layer held (``kv_peak``), the number to compare with B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

PRESSES = ("expected", "snapkv", "knorm", "streaming", "tova", "observed")


def make_press(name: str, ratio: float = 0.0):
    """A kvpress ScorerPress by short name, at ``ratio`` compression."""
    import kvpress

    classes = {
        "expected": kvpress.ExpectedAttentionPress,
        "snapkv": kvpress.SnapKVPress,
        "knorm": kvpress.KnormPress,
        "streaming": kvpress.StreamingLLMPress,
        "tova": kvpress.TOVAPress,
        "observed": kvpress.ObservedAttentionPress,
    }
    return classes[name](compression_ratio=ratio)


def kv_entries(cache) -> int:
    """The most KV entries any layer of a transformers cache holds now."""
    return max(int(layer.keys.shape[-2]) for layer in cache.layers if getattr(layer, "keys", None) is not None)


def question_start(tokenizer, ids: list[int], content: str) -> int:
    """Index of the first prompt token of the content's last line (the question): what precedes it is the
    context kvpress compresses."""
    text = tokenizer.decode(ids)
    line = content.rsplit("\n", 1)[-1]
    at = text.rfind(line)
    if at < 0:
        raise ValueError("cannot find the question in the decoded prompt")
    # the shortest prefix of tokens whose text reaches the question
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) >= at + 1:
            hi = mid
        else:
            lo = mid + 1
    return max(1, lo - 1)


def greedy(model, cache, ids, start: int, max_new: int, stop: set[int], peak: list[int]):
    """Greedy continuation after ``cache`` (which holds a compressed prefix of ``start`` positions): feed
    ``ids`` at positions ``start ..`` then decode; returns the new ids and keeps the largest cache seen."""
    import torch

    pos = torch.arange(start, start + ids.shape[-1]).unsqueeze(0)
    out = model(input_ids=ids.unsqueeze(0), past_key_values=cache, position_ids=pos, logits_to_keep=1)
    peak[0] = max(peak[0], kv_entries(cache))
    new = [int(out.logits[0, -1].argmax())]
    nxt = int(pos[0, -1]) + 1
    while len(new) < max_new and new[-1] not in stop:
        out = model(input_ids=torch.tensor([[new[-1]]]), past_key_values=cache, position_ids=torch.tensor([[nxt]]))
        peak[0] = max(peak[0], kv_entries(cache))
        new.append(int(out.logits[0, -1].argmax()))
        nxt += 1
    return torch.tensor(new, dtype=torch.long)


def run_case(model, tokenizer, case, press_name: str, budget: int, stop: set[int], interval: int):
    """(new ids, kv_peak) of one case under one press at one budget."""
    import contextlib

    import torch
    from kvpress import DecodingPress, PrefillDecodingPress
    from transformers import DynamicCache

    ids = case.ids
    cache = DynamicCache()
    peak = [0]
    with torch.no_grad():
        if case.task == "humaneval":
            target = max(1, budget - interval)
            n = ids.numel()
            prefill = make_press(press_name, max(0.0, 1.0 - target / n)) if n > target else None
            decoding = DecodingPress(
                base_press=make_press(press_name), compression_interval=interval, target_size=target
            )
            press = PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)
            with press(model):
                model.model(input_ids=ids[:-1].unsqueeze(0), past_key_values=cache)
                peak[0] = kv_entries(cache)
                new = greedy(model, cache, ids[-1:], n - 1, case.max_new_tokens, stop, peak)
        else:
            q = question_start(tokenizer, ids.tolist(), case.payload.content)
            keep = budget - (ids.numel() - q)
            if keep < 1:
                raise ValueError(f"{case.item_id}: B={budget} leaves no room for the context")
            ratio = max(0.0, 1.0 - keep / q)
            with make_press(press_name, ratio)(model) if ratio > 0 else contextlib.nullcontext():
                model.model(input_ids=ids[:q].unsqueeze(0), past_key_values=cache)
            peak[0] = kv_entries(cache)
            new = greedy(model, cache, ids[q:], q, case.max_new_tokens, stop, peak)
    hits = [j for j, t in enumerate(new.tolist()) if t in stop]
    return (new[: hits[0] + 1] if hits else new), peak[0]


def suite_config(like: Path, args):
    """The SuiteConfig the ``--like`` folder's last finished session ran with, with the case selection
    given on the command line where it has none yet."""
    from kvpop.evaluate.suite import SuiteConfig

    fields = {f.name for f in dataclasses.fields(SuiteConfig)}
    sf = like / "sessions.jsonl"
    lines = sf.read_text().splitlines() if sf.is_file() else []
    cfg = json.loads(lines[-1])["config"] if lines else {}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in fields}
    given = {"tasks": args.tasks and tuple(args.tasks), "cases": args.cases, "humaneval_split": args.humaneval_split}
    kw.update({k: v for k, v in given.items() if v is not None})
    if "tasks" not in kw:
        sys.exit(f"--like {like} has no finished session yet: give --tasks (and --cases / --humaneval-split as it ran)")
    return SuiteConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--like", required=True, type=Path, help="a `kvpop eval tasks` output folder")
    p.add_argument("--out", required=True, type=Path, help="output folder (resumable)")
    p.add_argument("--presses", nargs="+", default=["expected", "snapkv"], choices=PRESSES)
    p.add_argument("--budgets", nargs="+", type=int, help="default: the --like folder's budgets per task")
    p.add_argument("--interval", type=int, default=16, help="HumanEval: compress every N generated tokens")
    p.add_argument("--tasks", nargs="+", help="default: the --like folder's (from its last session)")
    p.add_argument("--cases", type=int, help="cases per task (default: the --like folder's)")
    p.add_argument("--humaneval-split", help="default: the --like folder's")
    p.add_argument("--max-minutes", type=float, help="stop starting cases after this long")
    args = p.parse_args(argv)
    if not (args.like / "run.json").is_file():
        p.error(f"--like {args.like}: no run.json; give a `kvpop eval tasks` output folder")
    if args.interval < 1:
        p.error("--interval must be >= 1")

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop.checkpoint import model_fingerprint
    from kvpop.evaluate.humaneval import SandboxLimits
    from kvpop.evaluate.store import RecordStore, Session, load_dirs, unit_key
    from kvpop.evaluate.suite import DENSE, build_cases, case_record, eos_ids, summarize, write_summary

    fp = json.loads((args.like / "run.json").read_text())
    fp = fp.get("fingerprint", fp)
    cfg = suite_config(args.like, args)
    _, units, _ = load_dirs([args.like])
    budgets = {}
    for u in units:
        if u["budget"] is not None and u["policy"] != DENSE:
            budgets.setdefault(u["task"], set()).add(int(u["budget"]))
    t0 = time.perf_counter()
    session = Session(None)
    model = AutoModelForCausalLM.from_pretrained(fp["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(fp["model"])
    if model_fingerprint(model) != fp["model_fingerprint"]:
        sys.exit(f"{fp['model']}: these weights are not the ones {args.like} ran on")
    store = RecordStore(args.out, fp, "kvpress")
    cases = build_cases(tokenizer, cfg)
    stop = eos_ids(model, tokenizer)
    limits = SandboxLimits(timeout_s=cfg.timeout_s)
    todo = []
    for task, cs in cases.items():
        for b in sorted(args.budgets or budgets.get(task, ()), reverse=True):
            for name in args.presses:
                for c in cs:
                    if store.done(unit_key(c.item_id, f"kvpress-{name}", b)) is None:
                        todo.append((c, name, b))
    ran, notes = 0, [f"kvpress presses on the cases of {args.like}"]
    bar = tqdm(todo, desc="kvpress tasks", dynamic_ncols=True)
    for c, name, b in bar:
        if args.max_minutes and time.perf_counter() - t0 > 60 * args.max_minutes:
            notes.append("stopped at --max-minutes; rerun to continue")
            break
        bar.set_postfix_str(f"{c.task} {name} B={b}")
        t1 = time.perf_counter()
        new, peak = run_case(model, tokenizer, c, name, b, stop, args.interval)
        text = tokenizer.decode(new, skip_special_tokens=True)
        rec = case_record(c, f"kvpress-{name}", b, new, text, cfg, stop, limits, wall_s=time.perf_counter() - t1)
        rec["kv_peak"] = peak
        store.append(rec)
        ran += 1
    bar.close()
    store.add_session(
        {
            **session.record(
                interrupted=False,
                tasks=list(cases),
                policies=[f"kvpress-{n}" for n in args.presses],
                budgets={t: sorted(v) for t, v in budgets.items()},
                skipped={},
                notes=notes,
                units_run=ran,
                config={"like": str(args.like), "presses": args.presses, "interval": args.interval},
                threads=torch.get_num_threads(),
                device="cpu",
            ),
            "tag": "kvpress",
        }
    )
    fp_all, units, sessions = load_dirs([args.out])
    write_summary(summarize(units, sessions, fp_all), args.out)
    print(f"[kvpress tasks] {ran} cases in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
