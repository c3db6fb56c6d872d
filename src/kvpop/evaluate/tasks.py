"""The four evaluation tasks, one document / case at a time.

- ``lm``: teacher-forced long-document LM, scored over positions ``>= B``.
- ``continuation``: context under the policy, then a continuation scored the same way
  (only the continuation's predictions count).
- ``needle``: a passkey hidden at a depth of filler text, asked for with the chat template;
  exact match of the number in the greedy answer.
- ``agreement``: greedy continuation of a prompt; token match rate against dense.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import EvictionConfig
from .core import DENSE, DenseCache, doc_key, policy_cache, teacher_forced

TASKS = ("lm", "continuation", "needle", "agreement")


def lm_doc(model, ids: Tensor, policy: str, budget: EvictionConfig, dense: DenseCache, **policy_kwargs) -> dict:
    return teacher_forced(model, ids, policy, budget, dense=dense, policy_kwargs=policy_kwargs)


def continuation_doc(model, ids: Tensor, context: int, policy: str, budget: EvictionConfig, dense: DenseCache,
                     **policy_kwargs) -> dict:  # fmt: skip
    """``ids`` = context + continuation; position ``context - 1`` predicts the first continuation token."""
    if not 1 <= context < ids.numel():
        raise ValueError(f"context {context} must be shorter than the document ({ids.numel()} tokens)")
    return teacher_forced(
        model, ids, policy, budget, score_from=context - 1, dense=dense, policy_kwargs=policy_kwargs
    )


# ------------------------------------------------------------------------------ generation


@torch.no_grad()
def greedy(
    model, tokenizer, prompt_ids: Tensor, max_new_tokens: int, cache=None, force_length: bool = False
) -> Tensor:
    """Greedy new token ids (1-D) after ``prompt_ids`` (1-D), with ``cache`` (None: dense)."""
    ids = prompt_ids.view(1, -1).to(model.device)
    kw = {}
    if force_length:
        kw["min_new_tokens"] = max_new_tokens
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
        **kw,
    )
    return out[0, ids.shape[1] :].cpu()


def _policy_generate(model, tokenizer, prompt: Tensor, n: int, policy: str, budget: EvictionConfig, dense: DenseCache,
                     force_length: bool, policy_kwargs: dict) -> tuple[Tensor, Tensor, float]:  # fmt: skip
    """(dense new ids, policy new ids, policy wall seconds)."""
    key = (doc_key(prompt), n, force_length)
    dense_new = dense.generation(key, lambda: greedy(model, tokenizer, prompt, n, None, force_length))
    if policy == DENSE:
        return dense_new, dense_new, 0.0
    t0 = time.perf_counter()
    # the oracle needs the whole sequence in advance: prompt + the dense continuation
    full = torch.cat([prompt.view(-1), dense_new])
    cache = policy_cache(model, policy, full, budget, **policy_kwargs)
    new = greedy(model, tokenizer, prompt, n, cache, force_length)
    return dense_new, new, time.perf_counter() - t0


def agreement_doc(model, tokenizer, prompt: Tensor, n_new: int, policy: str, budget: EvictionConfig, dense: DenseCache,
                  **policy_kwargs) -> dict:  # fmt: skip
    """Greedy ``n_new`` tokens under the policy vs dense (eos suppressed so both have ``n_new``)."""
    d, p, wall = _policy_generate(model, tokenizer, prompt, n_new, policy, budget, dense, True, policy_kwargs)
    n = min(d.numel(), p.numel())
    eq = (d[:n] == p[:n]).tolist()
    first = next((i for i, e in enumerate(eq) if not e), n)
    return {
        "n_tokens": n,
        "prefix_match": first / n if n else float("nan"),
        "match_rate": sum(eq) / n if n else float("nan"),
        "first_divergence": first,
        "wall_s": wall,
    }


# ------------------------------------------------------------------------------ needle

NEEDLE_QUESTION = "What is the secret passkey mentioned in the text above? Answer with the number only."


@dataclass
class NeedleCase:
    ids: Tensor  # prompt ids (chat template applied, generation prompt added)
    passkey: str
    length: int  # requested length; ids.numel() is the actual one
    depth: float


def _render(tokenizer, content: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(content + "\nThe passkey is", add_special_tokens=False)["input_ids"]


def needle_cases(tokenizer, filler_text: str, lengths, depths, seed: int = 0) -> list[NeedleCase]:
    """One case per (length, depth): filler cut to fit ``length`` tokens, passkey sentence at ``depth``."""
    filler = tokenizer(filler_text, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            needle = f" The secret passkey is {key}. Remember it, {key} is the secret passkey. "
            overhead = len(_render(tokenizer, needle + "\n\n" + NEEDLE_QUESTION))
            n_fill = length - overhead
            if n_fill < 1:
                raise ValueError(f"needle length {length} is too short for the question ({overhead} tokens)")
            if n_fill > len(filler):
                raise ValueError(f"not enough filler text for a {length}-token needle ({len(filler)} tokens)")
            cut = round(depth * n_fill)
            before = tokenizer.decode(filler[:cut])
            after = tokenizer.decode(filler[cut:n_fill])
            content = before + needle + after + "\n\n" + NEEDLE_QUESTION
            ids = torch.tensor(_render(tokenizer, content), dtype=torch.long)
            cases.append(NeedleCase(ids, key, length, depth))
    return cases


def needle_case(model, tokenizer, case: NeedleCase, policy: str, budget: EvictionConfig, dense: DenseCache,
                max_new_tokens: int = 16, **policy_kwargs) -> dict:  # fmt: skip
    _, new, wall = _policy_generate(model, tokenizer, case.ids, max_new_tokens, policy, budget, dense, False,
                                    policy_kwargs)  # fmt: skip
    answer = tokenizer.decode(new, skip_special_tokens=True)
    numbers = re.findall(r"\d+", answer)
    return {
        "length": case.length,
        "tokens": case.ids.numel(),
        "depth": case.depth,
        "passkey": case.passkey,
        "answer": answer.strip(),
        "correct": bool(numbers) and numbers[0] == case.passkey,
        "wall_s": wall,
    }
