"""Resuming is safe and exact: a run state is read without running code, a damaged one is one clear error,
a run over a capture store does not depend on what the store already held, and a run resumes only on the
model and starting scorer (by content, not path) it began with."""

import pickle
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpop.adapt import AdaptConfig, adapt
from kvpop.checkpoint import model_fingerprint, save_scorer
from kvpop.cli.train import main
from kvpop.testing import save_tiny_model, tiny_model, tiny_tokenizer, write_word_docs
from kvpop.train import TrainConfig, train
from kvpop.train.loop import build_run_scorer, trained_for
from kvpop.train.runs import Run, plain, read_state, write_state

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return write_word_docs(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    save_tiny_model(path, "llama")
    return path


def _cfg(out, docs, **kw) -> TrainConfig:
    base = {
        "out": str(out),
        "docs_from": str(docs),
        "seq_len": 64,
        "budgets": (24,),
        "window": 8,
        "sinks": 2,
        "steps": 6,
        "val_every": 3,
        "ckpt_every": 2,
        "val_docs": 0,
        "progress": False,
        "lr": 1e-2,
        "observed": (None, 4, 1),
        "scorer": "mlp",
    }
    base.update(kw)
    return TrainConfig(**base)


def _argv(out, docs, model_dir) -> list[str]:
    """``kvpop train`` arguments of the run ``_cfg(out, docs, steps=2)`` describes, on the saved tiny model."""
    return [
        "--kind",
        "mlp",
        "--out",
        str(out),
        "--model",
        str(model_dir),
        "--docs-from",
        str(docs),
        "--seq-len",
        "64",
        "--budget",
        "24",
        "--window",
        "8",
        "--sinks",
        "2",
        "--observed",
        "all,4,1",
        "--steps",
        "2",
        "--ckpt-every",
        "1",
        "--val-every",
        "2",
        "--val-docs",
        "0",
        "--lr",
        "0.01",
        "--no-progress",
    ]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


class _TouchOnLoad:
    """Unpickling this creates ``marker``: a stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# --- reading a run state runs no code ------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "bare-pickle"])
def test_a_state_holding_pickled_objects_is_refused_without_running_it(tmp_path, docs, model_dir, capsys, legacy):
    out, marker = tmp_path / "run", tmp_path / "ran-code"
    out.mkdir()
    evil = {"step": 1, "history": [], "resume": _cfg(out, docs, steps=2).resume_view(), "config": _TouchOnLoad(marker)}
    if legacy:
        (out / "train_state.pt").write_bytes(pickle.dumps(evil, protocol=2))
    else:
        torch.save(evil, out / "train_state.pt")
    # the planted file is live: unpickled the unsafe way, it runs its code
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps({"x": _TouchOnLoad(probe)}))
    assert probe.exists()

    assert main(_argv(out, docs, model_dir)) == 2
    line = _one_error_line(capsys)
    assert str(out / "train_state.pt") in line and "cannot be loaded safely" in line and "new --out" in line
    assert not marker.exists()
    with pytest.raises(ValueError, match="cannot be loaded safely"):  # kvpop adapt reads it the same way
        adapt(
            AdaptConfig(
                out=str(out),
                docs_from=str(docs),
                seq_len=64,
                budgets=(24,),
                sinks=2,
                mask="streaming",
                steps=2,
                val_docs=0,
                progress=False,
            )
        )
    assert not marker.exists()


def test_the_state_holds_only_tensors_and_plain_values(tmp_path):
    @dataclass
    class Part:
        where: Path
        n: np.int64

    sd = torch.nn.Linear(2, 2).state_dict()
    state = {
        "a": np.float64(0.5),
        "b": (np.arange(3), Path("x/y")),
        "c": Part(Path("p"), np.int64(3)),
        "w": torch.nn.Parameter(torch.ones(2)),
        "sd": sd,
        0: [None, True, float("-inf")],
    }
    got = plain(state)
    assert type(got["a"]) is float and got["b"][1] == "x/y" and got["c"] == {"where": "p", "n": 3}
    assert type(got["w"]) is torch.Tensor and torch.equal(got["b"][0], torch.arange(3))
    assert isinstance(got["sd"], OrderedDict) and got["sd"]._metadata == sd._metadata
    write_state(tmp_path / "s.pt", state)
    back = read_state(tmp_path / "s.pt")  # weights_only: it would refuse anything else
    assert back[0] == [None, True, float("-inf")] and back["sd"]._metadata == sd._metadata
    with pytest.raises(TypeError, match=r"state\['x'\] holds a .*object"):
        plain({"x": object()})


def test_a_real_run_state_reads_back_without_pickled_objects(tmp_path, docs):
    train(_cfg(tmp_path, docs, steps=2, ckpt_every=1, stop_after=1), tiny_model("llama"), tiny_tokenizer())
    blob = torch.load(tmp_path / "train_state.pt", weights_only=True)
    assert blob["step"] == 1 and set(blob) >= {"scorer", "optimizer", "scheduler", "resume", "fingerprint"}


# --- a damaged run state is one clear line ---------------------------------------------------------


def test_an_empty_or_truncated_state_is_one_clear_error(tmp_path, docs, model_dir, capsys):
    out = tmp_path / "run"
    train(_cfg(out, docs, steps=2, ckpt_every=1, stop_after=1), tiny_model("llama"), tiny_tokenizer())
    state = out / "train_state.pt"
    whole = state.read_bytes()
    want = f"{state} is empty/truncated or corrupt: remove it to start over or use another --out"
    for n in (0, len(whole) // 2, len(whole) - 30):  # EOFError, a zip without its directory, "[Errno 22]"
        state.write_bytes(whole[:n])
        assert main(_argv(out, docs, model_dir)) == 2, n
        assert _one_error_line(capsys) == f"kvpop train: error: {want}", n
    run = Run("train", _cfg(out, docs, steps=2), out)  # every truncation, through the same check
    for n in range(0, len(whole), max(1, len(whole) // 200)):
        state.write_bytes(whole[:n])
        with pytest.raises(ValueError) as err:
            run.saved_state()
        assert str(err.value) == want, n
    state.write_bytes(whole)
    assert main(_argv(out, docs, model_dir)) == 0  # the whole file resumes


# --- a run over a capture store is the same run however much of the store it filled ------------------


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return read_state(out / "train_state.pt")["scorer"]


def _same_run(a: dict, b: dict, out_a: Path, out_b: Path) -> None:
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    wa, wb = _weights(out_a), _weights(out_b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_store_run_equals_a_run_over_the_filled_store_and_a_resumed_one(tmp_path, docs):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    filling = train(_cfg(tmp_path / "fill", docs, store=str(tmp_path / "s1")), model, tok)  # captures every step
    assert len(list((tmp_path / "s1").glob("seq_*.safetensors"))) == 6
    reading = train(_cfg(tmp_path / "read", docs, store=str(tmp_path / "s1")), model, tok)  # reads every step
    _same_run(filling, reading, tmp_path / "fill", tmp_path / "read")
    # killed after step 5, whose capture is stored, but whose checkpoint is not (the last one is step 4's)
    part = tmp_path / "part"
    train(_cfg(part, docs, store=str(tmp_path / "s2"), stop_after=5), model, tok)
    assert read_state(part / "train_state.pt")["step"] == 4 and (tmp_path / "s2" / "seq_000004.safetensors").exists()
    resumed = train(_cfg(part, docs, store=str(tmp_path / "s2")), model, tok)
    _same_run(filling, resumed, tmp_path / "fill", part)


# --- a run resumes on the model and scorer it started with, by content ---------------------------------


def test_train_resumes_on_the_same_weights_from_another_folder_and_not_on_other_weights(
    tmp_path, docs, model_dir, capsys
):
    out = tmp_path / "run"
    argv = _argv(out, docs, model_dir)
    assert main([*argv, "--stop-after", "1"]) == 0
    other = tmp_path / "other"
    save_tiny_model(other, "llama", seed=1)
    capsys.readouterr()
    assert main([*argv[:5], str(other), *argv[6:]]) == 2
    line = _one_error_line(capsys)
    assert str(out) in line and "different model: the model changed" in line
    moved = tmp_path / "moved"
    shutil.copytree(model_dir, moved)
    assert main([*argv[:5], str(moved), *argv[6:]]) == 0  # the same weights elsewhere: it resumes


@pytest.fixture(scope="module")
def scorer_path(tmp_path_factory, docs):
    model = tiny_model("llama")
    tcfg = TrainConfig(docs_from=str(docs), seq_len=64, budgets=(24,), window=8, sinks=2, observed=(None, 4, 1))
    path = tmp_path_factory.mktemp("scorer") / "scorer.safetensors"
    save_scorer(
        build_run_scorer(tcfg, model), path, {"fingerprint": model_fingerprint(model), "trained_for": trained_for(tcfg)}
    )
    return path


def _adapt_cfg(out, docs, scorer, **kw) -> AdaptConfig:
    base = {
        "out": str(out),
        "docs_from": str(docs),
        "seq_len": 64,
        "budgets": (24,),
        "sinks": 2,
        "steps": 3,
        "val_every": 2,
        "ckpt_every": 1,
        "val_docs": 0,
        "progress": False,
        "lr": 1e-2,
        "lora_r": 4,
        "scorer": str(scorer),
    }
    base.update(kw)
    return AdaptConfig(**base)


def test_adapt_resumes_only_on_the_scorer_file_and_model_it_started_with(tmp_path, docs, scorer_path):
    tok, out = tiny_tokenizer(), tmp_path / "run"
    scorer = tmp_path / "a" / "scorer.safetensors"
    scorer.parent.mkdir()
    shutil.copy(scorer_path, scorer)
    adapt(_adapt_cfg(out, docs, scorer, stop_after=1), tiny_model("llama"), tok)
    # the same path, other bytes (another scorer of the same shape, trained for the same settings)
    model = tiny_model("llama")
    tcfg = TrainConfig(docs_from=str(docs), seq_len=64, budgets=(24,), window=8, sinks=2, observed=(None, 4, 1), seed=1)
    save_scorer(
        build_run_scorer(tcfg, model),
        scorer,
        {"fingerprint": model_fingerprint(model), "trained_for": trained_for(tcfg)},
    )
    with pytest.raises(ValueError, match=rf"started from another scorer: {scorer} is not the file it started with"):
        adapt(_adapt_cfg(out, docs, scorer), tiny_model("llama"), tok)
    # the same bytes at another path: it resumes, and only on the model it started with
    moved = tmp_path / "b" / "renamed.safetensors"
    moved.parent.mkdir()
    shutil.copy(scorer_path, moved)
    with pytest.raises(ValueError, match="different model: the model changed"):
        adapt(_adapt_cfg(out, docs, moved), tiny_model("llama", seed=1), tok)
    summary = adapt(_adapt_cfg(out, docs, moved), tiny_model("llama"), tok)
    assert summary["steps"] == 3 and len(summary["history"]) == 3
