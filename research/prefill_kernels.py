"""Two ways to make a prefill piece cheaper that did not help, timed on one piece of SmolLM2's shapes.

1. **The window statistics compiled.** ``torch.compile`` does not take ``kvpop.observed.chunk_observed``
   as it is (Dynamo refuses ``as_strided`` with a storage offset), so :func:`observed_padded` forms the
   same band and diagonal sums by pad-and-reshape, which it does take. Rows: the shipped eager function,
   the padded form eager, and the padded form compiled (``fullgraph``, static shapes).
2. **The piece's attention split in two.** Half of the chunk's own keys are masked (causal), so the
   slots (masked) and the chunk (``is_causal``, which skips the masked blocks) are attended separately and
   merged by their log-sum-exps (``aten._scaled_dot_product_flash_attention_for_cpu`` returns them),
   against the one masked SDPA call of ``kvpop.step``.

Every variant is first checked against the shipped one; rows alternate round by round.

    python research/prefill_kernels.py --out results/prefill_kernels      # about a minute

Writes OUT.json (milliseconds per call, each round, and medians).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def band_of(full: torch.Tensor, r: int, w: int) -> torch.Tensor:
    """``full [..., r, w + r - 1]`` to ``[..., r, w]`` with row ``i = full[i, i : i + w]``."""
    lead = full.shape[:-2]
    flat = F.pad(full.reshape(*lead, r * (w + r - 1)), (0, r))
    return flat.view(*lead, r, w + r)[..., :w]


def diagonal_sums(band: torch.Tensor, cols: int) -> torch.Tensor:
    """``band [..., c, o]`` to ``[..., cols]``: column ``j + a + 1`` sums ``band[j, a]``."""
    *lead, c, o = band.shape
    flat = F.pad(band, (0, c + 1)).reshape(*lead, c * (o + c + 1))[..., : c * (o + c)]
    return F.pad(flat.view(*lead, c, o + c).sum(-2), (1, cols - o - c))[..., :cols]


def observed_padded(query, keys, slot_index, n_real, sinks: int, window: int, obs_windows, scaling: float):
    """``chunk_observed`` (no padding) with the band and the diagonals by pad-and-reshape."""
    b, hq, c, d = query.shape
    h = keys.shape[1]
    g = hq // h
    s, w = sinks, window
    n = keys.shape[2] - c
    cols = w + c
    p = torch.arange(cols).view(1, cols)
    in_chunk = p >= w
    ring_t = slot_index[:, s : s + w]
    ring_p = ring_t - (n_real.view(b, 1) - w)
    ring_ok = (ring_t >= s) & (ring_p >= 0) & (ring_p < cols)
    at = torch.where(ring_ok, ring_p, cols)
    src = torch.where(in_chunk, n + p - w, 0)
    src = torch.cat([src.expand(b, cols), src.new_zeros(b, 1)], 1).scatter(1, at, torch.arange(s, s + w).expand(b, w))
    src = src[:, :cols]
    in_ring = torch.zeros(b, cols + 1, dtype=torch.bool).scatter(1, at, ring_ok)[:, :cols]
    k_band = keys.gather(2, src.view(b, 1, cols, 1).expand(b, h, cols, d)).float()
    q_scaled = query.float().view(b, h, g, c, d) * scaling
    parts = []
    for j0 in range(0, c, 128):
        j1 = min(c, j0 + 128)
        full = torch.matmul(q_scaled[:, :, :, j0:j1], k_band[:, :, None, j0 + 1 : j1 + w].transpose(-1, -2))
        parts.append(band_of(full, j1 - j0, w))
    band = torch.cat(parts, dim=-2)
    bias = torch.where(in_chunk | in_ring, 0.0, -math.inf)[:, 1:].unfold(1, w, 1)  # [b, c, w]
    sink_logits = torch.matmul(q_scaled, keys[:, :, None, :s].float().transpose(-1, -2))
    sink_bias = torch.where(slot_index[:, :s] >= 0, 0.0, -math.inf).view(b, 1, s).expand(b, c, s)
    x = torch.cat([sink_logits, band], -1) + torch.cat([sink_bias, bias], -1).reshape(b, 1, 1, c, s + w)
    band_p = torch.softmax(x, dim=-1)[..., s:].sum(2) / g
    sums = torch.stack([diagonal_sums(band_p[..., :o], cols) for o in obs_windows], -1)
    nobs = sums.shape[-1]
    ring = sums.gather(2, ring_p.clamp(0, cols - 1).view(b, 1, w, 1).expand(b, h, w, nobs))
    ring = torch.where(ring_ok.view(b, 1, w, 1), ring, 0.0)
    return torch.cat([ring, sums[:, :, w:]], dim=2)


def timed(rows: dict, rounds: int, calls: int) -> dict:
    out = {name: [] for name in rows}
    with torch.inference_mode():
        for f in rows.values():
            f()
        for _ in range(rounds):
            for name, f in rows.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                out[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: {"ms": ms, "median_ms": statistics.median(ms)} for name, ms in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default="results/prefill_kernels")
    args = p.parse_args(argv)
    from kvpop.observed import chunk_observed

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    # SmolLM2 at B = 512: 9 query heads over 3 KV heads of 64, 4 sinks, window 256, pieces of 256
    b, hq, h, c, d, s, w, budget, obs = 1, 9, 3, 256, 64, 4, 256, 512, (256, 32, 1)
    q, keys = torch.randn(b, hq, c, d), torch.randn(b, h, budget + c, d)
    n_real = torch.tensor([2000])
    slots = torch.full((1, s + w), -1)
    slots[0, :s] = torch.arange(s)
    for t in range(2000 - w, 2000):
        slots[0, s + (t - s) % w] = t
    shipped = lambda: chunk_observed(q, keys, slots, n_real, None, s, w, obs, 0.125)
    padded = lambda: observed_padded(q, keys, slots, n_real, s, w, obs, 0.125)
    compiled_fn = torch.compile(observed_padded, fullgraph=True, dynamic=False)
    compiled = lambda: compiled_fn(q, keys, slots, n_real, s, w, obs, 0.125)
    t0 = time.perf_counter()
    with torch.inference_mode():
        ref = shipped()
        for f in (padded, compiled):
            torch.testing.assert_close(f(), ref, rtol=1e-5, atol=1e-6)
    compile_s = time.perf_counter() - t0
    stats = timed(
        {"shipped (eager)": shipped, "pad-and-reshape, eager": padded, "pad-and-reshape, compiled": compiled},
        args.rounds,
        args.calls,
    )

    g = hq // h
    qa = q.view(b * h, g, c, d)
    ka, va = torch.randn(b * h, 1, budget + c, d), torch.randn(b * h, 1, budget + c, d)
    visible = torch.rand(b * h, 1, c, budget + c) > 0.2
    visible[..., budget:] = torch.ones(c, c, dtype=torch.bool).tril()
    visible[..., 0] = True
    bias = torch.where(visible[..., :budget], 0.0, -math.inf)
    kx, vx = ka.expand(b * h, g, budget + c, d), va.expand(b * h, g, budget + c, d)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def one_call():
        return F.scaled_dot_product_attention(qa, ka, va, attn_mask=visible, scale=0.125, enable_gqa=True)

    def split():
        o1, l1 = flash(qa, kx[:, :, :budget], vx[:, :, :budget], 0.0, False, attn_mask=bias, scale=0.125)
        o2, l2 = flash(qa, kx[:, :, budget:], vx[:, :, budget:], 0.0, True, scale=0.125)
        m = torch.maximum(l1, l2)
        w1, w2 = (l1 - m).exp(), (l2 - m).exp()
        return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)

    torch.testing.assert_close(split(), one_call(), rtol=1e-4, atol=1e-5)
    attn = timed({"one masked SDPA call": one_call, "slots + causal chunk, merged": split}, args.rounds, args.calls)
    out = {
        "threads": args.threads,
        "shapes": {"q_heads": hq, "kv_heads": h, "piece": c, "head_dim": d, "budget": budget},
        "compile_and_check_s": compile_s,
        "statistics": stats,
        "attention": attn,
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    for part in ("statistics", "attention"):
        for name, r in out[part].items():
            print(f"{part:>10} | {name:>28}: {r['median_ms']:.2f} ms per piece and layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
