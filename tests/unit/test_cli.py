"""The command line: one meaning of --scorer, benchmark help, long prompts, quiet loading, defaults."""

import re
import warnings

import pytest

from kvpop.checkpoint import model_fingerprint, save_scorer
from kvpop.cli import main
from kvpop.cli.generate import demo_prompt
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import save_tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)
TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny model with an MLP and an mLSTM scorer trained for it (random init)."""
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model(root / "model", "llama")
    paths = {}
    for kind in ("mlp", "mlstm"):
        cfg = ScorerConfig(kind=kind, num_layers=2, kv_heads=2, head_dim=16)
        meta = {"fingerprint": model_fingerprint(model)}
        paths[kind] = save_scorer(build_scorer(cfg), root / f"{kind}.safetensors", meta)
    (root / "prompt.txt").write_text(TEXT)
    return root, paths


def _generate(root, *extra):
    return main(
        [
            "generate",
            "--model",
            str(root / "model"),
            "--prompt-file",
            str(root / "prompt.txt"),
            "--budget",
            "16",
            "--window",
            "4",
            "--max-new-tokens",
            "6",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "bench,option",
    [
        ("generate", "--decode-steps"),
        ("overhead", "--context"),
        ("prefill", "--repeats"),
        ("targets", "--sizes"),
        ("gpu", "--contexts"),
    ],
)
def test_bench_subcommand_help_shows_its_options(bench, option, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", bench, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"kvpop bench {bench}" in out and option in out


def test_generate_prompt_file_reports_speed_and_memory_quietly(tiny, capsys):
    root, _ = tiny
    assert _generate(root, "--policy", "knorm") == 0
    out, err = capsys.readouterr()
    assert out.strip()  # the generated text
    assert "Loading weights" not in err  # transformers' per-load bar is silenced
    assert "policy=knorm KVpopCache(sinks=4, window=4, k=8, budget=16" in err
    assert "[kvpop] base model: " in err and "[kvpop] model=base policy=knorm " in err  # which model ran
    assert "tok/s" in err and "prompt 492 tokens" in err and "generated 6 tokens" in err
    assert "KV cache held 8.0 KiB vs" in err and "dense" in err
    assert "decode step: eager" in err  # KVPOP_COMPILE=0 in this suite (tests/conftest.py)


@pytest.mark.slow
def test_generate_says_it_ran_the_compiled_step_by_default(tiny, capsys, monkeypatch):
    """A fresh `kvpop generate` compiles its steady decode step once the generation is long enough (after
    EAGER_STEPS eager steps) unless --no-compile, and says which ran."""
    from kvpop.testing import compile_unavailable

    root, _ = tiny
    monkeypatch.delenv("KVPOP_COMPILE", raising=False)
    assert (
        main(
            [
                "generate",
                "--model",
                str(root / "model"),
                "--prompt",
                "hello there",
                "--policy",
                "knorm",
                "--budget",
                "16",
                "--window",
                "4",
                "--max-new-tokens",
                "64",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    if "compiling failed" in err:
        compile_unavailable(err)
    assert "decode step: compiled" in err
    assert _generate(root, "--policy", "knorm", "--no-compile") == 0
    assert "decode step: eager" in capsys.readouterr().err


def test_generate_default_policy_is_the_shipped_scorer(tiny, capsys):
    root, _ = tiny
    assert _generate(root) == 2  # the shipped scorer was trained for SmolLM2, not this model
    err = capsys.readouterr().err
    assert "smollm2-135m-instruct-mlp" in err and "different model" in err


@pytest.mark.parametrize("kind,policy", [("mlp", "kvpop-mlp"), ("mlstm", "kvpop-mlstm")])
def test_generate_scorer_path_picks_its_policy(tiny, capsys, kind, policy):
    root, paths = tiny
    assert _generate(root, "--scorer", str(paths[kind])) == 0
    assert f"policy={policy} " in capsys.readouterr().err
    assert _generate(root, "--scorer", str(paths[kind]), "--policy", "h2o") == 2
    assert f"is a {kind} scorer (policy {policy}); it cannot serve --policy h2o" in capsys.readouterr().err


def test_train_kind_flag():
    from kvpop.cli.train import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--kind", "mlp", "--out", "x"])).scorer == "mlp"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--scorer", "mlp", "--out", "x"])  # --scorer is a checkpoint path elsewhere


def test_eval_scorer_is_a_path_routed_by_its_kind(tiny, tmp_path, capsys):
    from kvpop.cli.eval import build_parser, config_from_args

    _, paths = tiny
    args = build_parser().parse_args(["--out", "x", "--scorer", str(paths["mlp"]), "--scorer", str(paths["mlstm"])])
    assert config_from_args(args).policy_kwargs == {
        "kvpop-mlp": {"path": str(paths["mlp"])},
        "kvpop-mlstm": {"path": str(paths["mlstm"])},
    }
    twice = build_parser().parse_args(["--out", "x", "--scorer", str(paths["mlp"]), "--scorer", str(paths["mlp"])])
    with pytest.raises(ValueError, match="two --scorer checkpoints of policy kvpop-mlp"):
        config_from_args(twice)
    from kvpop.cli.eval import main as eval_main

    assert eval_main(["--out", str(tmp_path), "--scorer", str(tmp_path / "missing.safetensors")]) == 2
    assert "no scorer checkpoint at" in capsys.readouterr().err


def test_demo_prompt_is_a_few_thousand_tokens():
    try:
        text = demo_prompt()
    except FileNotFoundError as exc:  # the paul_graham corpus is part of the setup
        pytest.skip(str(exc))
    assert 15_000 < len(text) < 40_000 and text.endswith("?")


def test_info_shows_the_split_and_lam_the_cache_would_use(tiny, capsys):
    import json

    root, _ = tiny
    assert (
        main(["info", "--model", str(root / "model"), "--policy", "h2o", "--budget", "16", "--lam", "0.01", "--json"])
        == 0
    )
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget == {"policy": "h2o", "sinks": 4, "window": 8, "k": 4, "B": 16, "lam": 0.01}
    # the default policy is the shipped scorer, trained for SmolLM2: on another model, the library's split
    assert main(["info", "--model", str(root / "model"), "--budget", "16", "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget["policy"] == "knorm" and budget["window"] == 8 and budget["lam"] == 0.0
    # a learned policy named explicitly on the wrong model is the usual clear error
    assert main(["info", "--model", str(root / "model"), "--policy", "kvpop-mlstm", "--budget", "16"]) == 2


def test_generate_with_an_adapter_bundle(tiny, tmp_path, capsys, monkeypatch):
    """--adapter loads a bundle and its scorer serves the default policy; --base-model excludes it;
    the shipped bundle is used by default only for the embedded model."""
    import argparse

    from kvpop import checkpoint
    from kvpop.adapt.lora import add_lora, save_adapter_bundle
    from kvpop.cli.generate import _compare_adapter, _generate_adapter
    from kvpop.testing import tiny_model

    root, _ = tiny
    scorer = build_scorer(ScorerConfig(kind="mlstm", num_layers=2, kv_heads=2, head_dim=16))
    save_adapter_bundle(add_lora(tiny_model("llama")), scorer, tmp_path / "bundle", {"trained_for": {"budgets": [16]}})
    assert _generate(root, "--adapter", str(tmp_path / "bundle")) == 0  # not the shipped scorer (which would fail)
    err = capsys.readouterr().err
    assert "adapted model:" in err and "model=adapted policy=kvpop-mlstm " in err
    # kvpop: the model's default learned policy, here the mLSTM bundle's, named as the concrete policy
    assert _generate(root, "--adapter", str(tmp_path / "bundle"), "--policy", "kvpop") == 0
    assert "model=adapted policy=kvpop-mlstm " in capsys.readouterr().err
    assert _generate(root, "--adapter", str(tmp_path / "bundle"), "--base-model") == 2
    assert "--adapter and --base-model exclude each other" in capsys.readouterr().err
    # a bundle with an MLP scorer serves kvpop-mlp by default (it used to fall back to the shipped mLSTM)
    mlp = build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16))
    save_adapter_bundle(add_lora(tiny_model("llama")), mlp, tmp_path / "mlp-bundle", {"trained_for": {"budgets": [16]}})
    assert _generate(root, "--adapter", str(tmp_path / "mlp-bundle")) == 0
    err = capsys.readouterr().err
    assert "policy=kvpop-mlp " in err and "adapter bundle" in err
    assert _generate(root, "--adapter", str(tmp_path / "mlp-bundle"), "--policy", "kvpop-mlstm") == 2
    assert "whose scorer is a mlp (policy 'kvpop-mlp')" in capsys.readouterr().err
    # one rule in the API: the bundle's scorer through the model and through its config alike
    import kvpop

    model, _ = kvpop.load_model(str(root / "model"), adapter=tmp_path / "mlp-bundle", progress=False)
    for cache in (
        kvpop.KVpopCache(model.config, budget=16, policy="kvpop-mlp"),
        kvpop.make_cache(model, "kvpop-mlp", budget=16),
    ):
        assert "adapter bundle" in cache.policy.source and cache.policy.scorer.config.kind == "mlp"
    # no policy named, or kvpop: the bundle's (the default follows the bundle, whichever kind its scorer is)
    for cache in (
        kvpop.KVpopCache(model.config, budget=16),
        kvpop.make_cache(model, budget=16),
        kvpop.KVpopCache(model.config, budget=16, policy="kvpop"),
        kvpop.make_cache(model, "kvpop", budget=16),
    ):
        assert "adapter bundle" in cache.policy.source and cache.policy.scorer.config.kind == "mlp"
    assert kvpop.default_policy(model) == "kvpop-mlp" == kvpop.default_policy(config=model.config)
    # the other learned policy by name stays an error that names the one serving the bundle
    with pytest.raises(ValueError, match="whose scorer is a mlp"):
        kvpop.KVpopCache(model.config, budget=16, policy="kvpop-mlstm")
    assert _generate(root, "--adapter", str(tmp_path / "bundle"), "--base-model") == 2
    assert "--adapter and --base-model exclude each other" in capsys.readouterr().err

    def args(**kw):
        base = {"adapter": None, "base_model": False, "model": None, "scorer": None}
        return argparse.Namespace(**{**base, **kw})

    monkeypatch.setattr(checkpoint, "DEFAULT_ADAPTER", tmp_path / "bundle")
    assert (
        _generate_adapter(args(), "kvpop-mlstm") == "default"
    )  # the embedded model, the policy the mLSTM bundle serves
    assert _generate_adapter(args(), None) == "default" and _generate_adapter(args(), "kvpop-mlp") is None
    assert _generate_adapter(args(base_model=True), "kvpop-mlstm") is None
    assert _generate_adapter(args(), "streaming") is None
    # one meaning of dense: the model the default runs, alone or as a row of --compare
    assert _generate_adapter(args(), "dense") == "default" == _compare_adapter(args(), ["dense", "streaming"])
    assert _generate_adapter(args(base_model=True), "dense") is None
    assert _generate_adapter(args(model="x"), "dense") is None
    assert _compare_adapter(args(), ["streaming", "h2o"]) is None  # no policy the bundle serves: the base model
    assert (
        _generate_adapter(args(model="x"), "kvpop-mlstm") is None
        and _generate_adapter(args(scorer="s"), "kvpop-mlstm") is None
    )
    # --compare loads the shipped bundle when the policy its scorer serves is compared
    assert _compare_adapter(args(), ["dense", "streaming", "kvpop-mlstm"]) == "default"
    assert _compare_adapter(args(), ["dense", "streaming", "kvpop-mlp"]) is None
    monkeypatch.setattr(checkpoint, "DEFAULT_ADAPTER", tmp_path / "mlp-bundle")  # an MLP bundle ships
    assert _compare_adapter(args(), ["dense", "streaming", "kvpop-mlp"]) == "default"
    assert (
        _compare_adapter(args(), ["dense", "kvpop-mlstm"]) is None
        and _compare_adapter(args(base_model=True), ["kvpop-mlp"]) is None
    )
    assert _compare_adapter(args(), ["dense", "streaming"]) == "default" == _generate_adapter(args(), "dense")
    # another learned policy by name runs on the base model (the LoRA was adapted under the bundle's scorer)
    assert _generate_adapter(args(), "kvpop-mlp") == "default" and _generate_adapter(args(), "kvpop-mlstm") is None
    assert _generate_adapter(args(), None) == "default"  # none named: the bundle, whichever kind its scorer is
    assert _compare_adapter(args(adapter="x"), ["dense"]) == "x"
    monkeypatch.setattr(checkpoint, "DEFAULT_ADAPTER", tmp_path / "none")
    assert _generate_adapter(args(), "kvpop-mlstm") is None  # nothing shipped: the base model


def test_dense_runs_the_model_the_default_runs_with_the_shipped_bundle():
    """On the embedded model, dense alone and a dense row of --compare run the adapted bundle the default runs;
    --base-model runs the base model for all. Decided from the shipped bundle's files (no model loads)."""
    import argparse

    from kvpop import checkpoint
    from kvpop.cli.generate import _bundle_policy, _compare_adapter, _generate_adapter

    try:
        checkpoint.default_adapter_path()
    except FileNotFoundError:
        pytest.skip("no adapter bundle ships with this install")
    served = _bundle_policy("default", "kvpop-mlp")
    other = "kvpop-mlstm" if served == "kvpop-mlp" else "kvpop-mlp"
    args = argparse.Namespace(adapter=None, base_model=False, model=None, scorer=None)
    assert _generate_adapter(args, None) == _generate_adapter(args, "dense") == "default"
    assert _generate_adapter(args, served) == "default"
    assert _compare_adapter(args, ["dense", "streaming"]) == _compare_adapter(args, ["dense", served]) == "default"
    assert _compare_adapter(args, ["dense", other]) is None  # the other learned policy: every row on the base model
    base = argparse.Namespace(adapter=None, base_model=True, model=None, scorer=None)
    assert all(_compare_adapter(base, names) is None for names in ([None], ["dense"], ["dense", served]))


