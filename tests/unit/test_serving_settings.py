"""The vLLM plugin's switch, ``additional_config["kvpop"]``: parsed and checked without vLLM."""

import pytest

from kvpop import KVpopCache
from kvpop.serving.vllm.settings import ServeSettings, SettingsError
from kvpop.testing import tiny_config


def test_absent_key_is_plugin_off():
    assert ServeSettings.from_additional_config({}) is None
    assert ServeSettings.from_additional_config(None) is None
    assert ServeSettings.from_additional_config({"other": 1}) is None


@pytest.mark.parametrize(
    "raw, words",
    [
        ("512", ["must be a dict"]),
        ({"budget": 64, "windw": 8}, ["unknown key", "windw", "window"]),
        ({"budget": 64, "policy": "dense"}, ["'policy'", "leave the kvpop key out"]),
        ({"budget": 64, "policy": "oracle"}, ["'policy'", "not a servable policy"]),
        ({"budget": 64, "policy": "nope"}, ["'policy'", "streaming"]),
        ({"budget": 64, "policy": "h2o", "scorer": "x.safetensors"}, ["'scorer'", "h2o"]),
        ({"budget": 64, "policy": "h2o", "seed": 1}, ["'seed'", "random"]),
    ],
)
def test_bad_settings_name_the_key(raw, words):
    with pytest.raises(SettingsError) as err:
        ServeSettings.from_additional_config({"kvpop": raw})
    msg = str(err.value)
    assert "additional_config['kvpop']" in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize(
    "raw, word",
    [
        ({"budget": 0}, "budget"),
        ({"budget": 16, "window": 20, "policy": "streaming"}, "window"),
        ({"policy": "h2o"}, "budget"),
        ({"budget": 64, "policy": "kvpop-mlstm", "scorer": "/nonexistent/s.safetensors"}, "s.safetensors"),
        ({"budget": 64}, "no shipped mlp scorer fits this model"),
    ],  # the default policy, on a model without a scorer
)
def test_budget_errors_from_the_cache_name_the_config(raw, word):
    settings = ServeSettings.from_additional_config({"kvpop": raw})
    with pytest.raises(SettingsError, match=r"additional_config\['kvpop'\]") as err:
        settings.build_cache(tiny_config())
    assert word in str(err.value)


def test_build_cache_is_kvpop_cache_and_leaves_the_config_alone():
    cfg = tiny_config()
    before = cfg._attn_implementation
    for raw in (
        {"budget": 64, "policy": "h2o"},
        {"budget": 64, "policy": "streaming", "sinks": 2},
        {"k": 10, "window": 8, "policy": "knorm", "lam": 0.5},
        {"budget": 64, "policy": "random", "seed": 3},
    ):
        settings = ServeSettings.from_additional_config({"kvpop": raw})
        cache = settings.build_cache(cfg)
        kw = {k: v for k, v in raw.items() if k not in ("policy", "seed")}
        want = KVpopCache(tiny_config(), policy=raw["policy"], **({"seed": raw["seed"]} if "seed" in raw else {}), **kw)
        assert cache.eviction == want.eviction and type(cache.policy) is type(want.policy)
        assert len(cache.layers) == cfg.num_hidden_layers
    assert cfg._attn_implementation == before  # the served model's config is not routed through kvpop


def _engine_config(**over):
    """A stand-in for vLLM's VllmConfig: only what the plugin's engine check reads."""
    from types import SimpleNamespace as NS

    cfg = NS(
        model_config=NS(hf_config=tiny_config()),
        speculative_config=None,
        cache_config=NS(cache_dtype="auto", enable_prefix_caching=False),
        parallel_config=NS(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        kv_transfer_config=None,
        lora_config=None,
    )
    for key, value in over.items():
        obj, _, attr = key.rpartition(".")
        setattr(getattr(cfg, obj) if obj else cfg, attr, value)
    return cfg


def test_engine_options_kvpop_cannot_serve_are_refused_together():
    from kvpop.serving.vllm import check_engine

    settings = ServeSettings.from_additional_config({"kvpop": {"budget": 32, "policy": "h2o"}})
    check_engine(_engine_config(), settings)  # plain: fine
    bad = _engine_config(
        **{
            "speculative_config": object(),
            "cache_config.cache_dtype": "fp8",
            "parallel_config.tensor_parallel_size": 2,
            "lora_config": object(),
            "kv_transfer_config": object(),
        }
    )
    with pytest.raises(SettingsError) as err:
        check_engine(bad, settings)
    msg = str(err.value)
    for word in ("speculative decoding", "kv_cache_dtype='fp8'", "tensor_parallel_size=2", "LoRA", "KV transfer"):
        assert word in msg, msg
    with pytest.raises(SettingsError, match="budget"):  # the settings against the model, too
        check_engine(_engine_config(), ServeSettings.from_additional_config({"kvpop": {"budget": 0}}))
