"""Scorer checkpoints: one safetensors file (weights + JSON config in its metadata), written atomically.

A checkpoint records the scorer config, what it was trained for (budget, window, sinks,
corpora, steps) and a fingerprint of the base model (architecture, layer/head/dim sizes, RoPE
parameters, vocabulary, and hashes of the weights), so using it with another model is a
clear error rather than a silent quality loss. The config part is checked whenever a learned
policy meets a model config (every ``KVpopCache``), the weight hash whenever the model itself
is at hand (``kvpop.generate``, ``make_cache``, the CLI). Files are written to a temporary name in the same
folder and renamed
into place: a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import TrainedSettings, attention_shape, text_config
from .files import atomic_write
from .scorers import ScorerConfig, ScorerStack, build_scorer

FORMAT = "kvpop-scorer-v1"
ASSETS = Path(__file__).parent / "assets" / "scorers"
DEFAULT_SCORERS = {
    "mlstm": ASSETS / "smollm2-135m-instruct-mlstm.safetensors",
    "mlp": ASSETS / "smollm2-135m-instruct-mlp.safetensors",
}
# the embedded model adapted to its bounded cache (kvpop adapt): LoRA adapter + the mLSTM scorer trained with it
DEFAULT_ADAPTER = ASSETS.parent / "adapters" / "smollm2-135m-instruct-kvpop"


class ScorerMismatchError(ValueError):
    """The scorer was trained for a different base model."""


WEIGHTS_KEY = "weights_sha256"
WEIGHTS_BF16_KEY = "weights_bf16_sha256"
WEIGHTS_SAMPLED_KEY = "weights_sampled_bf16_sha256"
SAMPLE_STRIDE = 1021  # every parameter, every 1021st value (a prime: the samples walk across rows and columns)


def _jsonable(x):
    return json.loads(json.dumps(x, sort_keys=True, default=str))


def config_fingerprint(config) -> dict[str, Any]:
    """What a scorer depends on that the model's config alone tells: architecture, layer/head/dim
    sizes, RoPE parameters and vocabulary (no weights needed)."""
    cfg = text_config(config)
    shape = attention_shape(cfg)
    rope = getattr(cfg, "rope_parameters", None)
    if rope is None:  # older configs
        rope = {"rope_theta": getattr(cfg, "rope_theta", None), "rope_scaling": getattr(cfg, "rope_scaling", None)}
    return {
        "model_type": cfg.model_type,
        "num_layers": shape.num_layers,
        "q_heads": int(cfg.num_attention_heads),
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(cfg.vocab_size),
        "rope": _jsonable(rope),
    }


def model_fingerprint(model) -> dict[str, Any]:
    """:func:`config_fingerprint` plus hashes of the base model's weights.

    :data:`WEIGHTS_SAMPLED_KEY`: the bfloat16 bit patterns of every parameter (every layer's
    projections, norms, embeddings, LM head), every :data:`SAMPLE_STRIDE`-th value, so a model
    fine-tuned in any layer (or with LoRA merged into projections other than ``k_proj``) is another
    model; 132k values for SmolLM2-135M (measured: ~13 ms on one CPU thread, against ~0.5 ms for the narrow hashes
    alone). Older checkpoints record only
    the narrow hashes of the first 4,096 values of layer 0's ``k_proj`` and of the embeddings, as
    float32 rounded to 5 decimals (:data:`WEIGHTS_KEY`) and as bfloat16 bit patterns
    (:data:`WEIGHTS_BF16_KEY`); both are still computed, so those checkpoints keep matching.
    bfloat16 bit patterns are what a float32 model and its bfloat16 copy share, so a scorer trained
    on one fits the other. Names are read through a ``peft`` wrapper (``base_model.model.``
    prefix, ``.base_layer``; the LoRA weights themselves are left out), so a model with unmerged
    LoRA adapters has its base model's fingerprint: the adapters do not change the base weights a
    scorer was trained on.
    """
    h, h16, hall = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    samples = []  # one conversion and one copy for all of them (per-parameter calls cost more than the work)
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        flat = p.detach().reshape(-1)
        x = flat[::SAMPLE_STRIDE]
        hall.update(f"{name}:{x.numel()};".encode())
        samples.append(x if not samples or x.device == samples[0].device else x.to(samples[0].device))
        if name.endswith(("layers.0.self_attn.k_proj.weight", "embed_tokens.weight")):
            x = flat[:4096]
            h.update(name.encode())
            h.update(x.float().cpu().numpy().round(5).tobytes())
            h16.update(name.encode())
            h16.update(x.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    if samples:
        all_bf16 = (
            torch.cat([x.to(torch.bfloat16) for x in samples])
            if len({x.dtype for x in samples}) > 1
            else torch.cat(samples).to(torch.bfloat16)
        )
        hall.update(all_bf16.view(torch.int16).cpu().numpy().tobytes())
    return {
        **config_fingerprint(model.config),
        WEIGHTS_KEY: h.hexdigest()[:16],
        WEIGHTS_BF16_KEY: h16.hexdigest()[:16],
        WEIGHTS_SAMPLED_KEY: hall.hexdigest()[:16],
    }


def fingerprint_diff(want: dict[str, Any], got: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields where a checkpoint's fingerprint (``want``) and this model's (``got``) disagree. A
    field the checkpoint does not record is not a mismatch; equal bfloat16 weight hashes (the narrow
    or the sampled one) mean the same weights, so the float32 hash (which changes with the dtype the
    model is loaded in) is not compared then."""
    same_bf16 = any(key in want and want.get(key) == got.get(key) for key in (WEIGHTS_BF16_KEY, WEIGHTS_SAMPLED_KEY))
    skip = {WEIGHTS_KEY} if same_bf16 else set()
    return {
        k: (want[k], got[k]) for k in want if k in got and k not in skip and _jsonable(want[k]) != _jsonable(got[k])
    }


