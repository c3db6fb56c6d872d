"""LoRA adapters for the LLM, via ``peft``: what adaptation (``kvpop adapt``) needs to build and write them.

The joint stage fine-tunes the LLM with a KL loss: the student is the model attending under
the eviction mask (:func:`kvpop.mask.masked_eviction`), the teacher the same base model
attending densely. With LoRA both live in one model: the adapter on is the student,
:func:`base_model` (:func:`kvpop.bundle.teacher_mode`, peft's ``disable_adapter``) is the base model, bit for bit.

:func:`save_adapter_bundle` writes an adapter bundle (the folder :mod:`kvpop.bundle` reads and loads) to a
temporary folder next to the destination and swaps it into place in one step (:func:`kvpop.files.atomic_dir`),
so a failed or killed save leaves the old or the new bundle at the path, never none.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..bundle import ADAPTER_META_FILE, FORMAT, SCORER_FILE, base_fingerprint, is_peft_model, peft_module, teacher_mode
from ..checkpoint import save_scorer
from ..compat import quiet_peft_wrap
from ..files import atomic_dir
from .config import DEFAULT_LORA_TARGETS

__all__ = ["add_lora", "base_model", "lora_config", "save_adapter_bundle"]


def lora_config(
    r: int = 16,
    alpha: float | None = None,
    targets: Sequence[str] = DEFAULT_LORA_TARGETS,
    dropout: float = 0.0,
    **kwargs,
):
    """A ``peft.LoraConfig`` for a causal LM: rank ``r``, ``lora_alpha = alpha`` (default ``2 r``),
    on the attention and MLP projections by default. ``kwargs`` go to ``LoraConfig``."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be an int >= 1; got {r!r}")
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    if not targets:
        raise ValueError("targets must name at least one module")
    return peft_module().LoraConfig(
        r=r,
        lora_alpha=float(2 * r if alpha is None else alpha),
        target_modules=targets,
        lora_dropout=float(dropout),
        bias="none",
        task_type="CAUSAL_LM",
        **kwargs,
    )


def add_lora(model, config=None):
    """Wrap ``model`` in a ``peft`` model with a fresh LoRA adapter (``lora_config()`` by default).

    The base weights are frozen; only the adapter's weights train. The base model is modified in
    place (LoRA layers are injected into it).
    """
    if is_peft_model(model):
        raise TypeError("model already carries a peft adapter")
    with quiet_peft_wrap():
        return peft_module().get_peft_model(model, config if config is not None else lora_config())


@contextlib.contextmanager
def base_model(model, frozen=None) -> Iterator[Any]:
    """The base model (the teacher of ``kvpop adapt``): ``frozen`` if given (a full fine-tune keeps a
    frozen copy), else ``model`` with its adapter off (:func:`teacher_mode`)."""
    if frozen is not None:
        yield frozen
    else:
        with teacher_mode(model):
            yield model


def save_adapter_bundle(peft_model, scorer=None, path: str | os.PathLike = "adapter", meta: dict | None = None) -> Path:
    """Write an adapter bundle to the folder ``path`` (atomically; see the module doc).

    ``peft_model``: a ``peft`` model (its adapters are saved with ``save_pretrained``).
    ``scorer``: an optional ``ScorerStack`` trained with it. ``meta``: JSON-serialisable metadata
    (budget, window, sinks, lam, steps, ...), stored with the base model's fingerprint. An
    existing folder at ``path`` is replaced only if it is a kvpop adapter bundle.
    """
    if not is_peft_model(peft_model):
        raise TypeError(f"save_adapter_bundle needs a peft model; got {type(peft_model).__name__}")
    path = Path(path)
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / ADAPTER_META_FILE).is_file())):
        raise FileExistsError(f"{path} exists and is not a kvpop adapter bundle; refusing to replace it")
    meta = dict(meta or {})
    fingerprint = base_fingerprint(peft_model)
    cfg = peft_model.peft_config.get(peft_model.active_adapter)
    header = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "peft_type": str(getattr(cfg, "peft_type", "")),
        "scorer": SCORER_FILE if scorer is not None else None,
        "meta": meta,
    }
    text = json.dumps(header, indent=2, sort_keys=True)  # fail before writing anything if meta is not JSON

    def write(tmp: Path) -> None:
        peft_model.save_pretrained(str(tmp))
        if scorer is not None:
            save_scorer(scorer, tmp / SCORER_FILE, meta={**meta, "fingerprint": fingerprint})
        (tmp / ADAPTER_META_FILE).write_text(text + "\n", encoding="utf-8")

    atomic_dir(path, write)
    return path
