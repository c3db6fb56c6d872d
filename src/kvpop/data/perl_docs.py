"""Perl 5 manual pages in POD (Debian's ``perl-doc``): extra training text, not an evaluation corpus."""

from __future__ import annotations

from .base import Corpus, locate_dir, read_text_files

CORPUS = Corpus(
    "perl_docs",
    "Perl 5 manual pages in POD (perlfaq, perlfunc, perlop, ...): technical prose with code",
    "apt-get install perl-doc",
    lambda: locate_dir("/usr/share/perl/5*/pod"),
    lambda root: read_text_files(root, "*.pod"),
    evaluation=False,
)
