"""``kvpop generate --compare``: the same prompt under several policies, side by side.

One model, one prompt, one budget; one :func:`kvpop.generate` per policy, then one small table:
the answer, the KV cache held at the end (and its share of what dense held for the same tokens),
prefill and decode tokens per second, and which decode step the cache ran (compiled or eager). So a
newcomer sees in one run what a bounded cache keeps and what it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..generate import GenerationResult

__all__ = ["Outcome", "compare", "human_bytes", "table"]


def human_bytes(n: float) -> str:
    """``23592960`` -> ``"22.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@dataclass
class Outcome:
    """One policy's answer and what it cost."""

    policy: str
    result: GenerationResult

    @property
    def row(self) -> dict:
        r = self.result
        return {
            "policy": self.policy,
            "kv_held": r.kv_bytes,
            "kv_share_of_dense": r.kv_bytes / max(1, r.dense_kv_bytes),
            "prefill_tokens_per_s": r.prefill_tokens_per_s,
            "decode_tokens_per_s": r.decode_tokens_per_s,
            "decode_step": r.compile_status or "-",  # "-": dense, no kvpop cache
            "answer": " ".join(r.text.split()),
        }


def compare(
    model,
    tokenizer,
    prompt: str,
    policies,
    *,
    cache_kwargs: dict | None = None,
    policy_kwargs: dict[str, dict] | None = None,
    **generate_kwargs,
) -> list[Outcome]:
    """``prompt`` under each of ``policies`` (names; ``"dense"`` for the full cache) with the same
    budget (``cache_kwargs``: ``budget``, ``window``, ``compile``, ... for every bounded policy),
    ``policy_kwargs`` per policy name (e.g. ``{"kvpop-mlstm": {"path": ...}}``) and ``generate_kwargs``
    (``max_new_tokens``, ``chat``, ...) for all."""
    from ..generate import generate

    out = []
    for p in policies:
        kw = {} if p == "dense" else dict(cache_kwargs or {})
        res = generate(
            model, tokenizer, prompt, policy=p, policy_kwargs=(policy_kwargs or {}).get(p), **kw, **generate_kwargs
        )
        out.append(Outcome(p, res))
    return out


def table(outcomes: list[Outcome]) -> str:
    """A Markdown table, one row per policy, the answer last (it is the long column)."""
    head = "| policy | KV held (vs dense) | prefill tok/s | decode tok/s | decode step | answer |"
    lines = [head, "|---|---|---|---|---|---|"]
    for o in outcomes:
        r = o.row
        pre = f"{r['prefill_tokens_per_s']:,.0f}" if r["prefill_tokens_per_s"] else "-"
        dec = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else "-"
        answer = r["answer"].replace("|", "\\|")
        lines.append(
            f"| {r['policy']} | {human_bytes(r['kv_held'])} ({r['kv_share_of_dense']:.1%}) | {pre} | {dec} | "
            f"{r['decode_step']} | {answer} |"
        )
    return "\n".join(lines)