def test_generate_compare_answers_under_each_policy_with_one_model_load(tiny, capsys, monkeypatch):
    """--compare: one load, the same prompt under each policy, one table (answer, KV held, tok/s, compiled)."""
    import kvpop.models

    root, paths = tiny
    loads = []
    real = kvpop.models.load_model
    monkeypatch.setattr(kvpop.models, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    # kvpop with --scorer: the policy of that scorer, named as the concrete policy in the table
    assert _generate(root, "--compare", "dense,streaming,kvpop", "--scorer", str(paths["mlstm"])) == 0
    out, err = capsys.readouterr()
    assert len(loads) == 1
    lines = out.strip().splitlines()
    assert lines[0].startswith("| policy | KV held (vs dense) | prefill tok/s | decode tok/s | decode step | answer |")
    cells = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]
    rows = {c[0]: c[1:] for c in cells}
    assert list(rows) == ["dense", "streaming", "kvpop-mlstm"]
    assert rows["dense"][0].endswith("(100.0%)") and rows["dense"][3] == "-"  # dense holds every token, no kvpop cache
    assert rows["streaming"][0].startswith("8.0 KiB (") and rows["kvpop-mlstm"][0].startswith(
        "8.0 KiB ("
    )  # B = 16 each
    assert rows["kvpop-mlstm"][3] == "eager"  # the suite runs eagerly (KVPOP_COMPILE=0)
    assert all(r[4] for r in rows.values())  # every row answered
    assert "kvpop-mlstm: KVpopCache(sinks=4, window=4, k=8, budget=16" in err and "[kvpop] model=base;" in err
    # the same answers as one policy at a time
    assert _generate(root, "--policy", "streaming") == 0
    assert capsys.readouterr().out.strip().split() == rows["streaming"][4].split()


