"""Dense masked reference for the bounded cache: the slow, obvious implementation.

It keeps *every* key in a transformers ``DynamicCache``, runs one token at a time, and keeps
per head a plain Python list of the long-range tokens, decided by the same rule as
``kvpop.testing.rule.reference_rule``. Attention masks exactly the tokens the rule evicted. It shares
only the policies with :class:`kvpop.KVpopCache`, so agreement between the two (logits and
held sets) checks the physical cache, the chunked prefill, the padding handling and the
observed-attention statistics at once. Batch size 1 only; it is for tests, not for speed.

A model with sliding-window layers: those attend densely over their own window (the last
``sliding_window`` tokens, written out here from the definition), the full-attention layers as
above, each with the policy's layer index among the full-attention layers.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface, DynamicCache

from ..attention import attention_implementation
from ..compat import cache_kwargs
from ..config import EvictionConfig, attention_shape
from ..policies import ExitBatch, Policy

NAME = "kvpop_reference"
_ACTIVE: list[MaskedReference] = []


class MaskedReference:
    """Token-by-token dense model with per-head eviction masks."""

    def __init__(self, model, eviction: EvictionConfig, policy: Policy):
        shape = attention_shape(model.config)
        self.model, self.cfg, self.policy = model, eviction, policy
        self.num_layers, self.kv_heads = shape.num_layers, shape.kv_heads
        self.bounded, self.sliding_window = shape.bounded, shape.sliding_window
        policy.validate(model.config, eviction)
        n = len(self.bounded)  # per-layer state below: by the policy's index (among the full-attention layers)
        self.states = [None] * n
        self.long_range = [[[] for _ in range(self.kv_heads)] for _ in range(n)]
        self.prio: list[dict[int, float]] = [{} for _ in range(n)]
        self.local_probs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # [h, t+1] per query
        self.t = -1

    def held(self, layer: int, head: int, t: int) -> set[int]:
        """The tokens model layer ``layer`` holds for ``head`` at step ``t``."""
        if layer not in self.bounded:  # a sliding layer: its own window
            return set(range(max(0, t - self.sliding_window + 1), t + 1))
        s, w = self.cfg.sinks, self.cfg.window
        lr = self.long_range[self.bounded.index(layer)][head]
        return set(range(min(s, t + 1))) | set(range(max(s, t - w + 1), t + 1)) | set(lr)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[1, T, vocab]`` of the sequence fed one token at a time."""
        if input_ids.shape[0] != 1:
            raise ValueError("MaskedReference runs batch size 1")
        cache = DynamicCache()  # every key of every layer (a sliding layer masks its window below)
        logits = []
        _ACTIVE.append(self)
        try:
            with attention_implementation(self.model, NAME):
                for i in range(input_ids.shape[1]):
                    self.t += 1
                    out = self.model(input_ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
                    logits.append(out.logits)
        finally:
            _ACTIVE.pop()
        return torch.cat(logits, dim=1)

    def attention(self, module, query, key, value, scaling):
        t = self.t
        s, w, k = self.cfg.sinks, self.cfg.window, self.cfg.k
        hq, h = query.shape[1], key.shape[1]
        g = hq // h
        q = query[0, :, 0].float().view(h, g, -1)  # [h, g, d]
        keys = key[0].float()  # [h, t+1, d]
        logits = torch.einsum("hgd,htd->hgt", q, keys) * scaling
        if module.layer_idx not in self.bounded:
            return self._attend(module.layer_idx, logits, value, query)
        layer = self.bounded.index(module.layer_idx)
        pos = torch.arange(t + 1)
        local = (pos < s) | (pos > t - w)
        p_local = torch.softmax(logits.masked_fill(~local, -math.inf), dim=-1).mean(1)  # [h, t+1]
        self.local_probs[layer].append(p_local)
        e = t - w
        if t == 0:
            self.states[layer] = self.policy.init_state(1, h, layer, query.device)
        if e >= s or self.policy.stateful:
            attention = None
            if self.policy.needs_attention and e >= s:
                stats = []
                for obs in self.policy.observation_windows(w):
                    rows = self.local_probs[layer][e + w - obs : e + w]
                    stats.append(torch.stack([r[:, e] for r in rows]).sum(0))
                attention = torch.stack(stats, -1).view(1, h, 1, -1)
            src = max(e, 0)
            batch = ExitBatch(
                layer_idx=layer,
                keys=key[:, :, src : src + 1],
                values=value[:, :, src : src + 1],
                index=torch.tensor([[e if e >= s else -1]]),
                new_keys=key[:, :, t : t + 1],
                new_values=value[:, :, t : t + 1],
                new_index=torch.tensor([[t]]),
                attention=attention,
                window=w,
            )
            self.states[layer], scores = self.policy.score(self.states[layer], batch)
            scores = scores.float().view(h) + self.cfg.lam * e
        if e >= s:
            for head in range(h):
                lr = self.long_range[layer][head]
                prio = self.prio[layer]

                def key_of(i, prio=prio, head=head):  # the rule's total order
                    return (prio[(head, i)], -i)

                prio[(head, e)] = scores[head].item()
                if len(lr) < k:
                    lr.append(e)
                elif k > 0:
                    worst = min(lr, key=key_of)
                    if key_of(e) > key_of(worst):
                        lr.remove(worst)
                        lr.append(e)
        return self._attend(module.layer_idx, logits, value, query)

    def _attend(self, layer: int, logits, value, query):
        """Attention of the step's query over the keys model layer ``layer`` holds."""
        t, hq, h = self.t, query.shape[1], value.shape[1]
        mask = torch.zeros(h, t + 1, dtype=torch.bool)
        for head in range(h):
            mask[head, sorted(self.held(layer, head, t))] = True
        scores_full = logits.masked_fill(~mask.view(h, 1, t + 1), -math.inf)
        probs = torch.softmax(scores_full, dim=-1)
        out = torch.einsum("hgt,htd->hgd", probs, value[0].float()).reshape(hq, 1, -1)
        return out.to(query.dtype).permute(1, 0, 2).unsqueeze(0), None  # [1, 1, hq, d]


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("kvpop_reference attention used outside MaskedReference.run")
    return _ACTIVE[-1].attention(module, query, key, value, scaling or query.shape[-1] ** -0.5)


AttentionInterface.register(NAME, _reference_attention)
