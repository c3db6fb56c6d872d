"""Bad arguments are refused before any work: exit code 2, one line on stderr naming the argument (or file),
no traceback, and no model loaded where the values alone decide."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import kvpop.models
from kvpop.cli import main
from kvpop.cli.options import model_position_limit

NOT_UTF8 = b"The capital of \xff France is"

# argv (after `kvpop`; "{model}": a model folder whose config.json says max_position_embeddings=4096, "{bad}": a
# file with a byte that is not UTF-8, "-" reads standard input, which holds that text) -> a fragment of the one line
ROWS = [
    (
        ["generate", "--compare", "dense,streaming", "--sinks", "600"],
        "--sinks 600 leaves no slot for the recent window",
    ),
    (["generate", "--sinks", "600"], "--sinks 600 leaves no slot for the recent window in the default --budget 512"),
    (["generate", "--policy", "streaming", "--budget", "16", "--sinks", "16"], "--sinks 16 leaves no slot"),
    (
        ["generate", "--policy", "h2o", "--compression", "0.5", "--reference-length", "64", "--sinks", "40"],
        "--sinks 40 leaves no slot for the recent window in --compression 0.5 of --reference-length 64 (B=32)",
    ),
    (["generate", "--policy", "knorm", "--budget", "8", "--window", "8"], "budget=8 is smaller than sinks + window"),
    (
        ["generate", "--model", "{model}", "--budget", "100000"],
        "--budget 100000 exceeds the model's position limit max_position_embeddings=4096",
    ),
    (
        ["generate", "--model", "{model}", "--compare", "dense,streaming", "--budget", "100000"],
        "max_position_embeddings=4096",
    ),
    (["info", "--model", "{model}", "--budget", "100000"], "max_position_embeddings=4096"),
    (["info", "--sinks", "600"], "--sinks 600 leaves no slot"),
    (["generate", "--max-new-tokens", "0", "--policy", "dense"], "--max-new-tokens must be a positive int, got 0"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be a positive int, got 0"),
    (["generate", "--max-new-tokens", "0", "--compare", "dense"], "--max-new-tokens must be a positive int, got 0"),
    (["generate", "--max-new-tokens", "-3", "--policy", "streaming"], "--max-new-tokens must be a positive int"),
    (["generate", "--budget", "0"], "--budget must be a positive int, got 0"),
    (["generate", "--policy", "knorm", "--budget", "64", "--lam", "nan"], "--lam must be a finite number"),
    (["generate", "--compression", "1.5"], "--compression must be in (0, 1)"),
    (
        ["generate", "--prompt", "The capital of \udcff France is"],
        "--prompt is not UTF-8 text: byte 0xff at character 15",
    ),
    (["generate", "--policy", "dense", "--prompt", ""], "--prompt is empty"),
    (["generate", "--policy", "dense", "--prompt-file", "{bad}"], "is not UTF-8 text: byte 0xff at offset 15"),
    (["generate", "--prompt-file", "-"], "--prompt-file - is not UTF-8 text: byte 0xff at offset 15"),
    (["generate", "--prompt-file", "{missing}"], "--prompt-file"),
    (["generate", "--adapter", "{model}", "--base-model"], "--adapter and --base-model exclude each other"),
    (["generate", "--compare", "dense,nope"], "--compare: unknown policy 'nope'"),
    (["generate", "--compare", "dense,streaming", "--policy", "h2o"], "--compare and --policy exclude each other"),
]


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were refused")

    monkeypatch.setattr(kvpop.models, "load_model", refuse)


def _argv(argv: list[str], root: Path) -> list[str]:
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    (root / "bad.txt").write_bytes(NOT_UTF8)
    names = {"{model}": str(model), "{bad}": str(root / "bad.txt"), "{missing}": str(root / "missing.txt")}
    argv = [names.get(a, a) for a in argv]
    if argv[0] == "generate" and not {"--prompt", "--prompt-file", "--demo-prompt"} & set(argv):
        argv += ["--prompt", "hi"]
    return argv


@pytest.mark.parametrize("argv,fragment", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_refused_in_one_line_before_any_model_loads(argv, fragment, tmp_path, monkeypatch, capsys, no_model_load):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(NOT_UTF8), encoding="utf-8"))
    assert main(_argv(argv, tmp_path)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("kvpop: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in err


def test_a_text_only_stdin_is_checked_too(tmp_path, monkeypatch, capsys, no_model_load):
    """A replaced sys.stdin without a byte buffer carries bad bytes as surrogates (surrogateescape)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(NOT_UTF8.decode("utf-8", "surrogateescape")))
    assert main(["generate", "--prompt-file", "-"]) == 2
    assert "--prompt-file - is not UTF-8 text: byte 0xff at character 15" in capsys.readouterr().err


def test_the_embedded_model_budget_is_refused_from_its_config(capsys, no_model_load):
    """The embedded model's limit comes from its converted config.json in the kvpop cache (no weights load)."""
    found = model_position_limit(None)
    if found is None:
        pytest.skip("the embedded model is not converted in this kvpop cache yet (the cache refuses after the load)")
    assert main(["generate", "--prompt", "hi", "--budget", str(found[0] + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"max_position_embeddings={found[0]}" in err[0] and "config.json" in err[0]


def test_a_bounded_budget_within_the_limit_and_dense_pass_the_checks(tmp_path):
    """The checks refuse only what is wrong: the limit itself, and dense with any budget (dense ignores it)."""
    import argparse

    from kvpop.cli.generate import _check_args, _check_budget_fits

    root = tmp_path
    model = Path(_argv(["generate", "--model", "{model}"], root)[2])
    base = {
        "model": str(model),
        "compression": None,
        "reference_length": 4096,
        "window": None,
        "sinks": 4,
        "lam": None,
        "max_new_tokens": 1,
        "prompt": "hi",
        "adapter": None,
        "base_model": False,
    }
    at_limit = argparse.Namespace(**base, budget=4096)
    _check_args(at_limit, bounded=True)
    _check_budget_fits(at_limit)
    _check_args(argparse.Namespace(**base, budget=100000), bounded=False)  # dense: no cache, no budget to refuse
