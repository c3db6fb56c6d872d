"""The CPython standard library's ``.py`` sources of the running Python (tests excluded): code."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from .base import Corpus, Document, read_text

# Folders of the stdlib that are tests, installed packages, build data or generated tables.
SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "lib-dynload", "pydoc_data", "encodings", "_bundled",
}  # fmt: skip


def locate() -> Path | None:
    path = Path(sysconfig.get_paths()["stdlib"])
    return path if (path / "os.py").is_file() else None


def read(root: Path) -> list[Document]:
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [
            d for d in dirnames
            if d not in SKIP_DIRS and not d.startswith("config-") and not d.startswith(".")
        ]  # fmt: skip
        for fname in filenames:
            if not fname.endswith(".py") or fname.startswith(("_sysconfigdata", "test_")):
                continue
            text = read_text(Path(dirpath) / fname)
            if text.strip():
                docs.append(Document((rel_dir / fname).as_posix(), text))
    return docs


CORPUS = Corpus(
    "python_code",
    "CPython standard library .py sources of the running Python (tests excluded)",
    "install a CPython that ships its standard library sources (e.g. apt-get install python3.11)",
    lambda: locate(),
    read,
    kind="code",
)
