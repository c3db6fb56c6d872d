"""RULER-style retrieval cases for ``kvpop eval tasks``: needles in essay filler, the question last.

Four tasks after RULER (Hsieh et al., 2024), with its needle sentence, templates, answer prefixes
and scoring:

- ``niah_single``: one "One of the special magic numbers for <key> is: <value>." sentence (a 7-digit
  number; ``niah_single_uuid``: a UUID) at a random depth of Paul Graham essays;
- ``niah_multikey``: four such needles with different keys (and values); one key is asked;
- ``niah_multivalue``: one key with four values; all four must be listed;
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) hidden in
  RULER's repeated noise sentences, after one worked example; every variable holding the value must
  be listed.

The question comes after the context and the assistant turn starts with RULER's answer prefix, so a
policy decides what to keep before it sees which key is asked (query-agnostic eviction). The score
of a case is RULER's ``string_match_all``: the fraction of expected values that appear in the answer
(case-insensitive substrings).

A case is deterministic: it draws from ``random.Random(f"{seed}/{task}/{length}/{index}")``, so
asking for more cases never changes the earlier ones. Its prompt (chat template, generation prompt,
answer prefix) plus ``max_new_tokens`` fits ``length`` tokens: the filler is cut to fill the rest.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field

RULER_TASKS = ("niah_single", "niah_single_uuid", "niah_multikey", "niah_multivalue", "vt")
TEMPLATE_VERSION = 1  # bump when a template changes: records made with another one are not reused

# RULER's "repeat" haystack: what variable tracking hides its chains in
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FIT_SLACK = 8  # a prompt is at most this many tokens short of length - max_new_tokens (usually)
DEPTHS = tuple(i / 39 for i in range(40))  # RULER draws needle depths from 40 evenly spaced ones in [0, 1]

_ADJECTIVES = (
    "ancient",
    "bitter",
    "brave",
    "calm",
    "clever",
    "cold",
    "crisp",
    "curious",
    "damp",
    "eager",
    "faint",
    "fancy",
    "fierce",
    "gentle",
    "giant",
    "glossy",
    "golden",
    "grumpy",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "lazy",
    "loud",
    "lucky",
    "mellow",
    "misty",
    "noble",
    "odd",
    "plain",
    "proud",
    "quiet",
    "rapid",
    "rusty",
    "shiny",
    "silent",
    "sleepy",
    "smooth",
    "tiny",
    "wild",
)
_NOUNS = (
    "anchor",
    "badger",
    "basket",
    "beacon",
    "bicycle",
    "blanket",
    "canyon",
    "castle",
    "cedar",
    "comet",
    "cottage",
    "crayon",
    "dolphin",
    "engine",
    "falcon",
    "feather",
    "garden",
    "glacier",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "mirror",
    "needle",
    "orchard",
    "pebble",
    "pillow",
    "puzzle",
    "quarry",
    "ribbon",
    "saddle",
    "tractor",
    "tunnel",
    "violin",
    "wagon",
    "walnut",
    "window",
)


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task: how many keys and values per key, the value type, and the answer length."""

    keys: int
    values: int
    value_type: str  # "numbers" | "uuids" | "variables"
    max_new_tokens: int


SPECS = {
    "niah_single": TaskSpec(1, 1, "numbers", 32),
    "niah_single_uuid": TaskSpec(1, 1, "uuids", 64),
    "niah_multikey": TaskSpec(4, 1, "numbers", 32),
    "niah_multivalue": TaskSpec(1, 4, "numbers", 64),
    "vt": TaskSpec(1, 5, "variables", 48),  # one chain of 4 hops: 5 variables
}


@dataclass
class RulerCase:
    task: str
    index: int
    ids: list[int]  # prompt token ids: chat template, generation prompt, answer prefix
    expected: list[str]  # every value the answer must contain
    query: str  # the asked key (vt: the value the chain starts from)
    length: int  # requested length: len(ids) + max_new_tokens <= length
    max_new_tokens: int
    depths: list[float]  # where each inserted sentence sits in the context (fraction of its sentences)
    needles: list[str]  # the inserted sentences, in context order
    content: str = field(repr=False, default="")  # the user turn
    answer_prefix: str = ""  # what the assistant turn starts with (part of ids)

    @property
    def item_id(self) -> str:
        return f"{self.task}/L{self.length}/{self.index:04d}"


