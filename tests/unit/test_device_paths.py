"""What differs on a GPU, checked on the CPU: kernel output layouts, the scorer's device, host syncs.

``kvpop bench gpu`` (``scripts/gpu_check.sh``) runs the cache on CUDA against the CPU; these tests
keep what it found from coming back where CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch

from kvpop import cache as cache_mod
from kvpop import make_cache
from kvpop.compat import cache_kwargs
from kvpop.policies.base import Policy
from kvpop.testing import random_learned_policy, tiny_model


def _ids(n: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 128, (batch, n), generator=g)


def _run(model, cache, ids, prefill):
    outs = [model(ids[:, :prefill], **cache_kwargs(cache)).logits[:, -1:]]
    outs += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_non_contiguous_attention_output(policy, monkeypatch):
    """CUDA's SDPA kernels return ``[b, h, L, d]`` laid out as ``[b, L, h, d]``: the chunk path must
    not assume a contiguous output (it used ``view``, which failed on CUDA at batch 2)."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(60)
    ref = _run(model, make_cache(model, policy, budget=24), ids, 40)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, CUDA's memory layout

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided)
    got = _run(model, make_cache(model, policy, budget=24), ids, 40)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_learned_policy_follows_the_cache_device():
    """A scorer built on one device moves to the device of the keys a cache first sees (a model
    moved to a GPU after the policy was made); kernels prepared after the move view the new weights."""
    model = tiny_model("llama", num_hidden_layers=2)
    policy = random_learned_policy(model)
    policy.scorer.double()  # stands for "another device": .to() must replace the weights the kernels view
    kernels = policy.prepare(torch.device("cpu"))
    kernel = kernels.decode_kernel(0, 8)
    assert kernels.decode_kernel(0, 8) is kernel  # one object while unchanged: a compiled step binds it
    policy.to(torch.device("cpu"))  # same device: nothing moves, new kernels view the same weights
    assert policy.prepare(torch.device("cpu")).decode_kernel(0, 8)[1][0].data_ptr() == kernel[1][0].data_ptr()
    moved = []
    policy.scorer.to = lambda device: moved.append(device)  # record instead of moving (no second device here)
    policy.to(torch.device("meta"))  # meta is never a target: building a cache on meta must not strip weights
    assert moved == []
    policy.scorer.parameters = lambda: iter([torch.zeros(1, device="meta")])
    policy.to(torch.device("cpu"))
    assert moved == [torch.device("cpu")]


class _NaNAfter(Policy):
    """A heuristic whose scores turn NaN after ``after`` calls (a user policy with a bug)."""

    name = "nan-after"

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0

    def score(self, state, batch):
        self.calls += 1
        s = batch.keys.float().norm(dim=-1)
        return state, s * float("nan") if self.calls > self.after else s


def test_nan_scores_are_caught_on_the_steady_path():
    """The steady decode path checks a heuristic's scores every NAN_CHECK_EVERY steps (a check
    is a device sync), so a policy that starts returning NaN fails within that many steps."""
    model = tiny_model("llama", num_hidden_layers=1)
    ids = _ids(40 + 2 * cache_mod.NAN_CHECK_EVERY, batch=1)
    policy = _NaNAfter(after=10**9)
    cache = make_cache(model, policy, budget=16)
    model(ids[:, :40], **cache_kwargs(cache))
    policy.after = policy.calls  # NaN from the next call on
    with pytest.raises(RuntimeError, match="NaN scores"):
        for i in range(40, ids.shape[1]):
            model(ids[:, i : i + 1], **cache_kwargs(cache))
    assert i < 40 + cache_mod.NAN_CHECK_EVERY + 1


def test_gpu_bench_runs_on_cpu(tmp_path):
    """``kvpop bench gpu`` at toy sizes on the CPU: every part runs, the target methods agree with
    the float64 reference, each decode row is divided by the floor of its own context, and the
    JSON and PNG are written. (On a GPU it is the same code at 8k-32k; flex rows need CUDA.)"""
    import json

    from kvpop.bench import gpu

    out = tmp_path / "bench_gpu"
    assert (
        gpu.main(
            [
                "--device",
                "cpu",
                "--sizes",
                "96",
                "--contexts",
                "80,120",
                "--budget",
                "48",
                "--steps",
                "2",
                "--rounds",
                "2",
                "--reps",
                "1",
                "--parity",
                "streaming",
                "--rows",
                "floor,dense,streaming,kvpop-mlstm",
                "--model",
                '{"num_hidden_layers": 2, "vocab_size": 256}',
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").is_file()
    par = {r["run"]: r for r in res["parity"]}
    assert set(par) == {"cpu+compile"} and all(r["max_logit_diff"] < 1e-4 for r in par.values())
    by = {r["method"]: r for r in res["targets"]}
    assert by["flex-f32"]["skipped"] == "flex needs CUDA"
    for m in ("blocked-f32", "dense-f32", "fused-cpu-f32"):
        assert by[m]["max_abs_err"] < 1e-4 and by[m]["same_inf"], by[m]
    assert [d["context"] for d in res["decode"]] == [80, 120]
    for d in res["decode"]:
        rows = {r["name"]: r for r in d["rows"]}
        assert set(rows) == {"floor", "dense", "streaming", "kvpop-mlstm"}, rows
        assert rows["floor"]["vs_floor"] == 1.0 and rows["kvpop-mlstm"]["steps"] == 4
    assert res["decode"][1]["rows"][3]["prefill_tokens"] == 120 - (80 + 5)  # a row's cache grows across contexts
    with pytest.raises(SystemExit, match="--rows"):
        gpu.main(["--device", "cpu", "--rows", "floor,nope"])
