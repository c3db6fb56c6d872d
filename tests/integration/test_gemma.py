"""Gemma 3 270M, the second real model (assembled from its PyPI chunk packages, converted once): it
loads, generates through the CLI under streaming and H2O with the whole cache bounded, equals its own
dense/sliding cache when the budget covers the sequence, and refuses SmolLM2's scorer."""

import warnings

import pytest
import torch
from transformers import DynamicCache

import kvpop
from kvpop.checkpoint import ScorerMismatchError
from kvpop.cli import main
from kvpop.compat import cache_kwargs
from kvpop.config import attention_shape

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gemma():
    try:
        return kvpop.load_model("gemma3-270m", progress=False)
    except kvpop.ModelLoadError as exc:  # the packages are part of the setup (scripts/setup.sh); say so loudly
        pytest.fail(f"Gemma 3 270M unavailable: {exc}")


def test_gemma_loads_as_a_hybrid_model(gemma):
    model, tok = gemma
    shape = attention_shape(model.config)
    assert model.config.model_type == "gemma3_text" and shape.num_layers == 18
    assert shape.bounded == (5, 11, 17) and shape.sliding_window == 512
    assert tok.padding_side == "left" and tok.pad_token is not None


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_cli_generates_with_the_whole_cache_bounded(gemma, policy, capsys):
    prompt = "The history of the Roman Empire"
    assert (
        main(
            [
                "generate",
                "--model",
                "gemma3-270m",
                "--policy",
                policy,
                "--budget",
                "64",
                "--prompt",
                prompt,
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert out.out.strip() and "sliding_layers=15 (window 512)" in out.err
    model, tok = gemma
    text = " ".join(["The Roman Empire grew from a city state into a power that ruled the Mediterranean."] * 40)
    res = kvpop.generate(model, tok, text, policy=policy, budget=64, max_new_tokens=4)
    seen = res.prompt_tokens + res.new_tokens - 1
    assert seen > 512  # past the sliding window too
    assert res.kv_bytes == kvpop.kv_bytes_at(model.config, seen, budget=64)
    assert res.cache.kv_bytes("sliding") == 15 * 2 * 511 * 256 * 4  # 15 layers x K and V x 511 tokens x 1 head x 256
    assert res.kv_bytes < res.dense_kv_bytes


def test_budget_at_least_length_equals_its_own_cache(gemma):
    model, tok = gemma
    ids = tok("The quick brown fox jumps over the lazy dog. " * 6, return_tensors="pt").input_ids[:, :64]
    with torch.no_grad():
        dense = DynamicCache(config=model.config)
        want = torch.cat(
            [model(ids[:, :48], **cache_kwargs(dense)).logits, model(ids[:, 48:], **cache_kwargs(dense)).logits], 1
        )
        cache = kvpop.KVpopCache(model.config, budget=80, window=16, policy="h2o")
        got = torch.cat(
            [model(ids[:, :48], **cache_kwargs(cache)).logits, model(ids[:, 48:], **cache_kwargs(cache)).logits], 1
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_smollm2_scorer_is_refused_on_gemma(gemma):
    model, _ = gemma
    for name in ("kvpop-mlstm", "kvpop-mlp"):
        with pytest.raises(ScorerMismatchError):
            kvpop.make_cache(model, name, budget=64)
