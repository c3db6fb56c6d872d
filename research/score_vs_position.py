"""Mean learned score vs position on one long held-out document, for scorers that see post-RoPE keys
and scorers that see keys with RoPE undone (issue: position-robust inputs).

    python research/score_vs_position.py NAME=runs/sweep/base/scorer.safetensors NAME2=... --out results/diagnostics/score_vs_position

A scorer trained on 4,096-token windows is read up to 8,000 tokens: a drift of its mean score with
position (beyond what the learned per-head tilt adds on purpose, which is subtracted here) means the
score depends on where a token is, not what it is.
"""

import argparse
import json
from pathlib import Path

import torch

import kvpop
from kvpop.capture import collect
from kvpop.checkpoint import load_scorer
from kvpop.data import long_documents


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scorers", nargs="+", help="NAME=PATH")
    p.add_argument("--corpus", default="python_docs")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--bin", type=int, default=250)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, tok = kvpop.load_model()
    ids = long_documents(tok, args.corpus, args.tokens, split="test", max_docs=1)[0].view(1, -1)
    caps = collect(model, ids, window=256, observed_windows=(256,), obs_windows=(None, 32, 1))
    S = ids.shape[1]
    result = {"corpus": args.corpus, "tokens": S, "bin": args.bin, "scorers": {}}
    for spec in args.scorers:
        name, path = spec.split("=", 1)
        scorer, meta = load_scorer(path, model=model)
        window = int(next(iter(meta["trained_for"]["windows"].values())))
        sums = torch.zeros(S)
        with torch.no_grad():
            for i, c in enumerate(caps):
                obs = c.observed.get(window) if scorer.config.observed else None
                if scorer.config.observed and obs is None:
                    raise SystemExit(f"no observed statistics for window {window} in the capture")
                r = scorer.forward_layer(i, c.keys.float(), c.values.float(), window, observed=obs)
                tilt = scorer.tilt()
                if tilt is not None:  # the tilt is a deliberate recency term: look at the content part
                    r = r - tilt[i].view(1, -1, 1) * torch.arange(S).view(1, 1, -1)
                sums += r[0].mean(0)
        mean = sums / len(caps)
        edges = list(range(0, S - window, args.bin))
        binned = [float(mean[a : a + args.bin].mean()) for a in edges]
        result["scorers"][name] = {
            "path": path,
            "position_free": scorer.config.position_free,
            "bin_starts": edges,
            "mean_score": binned,
            "drift_per_1k_tokens": float(
                torch.tensor(binned[len(binned) // 2 :]).mean() - torch.tensor(binned[: len(binned) // 2]).mean()
            )
            / (S / 2000),
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "score_vs_position.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in result["scorers"].items():
        ax.plot(
            r["bin_starts"],
            r["mean_score"],
            label=f"{name} ({'RoPE undone' if r['position_free'] else 'post-RoPE keys'})",
        )
    ax.axvline(4096, color="gray", ls=":", label="training length")
    ax.set_xlabel("token position")
    ax.set_ylabel("mean score (tilt removed)")
    ax.set_title(f"Score vs position, {args.corpus} test document, {S} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "score_vs_position.png", dpi=120)
    print(json.dumps({k: v["drift_per_1k_tokens"] for k, v in result["scorers"].items()}))


if __name__ == "__main__":
    main()
