"""Tiny random models, a tiny tokenizer and a tiny GGUF file, built offline (for tests).

Everything here is built locally (no hub access) and is small enough to run on a CPU in
milliseconds. Other test files in the project import these helpers; keep the signatures stable.

- :func:`tiny_config` / :func:`tiny_model`: a 2-layer GQA decoder of one of :data:`ARCHS`.
- :func:`tiny_tokenizer`: a byte-level BPE tokenizer over printable ASCII, with special tokens
  ``<pad>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos), ``<unk>``=3, ``<|im_start|>``=4, ``<|im_end|>``=5,
  left padding and a ChatML chat template.
- :func:`save_tiny_model`: save a tiny model + tokenizer as a Hugging Face folder.
- :func:`write_tiny_gguf`: write a tiny Llama model + tokenizer as an F32 GGUF file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
HYBRID_ARCHS = ("gemma3",)  # sliding-window and full-attention layers (tiny_config("gemma3"))

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")
# A few merges so the BPE is not purely byte-level; the merged tokens are part of the vocabulary.
_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"))

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _config_class(arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma3": Gemma3TextConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS + HYBRID_ARCHS}")
    return classes[arch]


def tiny_config(
    arch: str = "llama",
    num_hidden_layers: int | None = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    vocab_size: int = 128,
    max_position_embeddings: int = 4096,
    **overrides: Any,
):
    """A tiny config of ``arch`` (one of :data:`ARCHS`), with SDPA attention and no sliding window;
    or of ``"gemma3"`` (:data:`HYBRID_ARCHS`): 4 layers by default, sliding (window 8) and full
    attention alternating, ``sliding, full, sliding, full``.

    ``overrides`` are passed to the config class (e.g. ``tie_word_embeddings=True``,
    ``attn_implementation="eager"``, ``rope_parameters={...}``).
    """
    cls = _config_class(arch)
    if num_hidden_layers is None:
        num_hidden_layers = 4 if arch == "gemma3" else 2
    kwargs: dict[str, Any] = {
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
    }
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
        kwargs["sliding_window"] = None
    if arch == "gemma3":
        kwargs.update(
            sliding_window=8,
            query_pre_attn_scalar=head_dim,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)],
        )
    kwargs.update(overrides)
    attn = kwargs.pop("attn_implementation", None)
    config = cls(**kwargs)
    if attn is not None:
        config._attn_implementation = attn
    return config


# the shapes of the embedded models that have scorers shipped for them (configs only, no weights)
_EMBEDDED_SHAPES = {
    "smollm2-135m-instruct": ("llama", 30, 9, 3, 576, 1536, 49152, 100000.0, 8192),
    "qwen2.5-coder-0.5b": ("qwen2", 24, 14, 2, 896, 4864, 151936, 1000000.0, 32768),
}


def embedded_config(name: str):
    """The config (no weights) of an embedded model with shipped scorers (:data:`_EMBEDDED_SHAPES`): what
    tests need to check that a model of that shape picks its own shipped scorer."""
    arch, layers, heads, kv, hidden, inter, vocab, theta, positions = _EMBEDDED_SHAPES[name]
    return _config_class(arch)(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_size=hidden,
        intermediate_size=inter,
        vocab_size=vocab,
        rope_theta=theta,
        max_position_embeddings=positions,
    )


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any):
    """A randomly initialised tiny causal LM of ``arch`` (seeded, eval mode, on CPU)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if arch == "gemma3":  # its norms start at zero (a scale of 1): every key would have the same norm, ties everywhere
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.5)
    return model.eval()


def compile_unavailable(reason: str) -> None:
    """Skip a compile test where no compiler works here, but fail it under CI (``CI=true``), which
    has one: there a skip would let a broken compile path pass unnoticed."""
    import pytest

    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"no working compiler under CI=true: {reason}")
    pytest.skip(f"no working compiler here: {reason}")


def random_learned_policy(model, kind: str = "mlstm", extra: bool = False, seed: int = 7, cross_heads: bool = False):
    """A ``LearnedPolicy`` with a seeded random-init scorer for ``model`` (tests). ``extra``: the
    scorer also undoes RoPE, reads observed attention (windows None, 4, 1) and has a random tilt;
    ``cross_heads`` (MLP): each head reads every KV head's features of the token."""
    from ..config import attention_shape
    from ..policies import LearnedPolicy
    from ..rope import RopeSpec
    from ..scorers import ScorerConfig, build_scorer

    text = model.config
    cfg = ScorerConfig(
        kind=kind,
        num_layers=len(attention_shape(text).bounded),
        kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        seed=seed,
        position_free=extra,
        observed=(None, 4, 1) if extra else (),
        tilt=extra,
        cross_heads=cross_heads,
    )
    scorer = build_scorer(cfg)
    if extra:
        scorer.set_rope(RopeSpec.from_config(text))
        with torch.no_grad():
            scorer.tilt_theta.uniform_(0.0, 3.0, generator=torch.Generator().manual_seed(3))
    return LearnedPolicy(scorer)


