"""What a corpus is: documents, where a corpus's files are, and reading them once.

Every corpus comes from files that an ordinary package client installs (pip or apt), so
experiments are reproducible offline. A corpus module (one per corpus in this package) says where
its files are (``locate``) and how to read them into documents (``read``).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    """One document of a corpus; ``id`` is stable across machines and decides the split."""

    id: str
    text: str


class CorpusNotFoundError(FileNotFoundError):
    """A corpus's files are not installed; the message says how to install them."""


@dataclass(frozen=True)
class Corpus:
    """A named text source: where its files are and how to read them into documents."""

    name: str
    description: str
    install: str  # exact command that provides the files
    locate: Callable[[], Path | None]  # default root, or None when not installed
    read: Callable[[Path], list[Document]]  # root -> documents (any order)
    kind: str = "text"  # "text" or "code"
    short_documents: bool = False  # long_documents() concatenates consecutive docs
    evaluation: bool = True  # one of the six named evaluation corpora (False: extra training text only)

    def root(self, root: str | os.PathLike | None = None) -> Path:
        """The folder to read from (``root`` overrides); CorpusNotFoundError if absent."""
        if root is not None:
            path = Path(root)
            if not path.exists():
                raise CorpusNotFoundError(
                    f"corpus {self.name!r}: root {str(path)!r} does not exist "
                    f"(the default location is provided by `{self.install}`)"
                )
            return path
        path = self.locate()
        if path is None or not path.exists():
            raise CorpusNotFoundError(
                f"corpus {self.name!r} is not installed ({self.description}); install it with: {self.install}"
            )
        return path

    def documents(self, root: str | os.PathLike | None = None) -> list[Document]:
        """All documents sorted by id."""
        base = self.root(root)
        return list(read_cached(self, str(base.resolve())))


@functools.lru_cache(maxsize=8)
def read_cached(corpus: Corpus, root: str) -> tuple[Document, ...]:
    """A corpus's documents under ``root``, sorted by id (cached: the wikipedia JSON and the stdlib
    walk take a noticeable fraction of a second)."""
    try:
        docs = corpus.read(Path(root))
    except FileNotFoundError as exc:
        raise CorpusNotFoundError(
            f"corpus {corpus.name!r}: expected file missing under {root!r} ({exc}); install it with: {corpus.install}"
        ) from exc
    if not docs:
        raise CorpusNotFoundError(
            f"corpus {corpus.name!r}: no documents found under {root!r}; install it with: {corpus.install}"
        )
    docs.sort(key=lambda d: d.id)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"corpus {corpus.name!r} has duplicate document ids")
    return tuple(docs)


# --------------------------------------------------------------------------- locating and reading


def find_package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it (some fail to import)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_locator(package: str) -> Callable[[], Path | None]:
    """A ``locate`` for files inside an installed package (looked up at call time)."""
    return lambda: find_package_dir(package)


def locate_dir(*candidates: str) -> Path | None:
    """The first existing folder among glob patterns (the newest match of each pattern first)."""
    for pattern in candidates:
        for cand in sorted(glob.glob(pattern), reverse=True):
            if Path(cand).is_dir():
                return Path(cand)
    return None


def read_text(path: Path) -> str:
    """A text file with Unix newlines (undecodable bytes replaced)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_py_files(
    root: Path,
    top: Path,
    skip_dirs: set[str],
    skip_files: tuple[str, ...] = ("test_",),
    skip_dir_prefixes: tuple[str, ...] = (".",),
) -> list[Document]:
    """Every non-empty ``.py`` file under ``top`` (folders in ``skip_dirs`` or starting with a prefix in
    ``skip_dir_prefixes`` skipped, files starting with one of ``skip_files`` too), its path relative to
    ``root`` as id: the source-code corpora."""
    docs = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(skip_dir_prefixes)]
        for fname in filenames:
            if not fname.endswith(".py") or fname.startswith(skip_files):
                continue
            path = Path(dirpath) / fname
            text = read_text(path)
            if text.strip():
                docs.append(Document(path.relative_to(root).as_posix(), text))
    return docs


def read_text_files(root: Path, pattern: str) -> list[Document]:
    """Every non-empty file matching ``pattern`` in ``root``, its relative path as id."""
    docs = []
    for path in sorted(root.glob(pattern)):
        text = read_text(path)
        if text.strip():
            docs.append(Document(path.relative_to(root).as_posix(), text))
    return docs