# ------------------------------------------------------------------------------ scoring


def string_match_all(prediction: str, expected: list[str]) -> float:
    """RULER's score of one answer: the fraction of ``expected`` found in it (case-insensitive)."""
    if not expected:
        return float("nan")
    pred = "".join(ch for ch in prediction if ch.isprintable() or ch in "\n\t").lower()
    return sum(1.0 for r in expected if r.lower() in pred) / len(expected)


# ------------------------------------------------------------------------------ pieces


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _value(rng: random.Random, value_type: str) -> str:
    if value_type == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(rng: random.Random, n: int, draw) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = draw(rng)
        if v not in out:
            out.append(v)
    return out


def needle_sentence(value_type: str, key: str, value: str) -> str:
    return f"One of the special magic {value_type} for {key} is: {value}."


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _insert(sentences: list[str], inserts: list[tuple[float, str]]) -> tuple[str, list[float], list[str]]:
    """Context text with each ``(depth, sentence)`` put between the filler's sentences at that depth;
    returns the text, the actual depths (fraction of the filler sentences before each) and the order."""
    n = len(sentences)
    placed = sorted(((min(n, int(n * d)), s) for d, s in inserts), key=lambda t: t[0])
    parts, prev, depths = [], 0, []
    for pos, s in placed:
        parts += sentences[prev:pos]
        parts.append(s)
        depths.append(pos / n if n else 0.0)
        prev = pos
    parts += sentences[prev:]
    return " ".join(parts), depths, [s for _, s in placed]


def _plural_template(spec: TaskSpec, key: str) -> tuple[str, str, str]:
    """RULER's NIAH header, question and answer prefix (singular where one value is asked)."""
    vt = spec.value_type
    if spec.values == 1:
        one = vt[:-1]
        return (
            (
                f"A special magic {one} is hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the {one} afterwards."
            ),
            f"What is the special magic {one} for {key} mentioned in the provided text?",
            f"The special magic {one} for {key} mentioned in the provided text is",
        )
    return (
        (
            f"Some special magic {vt} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {vt} afterwards."
        ),
        f"What are all the special magic {vt} for {key} mentioned in the provided text?",
        f"The special magic {vt} for {key} mentioned in the provided text are",
    )


def _vt_chain(rng: random.Random, hops: int) -> tuple[list[str], str, list[str]]:
    """(variables, start value, statements) of one chain: VAR A = 12345, VAR B = VAR A, ..."""
    names = _distinct(rng, hops + 1, lambda r: "".join(r.choices(string.ascii_uppercase, k=5)))
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(hops)]
    return names, value, statements


def _vt_texts(names: list[str], value: str) -> tuple[str, str, str]:
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
        f"are assigned the value {value}, they are:"
    )
    return header, question, prefix


def _vt_example(rng: random.Random, hops: int) -> str:
    """RULER's one worked example before the real question: a short chain in a little noise, answered."""
    names, value, statements = _vt_chain(rng, hops)
    noise = _sentences(" ".join([NOISE] * 4))
    depths = sorted(rng.sample(DEPTHS, len(statements)))
    context, _, _ = _insert(noise, list(zip(depths, statements)))
    header, question, prefix = _vt_texts(names, value)
    return f"{header}\n\n{context}\n{question}\n{prefix} {' '.join(names)}\n\n"


# ------------------------------------------------------------------------------ cases


def _render(tokenizer, content: str, prefix: str) -> list[int]:
    from .tasks import render_chat

    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    return render_chat(tokenizer, content, fallback_suffix="\n") + prefix_ids


def filler_sentences(text: str) -> list[str]:
    """The filler's sentences, whitespace collapsed (RULER joins the essays into one line of words)."""
    return _sentences(re.sub(r"\s+", " ", text))


