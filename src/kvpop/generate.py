"""``kvpop.generate``: one call from prompt to text under a bounded cache.

It validates everything (policy, budget, padding side, position limit) before the model
runs, builds the cache with :func:`kvpop.make_cache`, calls ``model.generate`` with it, and
reports how many KV bytes were held against what a dense cache would have held, and how long
the prompt (prefill) and the new tokens (decode) took.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from .cache import KVpopCache, make_cache
from .compat import cache_kwargs
from .config import BudgetArgs
from .models import kv_bytes_at
from .policies import DENSE, POLICIES, Policy
from .validate import check_int, check_prompts

# generate() options that crop the cache after verifying draft tokens (transformers' assisted decoding)
CROPPING = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer")


@dataclass
class GenerationResult:
    texts: list[str]
    sequences: torch.Tensor  # prompt + generated ids
    new_tokens: int
    cache: KVpopCache | None
    kv_bytes: int  # bytes of keys/values held at the end
    dense_kv_bytes: int  # what a dense cache would hold for the same tokens
    prompt_tokens: int = 0  # per row, padding included
    prefill_s: float | None = None  # prompt forward + first token (None when not measured, e.g. beams)
    decode_s: float | None = None  # the remaining new_tokens - 1 steps
    compile_status: str | None = None  # the cache's decode step: "compiled", "eager", ... (None: dense)

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.prompt_tokens * self.sequences.shape[0] / self.prefill_s if self.prefill_s else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = self.new_tokens - 1
        return steps * self.sequences.shape[0] / self.decode_s if self.decode_s and steps > 0 else None


class _StepTimer(BaseStreamer):
    """Times generation through the streamer hooks: the prompt is put before the prefill, then one
    put per new token; the first new token marks the end of the prefill."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def put(self, value) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        self.marks.append(time.perf_counter())

    def phases(self) -> tuple[float | None, float | None]:
        if len(self.marks) < 3:
            return None, None
        return self.marks[1] - self.marks[0], self.marks[-1] - self.marks[1]


def dense_kv_bytes(config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """What the model's own cache holds for ``batch`` sequences of ``tokens`` (sliding layers: their window)."""
    return kv_bytes_at(config, tokens, dtype) * batch


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt: str | list[str],
    *,
    policy: str | Policy | None = None,
    max_new_tokens: int = 128,
    chat: bool = False,
    allow_position_overflow: bool = False,
    compile: bool | None = None,
    policy_kwargs: dict | None = None,
    **kwargs,
) -> GenerationResult:
    """Generate from ``prompt`` (a string or a batch of strings) with a bounded KV cache.

    ``policy`` is a name from ``kvpop.POLICIES``, ``"dense"``, or a :class:`Policy`; the default
    (and ``"kvpop"``) is the model's default learned policy: the shipped MLP scorer (``"kvpop-mlp"``), or
    on a model loaded with an adapter bundle the policy its scorer serves (:func:`kvpop.policies.default_policy`).
    ``policy_kwargs`` go to the policy factory (e.g. ``{"path": "scorer.safetensors"}``). The budget is
    ``budget=B``, ``k=K`` (+ ``window``), or ``compression=r`` with ``reference_length=L`` (the keywords of
    :class:`kvpop.config.BudgetArgs`);
    ``window`` and the recency tilt ``lam`` default to what a learned scorer was trained with (else
    ``B / 2`` and 0). Any other keyword goes to ``model.generate``. ``chat=True``
    wraps each prompt in the tokenizer's chat template. ``compile`` (default: on, unless
    ``KVPOP_COMPILE=0``) compiles the cache's steady decode step (``KVpopCache(compile=...)``): a few
    seconds once, faster steps after; ``result.compile_status`` says which ran.
    """
    budget = BudgetArgs.pop_from(kwargs)
    generate_kwargs = kwargs
    if isinstance(policy, str) and policy != DENSE and policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {DENSE}, {', '.join(sorted(POLICIES))}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1, optional=False)
    if generate_kwargs.get("use_cache") is False and policy != DENSE:
        raise ValueError(
            "use_cache=False cannot run with a KVpop cache (the whole sequence would go through it at "
            "every step); drop it, or use policy='dense'"
        )
    cropping = [name for name in CROPPING if generate_kwargs.get(name) is not None]
    if cropping and policy != DENSE:
        raise ValueError(
            f"{cropping[0]} (assisted decoding / prompt lookup) rolls the cache back after rejected draft "
            "tokens, and a KVpop cache cannot be rolled back (evicted tokens are gone); drop it, or use "
            "policy='dense'"
        )
    prompts = check_prompts(prompt)
    if policy != DENSE:  # each budget argument alone, before anything is built (make_cache checks how they combine)
        budget = budget.checked()
    if len(prompts) > 1 and tokenizer.padding_side != "left":
        raise ValueError(
            f"batched prompts need tokenizer.padding_side='left' (got {tokenizer.padding_side!r}): "
            "the cache skips left padding so that padding never takes a slot"
        )
    cache = make_cache(model, policy, compile=compile, **asdict(budget), **(policy_kwargs or {}))
    if chat:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    enc = {name: t.to(model.device) for name, t in enc.items()}
    n_prompt = enc["input_ids"].shape[1]
    mask = enc.get("attention_mask")
    no_tokens = [i for i in range(len(prompts)) if n_prompt == 0 or (mask is not None and not bool(mask[i].any()))]
    if no_tokens:
        raise ValueError(
            f"prompt{'' if isinstance(prompt, str) else f' item {no_tokens[0]}'} has no tokens after "
            "tokenization; give some text"
        )
    total = n_prompt + max_new_tokens
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and total > limit and not allow_position_overflow:
        raise ValueError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's position limit max_position_embeddings={limit}; positions past it are untrained and give "
            "garbage. Shorten the request or pass allow_position_overflow=True."
        )
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    if cache is not None:
        generate_kwargs.update(cache_kwargs(cache))  # transformers 5.19 refuses cache=, it takes past_key_values=
    timer = None
    if "streamer" not in generate_kwargs and generate_kwargs.get("num_beams", 1) == 1:
        timer = generate_kwargs["streamer"] = _StepTimer()
    out = model.generate(**enc, max_new_tokens=max_new_tokens, **generate_kwargs)
    new = out[:, n_prompt:]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    dtype = next(model.parameters()).dtype
    seen = out.shape[1] - 1  # the last sampled token is never fed back
    dense = dense_kv_bytes(model.config, out.shape[0], seen, dtype)
    held = cache.kv_bytes() if cache is not None else dense
    prefill_s, decode_s = timer.phases() if timer is not None else (None, None)
    status = None if cache is None else cache.compile_status
    return GenerationResult(texts, out, new.shape[1], cache, held, dense, n_prompt, prefill_s, decode_s, status)
