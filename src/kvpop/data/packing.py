"""Token views of documents: packed training sequences, evaluation documents of a fixed length,
and the training and validation windows (shaped like the evaluation documents)."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .base import Document
from .corpora import CORPORA, load_documents

if TYPE_CHECKING:
    import torch


def _long_tensor(ids: list[int]) -> torch.Tensor:
    """``ids`` as a long tensor; torch loads here, so reading the corpora (a parser's defaults) loads none."""
    import torch

    return torch.tensor(ids, dtype=torch.long)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without special tokens (Hugging Face tokenizers or anything with encode)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return [int(i) for i in ids]


def _resolve_docs(
    name_or_docs: str | Iterable[Document | str], split: str, root: str | os.PathLike | None
) -> list[Document]:
    """A corpus split by name, or the given documents/strings as they are (split ignored)."""
    if isinstance(name_or_docs, str):
        return load_documents(name_or_docs, split, root)
    docs = []
    for i, d in enumerate(name_or_docs):
        docs.append(d if isinstance(d, Document) else Document(f"doc{i:06d}", str(d)))
    return docs


def iter_packed(
    tokenizer: Any,
    name_or_docs: str | Iterable[Document | str],
    seq_len: int,
    split: str = "train",
    add_bos: bool = True,
    seed: int | None = None,
    root: str | os.PathLike | None = None,
) -> Iterator[torch.Tensor]:
    """One pass of packed training sequences: LongTensors of exactly ``seq_len`` ids.

    Documents (in id order, or shuffled by ``random.Random(seed)``) are tokenized lazily and
    joined into one stream, each followed by EOS; the stream is cut into consecutive chunks.
    With ``add_bos`` each chunk starts with BOS followed by ``seq_len - 1`` stream tokens.
    The last incomplete chunk is dropped.
    """
    if seq_len < 1 or (add_bos and seq_len < 2):
        raise ValueError(f"seq_len={seq_len} is too small")
    docs = _resolve_docs(name_or_docs, split, root)
    if seed is not None:
        docs = list(docs)
        random.Random(seed).shuffle(docs)
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    if eos is None:
        eos = bos
    if eos is None:
        raise ValueError("tokenizer has neither eos_token_id nor bos_token_id to separate documents")
    prefix = [int(bos if bos is not None else eos)] if add_bos else []
    body = seq_len - len(prefix)
    buf: list[int] = []
    start = 0
    for doc in docs:
        buf.extend(_encode(tokenizer, doc.text))
        buf.append(int(eos))
        while len(buf) - start >= body:
            yield _long_tensor(prefix + buf[start : start + body])
            start += body
        if start:
            del buf[:start]
            start = 0


def long_documents(
    tokenizer: Any,
    name: str | Iterable[Document | str],
    min_tokens: int,
    split: str = "test",
    max_docs: int | None = None,
    root: str | os.PathLike | None = None,
    concat: bool | None = None,
) -> list[torch.Tensor]:
    """Evaluation documents of exactly ``min_tokens`` ids (longer ones truncated).

    Documents shorter than ``min_tokens`` are skipped, unless ``concat`` (default: True for
    corpora of short documents such as wikipedia summaries) in which case consecutive
    documents of the split are joined with a blank line into one long document.
    """
    if min_tokens < 1:
        raise ValueError("min_tokens must be >= 1")
    docs = _resolve_docs(name, split, root)
    if concat is None:
        concat = isinstance(name, str) and CORPORA[name].short_documents
    out: list[torch.Tensor] = []

    def done() -> bool:
        return max_docs is not None and len(out) >= max_docs

    if not concat:
        for doc in docs:
            if done():
                break
            ids = _encode(tokenizer, doc.text)
            if len(ids) >= min_tokens:
                out.append(_long_tensor(ids[:min_tokens]))
        return out

    parts: list[str] = []
    approx = 0  # sum of per-part token counts; the joined text is re-tokenized to confirm
    for doc in docs:
        if done():
            break
        parts.append(doc.text.strip())
        approx += len(_encode(tokenizer, doc.text.strip())) + 1
        if approx >= min_tokens:
            ids = _encode(tokenizer, "\n\n".join(parts))
            if len(ids) >= min_tokens:
                out.append(_long_tensor(ids[:min_tokens]))
                parts, approx = [], 0
    return out


def _windows_of(
    tokenizer: Any, corpus: str, seq_len: int, split: str, rng: random.Random, root: str | os.PathLike | None = None
) -> Iterator[torch.Tensor]:
    """One shuffled pass of non-overlapping ``seq_len`` windows of a corpus split, shaped like the
    evaluation documents of :func:`long_documents`: plain text, no BOS/EOS; long documents give
    several windows (from a random offset), short-document corpora are joined with blank lines."""
    docs = list(_resolve_docs(corpus, split, root))
    rng.shuffle(docs)
    if CORPORA[corpus].short_documents:
        buf: list[int] = []
        sep = _encode(tokenizer, "\n\n")
        for doc in docs:
            if buf:
                buf.extend(sep)
            buf.extend(_encode(tokenizer, doc.text.strip()))
            while len(buf) >= seq_len:
                yield _long_tensor(buf[:seq_len])
                buf = buf[seq_len:]
        return
    for doc in docs:
        ids = _encode(tokenizer, doc.text)
        if len(ids) < seq_len:
            continue
        offset = rng.randrange(len(ids) - seq_len + 1) % seq_len
        for start in range(offset, len(ids) - seq_len + 1, seq_len):
            yield _long_tensor(ids[start : start + seq_len])


def training_windows(
    tokenizer: Any,
    corpora: Sequence[str],
    seq_len: int,
    split: str = "train",
    seed: int = 0,
    root: dict[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """An endless, deterministic stream of ``(corpus, ids)`` training windows of ``seq_len`` tokens.

    Each window's corpus is drawn with probability proportional to the square root of the
    corpus' size in characters (so a large corpus does not drown the others, and a small one is
    not repeated many times over); each corpus is re-shuffled (from ``seed`` and the epoch)
    whenever it runs out. Windows look like what the evaluation scores: no BOS/EOS inserted, no
    packing across unrelated documents except for corpora of short documents, joined by blank
    lines as :func:`long_documents` does.
    """
    corpora = list(dict.fromkeys(corpora))
    if not corpora:
        raise ValueError("training_windows needs at least one corpus")
    sizes = [sum(len(d.text) for d in _resolve_docs(c, split, (root or {}).get(c))) for c in corpora]
    weights = [math.sqrt(n) for n in sizes]
    epochs = dict.fromkeys(corpora, 0)

    def stream(c: str) -> Iterator[torch.Tensor]:
        return _windows_of(tokenizer, c, seq_len, split, random.Random(f"{seed}:{c}:{epochs[c]}"), (root or {}).get(c))

    streams = {c: stream(c) for c in corpora}
    pick = random.Random(f"{seed}:mix")
    while True:
        c = pick.choices(corpora, weights)[0]
        try:
            ids = next(streams[c])
        except StopIteration:
            epochs[c] += 1
            streams[c] = stream(c)
            ids = next(streams[c], None)
            if ids is None:
                raise ValueError(f"corpus {c!r} has no {split} window of {seq_len} tokens") from None
        yield c, ids


def round_robin_windows(
    tokenizer: Any,
    corpora: Sequence[str],
    seq_len: int,
    n: int,
    split: str = "validation",
    seed: int = 0,
    root: dict[str, str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """``n`` distinct ``(corpus, ids)`` windows of ``seq_len`` tokens, taken from the corpora in turn
    (one shuffled pass of each, as :func:`training_windows` cuts them); a corpus without more windows
    drops out, so fewer than ``n`` come back only when every corpus ran out. Validation sets built
    this way weigh the corpora evenly instead of by size."""
    streams = {
        c: _windows_of(tokenizer, c, seq_len, split, random.Random(f"{seed}:{c}:rr"), (root or {}).get(c))
        for c in dict.fromkeys(corpora)
    }
    out: list[tuple[str, torch.Tensor]] = []
    while len(out) < n and streams:
        for c in list(streams):
            if len(out) >= n:
                break
            ids = next(streams[c], None)
            if ids is None:
                del streams[c]
            else:
                out.append((c, ids))
    return out
