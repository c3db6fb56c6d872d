"""kvpop.scorers.average: the averaged MLP scores exactly the weighted mean of its members, on the
training path, the cache's read path and the fused decode path, and refuses members it cannot merge."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvpop.checkpoint import load_scorer, read_header, save_scorer
from kvpop.rope import RopeSpec
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.scorers.average import average_scorers

CFG = ScorerConfig(
    kind="mlp", num_layers=2, kv_heads=2, head_dim=16, hidden=8, position_free=True, observed=(None, 3, 1), tilt=True
)
ROPE = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)))


def _member(seed: int, hidden: int = 8):
    sc = build_scorer(dataclasses.replace(CFG, hidden=hidden, seed=seed))
    sc.set_rope(ROPE)
    with torch.no_grad():
        sc.tilt_theta.uniform_(-2.0, 3.0, generator=torch.Generator().manual_seed(seed))
        for layer in sc:  # non-zero output biases, so their averaging is tested too
            layer.b2.normal_(generator=torch.Generator().manual_seed(seed + 100))
    return sc.eval()


def _inputs(T=11, b=2):
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(b, 2, T, 16, generator=g), torch.randn(b, 2, T, 16, generator=g)
    return k, v, torch.rand(b, 2, T, 3, generator=g), torch.arange(200, 200 + T)


@torch.no_grad()
def test_average_scores_the_weighted_mean_on_every_path():
    members = [_member(1, 8), _member(2, 4), _member(3, 8)]
    weights = [1.0, 2.0, 1.0]
    merged = average_scorers(members, weights)
    assert merged.config.hidden == 20 and merged.config.kind == "mlp"
    a = torch.tensor(weights) / sum(weights)
    k, v, obs, pos = _inputs()
    for layer in range(2):
        want = sum(w * m.forward_layer(layer, k, v, 6, positions=pos, observed=obs) for w, m in zip(a, members))
        got = merged.forward_layer(layer, k, v, 6, positions=pos, observed=obs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got = merged.read(layer, None, k, v, positions=pos, observed=obs, window=6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the fused decode step (one new and one exiting token per row)
        k1, v1, o1 = k[:, :, :1], v[:, :, :1], obs[:, :, :1]
        t = torch.tensor([230, 231])
        _, got = merged.decode_scores(layer, None, k1, v1, k1, v1, t, t, o1, 6)
        want = sum(w * m.decode_scores(layer, None, k1, v1, k1, v1, t, t, o1, 6)[1] for w, m in zip(a, members))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the same ranking the members agree on, without the tilt's averaging moving it: equal weights of one
    # scorer give that scorer back
    same = average_scorers([members[0], members[0]])
    torch.testing.assert_close(
        same.forward_layer(0, k, v, 6, positions=pos, observed=obs),
        members[0].forward_layer(0, k, v, 6, positions=pos, observed=obs),
        rtol=1e-5,
        atol=1e-5,
    )


def test_average_refuses_what_it_cannot_merge():
    a = _member(1)
    with pytest.raises(ValueError, match="at least 2"):
        average_scorers([a])
    with pytest.raises(ValueError, match="weights must be positive"):
        average_scorers([a, _member(2)], [1.0, 0.0])
    with pytest.raises(ValueError, match="2 weights for 3"):
        average_scorers([a, a, a], [1.0, 1.0])
    other = build_scorer(dataclasses.replace(CFG, observed=(None,)))
    other.set_rope(ROPE)
    with pytest.raises(ValueError, match=r"stacks\[1\]\.config\.observed"):
        average_scorers([a, other])
    mlstm = build_scorer(dataclasses.replace(CFG, kind="mlstm"))
    with pytest.raises(ValueError, match=r"stacks\[1\] is a 'mlstm' scorer"):
        average_scorers([a, mlstm])
    shifted = _member(2)
    shifted.set_rope(RopeSpec(ROPE.inv_freq * 2))
    with pytest.raises(ValueError, match="different RoPE"):
        average_scorers([a, shifted])


def test_average_scorers_script_writes_a_loadable_checkpoint(tmp_path, monkeypatch):
    path = Path(__file__).resolve().parents[2] / "research" / "average_scorers.py"
    spec = importlib.util.spec_from_file_location("average_scorers", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    meta = {"trained_for": {"budget_range": [128, 2048], "window_fraction": 0.5}, "steps": 5, "tokens_seen": 10}
    save_scorer(_member(1), tmp_path / "a.safetensors", {**meta, "corpora": ["shakespeare"]})
    save_scorer(_member(2), tmp_path / "b.safetensors", {**meta, "corpora": ["package_code", "shakespeare"]})
    save_scorer(_member(3), tmp_path / "c.safetensors", {**meta, "trained_for": {"budget_range": [512, 512]}})
    out = tmp_path / "ab.safetensors"
    a, b, c = (str(tmp_path / f"{n}.safetensors") for n in "abc")
    monkeypatch.setattr(sys, "argv", ["average_scorers.py", a, c, "--out", str(out)])
    with pytest.raises(SystemExit, match="different trained_for"):
        script.main()
    assert not out.exists()
    monkeypatch.setattr(sys, "argv", ["average_scorers.py", a, b, "--weights", "3,1", "--out", str(out)])
    script.main()
    merged, got = load_scorer(out)
    assert merged.config.hidden == 16 and got["trained_for"] == meta["trained_for"]
    assert got["corpora"] == ["package_code", "shakespeare"] and got["tokens_seen"] == 20
    assert [m["weight"] for m in got["average_of"]] == [0.75, 0.25]
    assert read_header(out)["config"]["hidden"] == 16
    k, v, obs, pos = _inputs()
    want = 0.75 * _member(1).forward_layer(1, k, v, 6, positions=pos, observed=obs) + 0.25 * _member(2).forward_layer(
        1, k, v, 6, positions=pos, observed=obs
    )
    with torch.no_grad():
        torch.testing.assert_close(
            merged.forward_layer(1, k, v, 6, positions=pos, observed=obs), want.detach(), rtol=1e-5, atol=1e-5
        )
