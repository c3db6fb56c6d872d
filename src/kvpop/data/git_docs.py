"""Git's manual pages and guides, AsciiDoc sources (Debian's ``git-doc``): extra training text."""

from __future__ import annotations

from .base import Corpus, locate_dir, read_text_files

CORPUS = Corpus(
    "git_docs",
    "Git's manual pages and guides, AsciiDoc sources",
    "apt-get install git-doc",
    lambda: locate_dir("/usr/share/doc/git-doc"),
    lambda root: read_text_files(root, "*.txt"),
    evaluation=False,
)
