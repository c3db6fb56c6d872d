"""Which parts of a multi-key needle does a policy still hold when the question comes?

On RULER's multi-key task (four "One of the special magic numbers for <key> is: <value>." sentences in
essay filler, one key asked last) the default learned policy answers a number from the context but often
a distractor's or the asked one's first digits. This study prefills each case's prompt under a policy
(the question is the prompt's last sentence, so every needle left the window long before it) and reads,
for every needle, which of its tokens each layer's KV heads still hold: the key's tokens, the value's
tokens and the rest of the sentence.

    python research/multikey_kept.py --model qwen2.5-coder-0.5b --policies kvpop-mlp snapkv --out results/qwen/multikey-kept

A policy given as ``NAME=SCORER`` (``kvpop-mlp=runs/x/scorer.safetensors``) is a learned policy reading that
scorer file instead of the shipped one, reported under ``NAME=SCORER``.

Writes OUT/kept.json (per case, policy and needle: the fraction of (layer, KV head) pairs holding each
token of the key, the value and the frame, and the fraction holding all of the key's or all of the
value's tokens; a summary over the needles that left the window) and OUT/kept.png; prints one line per
case and policy. Resumable: a rerun skips the (case, policy) pairs in kept.json and redraws.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def token_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Character span of each token in ``decode(ids)`` (decoding prefixes: exact for byte-level BPE)."""
    spans, prev = [], 0
    for i in range(len(ids)):
        end = len(tokenizer.decode(ids[: i + 1]))
        spans.append((prev, end))
        prev = end
    return spans


def tokens_in(spans: list[tuple[int, int]], lo: int, hi: int) -> list[int]:
    """Tokens overlapping the characters ``[lo, hi)``."""
    return [i for i, (a, b) in enumerate(spans) if a < hi and b > lo and b > a]


def summarize(rows: list[dict], policies: list[str]) -> dict:
    """Per policy, over the needles that left the window (not held whole by every head): the mean
    fraction of (layer, head) pairs holding a key / value / frame token, holding the whole key / value,
    and holding the value's i-th token."""
    out = {}
    for policy in policies:
        needles = [n for r in rows if r["policy"] == policy for n in r["needles"] if n["key_all"] < 1.0]
        rec = {"needles": len(needles)}
        for part in ("key", "value", "frame"):
            toks = [x for n in needles for x in n[f"{part}_tokens"]]
            rec[f"{part}_token_held"] = sum(toks) / len(toks) if toks else None
            whole = [n[f"{part}_all"] for n in needles if n[f"{part}_all"] is not None]
            rec[f"{part}_whole_held"] = sum(whole) / len(whole) if whole else None
        width = max((len(n["value_tokens"]) for n in needles), default=0)
        rec["value_digit_held"] = [
            sum(n["value_tokens"][i] for n in needles if len(n["value_tokens"]) > i)
            / max(1, sum(len(n["value_tokens"]) > i for n in needles))
            for i in range(width)
        ]
        out[policy] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--policies", nargs="+", default=["kvpop-mlp", "snapkv"])
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--cases", type=int, default=4)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    import kvpop
    from kvpop.compat import cache_kwargs
    from kvpop.evaluate.suite import SuiteConfig, build_cases

    model, tokenizer = kvpop.load_model(args.model)
    cases = build_cases(tokenizer, SuiteConfig(tasks=("niah_multikey",), cases=args.cases))["niah_multikey"]
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "kept.json"
    rows = json.loads(out_file.read_text())["rows"] if out_file.exists() else []
    done = {(r["case"], r["policy"]) for r in rows}
    for case in cases:
        if all((case.item_id, policy) in done for policy in args.policies):
            continue
        ids = case.ids.tolist()
        text = tokenizer.decode(ids)
        spans = token_spans(tokenizer, ids)
        needles = []
        for sentence in case.payload.needles:
            at = text.find(sentence.strip())
            key = sentence.split(" for ", 1)[1].split(" is: ", 1)[0]
            value = sentence.rsplit(" is: ", 1)[1].rstrip(".")
            k0 = text.find(key, at)
            v0 = text.find(value, k0)
            part = {
                "key": tokens_in(spans, k0, k0 + len(key)),
                "value": tokens_in(spans, v0, v0 + len(value)),
            }
            whole = tokens_in(spans, at, at + len(sentence.strip()))
            part["frame"] = [t for t in whole if t not in part["key"] and t not in part["value"]]
            needles.append({"key": key, "value": value, "asked": key == case.payload.query, "tokens": part})
        for policy in args.policies:
            if (case.item_id, policy) in done:
                continue
            t0 = time.perf_counter()
            name, _, scorer = policy.partition("=")
            cache = kvpop.make_cache(model, name, budget=args.budget, **({"path": scorer} if scorer else {}))
            with torch.no_grad():
                model(torch.tensor([ids]), **cache_kwargs(cache), logits_to_keep=1)
            held = torch.cat([layer.held_indices()[0] for layer in cache.layers])  # [(layer, head), B]
            out = []
            for nd in needles:
                rec = {"key": nd["key"], "value": nd["value"], "asked": nd["asked"]}
                for name, toks in nd["tokens"].items():
                    holds = torch.stack([(held == t).any(-1) for t in toks]) if toks else None  # [token, pair]
                    rec[f"{name}_tokens"] = holds.float().mean(1).tolist() if toks else []
                    rec[f"{name}_all"] = holds.all(0).float().mean().item() if toks else None
                out.append(rec)
            rows.append({"case": case.item_id, "policy": policy, "needles": out, "seconds": time.perf_counter() - t0})
            line = "  ".join(
                f"{'*' if r['asked'] else ' '}{r['key']}: key {r['key_all']:.2f} value {r['value_all']:.2f}"
                for r in out
            )
            print(f"{case.item_id} {policy:>10}: {line}", flush=True)
            out_file.write_text(json.dumps({"budget": args.budget, "rows": rows}, indent=1) + "\n")

    summary = summarize(rows, args.policies)
    out_file.write_text(json.dumps({"budget": args.budget, "summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    parts = ("key", "value", "frame")
    width = 0.8 / len(args.policies)
    for i, policy in enumerate(args.policies):
        vals = [summary[policy][f"{p}_token_held"] for p in parts]
        ax.bar([x + width * i for x in range(len(parts))], vals, width=width, label=policy)
        ax2.plot(
            range(1, len(summary[policy]["value_digit_held"]) + 1),
            summary[policy]["value_digit_held"],
            "o-",
            label=policy,
        )
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(parts))], [f"{p} tokens" for p in parts])
    ax.set_ylabel("held by (layer, KV head), mean")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"Needle tokens at the question, B = {args.budget}")
    ax2.set_xlabel("token of the value (7 digits)")
    ax2.set_ylim(0, 1)
    ax2.set_title("Along the value")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "kept.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
