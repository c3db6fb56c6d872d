"""Issue 25, data safety: saves that survive a kill or a full disk, strict JSON summaries, an
unwritable --out refused before the model loads, and resume on another model refused."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvpop
from kvpop.files import atomic_dir, atomic_writes, clean_leftovers
from kvpop.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into", "green", "hills"]
    for i in range(12):
        (folder / f"d{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    return folder


def _cfg(out, docs, **kw):
    from kvpop.train import TrainConfig

    base = {
        "out": str(out),
        "docs_from": str(docs),
        "seq_len": 64,
        "budgets": (24,),
        "window": 8,
        "sinks": 2,
        "steps": 2,
        "val_every": 2,
        "ckpt_every": 1,
        "val_docs": 0,
        "progress": False,
        "scorer": "mlp",
        "observed": (),
    }
    base.update(kw)
    return TrainConfig(**base)


def _bundle(path: Path, tag: str) -> None:
    atomic_dir(path, lambda tmp: [(tmp / name).write_text(f"{tag} {name}\n" * 2000) for name in ("a", "b", "c")])


def _whole(path: Path) -> str:
    """The tag of the complete bundle at ``path`` (every file of one save), or fail."""
    tags = {(path / name).read_text().split(" ")[0] for name in ("a", "b", "c")}
    assert len(tags) == 1, tags
    return tags.pop()


# --- item 10: a bundle save killed at any point leaves the old or the new bundle ----------------

_CHILD = textwrap.dedent("""
    import importlib.util, os, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("kvpop_files", sys.argv[4])  # without importing torch (fast)
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
    path, point, fallback = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"

    def pause(where):
        if where == point:
            print(where, flush=True)
            time.sleep(60)  # killed here

    real_exchange, real_rename = files._exchange, os.rename

    def exchange(a, b):
        pause("before-swap")
        done = False if fallback else real_exchange(a, b)
        pause("after-swap")
        return done

    def rename(a, b):
        real_rename(a, b)
        if ".old-" in str(b):
            pause("between-renames")

    files._exchange, files.os.rename = exchange, rename

    def write(tmp):
        (tmp / "a").write_text("new a\\n" * 2000)
        pause("mid-write")
        (tmp / "b").write_text("new b\\n" * 2000)
        (tmp / "c").write_text("new c\\n" * 2000)

    files.atomic_dir(path, write)
    print("done", flush=True)
""")


_POINTS = ["mid-write", "before-swap", "after-swap", "done"]


@pytest.mark.parametrize(
    "point,fallback", [(p, False) for p in _POINTS] + [(p, True) for p in [*_POINTS, "between-renames"]]
)
def test_a_killed_bundle_save_leaves_the_old_or_the_new_bundle(tmp_path, point, fallback):
    """Killed (SIGKILL) at each point of a save: the old or the new bundle is at the path, whole; with
    the two-rename fallback (no atomic exchange), between the renames only the set-aside old bundle
    exists, and the next writer's start puts it back."""
    path = tmp_path / "best"
    _bundle(path, "old")
    import kvpop.files

    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), point, "1" if fallback else "0", kvpop.files.__file__],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().strip()
    assert line == point, line
    if point != "done":
        child.send_signal(signal.SIGKILL)
    child.wait(30)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "best"]
    new = point == "done" or (point == "after-swap" and not fallback)  # the fallback swaps after that point
    if point == "between-renames":  # the fallback's one window: the path is empty, the old bundle set aside
        assert not path.exists() and len(leftovers) == 2
    else:
        assert _whole(path) == ("new" if new else "old")
    clean_leftovers(tmp_path)  # the next writer's start
    assert [p.name for p in tmp_path.iterdir()] == ["best"]
    assert _whole(path) == ("new" if new else "old")
    _bundle(path, "next")  # and the next save works
    assert _whole(path) == "next"


_SAVE_CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    from kvpop.adapt.lora import add_lora, lora_config, save_adapter_bundle
    from kvpop.testing import tiny_model

    path = Path(sys.argv[1])
    model = add_lora(tiny_model("llama"), lora_config(r=2))
    save_adapter_bundle(model, None, path, meta={"tag": "old"})
    real_rename = os.rename

    def rename(a, b):  # killed after the first rename of the folder swap
        real_rename(a, b)
        print("renamed", flush=True)
        time.sleep(60)

    os.rename = rename
    print("saving", flush=True)
    save_adapter_bundle(model, None, path, meta={"tag": "new"})
    print("done", flush=True)
