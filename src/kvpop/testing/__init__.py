"""What the tests build on: tiny models, and the plain references (oracles) that every fast path
of kvpop is held to. Runtime code never imports this package (``tests/unit/test_layout.py``).

- :mod:`.models`: tiny random models, a tiny tokenizer, a tiny GGUF file, a random learned policy.
- :mod:`.rule`: the window-exit rule token by token, the pairwise and exit-by-exit chunk
  deciders, the teacher's labels by brute force.
- :mod:`.observed`: the observed-attention statistics by their definition.
- :mod:`.reference`: :class:`MaskedReference`, a dense model that masks evicted tokens.
"""

from .models import (
    ARCHS,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    compile_unavailable,
    embedded_config,
    random_learned_policy,
    save_tiny_model,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
    write_tiny_gguf,
    write_word_docs,
)

__all__ = [
    "ARCHS",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "compile_unavailable",
    "embedded_config",
    "random_learned_policy",
    "save_tiny_model",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
    "write_tiny_gguf",
    "write_word_docs",
]
