"""Training: loss goes down, resume reproduces an uninterrupted run, DDP ranks stay identical, checkpoints."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpop.checkpoint import ScorerMismatchError, load_scorer, read_header, save_scorer
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import save_tiny_model, tiny_model, tiny_tokenizer
from kvpop.train import TrainConfig, main, train


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into", "green", "hills", "and", "old", "trees"]
    for i in range(30):
        (folder / f"d{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    return folder


def _cfg(out, docs, **kw):
    base = {"out": str(out), "docs_from": str(docs), "seq_len": 64, "budget": 24, "window": 8, "sinks": 2, "steps": 6,
                "eval_every": 3, "ckpt_every": 2, "val_sequences": 1, "progress": False, "lr": 1e-2}
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kind", ["mlp", "mlstm"])
def test_training_runs_and_writes_checkpoint(tmp_path, docs, kind):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    summary = train(_cfg(tmp_path, docs, scorer=kind, steps=12, pool=4), model, tok)
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # it learns on a small pool
    header = read_header(tmp_path / "scorer.safetensors")
    assert header["config"]["kind"] == kind
    assert header["meta"]["trained_for"]["window"] == 8
    assert "validation" in summary and set(summary["validation"]) == {kind, "knorm", "random"}
    _, meta = load_scorer(tmp_path / "scorer.safetensors", model=model)
    assert meta["steps"] == 12


def test_resume_matches_uninterrupted_run(tmp_path, docs):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    full = tmp_path / "full"
    train(_cfg(full, docs, scorer="mlstm", steps=6), model, tok)
    part = tmp_path / "part"
    train(_cfg(part, docs, scorer="mlstm", steps=6, stop_after=4), model, tok)  # "killed" after the step-4 checkpoint
    summary = train(_cfg(part, docs, scorer="mlstm", steps=6), model, tok)
    assert summary["history"][0]["step"] == 1 and len(summary["history"]) == 6
    a, _ = load_scorer(full / "scorer.safetensors")
    b, _ = load_scorer(part / "scorer.safetensors")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_scorer_refuses_other_model(tmp_path):
    model = tiny_model("llama")
    other = tiny_model("llama", seed=1)
    from kvpop.checkpoint import model_fingerprint

    cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16)
    path = save_scorer(build_scorer(cfg), tmp_path / "s.safetensors", {"fingerprint": model_fingerprint(model)})
    load_scorer(path, model=model)
    with pytest.raises(ScorerMismatchError, match="different model"):
        load_scorer(path, model=other)


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16)
    path = save_scorer(build_scorer(cfg), tmp_path / "s.safetensors", {"steps": 1})
    import kvpop.checkpoint as ck

    def boom(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError):
        ck.save_scorer(build_scorer(cfg), path, {"steps": 2})
    assert read_header(path)["meta"]["steps"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_bad_config_fails_before_loading(tmp_path):
    with pytest.raises(ValueError, match="scorer must be"):
        _cfg(tmp_path, tmp_path, scorer="transformer").validate()
    with pytest.raises(ValueError, match="seq_len"):
        _cfg(tmp_path, tmp_path, seq_len=10).validate()
    with pytest.raises(ValueError, match="smaller than sinks"):
        _cfg(tmp_path, tmp_path, budget=4).validate()


def test_ddp_two_processes_keep_identical_weights(tmp_path, docs):
    model_dir = tmp_path / "model"
    save_tiny_model(model_dir, "llama")
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
        "-m", "kvpop.train", "--kind", "mlstm", "--out", str(out), "--model", str(model_dir),
        "--docs-from", str(docs), "--seq-len", "64", "--budget", "24", "--window", "8", "--sinks", "2",
        "--steps", "4", "--batch-size", "2", "--ckpt-every", "2", "--eval-every", "2", "--val-sequences", "1",
        "--check-sync", "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    assert (out / "scorer.safetensors").is_file()


def test_cli_main_validates_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--kind", "nope", "--out", str(tmp_path)])
