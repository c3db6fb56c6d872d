"""kvpop.rope (undoing RoPE on cached keys) and kvpop.observed (observed-attention statistics)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpop.observed import observed_attention, observed_features
from kvpop.rope import RopeSpec
from kvpop.testing import tiny_model
from kvpop.testing.observed import observed_attention_reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_unrotate_inverts_the_models_rope(arch):
    model = tiny_model(arch)
    c = model.config
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, c.num_key_value_heads, 37, c.head_dim, generator=g)
    pos = torch.stack([torch.arange(37) + 5000, torch.arange(37) * 3])
    cos, sin = model.model.rotary_emb(k, pos)
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    assert (k_rot - k).abs().max() > 1e-2
    back = RopeSpec.from_config(c).unrotate(k_rot, pos)
    torch.testing.assert_close(back, k, rtol=1e-4, atol=1e-4)


def test_unrotate_with_scaled_rope():
    model = tiny_model(
        "llama",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    spec = RopeSpec.from_config(model.config)
    assert spec.scaling != 1.0
    k = torch.randn(1, model.config.num_key_value_heads, 9, model.config.head_dim)
    pos = torch.arange(9).view(1, -1) * 50
    cos, sin = model.model.rotary_emb(k, pos)
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(spec.unrotate(k_rot, pos), k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window,sinks,block", [(5, 2, 4), (8, 0, 64), (3, 4, 7)])
def test_observed_attention_blocked_equals_reference(window, sinks, block):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 29, 8, generator=g)
    k = torch.randn(2, 3, 29, 8, generator=g)
    obs = (None, 2, 1, 50)
    got = observed_attention(q, k, window, sinks, obs, block=block)
    ref = observed_attention_reference(q, k, window, sinks, obs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert got[:, :, :sinks].abs().max() == 0 if sinks else True
    # the whole-window statistic sums the last `window` queries: >= any shorter one
    assert (got[..., 0] + 1e-6 >= got[..., 1]).all() and (got[..., 1] + 1e-6 >= got[..., 2]).all()
    feats = observed_features(got, window, obs)
    assert feats.shape == got.shape and torch.isfinite(feats).all()


def test_observed_attention_rejects_bad_windows():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="window"):
        observed_attention(q, k, 0, 1)
    with pytest.raises(ValueError, match="observation windows"):
        observed_attention(q, k, 3, 1, (0,))


@pytest.mark.parametrize("windows,sinks,block", [((3, 5, 11), 2, 4), ((1, 8, 64), 0, 16), ((4, 6), 4, 7)])
def test_observed_attention_for_several_windows_equals_reference(windows, sinks, block):
    """One pass over the queries serves every window (the capture records one per window of the grid)."""
    from kvpop.observed import observed_attention_windows

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 41, 8, generator=g)
    k = torch.randn(2, 3, 41, 8, generator=g)
    obs = (None, 2, 1)
    got = observed_attention_windows(q, k, windows, sinks, obs, block=block)
    for w in windows:
        torch.testing.assert_close(got[w], observed_attention_reference(q, k, w, sinks, obs), rtol=1e-5, atol=1e-6)