def make_case(
    tokenizer, task: str, index: int, filler: list[str], length: int, seed: int = 0, max_new_tokens: int | None = None
) -> RulerCase:
    """Case ``index`` of ``task`` at ``length`` tokens (prompt + ``max_new_tokens``).

    ``filler``: the essays' sentences (:func:`filler_sentences`; variable tracking uses RULER's noise
    instead). Each case reads the filler from a sentence at a random place of its own (wrapping around),
    takes as many words as fit (refitted: re-tokenizing the spliced text shifts the count) and puts the
    needles between its sentences at their depths."""
    if task not in SPECS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(SPECS)}")
    spec = SPECS[task]
    n_new = spec.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    if task == "vt":
        example = _vt_example(rng, 4)
        names, value, statements = _vt_chain(rng, 4)
        header, question, prefix = _vt_texts(names, value)
        header, sep = example + header, "\n\n"
        inserts = list(zip(sorted(rng.sample(DEPTHS, len(statements))), statements))
        expected, query = names, value
        source = _sentences(NOISE)
    else:
        keys = _distinct(rng, spec.keys, _key)
        values = [_distinct(rng, spec.values, lambda r: _value(r, spec.value_type)) for _ in keys]
        needles = [needle_sentence(spec.value_type, k, v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.randrange(len(keys))
        query, expected = keys[asked], values[asked]
        header, question, prefix = _plural_template(spec, query)
        sep = "\n"
        inserts = list(zip(rng.sample(DEPTHS, len(needles)), needles))
        source = filler
    if not source:
        raise ValueError(f"{task}: no filler text")
    target = length - n_new
    start = 0 if task == "vt" else int(rng.random() * len(source))
    words: list[str] = []
    i = start
    while len(words) < 2 * target + 64:  # more words than tokens fit (a word is at least one token)
        words += source[i % len(source)].split(" ")
        i += 1
        if task != "vt" and i - start >= len(source):
            break  # the whole filler once: never repeat essay text

    def build(n_words: int) -> tuple[list[int], str, list[float], list[str]]:
        context, depths, order = _insert(_sentences(" ".join(words[:n_words])), inserts)
        content = f"{header}{sep}{context}\n{question}"
        return _render(tokenizer, content, prefix), content, depths, order

    overhead = len(build(0)[0])
    if overhead >= target:
        raise ValueError(
            f"{task}: length {length} leaves no room for filler (template {overhead} tokens + {n_new} new tokens)"
        )
    per_word = len(tokenizer(" ".join(words[:200]), add_special_tokens=False)["input_ids"]) / max(1, len(words[:200]))
    n_words = min(len(words), int((target - overhead) / per_word))
    best = None
    for _ in range(12):
        ids, content, depths, order = build(n_words)
        if len(ids) <= target and (best is None or len(ids) > len(best[0])):
            best = (ids, content, depths, order)
        gap = target - len(ids)
        if 0 <= gap <= FIT_SLACK or (gap > 0 and n_words >= len(words)):
            break
        step = gap / per_word
        n_words = max(0, min(len(words), n_words + (int(step) if gap > 0 else math.floor(step) - 1)))
    if best is None or target - len(best[0]) > 4 * FIT_SLACK:
        got = "none fits" if best is None else f"at most {len(best[0])} tokens"
        raise ValueError(f"{task}: cannot fill case {index} to {length} tokens ({got}; not enough filler text?)")
    ids, content, depths, order = best
    return RulerCase(task, index, ids, list(expected), query, length, n_new, depths, order, content, prefix)


def make_cases(
    tokenizer,
    task: str,
    filler_text: str,
    n_cases: int,
    length: int = 4096,
    seed: int = 0,
    max_new_tokens: int | None = None,
    start: int = 0,
) -> list[RulerCase]:
    """Cases ``start .. start + n_cases - 1`` of ``task`` at ``length`` tokens."""
    filler = filler_sentences(filler_text) if task != "vt" else []
    return [make_case(tokenizer, task, i, filler, length, seed, max_new_tokens) for i in range(start, start + n_cases)]


def score_answer(case: RulerCase, answer: str) -> dict:
    """What a record keeps of one answer: the score, the answer and what was expected."""
    return {
        "score": string_match_all(answer, case.expected),
        "answer": answer.strip(),
        "expected": case.expected,
        "query": case.query,
        "depths": [round(d, 4) for d in case.depths],
    }
