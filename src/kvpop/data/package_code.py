"""Python sources of four packages kvpop itself depends on (``peft``, ``huggingface_hub``, ``tqdm``,
``gguf``): code, extra training text only.

Why: the out-of-domain corpus ``python_code`` (the CPython standard library) is where the
learned scorer was weakest, and the six training corpora hold little source code (HumanEval is
small). These packages are a different codebase from the standard library, installed on every
machine that installs kvpop, so the corpus needs no extra download. Document ids name the package
and file, so the splits stay fixed for the same package versions (they move with the versions).
"""

from __future__ import annotations

from pathlib import Path

from .base import Corpus, Document, find_package_dir, read_py_files

PACKAGES: tuple[str, ...] = ("peft", "huggingface_hub", "tqdm", "gguf")
SKIP_DIRS = {"tests", "test", "__pycache__"}


def locate() -> Path | None:
    """The folder that holds the packages (their common parent, normally ``site-packages``)."""
    dirs = [d for d in (find_package_dir(p) for p in PACKAGES) if d is not None]
    return dirs[0].parent if dirs else None


def read(root: Path) -> list[Document]:
    return [
        d for package in PACKAGES if (root / package).is_dir() for d in read_py_files(root, root / package, SKIP_DIRS)
    ]


CORPUS = Corpus(
    "package_code",
    f"Python sources of the installed {', '.join(PACKAGES)} packages (kvpop's dependencies; tests excluded)",
    "pip install peft huggingface_hub tqdm gguf (installed with kvpop)",
    locate,
    read,
    kind="code",
    evaluation=False,
)