def check_fingerprint(want: dict[str, Any] | None, source, *, config=None, model=None) -> None:
    """Raise :class:`ScorerMismatchError` if a scorer trained for ``want`` does not fit this model.

    The config part is checked against ``config`` (or ``model.config``); the weight hash only when
    ``model`` is given. A field the checkpoint does not record (older checkpoints have only the
    architecture, layer count, KV heads, head dim and weight hash) is not a mismatch.
    """
    if not want:
        return
    if model is not None:
        got = model_fingerprint(model)
    elif config is not None:
        got = config_fingerprint(config)
    else:
        return
    diff = fingerprint_diff(want, got)
    if diff:
        details = ", ".join(f"{k}: trained {a!r} vs this model {b!r}" for k, (a, b) in diff.items())
        raise ScorerMismatchError(f"scorer {source} was trained for a different model ({details})")


def scorer_writer(scorer: ScorerStack, meta: dict[str, Any] | None = None):
    """``write(path)`` that saves ``scorer`` with ``meta`` as a checkpoint file (for
    :func:`kvpop.files.atomic_writes`, which writes it with other files as one checkpoint)."""
    header = {"format": FORMAT, "config": scorer.config.to_dict(), "meta": meta or {}}
    tensors = {k: v.detach().contiguous().cpu() for k, v in scorer.state_dict().items()}
    metadata = {"kvpop": json.dumps(header)}  # fails before writing anything if meta is not JSON
    return lambda path: save_file(tensors, path, metadata=metadata)


