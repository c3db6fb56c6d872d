"""The run loop shared by kvpop train and kvpop adapt: resume from checkpoints written before it existed,
the schedule (validation, best, checkpoints, stop_after), the resume check, the learning-rate schedule."""

import itertools
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvpop.adapt import AdaptConfig, adapt
from kvpop.testing import tiny_model, tiny_tokenizer, write_word_docs
from kvpop.train import TrainConfig, train
from kvpop.train.runs import Run, cosine_schedule, resume_mismatch

FIXTURE = Path(__file__).parents[1] / "fixtures" / "runs_v0"
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture
def old_runs(tmp_path, monkeypatch):
    """The fixture's stopped runs in a working folder that holds the ``docs/`` they were made from."""
    write_word_docs(tmp_path / "docs")
    for name in ("train", "adapt"):
        shutil.copytree(FIXTURE / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path, json.loads((FIXTURE / "expected.json").read_text())


def _same_history(got: list[dict], want: list[dict], key: str) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in want]
    for g, w in zip(got, want, strict=True):
        assert g["budget"] == w["budget"]
        # the expected values were computed on another CPU: its matmul kernels round differently, which
        # moves a small KL (~4e-4) by ~1e-5 relative after a few steps (seen on an AMD EPYC); a wrong
        # resume (fresh LoRA or optimizer, another batch) moves it by orders of magnitude more
        assert g[key] == pytest.approx(w[key], rel=1e-4), g["step"]
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12)


@pytest.mark.parametrize(
    "name,config,run,key", [("train", TrainConfig, train, "loss"), ("adapt", AdaptConfig, adapt, "kl")]
)
def test_a_run_from_before_the_shared_loop_resumes(old_runs, name, config, run, key):
    folder, expected = old_runs
    state = folder / name / "train_state.pt"
    blob = torch.load(state, weights_only=True)  # a state of before holds tensors and plain values only: it resumes
    blob["history"][0]["restored"] = True  # so the history can only have come from the checkpoint
    torch.save(blob, state)
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in expected[name]["config"].items()}
    summary = run(config(out=str(folder / name), **cfg), tiny_model("llama"), tiny_tokenizer())
    assert summary["history"][0].get("restored") and "restored" not in summary["history"][2]
    _same_history(summary["history"], expected[name]["history"], key)


@dataclass
class _Cfg:
    steps: int
    val_every: int
    ckpt_every: int
    stop_after: int | None = None
    device: str = "cpu"
    batch_size: int = 1
    seq_len: int = 8
    check_sync: bool = False
    progress: bool = False

    def resume_view(self):
        return {"steps": self.steps}


class _Program:
    """Validation quality rises, then falls: the best is the peak."""

    validates = True

    def __init__(self, quality):
        self.quality, self.calls = quality, []

    def step(self, step):
        self.calls.append(("step", step))
        return {"step": step + 1}

    def synced(self):
        return []

    def validate(self, step):
        self.calls.append(("validate", step))
        return {"mean_retention": self.quality[step]}

    def describe(self, q):
        return str(q)

    def save_best(self, step, q):
        self.calls.append(("best", step))

    def checkpoint(self, step):
        self.calls.append(("checkpoint", step))

    def postfix(self, record):
        return {}


def test_loop_validates_keeps_the_best_checkpoints_and_stops(tmp_path):
    run = Run("train", _Cfg(steps=7, val_every=3, ckpt_every=2), tmp_path)
    prog = _Program({3: 0.5, 6: 0.9, 7: 0.7})
    run.loop(prog, desc="test")
    assert [c for c in prog.calls if c[0] == "validate"] == [("validate", 3), ("validate", 6), ("validate", 7)]
    assert [c for c in prog.calls if c[0] == "best"] == [("best", 3), ("best", 6)]
    assert [c for c in prog.calls if c[0] == "checkpoint"] == [("checkpoint", s) for s in (2, 4, 6, 7)]
    assert run.best == {"mean_retention": 0.9, "step": 6} and len(run.history) == 7
    assert run.history[5]["val"] == {"mean_retention": 0.9}
    summary = run.summary({"extra_seconds": 1.0}, {"budgets": [8]})
    assert list(summary)[:5] == ["steps", "tokens_seen", "seconds_this_process", "extra_seconds", "history"]
    assert json.loads((tmp_path / "summary.json").read_text())["best"]["step"] == 6

    stopped = Run("train", _Cfg(steps=7, val_every=3, ckpt_every=2, stop_after=4), tmp_path / "b")
    stopped.loop(_Program({3: 0.5}), desc="test")
    assert stopped.step == 4 and stopped.best["step"] == 3


def test_resume_check_lists_every_differing_setting(tmp_path):
    assert resume_mismatch({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == [
        "b: checkpoint 2 vs now 3",
        "c: checkpoint None vs now 4",
    ]
    run = Run("train", _Cfg(5, 1, 1), tmp_path)
    torch.save({"resume": {"steps": 4}}, tmp_path / "train_state.pt")
    with pytest.raises(ValueError, match="other settings.*steps: checkpoint 4 vs now 5"):
        run.saved_state()
    with pytest.raises(ValueError, match="different model"):
        run.check_model({"vocab_size": 10}, {"vocab_size": 11})
    run.check_model({"vocab_size": 10}, None)  # a new run: nothing to compare


def test_cosine_schedule_warms_up_then_decays_to_zero():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = cosine_schedule(opt, 100)  # warm-up: min(20, 100 / 10) = 10 steps
    lrs = []
    for _ in range(101):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:10] == pytest.approx([(s + 1) / 10 * 0.5 * (1 + math.cos(math.pi * s / 100)) for s in range(10)])
    assert all(a > b for a, b in itertools.pairwise(lrs[10:])) and lrs[100] == pytest.approx(0, abs=1e-12)
