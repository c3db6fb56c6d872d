"""LoRA adapter bundles: round trip, base-model check, atomic writes, teacher/student, gradients under the mask."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import kvpop
from kvpop.adapt.config import DEFAULT_LORA_TARGETS
from kvpop.adapt.lora import add_lora, lora_config, save_adapter_bundle
from kvpop.bundle import (
    ADAPTER_META_FILE,
    SCORER_FILE,
    AdapterMismatchError,
    base_fingerprint,
    load_adapter_bundle,
    read_bundle_meta,
    teacher_mode,
)
from kvpop.checkpoint import model_fingerprint
from kvpop.compat import cache_kwargs
from kvpop.mask import learned_priority_fn, masked_eviction
from kvpop.policies import LearnedPolicy
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import save_tiny_model, tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)

IDS = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:40].view(1, 40)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _scorer(seed=3):
    return build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16, seed=seed))


def _adapted(seed=0, r=4):
    """A tiny Llama with a LoRA adapter whose B matrices are random (a fresh adapter is the identity)."""
    model = add_lora(tiny_model("llama", seed=seed), lora_config(r=r))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_lora_config_defaults():
    cfg = lora_config()
    assert set(cfg.target_modules) == set(DEFAULT_LORA_TARGETS)
    assert (cfg.r, cfg.lora_alpha) == (16, 32.0)
    cfg = lora_config(r=4, alpha=1.0, targets="q_proj, v_proj")
    assert set(cfg.target_modules) == {"q_proj", "v_proj"} and cfg.lora_alpha == 1.0
    with pytest.raises(ValueError):
        lora_config(r=0)


def test_add_lora_freezes_base_and_teacher_mode_is_the_base_model():
    base = _logits(tiny_model("llama"))
    model = _adapted()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    student = _logits(model)
    assert (student - base).abs().max() > 1e-3
    with teacher_mode(model):
        assert torch.equal(_logits(model), base)
    assert torch.equal(_logits(model), student)  # the adapter is back on
    assert base_fingerprint(model) == model_fingerprint(tiny_model("llama"))
    with pytest.raises(TypeError), teacher_mode(tiny_model("llama")):
        pass


def test_bundle_round_trip(tmp_path):
    model = _adapted()
    scorer = _scorer()
    want = _logits(model)
    path = save_adapter_bundle(model, scorer, tmp_path / "bundle", {"budget": 20, "window": 6})
    names = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", SCORER_FILE, ADAPTER_META_FILE} <= names
    meta = read_bundle_meta(path)
    assert meta["meta"] == {"budget": 20, "window": 6}
    assert meta["fingerprint"] == model_fingerprint(tiny_model("llama"))

    got, sc, meta2 = load_adapter_bundle(tiny_model("llama"), path)
    assert meta2 == meta
    assert torch.equal(_logits(got), want)
    assert not got.training
    for a, b in zip(sc.state_dict().values(), scorer.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with teacher_mode(got):
        assert torch.equal(_logits(got), _logits(tiny_model("llama")))

    merged = load_adapter_bundle(tiny_model("llama"), path, merge=True).model
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged), want, rtol=1e-5, atol=1e-5)

    # without a scorer
    p2 = save_adapter_bundle(model, None, tmp_path / "no_scorer")
    assert not (p2 / SCORER_FILE).exists()
    assert load_adapter_bundle(tiny_model("llama"), p2).scorer is None


def test_wrapping_and_loading_print_no_peft_deprecation_warning(tmp_path):
    """peft reads ``is_gradient_checkpointing`` when it wraps a model; newer transformers warns on it.
    Adding a LoRA and loading a bundle (what ``kvpop generate`` does by default) must stay quiet."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = save_adapter_bundle(_adapted(), _scorer(), tmp_path / "bundle")
        load_adapter_bundle(tiny_model("llama"), path, merge=True)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_wrong_base_model_refused(tmp_path):
    path = save_adapter_bundle(_adapted(), None, tmp_path / "bundle")
    other = tiny_model("llama", seed=1)
    with pytest.raises(AdapterMismatchError, match="different base model"):
        load_adapter_bundle(other, path)
    assert not any("lora_" in n for n, _ in other.named_parameters())  # refused before touching it
    with pytest.raises(AdapterMismatchError, match="num_layers"):
        load_adapter_bundle(tiny_model("llama", num_hidden_layers=3), path)
    assert issubclass(AdapterMismatchError, ValueError)
    with pytest.raises(TypeError):
        load_adapter_bundle(_adapted(), path)


