"""Fixed splits by document: train / validation / test from a hash of the document id, so they are
identical on every machine and Python version and no document leaks from train into the others."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from .base import Document

SPLITS: tuple[str, ...] = ("train", "validation", "test")
_SPLIT_BOUNDS = (0.8, 0.9)  # train < 0.8 <= validation < 0.9 <= test
_SPLIT_SALT = "kvpop-split-v1:"


def unit_hash(doc_id: str) -> float:
    """A document id's place in [0, 1): what decides its split."""
    digest = hashlib.sha256((_SPLIT_SALT + doc_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(doc_id: str) -> str:
    """Split of a document id by hash alone (80/10/10), independent of the other documents."""
    u = unit_hash(doc_id)
    return "train" if u < _SPLIT_BOUNDS[0] else "validation" if u < _SPLIT_BOUNDS[1] else "test"


def check_split(split: str) -> None:
    if split not in SPLITS and split != "all":
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}, all")


def split_documents(docs: Sequence[Document], split: str) -> list[Document]:
    """The documents of ``split`` (or all), keeping the input order.

    Mostly ``split_of(id)``; when that leaves a split empty (tiny corpora), the document with
    the smallest hash in the largest split moves there, so all splits are non-empty given
    at least 3 documents.
    """
    check_split(split)
    if split == "all":
        return list(docs)
    assign = {d.id: split_of(d.id) for d in docs}
    if len(docs) >= 3:
        for target in SPLITS:
            if target not in assign.values():
                counts = Counter(assign.values())
                donor = max(SPLITS, key=lambda s: counts[s])  # has >= 2 documents here
                assign[min((i for i, s in assign.items() if s == donor), key=unit_hash)] = target
    return [d for d in docs if assign[d.id] == split]
