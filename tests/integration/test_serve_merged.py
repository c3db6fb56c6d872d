"""What ``kvpop serve`` serves by default is the model ``kvpop generate`` runs by default: the merged
folder (the shipped bundle's LoRA in the weights) under the settings the plugin gets gives the greedy
tokens of ``kvpop.load_model(adapter="default")`` with the same cache (real SmolLM2-135M-Instruct)."""

import warnings

import pytest
import torch

import kvpop
from kvpop.bundle import teacher_mode
from kvpop.checkpoint import default_adapter_path, read_tensors
from kvpop.compat import cache_kwargs
from kvpop.models import convert_gguf, default_gguf_path
from kvpop.serving.vllm.serve import prepare
from kvpop.serving.vllm.settings import KEY, ServeSettings

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.integration

BUDGET, NEW_TOKENS = 128, 16  # the prompt below: the 11th token differs from dense's, the 8th from the base model's


def linked_cache(cache, monkeypatch):
    """A fresh kvpop cache holding a link to the converted embedded model (converted once, in the user's
    cache, as every real-model test does): the merged folder goes to the fresh one."""
    converted = convert_gguf(default_gguf_path(), progress=False)
    (cache / "models").mkdir(parents=True)
    (cache / "models" / converted.name).symlink_to(converted)
    monkeypatch.setenv("KVPOP_CACHE_DIR", str(cache))
    return converted


@torch.no_grad()
def _greedy(model, ids, cache):
    out = model.generate(
        ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **cache_kwargs(cache)
    )
    return out[0, ids.shape[1] :].tolist()


def test_served_default_folder_equals_the_adapted_model(tmp_path, monkeypatch):
    from kvpop.data import load_documents

    converted = linked_cache(tmp_path / "cache", monkeypatch)
    plan = prepare(["--budget", str(BUDGET)], progress=False, need_vllm=False)
    assert plan.model.parent == tmp_path / "cache" / "models" and plan.settings["policy"] == "kvpop-mlp"
    assert plan.settings["scorer"] == str(plan.model / "kvpop" / "scorer.safetensors")
    assert [p.name for p in plan.model.glob("*.safetensors")] == ["model.safetensors"]  # vLLM reads these as weights
    name = "model.layers.3.mlp.down_proj.weight"  # the LoRA is in the weights
    assert not torch.equal(
        read_tensors(plan.model / "model.safetensors")[name], read_tensors(converted / "model.safetensors")[name]
    )
    assert prepare(["--budget", str(BUDGET)], progress=False, need_vllm=False).model == plan.model  # written once

    served, tok = kvpop.load_model(plan.model, progress=False)
    adapted, _ = kvpop.load_model(adapter="default", progress=False)
    assert adapted.kvpop_adapter.path == default_adapter_path()
    text = "\n\n".join(d.text for d in load_documents("wikipedia", "test")[:40])
    ids = torch.tensor([tok(text)["input_ids"][400:700]])

    # the cache the plugin builds from the served config (its build_cache works on a copy of the config, which
    # routes no model: the same arguments on the model's own config here)
    plugin = ServeSettings.from_additional_config({KEY: plan.settings}).build_cache(served.config)
    cache = kvpop.make_cache(served.config, plan.settings["policy"], budget=BUDGET, path=plan.settings["scorer"])
    assert cache.eviction == plugin.eviction
    got = _greedy(served, ids, cache)
    reference = kvpop.make_cache(adapted, budget=BUDGET)  # the bundle's policy and scorer
    assert reference.eviction == plugin.eviction and reference.policy.scorer.config == cache.policy.scorer.config
    want = _greedy(adapted, ids, reference)
    assert got == want
    assert want != _greedy(adapted, ids, None), "the budget does not matter here: the test would see nothing"
    with teacher_mode(adapted):  # the base model: serving it instead would fail the test
        assert want != _greedy(adapted, ids, kvpop.make_cache(adapted, budget=BUDGET))
