"""What differs between the transformers versions kvpop runs on: 5.19 (vLLM 0.32 pins
``transformers<5.20``) to the newest.

transformers renamed the keyword that passes a ``Cache`` to a model's ``forward`` and to
``generate`` from ``past_key_values`` to ``cache``. An older version silently ignores ``cache=``
(the model then builds its own dense cache, and a ``KVpopCache`` is never used), and a newer one
warns on ``past_key_values=``; :func:`cache_kwargs` passes it under the name the installed version
takes.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def cache_arg() -> str:
    """``"cache"`` where the installed transformers takes that keyword, else ``"past_key_values"``."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``model(ids, **cache_kwargs(cache))`` / ``model.generate(..., **cache_kwargs(cache))``."""
    return {cache_arg(): cache}
