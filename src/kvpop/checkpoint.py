"""Scorer checkpoints: one safetensors file (weights + JSON config in its metadata), written atomically.

A checkpoint records the scorer config, what it was trained for (budget, window, sinks,
corpora, steps) and a fingerprint of the base model (architecture, layer/head counts and a
hash of a few weights), so loading it onto another model is a clear error rather than a
silent quality loss. Files are written to a temporary name in the same folder and renamed
into place: a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from .config import attention_shape
from .scorers import ScorerConfig, ScorerStack, build_scorer

FORMAT = "kvpop-scorer-v1"
ASSETS = Path(__file__).parent / "assets" / "scorers"
DEFAULT_SCORERS = {"mlstm": ASSETS / "smollm2-135m-instruct-mlstm.safetensors", "mlp": ASSETS / "smollm2-135m-instruct-mlp.safetensors"}


class ScorerMismatchError(ValueError):
    """The scorer was trained for a different base model."""


def model_fingerprint(model) -> dict[str, Any]:
    """Architecture, sizes and a hash of a few weights of the base model."""
    cfg = model.config.get_text_config(decoder=True)
    shape = attention_shape(cfg)
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if name.endswith(("layers.0.self_attn.k_proj.weight", "embed_tokens.weight")):
            h.update(name.encode())
            h.update(p.detach().float().flatten()[:4096].cpu().numpy().round(5).tobytes())
    return {
        "model_type": cfg.model_type,
        "num_layers": shape.num_layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "weights_sha256": h.hexdigest()[:16],
    }


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename over ``path`` (same folder, so the rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a checkpoint should be as readable as any file
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_scorer(scorer: ScorerStack, path: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    header = {"format": FORMAT, "config": scorer.config.to_dict(), "meta": meta or {}}
    tensors = {k: v.detach().contiguous().cpu() for k, v in scorer.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"kvpop": json.dumps(header)}))
    return path


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no scorer checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("kvpop")
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    if raw is None:
        raise ValueError(f"{path} is a safetensors file but not a kvpop scorer (no 'kvpop' metadata)")
    header = json.loads(raw)
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown scorer format {header.get('format')!r}, expected {FORMAT!r}")
    return header


def load_scorer(path: str | os.PathLike, model=None) -> tuple[ScorerStack, dict[str, Any]]:
    """Load a scorer; with ``model``, refuse one trained for a different base model."""
    header = read_header(path)
    meta = header.get("meta", {})
    if model is not None and "fingerprint" in meta:
        want, got = meta["fingerprint"], model_fingerprint(model)
        diff = {k: (want.get(k), got.get(k)) for k in want if want.get(k) != got.get(k)}
        if diff:
            details = ", ".join(f"{k}: trained {a!r} vs this model {b!r}" for k, (a, b) in diff.items())
            raise ScorerMismatchError(f"scorer {path} was trained for a different model ({details})")
    scorer = build_scorer(ScorerConfig.from_dict(header["config"]))
    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    scorer.load_state_dict(state)
    return scorer.eval(), meta


def default_scorer_path(kind: str) -> Path:
    if kind not in DEFAULT_SCORERS:
        raise ValueError(f"scorer kind must be one of {sorted(DEFAULT_SCORERS)}, got {kind!r}")
    path = DEFAULT_SCORERS[kind]
    if not path.is_file():
        raise FileNotFoundError(
            f"no shipped {kind} scorer at {path}; train one with `kvpop train --scorer {kind} --out DIR` "
            "and pass --scorer DIR/scorer.safetensors"
        )
    return path