def _tiny_vocab(vocab_size: int) -> list[str]:
    """Tokens in id order: specials, byte-level printable ASCII (+ space, newline, tab), merges, fillers."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    chars = [spell[b] for b in [9, 10, 32, *range(33, 127)]]
    merged = [a + b for a, b in _MERGES]
    tokens = [*_SPECIAL_TOKENS, *chars, *merged]
    if vocab_size < len(tokens):
        raise ValueError(f"tiny_tokenizer needs vocab_size >= {len(tokens)}, got {vocab_size}")
    # transformers' GGUF byte-level tokenizer adds "<|endoftext|>" if it is missing; keep it in-vocab.
    fillers = ["<|endoftext|>", *(f"<extra_{i}>" for i in range(vocab_size))]
    return tokens + fillers[: vocab_size - len(tokens)]


def tiny_tokenizer(vocab_size: int = 128):
    """A byte-level BPE ``PreTrainedTokenizerFast`` over printable ASCII, built offline.

    Exactly ``vocab_size`` tokens (>= 108). Round-trips ASCII text (tab, newline, printable);
    other characters become ``<unk>``. Does not add bos/eos automatically. Left padding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = _tiny_vocab(vocab_size)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=list(_MERGES), unk_token="<unk>")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(path: str | os.PathLike, arch: str = "llama", **kw: Any):
    """Save ``tiny_model(arch, **kw)`` and a matching ``tiny_tokenizer`` to ``path``; return the model."""
    model = tiny_model(arch, **kw)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return model


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (HF rotate-half layout -> GGUF interleaved layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    name: str = "kvpop tiny llama",
    **config_overrides: Any,
):
    """Write a tiny Llama model (F32 weights) + :func:`tiny_tokenizer` as a GGUF file at ``path``.

    Returns the in-memory reference model whose weights were written, so tests can compare the
    logits of a model loaded from the file against it. Only ``arch="llama"`` is supported (the
    layout transformers' GGUF loader reads for Llama: ``token_embd``, ``blk.N.attn_q``, ...,
    Q/K rows permuted the llama.cpp way). ``tie_word_embeddings=True`` omits ``output.weight``.
    """
    import gguf
    import numpy as np

    if arch != "llama":
        raise ValueError(f"write_tiny_gguf only writes arch='llama', got {arch!r}")
    model = tiny_model(arch, seed=seed, **config_overrides)
    cfg = model.config
    tokenizer = tiny_tokenizer(cfg.vocab_size)
    tokens = _tiny_vocab(cfg.vocab_size)
    rope_theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    n_special = len(_SPECIAL_TOKENS)
    metadata = {  # GGUFWriter.add_<name>(value), in this order
        "name": name,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "head_count": cfg.num_attention_heads,
        "head_count_kv": cfg.num_key_value_heads,
        "rope_dimension_count": head_dim,
        "rope_freq_base": rope_theta,
        "layer_norm_rms_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "file_type": gguf.LlamaFileType.ALL_F32,
        "tokenizer_model": "gpt2",
        "tokenizer_pre": "default",
        "token_list": tokens,
        "token_types": [gguf.TokenType.CONTROL] * n_special + [gguf.TokenType.NORMAL] * (len(tokens) - n_special),
        "token_merges": [f"{a} {b}" for a, b in _MERGES],
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "unk_token_id": tokenizer.unk_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)

    sd = {k: v.detach().float() for k, v in model.state_dict().items()}

    def add(gguf_name: str, t: torch.Tensor) -> None:
        writer.add_tensor(gguf_name, np.ascontiguousarray(t.numpy().astype(np.float32)))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(
            f"blk.{i}.attn_q.weight",
            _llama_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
        )
        add(
            f"blk.{i}.attn_k.weight",
            _llama_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
        )
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


TINY_WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into", "green", "hills")
TINY_WORDS += ("and", "old", "trees")


def write_word_docs(folder, n_docs: int = 30, n_words: int = 300, seed: int = 0):
    """``n_docs`` text files ``d00.txt``.. of ``n_words`` random words from :data:`TINY_WORDS` (a tiny corpus the
    tiny tokenizer covers, for `kvpop train --docs-from` and its kin); returns ``folder``."""
    import random
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n_docs):
        (folder / f"d{i:02d}.txt").write_text(" ".join(rng.choice(TINY_WORDS) for _ in range(n_words)))
    return folder
