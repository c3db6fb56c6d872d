"""What differs between the transformers versions kvpop runs on: 5.19 (vLLM 0.32 pins
``transformers<5.20``) to the newest.

transformers renamed the keyword that passes a ``Cache`` to a model's ``forward`` and to
``generate`` from ``past_key_values`` to ``cache``. An older version silently ignores ``cache=``
(the model then builds its own dense cache, and a ``KVpopCache`` is never used), and a newer one
warns on ``past_key_values=``; :func:`cache_kwargs` passes it under the name the installed version
takes. Activation checkpointing likewise: :func:`enable_checkpointing` calls
``activation_checkpointing_enable`` where it exists (the old ``gradient_checkpointing_enable`` warns
there that it goes in v6) and the old name on 5.19, which has only that one. And peft (0.21) still
reads ``model.is_gradient_checkpointing`` whenever it wraps a model, which newer transformers answer
with a FutureWarning: :func:`quiet_peft_wrap` silences exactly that one around the wrap, so loading
an adapter bundle (the default of ``kvpop generate``) prints nothing a user has to act on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Iterator


@functools.cache
def cache_arg() -> str:
    """``"cache"`` where the installed transformers takes that keyword, else ``"past_key_values"``."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``model(ids, **cache_kwargs(cache))`` / ``model.generate(..., **cache_kwargs(cache))``."""
    return {cache_arg(): cache}


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant), under the name the
    installed transformers takes (a peft model passes the call on to its base model)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """Silence transformers' deprecation warning for ``is_gradient_checkpointing``, which peft reads
    while wrapping a model (peft's call, not ours; every other warning passes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning
        )
        yield
