"""kvpop.evaluate: metric math, one-forward parity with token-by-token, harness, plots, CLI (tiny models)."""

import json
import math
import warnings

import pytest
import torch

from kvpop import EvictionConfig, KVpopCache
from kvpop.cli.eval import main
from kvpop.compat import cache_kwargs
from kvpop.evaluate import (
    DenseOutputs,
    EvalConfig,
    PolicyUnavailable,
    Sums,
    build_cache,
    policy_available,
    run_eval,
    sums_from_logits,
    teacher_forced,
)
from kvpop.evaluate.core import oracle_targets_multi
from kvpop.testing import save_tiny_model, tiny_model, tiny_tokenizer

warnings.filterwarnings("ignore", category=FutureWarning)

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
)


def _ids(n, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n]


def test_metrics_math():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([1, 2, 3, 4, 5])
    m = sums_from_logits(logits, logits.clone(), targets).metrics()
    assert m["n_tokens"] == 5 and m["retention"] == pytest.approx(1.0) and m["kl"] == pytest.approx(0.0, abs=1e-12)
    assert m["top1_agreement"] == 1.0
    nll = -torch.log_softmax(logits.double(), -1)[torch.arange(5), targets].mean().item()
    assert m["nll_dense"] == pytest.approx(nll) and m["ppl_dense"] == pytest.approx(math.exp(nll))
    # uniform policy: KL = log V - H(dense), retention = ppl_dense / V
    m = sums_from_logits(logits, torch.zeros(5, 11), targets).metrics()
    p = torch.softmax(logits.double(), -1)
    kl = (p * (p.log() - math.log(1 / 11))).sum(-1).mean().item()
    assert m["kl"] == pytest.approx(kl) and m["retention"] == pytest.approx(math.exp(nll) / 11)
    # pooling is exact
    a, b = (
        sums_from_logits(logits[:2], logits[:2] * 0.5, targets[:2]),
        sums_from_logits(logits[2:], logits[2:] * 0.5, targets[2:]),
    )
    whole = sums_from_logits(logits, logits * 0.5, targets).metrics()
    for k, v in a.add(b).metrics().items():
        assert v == pytest.approx(whole[k])
    assert math.isnan(Sums().metrics()["retention"])


@pytest.mark.parametrize("policy", ["knorm", "h2o"])
def test_budget_at_least_length_is_dense(policy):
    model = tiny_model("llama")
    ids = _ids(40)
    m = teacher_forced(model, ids, policy, EvictionConfig.from_budget(48, window=8, sinks=2))
    assert m["scored_from"] == 0 and m["n_tokens"] == 39
    assert m["retention"] == pytest.approx(1.0, abs=1e-5)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6) and m["top1_agreement"] == 1.0


def _policies_for_parity():
    names = ["streaming", "knorm", "h2o", "tova"]
    if policy_available("oracle") is None:
        names.append("oracle")
    return names


@pytest.mark.parametrize("policy", _policies_for_parity())
def test_one_forward_equals_token_by_token(policy):
    model = tiny_model("llama")
    ids = _ids(70, seed=1)
    budget = EvictionConfig.from_budget(24, window=6, sinks=2)
    dense = DenseOutputs()
    got = teacher_forced(model, ids, policy, budget, dense=dense)
    assert got["scored_from"] == 24 and got["n_tokens"] == 70 - 1 - 24
    # reference: dense logits with no cache, policy logits by feeding the physical cache token by token
    with torch.no_grad():
        dl = model(ids.view(1, -1)).logits[0]
        oracle = oracle_targets_multi(model, ids, [6]) if policy == "oracle" else None
        cache = build_cache(model, policy, 24, window=6, sinks=2, oracle=oracle)
        pl = torch.cat([model(ids.view(1, -1)[:, i : i + 1], **cache_kwargs(cache)).logits[0] for i in range(70)])
    ref = sums_from_logits(dl[24:69], pl[24:69], ids[25:70]).metrics()
    assert ref["retention"] != pytest.approx(1.0, abs=1e-6)  # eviction changed something
    for k in ("nll_dense", "nll_policy", "retention", "kl", "top1_agreement"):
        assert got[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-5), k


def test_one_budget_rule_for_evaluation_and_cache():
    """Compression bounds are EvictionConfig's, wherever a budget is stated: (0, 1)."""
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="compression must be in \\(0, 1\\)"):
            EvalConfig(compressions=(bad,), reference_length=64).budgets()
        with pytest.raises(ValueError, match="compression must be in \\(0, 1\\)"):
            KVpopCache(tiny_model("llama").config, compression=bad, reference_length=64, policy="knorm")
    (b,) = EvalConfig(compressions=(0.875,), reference_length=4096, window_fraction=None).budgets()
    assert b == EvictionConfig.from_budget(compression=0.875, reference_length=4096)
    assert (b.budget, b.window, b.sinks, b.k) == (512, 256, 4, 252)
    # the default evaluation resolves each policy's window as a cache does (B / 2 for the heuristics)
    (b,) = EvalConfig(compressions=(0.875,), reference_length=4096).budgets()
    assert (b.budget, b.window, b.sinks, b.k) == (512, 256, 4, 252)


