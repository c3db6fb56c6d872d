"""The evaluation tasks, one document / case at a time.

- ``lm``: teacher-forced long-document LM, scored over positions ``>= B`` (all tokens, and the
  long-dependency tokens: where the full context beats a window-only dense run by more than a
  threshold, see :mod:`kvpop.evaluate.core`).
- ``continuation``: the last ``continuation_tokens`` predictions of the same document (a
  continuation after a long context): the same forward as ``lm``, a different slice.
- ``needle``: a passkey hidden at a depth of essay filler, asked for with the chat template;
  exact match of the number in the greedy answer. A grid of lengths x depths.
- ``multikey``: several "The access code for <Name> is <5 digits>." facts spread through essay
  filler, then a question for one of them with the chat template; exact match of the number.
- ``agreement``: greedy continuation of a prompt; token match rate against dense.

Cases are deterministic: each needle cell and each multi-key case draws from its own
``random.Random`` seeded by ``(seed, task, length, depth / case index)``, so asking for more
lengths, depths or cases never changes the ones already there.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..compat import cache_kwargs

if TYPE_CHECKING:
    from torch import Tensor

TASKS = ("lm", "continuation", "needle", "multikey", "agreement")
DEFAULT_TASKS = ("lm", "continuation", "needle", "multikey")
TEXT_TASKS = ("lm", "continuation", "agreement")  # tasks that run on a document's own text


# ------------------------------------------------------------------------------ generation


def pad_id(tokenizer) -> int:
    """The token that pads a batch: the tokenizer's pad token, else its end of sequence."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def generate_greedy(model, tokenizer, ids: Tensor, mask: Tensor, max_new_tokens: int, cache=None, **kw) -> Tensor:
    """``model.generate`` of ``ids`` ``[b, n]`` (``mask``: its attention mask), greedy, with ``cache`` (None:
    dense); ``kw`` to ``generate`` too. Returns the whole sequences."""
    import torch  # the task names and case text load without torch (the parser of kvpop eval reads them)

    with torch.no_grad():
        return model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            **cache_kwargs(cache),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id(tokenizer),
            **kw,
        )


def greedy(model, tokenizer, prompt_ids: Tensor, max_new_tokens: int, cache=None, force_length: bool = False) -> Tensor:
    """Greedy new token ids (1-D) after ``prompt_ids`` (1-D), with ``cache`` (None: dense)."""
    import torch

    ids = prompt_ids.view(1, -1)
    kw = {"min_new_tokens": max_new_tokens} if force_length else {}
    out = generate_greedy(model, tokenizer, ids, torch.ones_like(ids), max_new_tokens, cache, **kw)
    return out[0, ids.shape[1] :].cpu()


def agreement_result(dense_new: Tensor, new: Tensor) -> dict:
    n = min(dense_new.numel(), new.numel())
    eq = (dense_new[:n] == new[:n]).tolist()
    first = next((i for i, e in enumerate(eq) if not e), n)
    return {
        "n_tokens": n,
        "prefix_match": first / n if n else float("nan"),
        "match_rate": sum(eq) / n if n else float("nan"),
        "first_divergence": first,
    }


# ------------------------------------------------------------------------------ prompts


