"""The Python documentation's reStructuredText sources (Debian's ``python3.11-doc``)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

from .base import Corpus, Document, read_text

DIRS = ("/usr/share/doc/python3.11/html/_sources",)


def locate() -> Path | None:
    """Debian's python3.11-doc, else any other python3.X-doc (newest first)."""
    candidates = list(DIRS)
    candidates += sorted(
        glob.glob("/usr/share/doc/python3*/html/_sources"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p)],
        reverse=True,
    )
    for cand in candidates:
        if Path(cand).is_dir():
            return Path(cand)
    return None


def read(root: Path) -> list[Document]:
    docs = []
    for path in root.rglob("*.rst.txt"):
        text = read_text(path)
        if text.strip():
            docs.append(Document(path.relative_to(root).as_posix()[: -len(".txt")], text))
    return docs


CORPUS = Corpus(
    "python_docs",
    "Python 3.11 documentation, reStructuredText sources",
    "apt-get install python3.11-doc",
    lambda: locate(),  # looked up at call time so tests can patch it
    read,
)
