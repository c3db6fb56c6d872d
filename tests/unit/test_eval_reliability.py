"""kvpop eval's output folder and arguments (tiny models): records made from files since replaced at the
same path are not reused, and an unwritable or damaged folder or a bad number is one line naming it,
found before any model loads where the value alone decides."""

import errno
import json
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import kvpop.models
from kvpop.checkpoint import model_fingerprint, save_scorer
from kvpop.cli import main as kvpop_main
from kvpop.cli.eval import main
from kvpop.evaluate.store import RecordStore, StoreMismatch, load_dirs
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import save_tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model loads: the check under test must come first."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvpop.models, "load_model", refuse)


@pytest.fixture
def folders(tmp_path):
    """(model, its folder, a folder of two documents)."""
    model = save_tiny_model(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT * 3)
    (docs / "b.txt").write_text(TEXT[::-1] * 3)
    return model, tmp_path / "model", docs


def _args(model_dir: Path, docs: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--docs-from",
        str(docs),
        "--out",
        str(out),
        "--doc-tokens",
        "64",
        "--reference-length",
        "64",
        "--compression",
        "0.75",
        "--no-progress",
        "--no-plots",
        "--bootstrap",
        "20",
        *extra,
    ]


def _units_run(out: Path) -> int:
    return json.loads((out / "results.json").read_text())["sessions"][-1]["units_run"]