def render_chat(tokenizer, content: str, fallback_suffix: str = "\nAnswer:") -> list[int]:
    """Token ids of ``content`` as one user turn with the generation prompt (chat template), or
    ``content + fallback_suffix`` for a tokenizer without a template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(content + fallback_suffix, add_special_tokens=False)["input_ids"]


def first_number(answer: str) -> str | None:
    numbers = re.findall(r"\d+", answer)
    return numbers[0] if numbers else None


def _filler_ids(tokenizer, filler_text: str) -> list[int]:
    return tokenizer(filler_text, add_special_tokens=False)["input_ids"]


def _spliced(tokenizer, filler: list[int], start: int, n_fill: int, inserts: list[tuple[float, str]]) -> str:
    """``filler[start:start + n_fill]`` as text with each ``(depth, sentence)`` inserted at its depth."""
    cuts = sorted((round(d * n_fill), s) for d, s in inserts)
    parts, prev = [], 0
    for cut, sentence in cuts:
        parts.append(tokenizer.decode(filler[start + prev : start + cut]))
        parts.append(sentence)
        prev = cut
    parts.append(tokenizer.decode(filler[start + prev : start + n_fill]))
    return "".join(parts)


def _n_fill(length: int, overhead: int, available: int, what: str) -> int:
    n_fill = length - overhead
    if n_fill < 1:
        raise ValueError(f"{what} length {length} is too short for the question ({overhead} tokens)")
    if n_fill > available:
        raise ValueError(f"not enough filler text for a {length}-token {what} ({available} tokens)")
    return n_fill


# ------------------------------------------------------------------------------ needle

NEEDLE_QUESTION = "What is the secret passkey mentioned in the text above? Answer with the number only."


@dataclass
class NeedleCase:
    ids: Tensor  # prompt ids (chat template applied, generation prompt added)
    passkey: str
    length: int  # requested length; ids.numel() is the actual one
    depth: float

    @property
    def case_id(self) -> str:
        return f"L{self.length}-d{self.depth:.2f}"


def needle_cases(tokenizer, filler_text: str, lengths, depths, seed: int = 0) -> list[NeedleCase]:
    """One case per (length, depth): filler cut to fit ``length`` tokens, passkey sentence at ``depth``."""
    import torch

    filler = _filler_ids(tokenizer, filler_text)
    cases = []
    for length in lengths:
        for depth in depths:
            rng = random.Random(f"{seed}/needle/{length}/{depth:.6f}")
            key = str(rng.randint(10000, 99999))
            needle = f" The secret passkey is {key}. Remember it, {key} is the secret passkey. "
            overhead = len(render_chat(tokenizer, needle + "\n\n" + NEEDLE_QUESTION))
            n_fill = _n_fill(length, overhead, len(filler), "needle")
            content = _spliced(tokenizer, filler, 0, n_fill, [(depth, needle)]) + "\n\n" + NEEDLE_QUESTION
            ids = torch.tensor(render_chat(tokenizer, content), dtype=torch.long)
            cases.append(NeedleCase(ids, key, length, depth))
    return cases


def needle_result(tokenizer, case: NeedleCase, new: Tensor) -> dict:
    answer = tokenizer.decode(new, skip_special_tokens=True)
    return {
        "length": case.length,
        "tokens": case.ids.numel(),
        "depth": case.depth,
        "passkey": case.passkey,
        "answer": answer.strip(),
        "correct": first_number(answer) == case.passkey,
    }


# ------------------------------------------------------------------------------ multi-key recall

MULTIKEY_NAMES = (
    "Alice",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Esther",
    "Farid",
    "Greta",
    "Hiroshi",
    "Ingrid",
    "Jamal",
    "Keiko",
    "Lorenzo",
    "Marta",
    "Nikolai",
    "Olga",
    "Pedro",
    "Quentin",
    "Rosa",
    "Stefan",
    "Tamara",
    "Ulrich",
    "Valeria",
    "Wendell",
    "Ximena",
    "Yusuf",
    "Zofia",
)


def multikey_fact(name: str, code: str) -> str:
    return f" The access code for {name} is {code}. "


def multikey_question(name: str) -> str:
    return f"What is the access code for {name}? Answer with the number only."


@dataclass
class MultiKeyCase:
    ids: Tensor  # prompt ids (chat template applied, generation prompt added)
    facts: list[tuple[str, str]]  # (name, code) in the order they appear
    depths: list[float]  # depth of each fact in the filler
    asked: str  # the name asked for
    answer: str  # its code
    length: int  # requested length; ids.numel() is the actual one
    case: int
    text: str = field(repr=False, default="")  # the user turn (filler, facts, question)

    @property
    def case_id(self) -> str:
        return f"L{self.length}-c{self.case:02d}"


def multikey_cases(
    tokenizer, filler_text: str, lengths, n_cases: int, n_keys: int = 4, seed: int = 0
) -> list[MultiKeyCase]:
    """``n_cases`` cases per length: ``n_keys`` facts, one in each of ``n_keys`` equal segments of
    the filler (a random depth inside the middle 70% of its segment), then a question for one of
    them. Each case reads the filler from its own random offset, so cases differ in their text."""
    if not 1 <= n_keys <= len(MULTIKEY_NAMES):
        raise ValueError(f"n_keys must be in [1, {len(MULTIKEY_NAMES)}], got {n_keys}")
    import torch

    filler = _filler_ids(tokenizer, filler_text)
    cases = []
    for length in lengths:
        for c in range(n_cases):
            rng = random.Random(f"{seed}/multikey/{length}/{c}/{n_keys}")
            names = rng.sample(MULTIKEY_NAMES, n_keys)
            codes: list[str] = []
            while len(codes) < n_keys:
                code = str(rng.randint(10000, 99999))
                if code not in codes:
                    codes.append(code)
            depths = [(j + rng.uniform(0.15, 0.85)) / n_keys for j in range(n_keys)]
            asked = rng.randrange(n_keys)
            facts = [multikey_fact(n, code) for n, code in zip(names, codes)]
            question = multikey_question(names[asked])
            overhead = len(render_chat(tokenizer, "".join(facts) + "\n\n" + question))
            n_fill = _n_fill(length, overhead, len(filler), "multi-key case")
            start = rng.randrange(0, len(filler) - n_fill + 1)
            text = _spliced(tokenizer, filler, start, n_fill, list(zip(depths, facts))) + "\n\n" + question
            ids = torch.tensor(render_chat(tokenizer, text), dtype=torch.long)
            cases.append(
                MultiKeyCase(ids, list(zip(names, codes)), depths, names[asked], codes[asked], length, c, text)
            )
    return cases


def multikey_result(tokenizer, case: MultiKeyCase, new: Tensor) -> dict:
    answer = tokenizer.decode(new, skip_special_tokens=True)
    got = first_number(answer)
    return {
        "length": case.length,
        "tokens": case.ids.numel(),
        "case": case.case,
        "n_keys": len(case.facts),
        "asked": case.asked,
        "asked_depth": case.depths[[n for n, _ in case.facts].index(case.asked)],
        "expected": case.answer,
        "answer": answer.strip(),
        "correct": got == case.answer,
        "other_key": got is not None and got != case.answer and got in {c for _, c in case.facts},
    }
