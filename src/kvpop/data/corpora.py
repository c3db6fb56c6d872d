"""The registry of corpora by name, and a corpus split's documents."""

from __future__ import annotations

import os
from typing import Any

from .base import Corpus, CorpusNotFoundError, Document
from .git_docs import CORPUS as GIT_DOCS
from .human_eval import CORPUS as HUMAN_EVAL
from .package_code import CORPUS as PACKAGE_CODE
from .paul_graham import CORPUS as PAUL_GRAHAM
from .perl_docs import CORPUS as PERL_DOCS
from .python_code import CORPUS as PYTHON_CODE
from .python_docs import CORPUS as PYTHON_DOCS
from .shakespeare import CORPUS as SHAKESPEARE
from .splits import SPLITS, check_split, split_documents
from .wikipedia import CORPUS as WIKIPEDIA

CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        SHAKESPEARE,
        PAUL_GRAHAM,
        WIKIPEDIA,
        PYTHON_DOCS,
        PYTHON_CODE,
        HUMAN_EVAL,
        PERL_DOCS,
        GIT_DOCS,
        PACKAGE_CODE,
    )
}
EVALUATION_CORPORA: tuple[str, ...] = tuple(n for n, c in CORPORA.items() if c.evaluation)


def get_corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; valid corpora: {', '.join(CORPORA)}")
    return CORPORA[name]


def list_corpora(evaluation_only: bool = False) -> list[str]:
    """Names of the registered corpora (installed or not); ``evaluation_only``: the six named ones."""
    return [n for n, c in CORPORA.items() if c.evaluation or not evaluation_only]


def load_documents(name: str, split: str = "train", root: str | os.PathLike | None = None) -> list[Document]:
    """Documents of a corpus split, sorted by id; ``root`` overrides where the files are."""
    corpus = get_corpus(name)
    check_split(split)
    return split_documents(corpus.documents(root), split)


def corpus_stats(name: str, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Documents and characters per split, for listing corpora (no error when missing)."""
    corpus = get_corpus(name)
    stats: dict[str, Any] = {
        "name": name,
        "description": corpus.description,
        "install": corpus.install,
        "kind": corpus.kind,
        "available": True,
        "root": None,
        "error": None,
        "splits": {},
    }
    try:
        stats["root"] = str(corpus.root(root))
        docs = corpus.documents(root)
    except CorpusNotFoundError as exc:
        stats.update(available=False, error=str(exc))
        return stats
    for split in (*SPLITS, "all"):
        part = split_documents(docs, split)
        stats["splits"][split] = {"documents": len(part), "characters": sum(len(d.text) for d in part)}
    return stats
