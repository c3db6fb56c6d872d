"""kvpop on every transformers it supports: 5.19 (vLLM 0.32's pin) to the newest."""

import torch

from kvpop import KVpopCache
from kvpop.compat import cache_arg, cache_kwargs
from kvpop.testing import tiny_model


def test_a_cache_passed_by_kvpop_reaches_the_model():
    """transformers < 5.2x silently ignores ``cache=`` (the model then makes its own dense cache):
    ``cache_kwargs`` passes the cache under the keyword the installed version takes."""
    model = tiny_model()
    ids = torch.arange(3, 23).view(1, -1)
    forward, generate = (KVpopCache(model.config, budget=12, window=4, policy="streaming") for _ in range(2))
    with torch.no_grad():
        model(ids, **cache_kwargs(forward))
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, **cache_kwargs(generate))
    assert forward.get_seq_length() == ids.shape[1]
    assert generate.get_seq_length() == ids.shape[1] + 2  # the prompt and the new tokens but the last
    assert cache_arg() in ("cache", "past_key_values")
