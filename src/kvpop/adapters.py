"""LoRA adapters for the LLM (method.md section 5, "Adapting the LLM"), via ``peft``.

The joint stage fine-tunes the LLM with a KL loss: the student is the model attending under
the eviction mask (:func:`kvpop.mask.masked_eviction`), the teacher the same base model
attending densely. With LoRA both live in one model: the adapter on is the student,
:func:`teacher_mode` (peft's ``disable_adapter``) is the base model, bit for bit.

An *adapter bundle* is a folder::

    adapter_config.json, adapter_model.safetensors   the peft adapter (save_pretrained)
    scorer.safetensors                               optional scorer (kvpop.checkpoint.save_scorer)
    kvpop_adapter.json                               format, base-model fingerprint, user metadata

It is written to a temporary folder next to the destination and swapped into place in one step
(:func:`kvpop.files.atomic_dir`), so a failed or killed save leaves the old or the new bundle at
the path, never none. Loading it onto a base model other than the one
it was trained on raises :class:`AdapterMismatchError`.

A server that takes no LoRA layers (vLLM with kvpop) loads a bundle merged into a copy of its base
model: :mod:`kvpop.serving.merged`.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .checkpoint import fingerprint_diff, load_scorer, model_fingerprint, read_tensors, save_scorer
from .compat import quiet_peft_wrap
from .files import atomic_dir

__all__ = [
    "ADAPTER_META_FILE",
    "DEFAULT_LORA_TARGETS",
    "SCORER_FILE",
    "AdapterBundle",
    "AdapterMismatchError",
    "add_lora",
    "base_fingerprint",
    "check_adapter_bundle",
    "load_adapter_bundle",
    "lora_config",
    "read_bundle_meta",
    "save_adapter_bundle",
    "set_adapter_weights",
    "teacher_mode",
]

FORMAT = "kvpop-adapter-v1"
ADAPTER_META_FILE = "kvpop_adapter.json"
SCORER_FILE = "scorer.safetensors"
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the scorer of a merged folder: in a subfolder, since a server reads every top-level *.safetensors as weights


class AdapterMismatchError(ValueError):
    """The adapter bundle was trained on a different base model."""


class AdapterBundle(NamedTuple):
    """What :func:`load_adapter_bundle` returns: the adapted model, the bundled scorer (or None), the metadata."""

    model: Any
    scorer: Any
    meta: dict


def _peft():
    try:
        import peft
    except ImportError as exc:  # declared dependency; say what to do if it is missing
        raise ImportError("kvpop adapters need peft: pip install peft") from exc
    return peft


def _is_peft(model) -> bool:
    return isinstance(model, _peft().PeftModel)


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
    return _peft().LoraConfig(
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
    if _is_peft(model):
        raise TypeError("model already carries a peft adapter")
    with quiet_peft_wrap():
        return _peft().get_peft_model(model, config if config is not None else lora_config())


def set_adapter_weights(peft_model, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy saved adapter weights (the names of ``adapter_model.safetensors``) into ``peft_model``'s active
    adapter (peft's ``set_peft_model_state_dict``, its warnings silenced); returns the keys it had no place for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _peft().set_peft_model_state_dict(peft_model, tensors)
    return list(getattr(result, "unexpected_keys", []) or [])


@contextlib.contextmanager
def teacher_mode(model) -> Iterator[Any]:
    """Run the base model (the distillation teacher) from an adapted one: the adapter is off inside.

    ``model`` must be a ``peft`` model with its adapter not merged (merged weights cannot be
    switched off). Outside the context the adapter is on (the student).
    """
    if not _is_peft(model):
        raise TypeError(
            "teacher_mode needs a peft model (kvpop.adapters.add_lora or load_adapter_bundle with merge=False)"
        )
    with model.disable_adapter():
        yield model


@contextlib.contextmanager
def base_model(model, frozen=None) -> Iterator[Any]:
    """The base model (the teacher of ``kvpop adapt``): ``frozen`` if given (a full fine-tune keeps a
    frozen copy), else ``model`` with its adapter off (:func:`teacher_mode`)."""
    if frozen is not None:
        yield frozen
    else:
        with teacher_mode(model):
            yield model


def base_fingerprint(model) -> dict[str, Any]:
    """``kvpop.checkpoint.model_fingerprint`` of the base model; it reads through a peft wrapper
    (unmerged LoRA weights do not change the base weights)."""
    return model_fingerprint(model)


# --------------------------------------------------------------------------------------------
# bundles
# --------------------------------------------------------------------------------------------


def save_adapter_bundle(peft_model, scorer=None, path: str | os.PathLike = "adapter", meta: dict | None = None) -> Path:
    """Write an adapter bundle to the folder ``path`` (atomically; see the module doc).

    ``peft_model``: a ``peft`` model (its adapters are saved with ``save_pretrained``).
    ``scorer``: an optional ``ScorerStack`` trained with it. ``meta``: JSON-serialisable metadata
    (budget, window, sinks, lam, steps, ...), stored with the base model's fingerprint. An
    existing folder at ``path`` is replaced only if it is a kvpop adapter bundle.
    """
    if not _is_peft(peft_model):
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
    if _is_peft(model):
        raise TypeError("load_adapter_bundle needs the plain base model; this one already carries a peft adapter")
    diff = fingerprint_diff(header.get("fingerprint", {}), base_fingerprint(model))
    if diff:
        details = ", ".join(f"{k}: trained {a!r} vs this model {b!r}" for k, (a, b) in diff.items())
        raise AdapterMismatchError(f"adapter bundle {path} was trained on a different base model ({details})")
    was_training = model.training
    with quiet_peft_wrap():
        peft_model = _peft().PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    if not trainable and not was_training:
        peft_model.eval()
    out = peft_model.merge_and_unload() if merge else peft_model
    scorer = None
    if header.get("scorer"):
        scorer, _ = load_scorer(path / header["scorer"])
    return AdapterBundle(out, scorer, header)
