"""A user's own texts: a folder of ``.txt`` files or a ``.jsonl`` with a "text" field per line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .base import Document, read_text


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
        docs = [Document(f.relative_to(path).as_posix(), read_text(f)) for f in files]
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
    raise ValueError(f"{str(path)!r}: expected a folder of .txt files or a .jsonl file with a 'text' field per line")