def _error(capsys) -> str:
    """The one error line of the last command (other stderr lines, e.g. a model's load messages, aside)."""
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("kvpop eval: error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    return errors[0]


def _scorer(path: Path, model, seed: int) -> Path:
    """A scorer for ``model`` whose weights depend on ``seed`` (a fresh scorer's do not)."""
    scorer = build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in scorer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return save_scorer(scorer, path, {"fingerprint": model_fingerprint(model)})


# ------------------------------------------------------------------------------ stale results


def test_replaced_model_weights_are_not_taken_for_the_old_ones(folders, tmp_path, capsys):
    _, model_dir, docs = folders
    out = tmp_path / "out"
    args = _args(model_dir, docs, out, "--policies", "dense", "knorm")
    assert main(args) == 0 and _units_run(out) > 0
    assert main(args) == 0 and _units_run(out) == 0  # the same files: nothing to redo
    before = (out / "results.json").read_bytes()
    capsys.readouterr()
    save_tiny_model(model_dir, seed=1)  # other weights at the same path
    assert main(args) == 2
    printed = capsys.readouterr()
    err = [x for x in printed.err.splitlines() if "error" in x]
    assert len(err) == 1 and f"weights of model {str(model_dir)!r}" in err[0], err
    assert str(out) in err[0] and "another --out" in err[0] and "delete" in err[0]
    assert "knorm" not in printed.out  # no table of the old model's numbers
    assert (out / "results.json").read_bytes() == before
    assert main([*args, "--dry-run"]) == 2  # the plan says so too, instead of "done"
    assert "weights of model" in _error(capsys)
    other = tmp_path / "out2"
    assert main([*args[:5], str(other), *args[6:]]) == 0 and _units_run(other) > 0


def test_a_replaced_scorer_file_is_not_taken_for_the_old_one(folders, tmp_path, capsys):
    model, model_dir, docs = folders
    path = _scorer(tmp_path / "mlp.safetensors", model, seed=0)
    out = tmp_path / "out"
    args = _args(model_dir, docs, out, "--policies", "dense", "kvpop-mlp", "--scorer", str(path))
    assert main(args) == 0 and _units_run(out) > 0
    assert main(args) == 0 and _units_run(out) == 0
    capsys.readouterr()
    _scorer(path, model, seed=1)  # another scorer at the same path
    assert main(args) == 2
    err = _error(capsys)
    assert f"the scorer file {path} of policy kvpop-mlp" in err and "another --out" in err, err
    assert "weights of model" not in err


def test_a_folder_made_before_content_hashes_resumes_and_records_them(folders, tmp_path):
    """Folders whose run.json predates the hashes (the committed results) still resume; they record the
    hashes on their next run, so a later change of file is caught."""
    _, model_dir, docs = folders
    out = tmp_path / "out"
    args = _args(model_dir, docs, out, "--policies", "dense", "knorm")
    assert main(args) == 0
    run = json.loads((out / "run.json").read_text())
    fp = run["fingerprint"]
    assert fp["model_weights"] and all("sha256" in kw for kw in fp["policy_kwargs"].values())
    old = {k: v for k, v in fp.items() if k != "model_weights"}
    old["policy_kwargs"] = {}
    (out / "run.json").write_text(json.dumps({"fingerprint": old}))
    assert main(args) == 0 and _units_run(out) == 0
    assert json.loads((out / "run.json").read_text()) == run


def test_merge_refuses_other_weights_or_scorer_files_and_takes_older_folders(tmp_path):
    base = {"reference_length": 64, "sinks": 4}

    def folder(name: str, kwargs: dict, policies=("dense",), **over) -> Path:
        store = RecordStore(tmp_path / name, {**base, **over, "policy_kwargs": kwargs})
        for p in policies:
            store.append({"key": f"doc/{name}/0|{p}|16", "policy": p, "budget": 16})
        return tmp_path / name

    mlp = {"kvpop-mlp": {"path": "s.safetensors", "sha256": "a" * 64}}
    one = folder("one", mlp, ("dense", "kvpop-mlp"), model_weights="w1")
    with pytest.raises(StoreMismatch, match="weights of model"):
        load_dirs([one, folder("two", mlp, model_weights="w2")])
    with pytest.raises(StoreMismatch, match="scorer file s.safetensors of policy kvpop-mlp"):
        load_dirs(
            [
                one,
                folder(
                    "three",
                    {"kvpop-mlp": {"path": "s.safetensors", "sha256": "b" * 64}},
                    ("kvpop-mlp",),
                    model_weights="w1",
                ),
            ]
        )
    old = folder("old", {"kvpop-mlp": {"path": "s.safetensors"}}, ("kvpop-mlp",))  # before the hashes
    fp, units, _ = load_dirs([old, one])
    assert fp["model_weights"] == "w1" and fp["policy_kwargs"] == mlp and len(units) == 3


# ------------------------------------------------------------------------------ unwritable --out


def test_an_out_under_a_file_is_one_line_before_the_model_loads(tmp_path, no_model, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    assert main(["--out", str(out), "--quick", "--docs-from", str(tmp_path)]) == 2
    err = _error(capsys)
    assert str(out) in err and "not a writable folder" in err


def test_a_read_only_out_is_one_line_before_the_model_loads(tmp_path, no_model, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    src = tmp_path / "src"
    RecordStore(src, {"sinks": 4}).append({"key": "doc/a/0|dense|16", "policy": "dense", "budget": 16})
    if os.geteuid() == 0:  # root writes into a 0o555 folder: refuse there as a read-only file system would
        real = tempfile.mkstemp

        def mkstemp(*a, dir=None, **k):
            if dir is not None and Path(dir).resolve().is_relative_to(ro.resolve()):
                raise OSError(errno.EROFS, "Read-only file system")
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    os.chmod(ro, 0o555)
    try:
        for out in (ro, ro / "new"):
            assert main(["--out", str(out), "--quick"]) == 2
            err = _error(capsys)
            assert str(out) in err and "not a writable folder" in err
        assert main(["--merge", str(src), "--out", str(ro), "--no-plots"]) == 2
        assert str(ro) in _error(capsys)
    finally:
        os.chmod(ro, 0o755)


# ------------------------------------------------------------------------------ damaged files


@pytest.mark.parametrize("text", ["", '{"fingerprint": {"sinks"', "[]"])
def test_a_damaged_run_json_is_named_before_the_model_loads(tmp_path, no_model, capsys, text):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(text)
    assert main(["--out", str(out), "--quick"]) == 2
    err = _error(capsys)
    assert str(out / "run.json") in err and "another --out" in err and f"delete {out}" in err
    assert "Expecting" not in err.split(" is ")[0]
    assert main(["--merge", str(out), "--out", str(tmp_path / "merged"), "--no-plots"]) == 2
    assert str(out / "run.json") in _error(capsys)


def test_a_damaged_record_line_is_named_not_dropped(tmp_path):
    """Only a last line can be cut by a kill (dropped quietly); a damaged line with lines after it is an
    error naming the file and line, and the lines after it are kept, not truncated away."""
    fp = {"sinks": 4}
    store = RecordStore(tmp_path / "o", fp)
    for i in range(3):
        store.append({"key": f"k{i}", "policy": "dense"})
    f = tmp_path / "o" / "records" / "main.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    damaged = "".join([lines[0], "{garbage\n", lines[2]])
    for bad in (damaged, "".join([lines[0], "[1, 2]\n", lines[2]])):
        f.write_text(bad)
        with pytest.raises(StoreMismatch, match=r"main\.jsonl: line 2 is damaged"):
            RecordStore(tmp_path / "o", fp)
        with pytest.raises(StoreMismatch, match=r"main\.jsonl: line 2 is damaged"):
            load_dirs([tmp_path / "o"])
        assert f.read_text() == bad
    f.write_text("".join([lines[0], lines[2], '{"key": "k3"']))  # a kill cut the last line
    assert set(RecordStore(tmp_path / "o", fp).records) == {"k0", "k2"}


def test_a_damaged_record_file_is_one_line_from_the_cli(folders, tmp_path, capsys):
    _, model_dir, docs = folders
    out = tmp_path / "out"
    args = _args(model_dir, docs, out, "--policies", "dense", "knorm")
    assert main(args) == 0
    f = out / "records" / "main.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(["{\n", *lines[1:]]))
    capsys.readouterr()
    assert main(args) == 2
    err = _error(capsys)
    assert f"{f}: line 1 is damaged" in err


def test_a_damaged_shared_run_is_computed_again(tmp_path):
    from kvpop.evaluate.grid import Item, SharedStore

    item = Item("doc", "x", "user", "0", torch.arange(8))
    shared = SharedStore(tmp_path, item)
    shared.put("dense", {"h": torch.ones(2)})
    (shared.dir / "dense.safetensors").write_bytes(b"")
    assert shared.get("dense") is None and not (shared.dir / "dense.safetensors").exists()


# ------------------------------------------------------------------------------ numbers


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--docs", "0"], "--docs must be >= 1, got 0"),
        (["--doc-tokens", "0"], "--doc-tokens must be >= 2, got 0"),
        (["--compression", "0.5", "1.5"], "--compression must be > 0 and < 1, got 1.5"),
        (["--reference-length", "0"], "--reference-length must be >= 1, got 0"),
        (["--sinks", "-1"], "--sinks must be >= 0, got -1"),
        (["--window", "0"], "--window must be >= 1, got 0"),
        (["--window-fraction", "nan"], "--window-fraction must be >= 0 and <= 1, got nan"),
        (["--lam", "-0.5"], "--lam must be >= 0, got -0.5"),
        (["--continuation-tokens", "0"], "--continuation-tokens must be >= 1, got 0"),
        (["--longdep-threshold", "inf"], "--longdep-threshold must be >= 0, got inf"),
        (["--needle-lengths", "200", "0"], "--needle-lengths must be >= 1, got 0"),
        (["--needle-depths", "0.5", "1.5"], "--needle-depths must be >= 0 and <= 1, got 1.5"),
        (["--multikey-lengths", "-5"], "--multikey-lengths must be >= 1, got -5"),
        (["--multikey-cases", "0"], "--multikey-cases must be >= 1, got 0"),
        (["--multikey-keys", "27"], "--multikey-keys must be >= 1 and <= 26, got 27"),
        (["--agreement-tokens", "0"], "--agreement-tokens must be >= 1, got 0"),
        (["--bootstrap", "-1"], "--bootstrap must be >= 0, got -1"),
        (["--max-minutes", "0"], "--max-minutes must be > 0, got 0.0"),
        (["--shard", "3/2"], "--shard 3/2: need 1 <= I <= N"),
        (["--shard", "x"], "--shard must look like I/N (e.g. 1/2), got 'x'"),
    ],
)
def test_each_bad_number_names_its_own_flag_before_the_model_loads(tmp_path, no_model, capsys, extra, message):
    assert main(["--out", str(tmp_path / "out"), "--docs-from", str(tmp_path), *extra]) == 2
    assert _error(capsys) == f"kvpop eval: error: {message}"
    assert not (tmp_path / "out").exists()


def test_the_top_level_cli_checks_the_same_way(tmp_path, no_model, capsys):
    assert kvpop_main(["eval", "--out", str(tmp_path / "out"), "--docs", "0"]) == 2
    assert _error(capsys) == "kvpop eval: error: --docs must be >= 1, got 0"


def test_the_fingerprint_hashes_the_scorer_shipped_for_the_model_it_evaluates():
    """A learned policy given no file reads the scorer shipped for its model (Qwen's on Qwen); the
    fingerprint must hash that file, not the default model's, or replacing it would go unnoticed."""
    from types import SimpleNamespace

    from kvpop.checkpoint import ASSETS, DEFAULT_SCORERS
    from kvpop.evaluate.harness import content_kwargs, file_sha256, shipped_scorer_file, shipped_scorers_sha256
    from kvpop.testing import embedded_config, tiny_model

    qwen = SimpleNamespace(config=embedded_config("qwen2.5-coder-0.5b"))
    for kind, policy in (("mlp", "kvpop-mlp"), ("mlstm", "kvpop-mlstm")):
        path = ASSETS / f"qwen2.5-coder-0.5b-{kind}.safetensors"
        assert shipped_scorer_file(qwen.config, kind) == path
        digest = content_kwargs(qwen, None)[policy]["sha256"]
        assert digest == shipped_scorers_sha256(qwen.config, kind) != file_sha256(DEFAULT_SCORERS[kind])
    # the MLP for small budgets ships beside Qwen's default: the digest covers both files
    main, small = (ASSETS / f"qwen2.5-coder-0.5b-mlp{s}.safetensors" for s in ("", "-b55-512"))
    assert content_kwargs(qwen, None)["kvpop-mlp"]["sha256"] not in (file_sha256(small), file_sha256(main), None)
    mlstm = ASSETS / "qwen2.5-coder-0.5b-mlstm.safetensors"
    assert content_kwargs(qwen, None)["kvpop-mlstm"]["sha256"] == file_sha256(mlstm)  # one file: its own
    # a model no shipped scorer fits records no hash (its learned policies need --scorer)
    assert "kvpop-mlp" not in content_kwargs(tiny_model("qwen2"), None)


def test_the_same_scorer_bytes_resume_whatever_path_names_them(folders, tmp_path, monkeypatch, capsys):
    """The scorer's sha256 decides: a relative path, or a copy of the file elsewhere, resumes the folder."""
    model, model_dir, docs = folders
    path = _scorer(tmp_path / "mlp.safetensors", model, seed=0)
    out = tmp_path / "out"
    assert main(_args(model_dir, docs, out, "--policies", "dense", "kvpop-mlp", "--scorer", str(path))) == 0
    monkeypatch.chdir(tmp_path)
    assert main(_args(model_dir, docs, out, "--policies", "dense", "kvpop-mlp", "--scorer", path.name)) == 0
    assert _units_run(out) == 0
    copy = tmp_path / "elsewhere" / "copy.safetensors"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert main(_args(model_dir, docs, out, "--policies", "dense", "kvpop-mlp", "--scorer", str(copy))) == 0
    assert _units_run(out) == 0
    capsys.readouterr()
    _scorer(copy, model, seed=1)  # other bytes under the new name
    assert main(_args(model_dir, docs, out, "--policies", "dense", "kvpop-mlp", "--scorer", str(copy))) == 2
    assert f"the scorer file {copy} of policy kvpop-mlp" in _error(capsys)