""")


def test_save_adapter_bundle_killed_mid_swap_leaves_a_bundle(tmp_path):
    """The reported bug: the old save renamed the bundle away, then the new one in; killed between
    the two, no bundle was left at the path (and nothing put it back)."""
    from kvpop.bundle import read_bundle_meta

    path = tmp_path / "adapter"
    child = subprocess.Popen([sys.executable, "-c", _SAVE_CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "saving"
    line = child.stdout.readline().strip()  # "renamed": the swap took two renames; "done": one atomic exchange
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert read_bundle_meta(path)["meta"]["tag"] == ("new" if line == "done" else "old")  # right after the kill
    clean_leftovers(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_saved_files_get_the_users_umask(tmp_path):
    """A scorer checkpoint was written 0600 (safetensors recreates the file with that mode)."""
    from kvpop.adapt.lora import add_lora, lora_config, save_adapter_bundle
    from kvpop.checkpoint import save_scorer
    from kvpop.scorers import ScorerConfig, build_scorer

    scorer = build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16))
    old = os.umask(0o022)
    try:
        save_scorer(scorer, tmp_path / "s.safetensors")
        save_adapter_bundle(add_lora(tiny_model("llama"), lora_config(r=2)), scorer, tmp_path / "b")
        atomic_writes([(tmp_path / "x.bin", lambda p: Path(p).write_bytes(b"x"))])
    finally:
        os.umask(old)
    assert (tmp_path / "s.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "x.bin").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o755
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "b").iterdir()} == {
        f.name: 0o644 for f in (tmp_path / "b").iterdir()
    }


def test_save_adapter_bundle_keeps_the_previous_bundle_on_a_failed_write(tmp_path, monkeypatch):
    from kvpop.adapt.lora import add_lora, lora_config, save_adapter_bundle
    from kvpop.bundle import read_bundle_meta

    peft_model = add_lora(tiny_model("llama"), lora_config(r=2))
    save_adapter_bundle(peft_model, None, tmp_path / "adapter", meta={"steps": 1})
    real = type(peft_model).save_pretrained

    def full_disk(self, folder, **kw):
        real(self, folder, **kw)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(peft_model), "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_adapter_bundle(peft_model, None, tmp_path / "adapter", meta={"steps": 2})
    assert read_bundle_meta(tmp_path / "adapter")["meta"]["steps"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


# --- item 11: summaries are strict JSON ---------------------------------------------------------


def _strict(path: Path):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_train_summary_with_no_validation_is_strict_json(tmp_path, docs, capsys):
    from kvpop.train import train

    train(_cfg(tmp_path, docs), tiny_model("llama"), tiny_tokenizer())
    summary = _strict(tmp_path / "summary.json")
    assert summary["best"]["mean_retention"] is None


def test_every_json_the_package_ships_is_strict():
    """The shipped summaries are read by other tools: no NaN / Infinity (scripts/ship_adapter.py once
    wrote a run's "no validation yet" best as -Infinity)."""
    root = Path(kvpop.__file__).parent / "assets"
    files = sorted(root.rglob("*.json"))
    assert files
    for f in files:
        _strict(f)


# --- item 13: an unwritable or full --out -------------------------------------------------------


def test_train_refuses_an_unwritable_out_before_the_model_loads(tmp_path, docs, monkeypatch, capsys):
    import kvpop.models
    from kvpop.cli.train import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvpop.models, "load_model", no_load)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"  # under a file: cannot be created (as root, a read-only folder can)
    rc = main(["--out", str(out), "--docs-from", str(docs), "--seq-len", "64", "--budget", "24", "--window", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--out" in err[0] and "not a writable folder" in err[0]


def test_adapt_refuses_an_unwritable_out_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import kvpop.models
    from kvpop.cli.adapt import main

    monkeypatch.setattr(kvpop.models, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    (tmp_path / "file").write_text("x")
    rc = main(["--out", str(tmp_path / "file" / "run"), "--mask", "streaming", "--budget", "24", "--seq-len", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not a writable folder" in err[0]


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_checkpoint_whole(tmp_path, docs, monkeypatch):
    from kvpop.train import train

    model, tok = tiny_model("llama"), tiny_tokenizer()
    train(_cfg(tmp_path, docs, steps=2, stop_after=1), model, tok)
    before = {n: (tmp_path / n).read_bytes() for n in ("scorer.safetensors", "train_state.pt")}
    real_save = torch.save

    def full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="previous checkpoint there is whole"):
        train(_cfg(tmp_path, docs, steps=2), model, tok)
    monkeypatch.undo()
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# --- item 6: train refuses to resume on another model -------------------------------------------


def test_train_refuses_to_resume_on_a_different_model(tmp_path, docs):
    from kvpop.train import train

    tok = tiny_tokenizer()
    train(_cfg(tmp_path, docs, steps=2, stop_after=1), tiny_model("llama"), tok)
    with pytest.raises(ValueError, match="holds a run on a different model"):
        train(_cfg(tmp_path, docs, steps=2), tiny_model("llama", seed=1), tok)
    # a state from before it recorded the fingerprint: the scorer checkpoint's is used
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    del state["fingerprint"]
    torch.save(state, tmp_path / "train_state.pt")
    with pytest.raises(ValueError, match="holds a run on a different model"):
        train(_cfg(tmp_path, docs, steps=2), tiny_model("llama", seed=1), tok)
    summary = train(_cfg(tmp_path, docs, steps=2), tiny_model("llama"), tok)  # the same model resumes
    assert summary["history"][-1]["step"] == 2
