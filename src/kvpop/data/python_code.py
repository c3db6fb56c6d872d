"""The CPython standard library's ``.py`` sources of the running Python (tests excluded): code."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from .base import Corpus, Document, read_py_files

# Folders of the stdlib that are tests, installed packages, build data or generated tables.
SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib-dynload",
    "pydoc_data",
    "encodings",
    "_bundled",
}


def locate() -> Path | None:
    path = Path(sysconfig.get_paths()["stdlib"])
    return path if (path / "os.py").is_file() else None


def read(root: Path) -> list[Document]:
    return read_py_files(
        root, root, SKIP_DIRS, skip_files=("_sysconfigdata", "test_"), skip_dir_prefixes=(".", "config-")
    )


CORPUS = Corpus(
    "python_code",
    "CPython standard library .py sources of the running Python (tests excluded)",
    "install a CPython that ships its standard library sources (e.g. apt-get install python3.11)",
    lambda: locate(),
    read,
    kind="code",
)