def test_generate_compare_checks_its_arguments_before_loading(tiny, capsys, monkeypatch):
    import kvpop.models

    root, _ = tiny
    monkeypatch.setattr(kvpop.models, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert _generate(root, "--compare", "dense,nope") == 2
    assert "--compare: unknown policy 'nope'" in capsys.readouterr().err
    assert _generate(root, "--compare", "dense,streaming", "--policy", "h2o") == 2
    assert "--compare and --policy exclude each other" in capsys.readouterr().err
    assert _generate(root, "--compare", ",") == 2
    assert "give at least one policy" in capsys.readouterr().err


def test_bench_overhead_takes_a_scorer_for_its_kind(tiny, tmp_path, capsys):
    """`kvpop bench overhead --scorer` times the learned policy of the checkpoint's kind with that
    checkpoint (a model with no shipped scorer, like Gemma, can be benchmarked with its own), next to
    the floor and dense; an unreadable checkpoint is one error before the model loads."""
    import json

    root, paths = tiny
    out = tmp_path / "overhead"
    argv = [
        "bench",
        "overhead",
        "--model",
        str(root / "model"),
        "--policies",
        "streaming,kvpop-mlp",
        "--compile",
        "",
        "--budget",
        "16",
        "--context",
        "40",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--out",
        str(out),
    ]
    assert main([*argv, "--scorer", str(paths["mlp"])]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["name"] for r in result["rows"]] == ["floor", "dense", "streaming", "kvpop-mlp"]
    assert all(r["steps"] == 4 and r["step_ms"] > 0 for r in result["rows"])
    assert result["options"]["scorer"] == str(paths["mlp"]) and out.with_suffix(".png").exists()
    with pytest.raises(SystemExit, match="--scorer .*missing"):
        main([*argv, "--scorer", str(tmp_path / "missing.safetensors")])