def test_save_is_atomic(tmp_path, monkeypatch):
    first = _adapted()
    path = save_adapter_bundle(first, _scorer(), tmp_path / "bundle", {"run": 1})
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    second = add_lora(tiny_model("llama"), lora_config(r=2))

    def broken(self, save_directory, **kw):
        with open(f"{save_directory}/adapter_model.safetensors", "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(type(second), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        save_adapter_bundle(second, None, path, {"run": 2})
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no temp folder left behind
    with pytest.raises(TypeError):  # meta must be JSON: fails before anything is written
        save_adapter_bundle(first, None, path, {"bad": object()})
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    monkeypatch.undo()

    # a successful save replaces the bundle
    save_adapter_bundle(second, None, path, {"run": 2})
    assert read_bundle_meta(path)["meta"] == {"run": 2}
    assert not (path / SCORER_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]

    # a folder that is not a bundle is never replaced
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        save_adapter_bundle(second, None, other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_lora_gradients_under_masked_eviction():
    model = _adapted()
    scorer = _scorer()
    fn = learned_priority_fn(scorer, 6, 0.01)
    with teacher_mode(model):
        teacher = _logits(model)  # dense base model
    model.train()
    with masked_eviction(model, fn, sinks=2, window=6, k=12):
        student = model(input_ids=IDS, use_cache=False).logits
    loss = torch.nn.functional.kl_div(
        torch.log_softmax(student, -1), torch.log_softmax(teacher, -1), log_target=True, reduction="batchmean"
    )
    loss.backward()
    lora = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(g is not None and torch.isfinite(g).all() for g in lora.values())
    assert sum(float(g.abs().sum()) for n, g in lora.items() if "lora_A" in n) > 0
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is None for p in scorer.parameters())
    # the adapted model under the mask is the adapted model under the physical cache
    model.eval()
    with torch.no_grad():
        cache = kvpop.KVpopCache(model.config, budget=20, window=6, sinks=2, policy=LearnedPolicy(scorer), lam=0.01)
        ref = model(input_ids=IDS, **cache_kwargs(cache), use_cache=True).logits
    torch.testing.assert_close(student.detach(), ref, rtol=1e-5, atol=1e-5)


def test_load_model_with_adapter(tmp_path):
    save_tiny_model(tmp_path / "base", seed=0)
    base, _ = kvpop.load_model(tmp_path / "base", progress=False)
    adapted = _adapted()
    want = _logits(adapted)
    save_adapter_bundle(adapted, _scorer(), tmp_path / "bundle", {"note": "x"})

    model, _ = kvpop.load_model(tmp_path / "base", adapter=tmp_path / "bundle", progress=False)
    assert torch.equal(_logits(model), want)
    assert model.kvpop_adapter.meta["meta"] == {"note": "x"}
    assert model.kvpop_adapter.scorer is not None
    assert not any("mlp.w1" in n or n.endswith(".w1") for n, _ in model.named_parameters())
    with teacher_mode(model):
        assert torch.equal(_logits(model), _logits(base))
    json.dumps(model.kvpop_adapter.meta)

    merged, _ = kvpop.load_model(tmp_path / "base", adapter=tmp_path / "bundle", merge=True, progress=False)
    torch.testing.assert_close(_logits(merged), want, rtol=1e-5, atol=1e-5)

    save_tiny_model(tmp_path / "other", seed=5)
    with pytest.raises(AdapterMismatchError):
        kvpop.load_model(tmp_path / "other", adapter=tmp_path / "bundle", progress=False)
    with pytest.raises(ValueError, match="adapter"):
        kvpop.load_model(tmp_path / "base", merge=True, progress=False)


def test_a_scorer_for_the_base_model_serves_the_adapted_model(tmp_path):
    """LoRA leaves the base weights alone: the adapted model keeps its base model's fingerprint, so
    ``make_cache(adapted_model, "kvpop-mlstm", path=...)`` accepts a scorer trained for the base model."""
    from kvpop.checkpoint import save_scorer

    base, model = tiny_model("llama"), _adapted()
    assert model_fingerprint(model) == model_fingerprint(base)
    cfg = ScorerConfig(kind="mlstm", num_layers=2, kv_heads=2, head_dim=16)
    path = save_scorer(build_scorer(cfg), tmp_path / "s.safetensors", {"fingerprint": model_fingerprint(base)})
    cache = kvpop.make_cache(model, "kvpop-mlstm", path=path, budget=16, window=4)
    assert cache.budget == 16
    with torch.no_grad():  # a merged adapter changes the base weights: that is another model
        model.get_base_model().model.layers[0].self_attn.k_proj.base_layer.weight.add_(0.1)
    assert model_fingerprint(model) != model_fingerprint(base)


# --------------------------------------------------------------------------------------------
# a broken bundle's JSON names its file


@pytest.fixture
def shipped_copy(tmp_path):
    """A copy of the shipped adapter bundle, to break."""
    from kvpop.checkpoint import default_adapter_path

    return Path(shutil.copytree(default_adapter_path(), tmp_path / "bundle"))


@pytest.mark.parametrize("name", [ADAPTER_META_FILE, "adapter_config.json"])
@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]"])
def test_invalid_bundle_json_is_one_line_naming_the_file(shipped_copy, name, text):
    from kvpop.bundle import check_adapter_bundle

    (shipped_copy / name).write_text(text)
    for read in (check_adapter_bundle, lambda p: kvpop.load_model(adapter=p, progress=False)):
        with pytest.raises(ValueError) as err:  # before any model loads
            read(shipped_copy)
        msg = str(err.value)
        assert str(shipped_copy / name) in msg and "\n" not in msg and "corrupt" in msg, msg