def test_unregistered_policy_is_reported():
    assert "not registered" in policy_available("no-such-policy")


def _small_cfg(**kw):
    base = {
        "tasks": ("lm", "continuation", "agreement", "needle", "multikey"),
        "policies": ("dense", "knorm", "streaming", "no-such-policy"),
        "skip_unavailable": True,
        "compressions": (0.5, 0.75),
        "reference_length": 64,
        "docs": 1,
        "doc_tokens": 64,
        "agreement_tokens": 6,
        "needle_lengths": (220,),
        "needle_depths": (0.5,),
        "multikey_lengths": (300,),
        "multikey_cases": 2,
        "bootstrap": 200,
    }
    base.update(kw)
    return EvalConfig(**base)


def test_run_eval_schema_and_plots(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    docs = {"mine": [_ids(64, seed=2), _ids(64, seed=3)]}
    res = run_eval(model, tok, _small_cfg(), documents=docs, filler=TEXT * 20, out=tmp_path, progress=False)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema_version"] == 2 and data["policies"] == ["dense", "streaming", "knorm"]
    assert "no-such-policy" in data["skipped_policies"]
    recs = data["records"]
    for r in recs:
        assert {
            "task",
            "policy",
            "domain",
            "budget",
            "window",
            "sinks",
            "compression",
            "metrics",
            "wall_s",
        } <= set(r)
    lm = [r for r in recs if r["task"] == "lm"]
    assert {(r["policy"], r["budget"]) for r in lm} == {
        (p, b) for p in ("dense", "knorm", "streaming") for b in (32, 16)
    }
    for r in lm:
        assert r["domain"] == "user" and r["n_items"] == 2
        assert set(r["metrics"]) >= {"retention", "kl", "top1_agreement", "nll_policy", "ppl_dense"}
        if r["policy"] == "dense":
            assert r["metrics"]["retention"] == pytest.approx(1.0) and r["metrics"]["kl"] == pytest.approx(0.0)
        assert r["metrics"]["n_tokens"] == 2 * (63 - r["budget"])
        assert r["longdep"]["n_tokens"] <= r["metrics"]["n_tokens"] and "ci" in r and "per_item" in r
        assert r["window"] == (
            None if r["policy"] == "dense" else r["budget"] - 4 if r["policy"] == "streaming" else r["budget"] // 2
        )  # the same window fraction for every policy, recorded
    cont = [r for r in recs if r["task"] == "continuation"]
    assert cont and all(r["metrics"]["n_tokens"] == 2 * 4 for r in cont)  # the last 64 // 16 = 4 predictions
    agr = [r for r in recs if r["task"] == "agreement"]
    assert all(0.0 <= r["metrics"]["match_rate"] <= 1.0 for r in agr)
    assert [r["metrics"]["match_rate"] for r in agr if r["policy"] == "dense"] == [1.0]
    needle = [r for r in recs if r["task"] == "needle"]
    assert needle and all(len(r["cases"]) == 1 and "answer" in r["cases"][0] for r in needle)
    mk = [r for r in recs if r["task"] == "multikey"]
    assert {(r["policy"], r["budget"]) for r in mk} == {("dense", None)} | {
        (p, b) for p in ("knorm", "streaming") for b in (32, 16)
    }
    assert all(r["metrics"]["n_cases"] == 2 and set(r["by_length"]) == {"300"} for r in mk)
    for name in ("lm", "continuation", "agreement", "needle", "needle_heatmap", "multikey", "multikey_vs_compression"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000, name
    assert (tmp_path / "table.md").read_text().startswith("# kvpop eval")
    assert res["records"] == recs


def test_run_eval_on_fixture_corpora(tmp_path):
    from pathlib import Path

    fixtures = Path(__file__).parents[1] / "fixtures" / "corpora"
    roots = {name: fixtures / name for name in ("paul_graham", "python_code")}
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _small_cfg(
        tasks=("lm",),
        policies=("dense", "knorm"),
        compressions=(0.75,),
        corpora=tuple(roots),
        corpus_root=roots,
    )
    res = run_eval(model, tok, cfg, progress=False, plots=False, out=tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["selection"]["corpus_root"][
        "paul_graham"
    ].endswith("paul_graham")
    doms = {(r["domain"], tuple(r["corpora"])) for r in res["records"]} | {("note", n) for n in res["notes"]}
    # every corpus is either evaluated in its domain or skipped with a note
    assert ("in_domain", ("paul_graham",)) in doms or any("paul_graham" in str(d) for d in doms)
    assert ("out_of_domain", ("python_code",)) in doms or any("python_code" in str(d) for d in doms)


def test_split_picks_the_documents_and_is_part_of_the_fingerprint(tmp_path):
    """--split validation reads the validation documents, records the split (a test-split folder refuses to
    resume with it) and leaves the test-split fingerprint as it was; a bad split fails before any work."""
    from pathlib import Path

    from kvpop.data import long_documents
    from kvpop.evaluate.harness import corpus_documents, fingerprint

    fixtures = Path(__file__).parents[1] / "fixtures" / "corpora"
    roots = {"paul_graham": fixtures / "paul_graham"}
    model, tok = tiny_model("llama"), tiny_tokenizer()
    test_cfg = _small_cfg(
        tasks=("lm",),
        policies=("dense", "knorm"),
        compressions=(0.75,),
        corpora=("paul_graham",),
        corpus_root=roots,
        doc_tokens=32,
        reference_length=64,
    )
    val_cfg = _small_cfg(**{**test_cfg.__dict__, "split": "validation"})
    for cfg, split in ((test_cfg, "test"), (val_cfg, "validation")):
        ((_, name, docs),) = corpus_documents(tok, cfg, [])
        want = long_documents(tok, "paul_graham", 32, split=split, max_docs=1, root=roots["paul_graham"])
        assert name == "paul_graham" and [d.tolist() for d in docs] == [d.tolist() for d in want] and want
    assert "split" not in fingerprint(model, test_cfg)  # folders made before --split still resume and merge
    assert fingerprint(model, val_cfg) == {**fingerprint(model, test_cfg), "split": "validation"}
    run_eval(model, tok, test_cfg, progress=False, plots=False, out=tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        run_eval(model, tok, val_cfg, progress=False, plots=False, out=tmp_path)
    with pytest.raises(ValueError, match="split must be one of train, validation, test"):
        run_eval(
            model,
            tok,
            _small_cfg(**{**test_cfg.__dict__, "split": "dev"}),
            progress=False,
            plots=False,
            out=tmp_path / "bad",
        )
    assert not (tmp_path / "bad").exists()


def test_cli_on_saved_tiny_model(tmp_path, capsys):
    save_tiny_model(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT * 3)
    (docs / "b.txt").write_text(TEXT[::-1] * 3)
    out = tmp_path / "out"
    args = [
        "--model",
        str(tmp_path / "model"),
        "--docs-from",
        str(docs),
        "--out",
        str(out),
        "--quick",
        "--doc-tokens",
        "64",
        "--policies",
        "dense",
        "knorm",
        "no-such-policy",
        "--no-progress",
    ]
    assert main(args) == 2  # an unavailable policy is an error ...
    err = capsys.readouterr().err
    assert "no-such-policy" in err and "--skip-unavailable" in err
    assert not (out / "run.json").exists()  # ... found before any work
    rc = main([*args, "--skip-unavailable"])  # ... unless asked to skip it
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in data["records"]} == {"dense", "knorm"}
    assert "no-such-policy" in data["skipped_policies"]
    assert all(
        r["task"] in ("lm", "continuation") and r["domain"] == "user" and r["budget"] == 8 for r in data["records"]
    )
    assert (out / "lm.png").exists()
    printed = capsys.readouterr().out
    assert "knorm" in printed and "results.json" in printed and "skipped policies: no-such-policy" in printed
    assert main(["--out", str(out), "--compression", "1.5"]) == 2
    assert main(["--out", str(out), "--compression", "0"]) == 2  # no eviction is policy dense, not compression 0


def test_missing_learned_scorer_is_an_error_unless_skipped(tmp_path):
    model = tiny_model("llama")
    kw = {
        "tasks": ("lm",),
        "policies": ("dense", "kvpop-mlp"),
        "compressions": (0.75,),
        "policy_kwargs": {"kvpop-mlp": {"path": str(tmp_path / "missing.safetensors")}},
    }
    with pytest.raises(PolicyUnavailable, match="kvpop-mlp"):
        run_eval(
            model,
            tiny_tokenizer(),
            _small_cfg(**kw, skip_unavailable=False),
            documents={"x": [_ids(64)]},
            progress=False,
            plots=False,
        )
    res = run_eval(model, tiny_tokenizer(), _small_cfg(**kw), documents={"x": [_ids(64)]}, progress=False, plots=False)
    assert "kvpop-mlp" in res["skipped_policies"] and res["policies"] == ["dense"]
    assert {r["policy"] for r in res["records"]} == {"dense"}


def test_eval_checks_the_shipped_scorer_against_the_model():
    """kvpop eval builds learned policies with the model at hand: a scorer for another model is an error
    (or, with skip_unavailable, skipped), with why."""
    kw = {"tasks": ("lm",), "policies": ("dense", "kvpop-mlstm"), "compressions": (0.75,)}
    with pytest.raises(PolicyUnavailable, match="different model"):
        run_eval(
            tiny_model("llama"),
            tiny_tokenizer(),
            _small_cfg(**kw, skip_unavailable=False),
            documents={"x": [_ids(64)]},
            progress=False,
            plots=False,
        )
    res = run_eval(
        tiny_model("llama"),
        tiny_tokenizer(),
        _small_cfg(**kw),
        documents={"x": [_ids(64)]},
        progress=False,
        plots=False,
    )
    assert res["policies"] == ["dense"]
    assert "different model" in res["skipped_policies"]["kvpop-mlstm"]