def save_scorer(scorer: ScorerStack, path: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    atomic_write(path, scorer_writer(scorer, meta))
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


def scorer_kind(path: str | os.PathLike) -> str:
    """``"mlp"`` or ``"mlstm"``: the kind of the scorer in a checkpoint (from its header only)."""
    kind = read_header(path).get("config", {}).get("kind")
    if kind not in DEFAULT_SCORERS:
        raise ValueError(f"{path}: unknown scorer kind {kind!r}")
    return kind


def load_scorer(path: str | os.PathLike, model=None, config=None) -> tuple[ScorerStack, dict[str, Any]]:
    """Load a scorer; refuse one trained for a different base model.

    With ``model``: its config fingerprint and weight hash are checked; with only ``config``: the
    config fingerprint (see :func:`check_fingerprint`)."""
    header = read_header(path)
    meta = header.get("meta", {})
    check_fingerprint(meta.get("fingerprint"), path, config=config, model=model)
    scorer = build_scorer(ScorerConfig.from_dict(header["config"]))
    state = read_tensors(path)
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    bad = next((k for k, v in floats.items() if not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise ValueError(
            f"{path}: tensor {bad!r} holds NaN or infinite values; the checkpoint is corrupt (a "
            "diverged run?): use an earlier checkpoint"
        )
    if floats and not any(bool(v.any()) for v in floats.values()):
        raise ValueError(f"{path}: every weight is zero; this is not a trained scorer")
    scorer.load_state_dict(state)
    return scorer.eval(), meta


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; an unreadable (truncated, corrupt) file is one ``ValueError``."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc


def default_adapter_path() -> Path:
    """The shipped adapter bundle of the embedded model (``kvpop.load_model(adapter="default")``)."""
    if not (DEFAULT_ADAPTER / "kvpop_adapter.json").is_file():
        raise FileNotFoundError(
            f"no shipped adapter bundle at {DEFAULT_ADAPTER}; make one with `kvpop adapt --out DIR` and pass "
            "adapter=DIR/best"
        )
    return DEFAULT_ADAPTER


def shipped_scorers(kind: str, config=None) -> list[Path]:
    """Every shipped ``kind`` scorer for the model of ``config`` (None: the embedded default model): its
    default first, then those trained for other budget ranges.

    The default is ``assets/scorers/<model>-<kind>.safetensors``, the one whose recorded config fingerprint
    matches ``config``, so a scorer shipped for another embedded model is picked up by its file alone; a
    scorer for other budgets sits beside it as ``<model>-<kind>-b<lo>-<hi>.safetensors`` (its budget range
    is read from its header, not its name). No default is a :class:`ScorerMismatchError` (or, for the
    embedded model, ``FileNotFoundError``) that says what to do.
    """
    if kind not in DEFAULT_SCORERS:
        raise ValueError(f"scorer kind must be one of {sorted(DEFAULT_SCORERS)}, got {kind!r}")
    if config is None:
        primary = DEFAULT_SCORERS[kind]
        if not primary.is_file():
            raise FileNotFoundError(
                f"no shipped {kind} scorer at {primary}; train one with `kvpop train --kind {kind} --out DIR` "
                "and pass --scorer DIR/scorer.safetensors"
            )
        return [primary, *sorted(primary.parent.glob(f"{primary.stem}-b*-*.safetensors"))]
    want = config_fingerprint(config)

    def fits(path: Path) -> bool:
        recorded = read_header(path).get("meta", {}).get("fingerprint") or {}
        return not fingerprint_diff({k: v for k, v in recorded.items() if k in want}, want)

    shipped = sorted(ASSETS.glob(f"*-{kind}.safetensors"))
    primary = next((p for p in shipped if fits(p)), None)
    if primary is None:
        names = ", ".join(p.stem for p in shipped) or "none"
        raise ScorerMismatchError(
            f"no shipped {kind} scorer fits this model: the shipped ones ({names}) were trained for a different "
            f"model (this one: {want['model_type']}, {want['num_layers']} layers, {want['kv_heads']} KV heads); "
            "train one (docs/training.md) and pass --scorer, or use a heuristic policy (streaming, tova, h2o, snapkv)"
        )
    return [primary, *(p for p in sorted(ASSETS.glob(f"{primary.stem}-b*-*.safetensors")) if fits(p))]


def trained_budget_range(path: str | os.PathLike) -> tuple[int, int] | None:
    """The budgets a scorer checkpoint was trained over (from its header; None: it does not say)."""
    trained = TrainedSettings.from_meta(read_header(path).get("meta", {}).get("trained_for"))
    return None if trained is None else trained.budget_range


def scorer_for_budget(paths: list[Path], budget: int | None) -> Path:
    """Which of a model's shipped scorers (default first, :func:`shipped_scorers`) serves a cache of ``budget``.

    The default, unless ``budget`` lies outside the budgets it was trained over: then the scorer trained
    over the narrowest range that holds ``budget``, or, when none does, the one whose range is nearest
    (in ratio). A scorer is only as good as the budgets it saw, and one trained on small budgets alone
    keeps what a small cache needs better than one whose training spread over every budget."""
    primary = paths[0]
    if budget is None or len(paths) == 1:
        return primary
    ranges = {p: trained_budget_range(p) for p in paths}
    if ranges[primary] is None or ranges[primary][0] <= budget <= ranges[primary][1]:
        return primary

    def distance(p: Path) -> tuple[float, float]:
        lo, hi = ranges[p] or (0, 0)
        if lo <= budget <= hi:
            return 0.0, math.log(hi / lo)
        return (math.inf if not lo else abs(math.log(budget / (lo if budget < lo else hi)))), 0.0

    return min(paths, key=distance)  # min keeps the first (the default) on a tie


def default_scorer_path(kind: str, config=None, budget: int | None = None) -> Path:
    """The shipped ``kind`` scorer for the model of ``config`` (None: the embedded default model) at a cache
    of ``budget`` slots per KV head (None: the model's default scorer): :func:`scorer_for_budget` over
    :func:`shipped_scorers`."""
    return scorer_for_budget(shipped_scorers(kind, config), budget)
