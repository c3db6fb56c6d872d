"""Adapter bundles: what loading and serving an adapted model needs (method.md section 5, "Adapting the LLM").

An *adapter bundle* is a folder::

    adapter_config.json, adapter_model.safetensors   the peft adapter (save_pretrained)
    scorer.safetensors                               optional scorer (kvpop.checkpoint.save_scorer)
    kvpop_adapter.json                               format, base-model fingerprint, user metadata

:func:`kvpop.adapt.lora.save_adapter_bundle` writes one (``kvpop adapt``); this module reads, checks and loads
it. Loading it onto a base model other than the one it was trained on raises :class:`AdapterMismatchError`.
With the adapter loaded unmerged, :func:`teacher_mode` (peft's ``disable_adapter``) is the base model, bit for
bit.

A server that takes no LoRA layers (vLLM with kvpop) loads a bundle merged into a copy of its base
model: :mod:`kvpop.serving.merged`.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .checkpoint import fingerprint_diff, load_scorer, model_fingerprint, read_tensors
from .compat import quiet_peft_wrap

__all__ = [
    "ADAPTER_FILES",
    "ADAPTER_META_FILE",
    "FORMAT",
    "SCORER_FILE",
    "AdapterBundle",
    "AdapterMismatchError",
    "base_fingerprint",
    "check_adapter_bundle",
    "is_peft_model",
    "load_adapter_bundle",
    "peft_module",
    "read_bundle_meta",
    "set_adapter_weights",
    "teacher_mode",
]

FORMAT = "kvpop-adapter-v1"
ADAPTER_META_FILE = "kvpop_adapter.json"
SCORER_FILE = "scorer.safetensors"


class AdapterMismatchError(ValueError):
    """The adapter bundle was trained on a different base model."""


class AdapterBundle(NamedTuple):
    """What :func:`load_adapter_bundle` returns: the adapted model, the bundled scorer (or None), the metadata."""

    model: Any
    scorer: Any
    meta: dict


def peft_module():
    """The ``peft`` package (a declared dependency; a missing one is an ``ImportError`` that says what to do)."""
    try:
        import peft
    except ImportError as exc:  # declared dependency; say what to do if it is missing
        raise ImportError("kvpop adapters need peft: pip install peft") from exc
    return peft


def is_peft_model(model) -> bool:
    """Whether ``model`` carries a peft adapter (a ``peft.PeftModel``)."""
    return isinstance(model, peft_module().PeftModel)


def set_adapter_weights(peft_model, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy saved adapter weights (the names of ``adapter_model.safetensors``) into ``peft_model``'s active
    adapter (peft's ``set_peft_model_state_dict``, its warnings silenced); returns the keys it had no place for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = peft_module().set_peft_model_state_dict(peft_model, tensors)
    return list(getattr(result, "unexpected_keys", []) or [])


@contextlib.contextmanager
def teacher_mode(model) -> Iterator[Any]:
    """Run the base model (the distillation teacher) from an adapted one: the adapter is off inside.

    ``model`` must be a ``peft`` model with its adapter not merged (merged weights cannot be
    switched off). Outside the context the adapter is on (the student).
    """
    if not is_peft_model(model):
        raise TypeError(
            "teacher_mode needs a peft model (kvpop.adapt.lora.add_lora or load_adapter_bundle with merge=False)"
        )
    with model.disable_adapter():
        yield model


def base_fingerprint(model) -> dict[str, Any]:
    """``kvpop.checkpoint.model_fingerprint`` of the base model; it reads through a peft wrapper
    (unmerged LoRA weights do not change the base weights)."""
    return model_fingerprint(model)


def _read_json_object(f: Path) -> dict[str, Any]:
    """A bundle's JSON file as a dict; a broken one is one line naming the file (json's own error names none)."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{f} is not valid JSON ({exc}); the adapter bundle is corrupt") from exc
    if not isinstance(data, dict):  # a corrupt file, as above (callers catch ValueError)
        kind = type(data).__name__
        raise ValueError(f"{f} holds a JSON {kind}, not an object; the adapter bundle is corrupt")  # noqa: TRY004
    return data


def read_bundle_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``kvpop_adapter.json`` of a bundle (format checked)."""
    path = Path(path)
    f = path / ADAPTER_META_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a kvpop adapter bundle (no {ADAPTER_META_FILE})")
    header = _read_json_object(f)
    if header.get("format") != FORMAT:
        raise ValueError(f"{f}: unknown adapter bundle format {header.get('format')!r}, expected {FORMAT!r}")
    return header


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what peft's save_pretrained writes


def check_adapter_bundle(path: str | os.PathLike) -> dict[str, Any]:
    """The bundle's ``kvpop_adapter.json``, after checking that its files are there and readable and
    its weights finite, so a broken bundle is one clear error before any model is loaded or touched
    (peft would look for a missing file on the Hugging Face hub, and a truncated one raises a raw
    ``SafetensorError``). The bundled scorer is checked when it loads (:func:`kvpop.checkpoint.load_scorer`)."""
    path = Path(path)
    header = read_bundle_meta(path)
    for name in ADAPTER_FILES:
        if not (path / name).is_file():
            raise FileNotFoundError(f"adapter bundle {path} has no {name}; it is incomplete (copy the whole folder)")
    _read_json_object(path / ADAPTER_FILES[0])  # peft would raise json's bare "Expecting value ..."
    tensors = read_tensors(path / ADAPTER_FILES[1])
    bad = next((k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise ValueError(f"adapter bundle {path}: tensor {bad!r} holds NaN or infinite values; the bundle is corrupt")
    if header.get("scorer") and not (path / header["scorer"]).is_file():
        raise FileNotFoundError(f"adapter bundle {path} names a scorer {header['scorer']} that is not there")
    return header


def load_adapter_bundle(
    model, path: str | os.PathLike, *, merge: bool = False, trainable: bool = False
) -> AdapterBundle:
    """Put the bundle's adapter onto ``model`` (the plain base model; modified in place).

    Returns ``AdapterBundle(model, scorer, meta)``: ``model`` is a ``peft`` model (adapter on;
    :func:`teacher_mode` turns it off), or with ``merge=True`` the plain model with the LoRA
    weights merged into its base weights (faster inference, no teacher). ``scorer`` is the
    bundled ``ScorerStack`` or ``None``; ``meta`` the bundle's ``kvpop_adapter.json``.
    ``trainable=True`` loads the adapter for further training. Raises
    :class:`AdapterMismatchError` (before touching the model) if the bundle was trained on a
    different base model.
    """
    path = Path(path)
    header = check_adapter_bundle(path)
    if is_peft_model(model):
        raise TypeError("load_adapter_bundle needs the plain base model; this one already carries a peft adapter")
    diff = fingerprint_diff(header.get("fingerprint", {}), base_fingerprint(model))
    if diff:
        details = ", ".join(f"{k}: trained {a!r} vs this model {b!r}" for k, (a, b) in diff.items())
        raise AdapterMismatchError(f"adapter bundle {path} was trained on a different base model ({details})")
    was_training = model.training
    with quiet_peft_wrap():
        peft_model = peft_module().PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    if not trainable and not was_training:
        peft_model.eval()
    out = peft_model.merge_and_unload() if merge else peft_model
    scorer = None
    if header.get("scorer"):
        scorer, _ = load_scorer(path / header["scorer"])
    return AdapterBundle(out, scorer, header)