def test_generate_with_a_broken_bundle_prints_one_line(shipped_copy, capsys):
    from kvpop.cli import main

    (shipped_copy / "adapter_config.json").write_text("{")
    assert main(["generate", "--adapter", str(shipped_copy), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvpop: error: ") and str(shipped_copy / "adapter_config.json") in err[-1], err


# --------------------------------------------------------------------------------------------
# merged model folders


def test_merged_model_folder_is_the_adapted_model_written_once(tmp_path, kvpop_cache, monkeypatch):
    from kvpop.checkpoint import load_scorer, read_tensors
    from kvpop.serving import merged as merging

    save_tiny_model(tmp_path / "base", seed=0)
    adapted = _adapted()
    want = _logits(adapted)
    save_adapter_bundle(adapted, _scorer(), tmp_path / "bundle", {"note": "x"})

    out = merging.merged_model_folder(tmp_path / "base", tmp_path / "bundle", progress=False)
    assert out.parent == kvpop_cache / "models" and (out / merging.MERGED_MARKER).is_file()
    model, _ = kvpop.load_model(out, progress=False)  # a plain folder: no peft, no bundle
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)
    assert not hasattr(model.config, "kvpop_adapter") and not hasattr(model, "kvpop_adapter")
    assert not any("lora" in n for n, _ in model.named_parameters())
    # vLLM reads every top-level *.safetensors of a model folder as weights: the scorer is in a subfolder
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    scorer, _ = load_scorer(out / merging.MERGED_SCORER)
    assert all(torch.equal(a, b) for a, b in zip(scorer.state_dict().values(), _scorer().state_dict().values()))
    marker = json.loads((out / merging.MERGED_MARKER).read_text())
    assert marker["bundle_key"] == merging.bundle_key(tmp_path / "bundle") and marker["meta"] == {"note": "x"}

    # reused, not merged again; the same bundle elsewhere (another install) is the same folder
    shutil.copytree(tmp_path / "bundle", tmp_path / "elsewhere" / "bundle")
    with monkeypatch.context() as m:  # (not monkeypatch.undo(): that would drop the kvpop_cache fixture's setenv)
        m.setattr(merging, "save_merged_model", lambda *a: pytest.fail("merged twice"))
        assert merging.merged_model_folder(tmp_path / "base", tmp_path / "bundle", progress=False) == out
        assert merging.merged_model_folder(tmp_path / "base", tmp_path / "elsewhere" / "bundle", progress=False) == out

    # a changed bundle: a new folder
    save_adapter_bundle(_adapted(r=2), _scorer(), tmp_path / "bundle", {"note": "y"})
    other = merging.merged_model_folder(tmp_path / "base", tmp_path / "bundle", progress=False)
    assert other != out and other.parent == out.parent and (other / merging.MERGED_MARKER).is_file()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        read_tensors(other / "model.safetensors")[name], read_tensors(out / "model.safetensors")[name]
    )


def test_a_failed_merge_leaves_no_folder(tmp_path, kvpop_cache, monkeypatch):
    from kvpop.serving import merged as merging

    save_tiny_model(tmp_path / "base", seed=0)
    save_adapter_bundle(_adapted(), _scorer(), tmp_path / "bundle")
    real_copy = merging.shutil.copyfile

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merging.shutil, "copyfile", full_disk)
    with pytest.raises(OSError, match="No space"):
        merging.merged_model_folder(tmp_path / "base", tmp_path / "bundle", progress=False)
    assert [p.name for p in (kvpop_cache / "models").iterdir()] == []  # no folder, no temp folder
    monkeypatch.setattr(merging.shutil, "copyfile", real_copy)
    out = merging.merged_model_folder(tmp_path / "base", tmp_path / "bundle", progress=False)
    assert (out / merging.MERGED_MARKER).is_file()

    save_tiny_model(tmp_path / "other", seed=5)
    with pytest.raises(AdapterMismatchError):  # before anything is written
        merging.merged_model_folder(tmp_path / "other", tmp_path / "bundle", progress=False)
    assert len(list((kvpop_cache / "models").iterdir())) == 1
