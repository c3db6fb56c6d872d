"""Undoing RoPE on cached keys, so a scorer sees what a key *is*, not where it sits.

Cached keys carry their rotary position: a slowly rotating pair of dimensions encodes the
absolute index almost linearly, so a scorer fed post-RoPE keys learns scores that drift with
position (trained at positions < 4k, used at 8k). Rotating each key back by its known position
gives the pre-RoPE key, identical for the same content anywhere in the sequence.

transformers applies ``k' = (k * cos + rotate_half(k) * sin) * a`` with ``cos``/``sin`` of
``position * inv_freq`` (concatenated twice) and an attention scaling ``a`` (1 for plain RoPE,
other values for YaRN/LongRoPE); the inverse is ``k = (k' * cos - rotate_half(k') * sin) / a``.
The frequencies come from the model config through transformers' own RoPE initialisers, so
every RoPE type those support is undone the same way the model applied it (dynamic NTK, which
changes the frequencies with the sequence length, uses its initial frequencies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import text_config


@dataclass(frozen=True)
class RopeSpec:
    """Inverse frequencies ``[head_dim // 2]`` and the attention scaling of a model's RoPE."""

    inv_freq: Tensor
    scaling: float = 1.0

    @classmethod
    def from_config(cls, config) -> RopeSpec:
        text = text_config(config)
        params = dict(getattr(text, "rope_parameters", None) or {})
        layer_type = None
        if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the full layers' RoPE,
            layer_type, params = "full_attention", dict(params["full_attention"])  # what a KVpop cache holds
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            base = float(params.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return cls(inv, 1.0)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope_type {rope_type!r} in the model config; cannot undo its RoPE")
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, None, **({"layer_type": layer_type} if layer_type else {}))
        return cls(inv.float(), float(scaling))

    def unrotate(self, keys: Tensor, positions: Tensor) -> Tensor:
        """Pre-RoPE keys of post-RoPE ``keys [b, h, T, d]`` at ``positions [b, T]`` or ``[T]``.

        Padding positions (negative) are clamped to 0: their keys are ignored anyway.
        """
        pos = positions.clamp(min=0)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        return unrotate(keys, pos, self.inv_freq.to(keys.device), self.scaling)


def unrotate(keys: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float = 1.0) -> Tensor:
    """``keys [b, h, T, d]`` rotated back by ``positions [b, T]`` (float32 math, as the model's RoPE)."""
    rot = 2 * inv_freq.numel()
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)  # [b, T, d/2]
    emb = torch.cat((freqs, freqs), -1).unsqueeze(1)  # [b, 1, T, rot]
    cos, sin = emb.cos(), emb.sin()
    k = keys.float()
    kr, rest = k[..., :rot], k[..., rot:]
    half = rot // 2
    rotated_half = torch.cat((-kr[..., half:], kr[..., :half]), -1)
    out = kr * cos - rotated_half * sin
    if scaling != 1.0:
        out = out / scaling
    return torch.cat((out, rest), -1) if rest.shape[-1] else out
