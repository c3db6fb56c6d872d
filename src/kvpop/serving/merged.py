"""A model folder with an adapter bundle's LoRA merged in, for servers without LoRA layers.

``kvpop serve`` serves what ``kvpop generate`` runs by default: the embedded model adapted to its bounded
cache. vLLM loads plain model folders, so the bundle's LoRA is merged into a copy of the base model once,
written atomically beside the converted models in the kvpop cache, keyed by the bundle's content.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..bundle import ADAPTER_FILES, ADAPTER_META_FILE, check_adapter_bundle
from ..files import atomic_dir
from ..models import cache_dir, cache_lock, load_model

__all__ = ["MERGED_MARKER", "MERGED_SCORER", "bundle_key", "merged_model_folder", "save_merged_model"]

MERGED_FORMAT = "kvpop-merged-v1"
MERGED_MARKER = "kvpop-merged.json"  # written last: a merged folder without it is never used
MERGED_SCORER = "kvpop/scorer.safetensors"


def _hash_file(h, f: Path) -> None:
    h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)


def bundle_key(path: str | os.PathLike) -> str:
    """A short key of a bundle's content (its adapter, metadata and scorer files): a changed bundle gets a
    new key, the same bundle installed at another path the same one."""
    path = Path(path)
    header = check_adapter_bundle(path)
    h = hashlib.sha256(f"{MERGED_FORMAT}\0".encode())
    for name in (*ADAPTER_FILES, ADAPTER_META_FILE, *([header["scorer"]] if header.get("scorer") else [])):
        _hash_file(h, path / name)
    return h.hexdigest()[:12]


def _base_key(base: Path) -> str:
    """The base folder's identity: its path and its files' sizes and times (a converted folder never changes)."""
    h = hashlib.sha256(os.path.realpath(base).encode())
    for f in sorted(p for p in base.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:8]


def save_merged_model(base: str | os.PathLike, bundle: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model folder ``base`` with ``bundle``'s LoRA merged into its weights (peft's
    ``merge_and_unload``), the base tokenizer and the bundle's scorer (:data:`MERGED_SCORER`) to the folder
    ``out``, atomically (:func:`kvpop.files.atomic_dir`), with :data:`MERGED_MARKER` written last.

    The folder is a plain Hugging Face model: a server without LoRA layers (vLLM with kvpop) loads it and
    runs the adapted model; its scorer serves the learned policy. A bundle trained on another base model
    raises :class:`AdapterMismatchError` before anything is written.
    """
    from transformers import AutoTokenizer

    base, bundle = Path(base), Path(bundle)
    header = check_adapter_bundle(bundle)
    model, _ = load_model(base, progress=False, adapter=bundle, merge=True)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)  # as saved: not load_model's padding
    # the merged folder stands alone: its config does not name the bundle (the scorer is copied in)
    vars(model.config).pop("kvpop_adapter", None)
    marker = {
        "format": MERGED_FORMAT,
        "base": os.path.realpath(base),
        "bundle": os.path.realpath(bundle),
        "bundle_key": bundle_key(bundle),
        "scorer": MERGED_SCORER if header.get("scorer") else None,
        "fingerprint": header.get("fingerprint"),
        "meta": header.get("meta"),
        "merged_at": time.time(),
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if header.get("scorer"):
            (tmp / MERGED_SCORER).parent.mkdir()
            shutil.copyfile(bundle / header["scorer"], tmp / MERGED_SCORER)
        (tmp / MERGED_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    out = Path(out)
    atomic_dir(out, write)
    return out


def _is_merged(folder: Path) -> bool:
    return (folder / MERGED_MARKER).is_file() and (folder / "config.json").is_file()


@contextlib.contextmanager
def _progress_bars(on: bool) -> Iterator[None]:
    """transformers' progress bars (writing the weights) on or off for the block."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def merged_model_folder(base: str | os.PathLike, bundle: str | os.PathLike, progress: bool = True) -> Path:
    """The model folder ``base`` with ``bundle``'s LoRA merged in (:func:`save_merged_model`), written once
    to ``<kvpop cache>/models/`` (beside the converted embedded models) and reused after.

    The folder's name carries the bundle's content key (:func:`bundle_key`) and the base folder's, so a
    changed bundle or base gets a new folder and an unchanged one is never merged again. Its scorer is
    ``<folder>/kvpop/scorer.safetensors`` (absent for a bundle without one).
    """
    base, bundle = Path(base), Path(bundle)
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base} is not a model folder (no config.json); pass the base model's folder")
    name = f"{base.name}--{bundle.resolve().name}-{_base_key(base)}-{bundle_key(bundle)}"
    out = cache_dir() / "models" / name
    if _is_merged(out):
        return out
    with cache_lock(name):  # two servers started at once merge once
        if _is_merged(out):  # another process merged it while this one waited
            return out
        if progress:
            print(
                f"kvpop: merging the LoRA of {bundle} into {base.name} (one time only) -> {out}",
                file=sys.stderr,
                flush=True,
            )
        start = time.perf_counter()
        with _progress_bars(progress):
            save_merged_model(base, bundle, out)
        if progress:
            print(f"kvpop: merged in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return out
