"""Training: it runs and checkpoints, resume reproduces an uninterrupted run and refuses other settings,
the capture store is reused, DDP ranks stay identical, the loss and labels mean what they say."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpop.checkpoint import ScorerMismatchError, load_scorer, read_header, save_scorer
from kvpop.cli.train import main
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import save_tiny_model, tiny_model, tiny_tokenizer, write_word_docs
from kvpop.train import TrainConfig, train
from kvpop.train.labels import Labels, decision_weights, labels_for, layer_loss, margins


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return write_word_docs(tmp_path_factory.mktemp("docs"))


def _cfg(out, docs, **kw):
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
        "val_docs": 1,
        "progress": False,
        "lr": 1e-2,
        "observed": (None, 4, 1),
    }
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kind", ["mlp", "mlstm"])
def test_training_runs_and_writes_checkpoints(tmp_path, docs, kind):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    summary = train(_cfg(tmp_path, docs, scorer=kind, steps=6, budgets=(24, 32)), model, tok)
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert {h["budget"] for h in summary["history"]} <= {24, 32}
    header = read_header(tmp_path / "scorer.safetensors")
    assert header["config"]["kind"] == kind and header["config"]["position_free"] and header["config"]["tilt"]
    tf = header["meta"]["trained_for"]
    assert tf["window"] == 8 and tf["budget_range"] == [24, 32] and tf["budgets"] == [24, 32]
    assert summary["tokens_seen"] == 6 * 64
    # retention under the real cache was measured, next to streaming, and the best checkpoint kept
    vals = [h["val"] for h in summary["history"] if "val" in h]
    assert len(vals) == 2 and {"24", "32"} <= set(vals[0]) and "streaming" in vals[0]["24"]
    best = read_header(tmp_path / "best.safetensors")["meta"]
    assert best["steps"] == summary["best"]["step"]
    dec = summary["validation_decisions"]["24"]
    assert set(dec["baselines"]) == {"always_evict", "always_keep", "knorm", "random"}
    assert len(dec["per_layer_accuracy"]) == 2
    _, meta = load_scorer(tmp_path / "scorer.safetensors", model=model)
    assert meta["steps"] == 6


def test_resume_matches_uninterrupted_run(tmp_path, docs):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    full = tmp_path / "full"
    train(_cfg(full, docs, scorer="mlstm", val_docs=0), model, tok)
    part = tmp_path / "part"
    train(_cfg(part, docs, scorer="mlstm", val_docs=0, stop_after=4), model, tok)  # "killed" after step 4's checkpoint
    summary = train(_cfg(part, docs, scorer="mlstm", val_docs=0), model, tok)
    assert summary["history"][0]["step"] == 1 and len(summary["history"]) == 6
    a, _ = load_scorer(full / "scorer.safetensors")
    b, _ = load_scorer(part / "scorer.safetensors")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "change,needle",
    [({"budgets": (28,)}, "budgets"), ({"window": 6}, "window"), ({"lam": 0.01}, "lam"), ({"lr": 3e-3}, "lr")],
)
def test_resume_refuses_other_settings(tmp_path, docs, change, needle):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    train(_cfg(tmp_path, docs, scorer="mlp", val_docs=0, stop_after=2), model, tok)
    with pytest.raises(ValueError, match=f"other settings.*{needle}: checkpoint"):
        train(_cfg(tmp_path, docs, scorer="mlp", val_docs=0, **change), model, tok)


def test_capture_store_is_reused_and_guarded(tmp_path, docs):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = tmp_path / "store"
    filled = train(
        _cfg(tmp_path / "cap", docs, store=str(store), capture_only=True, steps=4, extra_windows=(4,)), model, tok
    )
    assert filled["captured"] == 4 and len(list(store.glob("seq_*.safetensors"))) == 4
    a = train(_cfg(tmp_path / "a", docs, scorer="mlp", val_docs=0, steps=4, store=str(store)), model, tok)
    b = train(_cfg(tmp_path / "b", docs, scorer="mlp", val_docs=0, steps=4), model, tok)  # captured on the fly
    assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]], rel=1e-3)
    # a run at the extra window reads it from the store; other settings are refused
    train(_cfg(tmp_path / "c", docs, scorer="mlp", val_docs=0, steps=2, window=4, store=str(store)), model, tok)
    # a run without observed-attention inputs reads the same store
    train(_cfg(tmp_path / "f", docs, scorer="mlp", val_docs=0, steps=2, observed=(), store=str(store)), model, tok)
    with pytest.raises(ValueError, match="no targets for windows"):
        train(_cfg(tmp_path / "d", docs, scorer="mlp", val_docs=0, steps=2, window=5, store=str(store)), model, tok)
    with pytest.raises(ValueError, match="other settings"):
        train(_cfg(tmp_path / "e", docs, scorer="mlp", val_docs=0, steps=2, sinks=3, store=str(store)), model, tok)
    # the store holds mean targets: a run learning the power mean is refused, and captures its own store
    with pytest.raises(ValueError, match="other settings.*target_power"):
        train(
            _cfg(tmp_path / "p", docs, scorer="mlp", val_docs=0, steps=2, target_power=8.0, store=str(store)),
            model,
            tok,
        )
    p8 = train(
        _cfg(tmp_path / "p8", docs, scorer="mlp", val_docs=0, steps=4, target_power=8.0, store=str(tmp_path / "s8")),
        model,
        tok,
    )
    assert [h["loss"] for h in p8["history"]] != pytest.approx([h["loss"] for h in a["history"]], rel=1e-3)
    assert json.loads((tmp_path / "s8" / "store.json").read_text())["target_power"] == 8.0
    # a store from before the bfloat16 weight hash still serves the model; another model's weights do not
    meta = json.loads((store / "store.json").read_text())
    del meta["fingerprint"]["weights_bf16_sha256"]
    (store / "store.json").write_text(json.dumps(meta))
    train(_cfg(tmp_path / "g", docs, scorer="mlp", val_docs=0, steps=2, store=str(store)), model, tok)
    with pytest.raises(ValueError, match="other settings.*fingerprint"):
        train(
            _cfg(tmp_path / "h", docs, scorer="mlp", val_docs=0, steps=2, store=str(store)),
            tiny_model("llama", seed=1),
            tok,
        )


def test_data_seed_reuses_the_store_for_a_seed_control(tmp_path, docs):
    """--seed 1 --data-seed 0 trains another initialisation (and budget draws) on seed 0's sequences, so
    seed 0's store serves it; --seed 1 alone is another data stream and is refused."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = tmp_path / "store"
    train(_cfg(tmp_path / "cap", docs, store=str(store), capture_only=True, steps=4), model, tok)
    base = train(_cfg(tmp_path / "s0", docs, scorer="mlp", val_docs=0, steps=4, store=str(store)), model, tok)
    ctl = train(
        _cfg(tmp_path / "s1", docs, scorer="mlp", val_docs=0, steps=4, seed=1, data_seed=0, store=str(store)),
        model,
        tok,
    )
    fly = train(_cfg(tmp_path / "s1-fly", docs, scorer="mlp", val_docs=0, steps=4, seed=1, data_seed=0), model, tok)
    # the same sequences as a capture on the fly with the same data seed, another scorer than seed 0's
    assert [h["loss"] for h in ctl["history"]] == pytest.approx([h["loss"] for h in fly["history"]], rel=1e-3)
    assert [h["loss"] for h in ctl["history"]] != pytest.approx([h["loss"] for h in base["history"]], rel=1e-3)
    a, _ = load_scorer(tmp_path / "s0" / "scorer.safetensors")
    b, _ = load_scorer(tmp_path / "s1" / "scorer.safetensors")
    assert any(not torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="other settings"):
        train(_cfg(tmp_path / "s1-own", docs, scorer="mlp", val_docs=0, steps=2, seed=1, store=str(store)), model, tok)


def test_boundary_margin_compares_priorities_and_learns():
    """The margin adds lam * (t_new - t_bnd) (the tilt counted once), and one step on a batch lowers its loss."""
    g = torch.Generator().manual_seed(0)
    targets = torch.randn(2, 1, 2, 80, generator=g)
    targets[..., -8:] = float("-inf")
    lab = labels_for(targets, window=8, k=10, sinks=2, lam=0.05)
    scores = torch.randn(1, 2, 80, generator=g)
    plain = margins(scores, lab, 0, 0.0)
    tilted = margins(scores, lab, 0, 0.05)
    torch.testing.assert_close(tilted - plain, 0.05 * (lab.t_new[0] - lab.t_bnd[0].clamp(min=0)).float())
    # with lam, the teacher's own priorities reproduce its decisions exactly
    ok = ((margins(targets[0], lab, 0, 0.05) > 0) == (lab.y[0] > 0)) | ~lab.valid[0]
    assert bool(ok.all())
    w = decision_weights(targets, lab, 0, "mass")
    assert w[lab.valid[0]].mean() == pytest.approx(1.0, rel=1e-5)
    s = scores.clone().requires_grad_(True)
    kw = {"loss": "boundary", "lam": 0.05, "tau": 1.0, "weighting": "mass", "window": 8}
    before = layer_loss(s, targets, lab, 0, **kw)
    before.backward()
    with torch.no_grad():
        after = layer_loss(s - 1.0 * s.grad, targets, lab, 0, **kw)
    assert after < before
    assert isinstance(lab, Labels)


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
        _cfg(tmp_path, tmp_path, budgets=(4,)).validate()
    with pytest.raises(ValueError, match="no long-range slot"):
        _cfg(tmp_path, tmp_path, budgets=(10,)).validate()
    with pytest.raises(ValueError, match="unknown corpus"):
        _cfg(tmp_path, tmp_path, docs_from=None, corpora=("nope",)).validate()
    with pytest.raises(ValueError, match="capture_only needs a store"):
        _cfg(tmp_path, tmp_path, capture_only=True).validate()
    with pytest.raises(ValueError, match="cross_heads is an MLP option"):
        _cfg(tmp_path, tmp_path, scorer="mlstm", cross_heads=True).validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            _cfg(tmp_path, tmp_path, device="cuda").validate()


def test_ddp_two_processes_keep_identical_weights(tmp_path, docs):
    model_dir = tmp_path / "model"
    save_tiny_model(model_dir, "llama")
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        "-m",
        "kvpop.train",
        "--kind",
        "mlstm",
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
        "4",
        "--batch-size",
        "2",
        "--ckpt-every",
        "2",
        "--val-every",
        "2",
        "--val-docs",
        "1",
        "--check-sync",
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    assert (out / "scorer.safetensors").is_file() and (out / "best.safetensors").is_file()


def test_cli_main_validates_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--kind", "nope", "--out", str(tmp_path)])
    assert main(["--out", str(tmp_path), "--budget", "4"]) == 2
    assert "smaller than sinks" in capsys.readouterr().err


def test_noisy_oracle_diagnostic(tmp_path, docs):
    from kvpop.train.diagnose import noisy_oracle, plot_noisy_oracle

    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _cfg(tmp_path, docs)
    res = noisy_oracle(model, tok, cfg, 24, [0.0, 1.0, 4.0], n_docs=2, progress=False)
    exact, noisy = res["sigmas"]["0.0"], res["sigmas"]["4.0"]
    assert exact["rank_correlation"] == pytest.approx(1.0)
    assert noisy["rank_correlation"] < 0.6
    assert 0 < res["streaming"] <= 1.2 and len(exact["per_doc"]) == 2
    plot_noisy_oracle(res, tmp_path / "n.png")
    assert (tmp_path / "n.png").stat().st_size > 0


def test_noisy_oracle_places_learned_scorers_on_the_same_documents(tmp_path, docs):
    from kvpop.checkpoint import model_fingerprint, save_scorer
    from kvpop.scorers import ScorerConfig, build_scorer
    from kvpop.train.diagnose import noisy_oracle, plot_noisy_oracle

    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _cfg(tmp_path, docs)
    path = save_scorer(
        build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16, observed=(None, 1))),
        tmp_path / "s.safetensors",
        {"fingerprint": model_fingerprint(model)},
    )
    plain = noisy_oracle(model, tok, cfg, 24, [0.0], n_docs=2, progress=False)
    res = noisy_oracle(model, tok, cfg, 24, [0.0], n_docs=2, progress=False, scorers={"s": str(path)})
    # the targets read through the training capture are the oracle's own: same retention
    assert res["sigmas"]["0.0"]["retention"] == pytest.approx(plain["sigmas"]["0.0"]["retention"], rel=1e-6)
    assert plain["scorers"] == {}
    s = res["scorers"]["s"]
    assert -1 <= s["rank_correlation"] < 0.99 and 0 < s["retention"] <= 1.2 and len(s["per_doc"]) == 2
    plot_noisy_oracle(res, tmp_path / "n.png", {"s": (s["rank_correlation"], s["retention"])})
    assert (tmp_path / "n.png").stat().st_size > 0


def test_budget_range_draws_log_uniform_budgets_at_the_nearest_captured_window():
    cfg = TrainConfig(budget_range=(128, 2048), window_fraction=0.5, windows_per_octave=2, seq_len=8192)
    cfg.validate()
    assert cfg.window_grid() == (64, 91, 128, 181, 256, 362, 512, 724, 1024)
    assert cfg.capture_windows() == cfg.window_grid() and cfg.validation_budgets() == (256, 512, 1024)
    evs = [cfg.step_eviction(s) for s in range(400)]
    budgets = sorted(e.budget for e in evs)
    assert budgets[0] >= 128 and budgets[-1] <= 2048 and 380 < budgets[200] < 690  # log-uniform: median ~512
    for e in evs:
        assert e.window in cfg.window_grid() and e.budget == e.sinks + e.window + e.k
        assert abs(math.log2(e.window / (e.budget / 2))) <= 0.27  # within ~2 ** (1/4) of B / 2 (integer rounding)
    assert [cfg.step_eviction(s) for s in range(5)] == evs[:5]  # deterministic per step (resume)
    tf = cfg.trained_settings()
    assert tf["budget_range"] == [128, 2048] and tf["window_fraction"] == 0.5 and tf["budgets"] is None


def test_lam_scale_trains_each_budget_at_its_own_tilt():
    cfg = TrainConfig(budget_range=(128, 2048), window_fraction=0.5, seq_len=8192, lam_scale=0.5)
    cfg.validate()
    for s in range(20):
        ev = cfg.step_eviction(s)
        assert ev.lam == pytest.approx(0.5 / ev.budget)
    assert cfg.eviction(256).lam == pytest.approx(0.5 / 256)
    tf = cfg.trained_settings()
    assert tf["lam_scale"] == 0.5 and tf["lam"] == 0.0
    assert cfg.resume_view()["lam_scale"] == 0.5 and "lam_scale" not in TrainConfig().resume_view()
    with pytest.raises(ValueError, match="lam_scale must be a finite number > 0"):
        TrainConfig(lam_scale=-1.0).validate()
    # with lam as well, lam is the floor: lam_scale / B below 1,000, lam above
    floor = TrainConfig(budget_range=(128, 2048), window_fraction=0.5, seq_len=8192, lam=5e-4, lam_scale=0.5)
    floor.validate()
    assert [floor.eviction(b).lam for b in (250, 1000, 2000)] == pytest.approx([2e-3, 5e-4, 5e-4])
    assert floor.trained_settings()["lam"] == 5e-4 and floor.trained_settings()["lam_scale"] == 0.5


def test_lam_scale_run_records_the_rule_and_caches_follow_it(tmp_path, docs):
    import warnings

    from kvpop import KVpopCache
    from kvpop.config import ScorerSettingsWarning
    from kvpop.policies import LearnedPolicy

    model, tok = tiny_model("llama"), tiny_tokenizer()
    summary = train(
        _cfg(tmp_path, docs, scorer="mlp", steps=2, budget_range=(12, 48), window=None, lam_scale=0.24, val_every=2),
        model,
        tok,
    )
    assert summary["history"]
    scorer, meta = load_scorer(tmp_path / "scorer.safetensors", model=model)
    assert meta["trained_for"]["lam_scale"] == 0.24
    pol = LearnedPolicy(scorer, trained_for=meta["trained_for"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        for budget in (12, 24, 48):
            assert KVpopCache(model.config, budget=budget, policy=pol).eviction.lam == pytest.approx(0.24 / budget)


def test_budget_range_run_serves_every_budget_in_its_range(tmp_path, docs):
    """A scorer trained over a budget range defaults to its trained fraction at any budget inside it
    (no warning) and warns outside, naming the range (issue #23)."""
    import warnings

    from kvpop import KVpopCache
    from kvpop.config import ScorerSettingsWarning
    from kvpop.policies import LearnedPolicy

    model, tok = tiny_model("llama"), tiny_tokenizer()
    summary = train(
        _cfg(tmp_path, docs, scorer="mlp", steps=6, budget_range=(12, 48), window=None, val_every=6), model, tok
    )
    assert {h["budget"] for h in summary["history"]} <= set(range(12, 49))
    assert len({h["budget"] for h in summary["history"]}) > 1
    scorer, meta = load_scorer(tmp_path / "scorer.safetensors", model=model)
    pol = LearnedPolicy(scorer, trained_for=meta["trained_for"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScorerSettingsWarning)
        for budget in (12, 30, 48):
            assert KVpopCache(model.config, budget=budget, policy=pol).eviction.window == round(budget / 2)
    with pytest.warns(ScorerSettingsWarning, match="trained over budgets 12..48"):
        KVpopCache(model.config, budget=60, policy=pol)
    val = [h["val"] for h in summary["history"] if "val" in h][-1]
    assert {"retention", "continuation", "streaming", "continuation_wins_vs_streaming"} <= set(val["24"])


def test_windows_per_sequence_keeps_a_smaller_store_and_budgets_follow_the_windows(tmp_path, docs):
    """--windows-per-sequence: each stored sequence carries the targets of a few windows of the grid
    (rotating, so the grid is covered), and a step draws a budget whose window its sequence has."""
    from safetensors import safe_open

    model, tok = tiny_model("llama"), tiny_tokenizer()
    kw = {"budget_range": (12, 48), "window": None, "windows_per_sequence": 2, "val_docs": 0}
    cfg = _cfg(tmp_path / "cap", docs, store=str(tmp_path / "store"), capture_only=True, steps=5, **kw)
    assert cfg.window_grid() == (6, 8, 12, 17, 24)
    seq_windows = [cfg.sequence_windows(j) for j in range(5)]
    assert all(len(w) == 2 for w in seq_windows) and set().union(*seq_windows) == set(cfg.window_grid())
    train(cfg, model, tok)
    for j in range(5):
        with safe_open(str(tmp_path / "store" / f"seq_{j:06d}.safetensors"), framework="pt") as f:
            targets = {k for k in f.keys() if k.startswith("target_")}  # noqa: SIM118 (safe_open is not iterable)
            assert targets == {f"target_{w}" for w in seq_windows[j]}
    run = _cfg(tmp_path / "run", docs, scorer="mlp", store=str(tmp_path / "store"), steps=5, **kw)
    summary = train(run, model, tok)
    for h in summary["history"]:
        ev = run.grid_eviction(h["budget"])
        assert ev.window in seq_windows[h["step"] - 1] and 12 <= h["budget"] <= 48
    with pytest.raises(ValueError, match="windows per sequence"):  # a run that wants every window is refused
        train(
            _cfg(
                tmp_path / "all",
                docs,
                scorer="mlp",
                store=str(tmp_path / "store"),
                steps=1,
                **{**kw, "windows_per_sequence": 0},
            ),
            model,
            tok,
        )


def test_a_run_over_part_of_a_stores_budget_range_trains_at_the_stores_windows(tmp_path, docs):
    """A store captured for budgets 12..48 (two windows per sequence) serves a run over 14..30: the run
    trains at the store's windows its range reaches, reads only those, and records that grid; a range
    that some sequence holds no window for is refused before training."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    kw = {"window": None, "windows_per_sequence": 2, "val_docs": 0}
    store = str(tmp_path / "store")
    train(
        _cfg(tmp_path / "cap", docs, store=store, capture_only=True, budget_range=(12, 48), steps=5, **kw), model, tok
    )
    run = _cfg(tmp_path / "run", docs, scorer="mlp", store=store, steps=5, budget_range=(14, 30), **kw)
    own = run.window_grid()
    assert own != (6, 8, 12, 17, 24)  # its own grid is not the store's: refused before the option existed
    summary = train(run, model, tok)
    assert run.window_grid() == (6, 8, 12, 17)  # 7..15, within 2 ** (1/4) of the store's windows
    full = _cfg(tmp_path / "x", docs, budget_range=(12, 48), **kw)
    for h in summary["history"]:
        ev = run.grid_eviction(h["budget"])
        assert 14 <= h["budget"] <= 30 and ev.window in set(full.sequence_windows(h["step"] - 1)) & set(
            run.window_grid()
        )
    _, meta = load_scorer(tmp_path / "run" / "scorer.safetensors", model=model)
    assert meta["trained_for"]["window_grid"] == [6, 8, 12, 17] and meta["trained_for"]["budget_range"] == [14, 30]
    with pytest.raises(ValueError, match="sequence 0 keeps none of the windows"):  # 17, 24: not in seq 0's 6, 12
        train(
            _cfg(tmp_path / "narrow", docs, scorer="mlp", store=store, steps=1, budget_range=(40, 48), **kw), model, tok
        )
    with pytest.raises(ValueError, match=r"budget_range \(6, 48\) needs windows 3..24"):  # below the store's grid
        train(_cfg(tmp_path / "low", docs, scorer="mlp", store=store, steps=1, budget_range=(6, 48), **kw), model, tok)
    with pytest.raises(ValueError, match="holds 2 windows per sequence of the grid"):  # a fixed window: refused
        train(
            _cfg(
                tmp_path / "fixed",
                docs,
                scorer="mlp",
                store=store,
                steps=1,
                budgets=(20,),
                window=6,
                windows_per_sequence=2,
                val_docs=0,
            ),
            model,
            tok,
        )


def test_validation_baseline_is_shared_through_a_cache_folder(tmp_path, docs, monkeypatch):
    """--val-cache: the dense and StreamingLLM validation runs are computed once per sweep, and a run
    reading them back measures the same numbers."""
    from kvpop.train import quality

    model, tok = tiny_model("llama"), tiny_tokenizer()
    kw = {"scorer": "mlp", "steps": 2, "val_every": 2, "val_docs": 2, "val_cache": str(tmp_path / "vc")}
    first = train(_cfg(tmp_path / "a", docs, **kw), model, tok)
    files = sorted(p.name.split("_")[0] for p in (tmp_path / "vc").iterdir())
    assert files == ["dense", "streaming"]
    calls = []
    real = quality.RetentionProbe._run
    monkeypatch.setattr(quality.RetentionProbe, "_run", lambda self, pol, b: calls.append(pol) or real(self, pol, b))
    second = train(_cfg(tmp_path / "b", docs, **kw), model, tok)
    assert "streaming" not in calls  # read back, not rerun
    v1, v2 = first["history"][-1]["val"]["24"], second["history"][-1]["val"]["24"]
    assert v1["streaming"] == v2["streaming"] and v1["retention"] == pytest.approx(v2["retention"], rel=1e-6)


def test_cross_heads_scorer_trains_and_reads_every_head(tmp_path, docs):
    """--cross-heads: the MLP's input is the token's features in all KV heads of the layer, so changing one
    head's key changes every head's score (not only its own, as without the option); the run trains, resumes
    and saves a scorer a cache loads with the option on."""
    from kvpop.train.loop import build_run_scorer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    summary = train(_cfg(tmp_path, docs, scorer="mlp", cross_heads=True, val_docs=0), model, tok)
    assert all(torch.isfinite(torch.tensor([h["loss"] for h in summary["history"]])))
    scorer, _ = load_scorer(tmp_path / "scorer.safetensors", model=model)
    assert scorer.config.cross_heads and scorer[0].w1.shape[1] == 2 * (2 * 16 + 2 + 3)  # 2 heads x (k, v, norms, obs)
    for cross in (True, False):
        s = build_run_scorer(_cfg(tmp_path, docs, scorer="mlp", cross_heads=cross), model)
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
        obs = torch.rand(1, 2, 5, 3, generator=g)
        a = s.forward_layer(0, k, v, 8, observed=obs)
        k2 = k.clone()
        k2[:, 0] += 1.0
        b = s.forward_layer(0, k2, v, 8, observed=obs)
        assert not torch.allclose(a[:, 0], b[:, 0])
        assert torch.allclose(a[:, 1], b[:, 1]) is (not cross)
    with pytest.raises(ValueError, match="cross_heads"):
        train(_cfg(tmp_path, docs, scorer="mlp", val_docs=0), model, tok)  # the run was made with cross_heads


def test_ship_scorer_ships_the_last_checkpoint_of_a_run_without_validation(tmp_path, monkeypatch):
    """scripts/ship_scorer.py: --checkpoint scorer.safetensors ships a run trained with --val-docs 0 (its best
    is never written), recording the step, the validation report and the note; without it the missing
    best.safetensors is one clear error and the shipped files stay as they were."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "ship_scorer.py"
    spec = importlib.util.spec_from_file_location("ship_scorer", path)
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    run, assets = tmp_path / "run", tmp_path / "assets"
    run.mkdir()
    assets.mkdir()
    cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16, observed=(None, 1))
    save_scorer(build_scorer(cfg), run / "scorer.safetensors", {"steps": 7, "corpora": ["shakespeare", "package_code"]})
    (run / "summary.json").write_text(
        json.dumps(
            {
                "seconds_this_process": 12.5,
                "tokens_seen": 64,
                "best": {"mean_retention": None, "step": 0},
                "trained_for": {"budget_range": [128, 2048]},
                "history": [{"step": 7, "loss": 0.1}],
                "config": {"scorer": "mlp"},
            }
        )
    )
    dest = assets / "smollm2-135m-instruct-mlp.safetensors"
    dest.write_bytes(b"old")
    dest.with_suffix(".summary.json").write_text("{}")
    monkeypatch.setattr(ship, "ASSETS", assets)
    argv = ["ship_scorer.py", str(run), "--command", "kvpop train ...", "--unique-tokens", "32"]
    monkeypatch.setattr(sys, "argv", [*argv, "--checkpoint", "scorer.safetensors", "--model", "gemma3-270m"])
    with pytest.raises(SystemExit, match="ships nothing trained on Gemma 3 270M"):
        ship.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--checkpoint", "scorer.safetensors", "--model", "someorg/model"])
    with pytest.raises(SystemExit, match="not an embedded model"):
        ship.main()
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="--checkpoint scorer.safetensors"):
        ship.main()
    assert dest.read_bytes() == b"old" and dest.with_suffix(".summary.json").read_text() == "{}"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            *argv,
            "--checkpoint",
            "scorer.safetensors",
            "--validation",
            "v.md",
            "--note",
            "chosen on the validation split",
        ],
    )
    ship.main()
    assert dest.read_bytes() == (run / "scorer.safetensors").read_bytes()
    summary = json.loads(dest.with_suffix(".summary.json").read_text())
    assert summary["shipped_checkpoint"] == "scorer.safetensors" and summary["step"] == 7 and summary["best"] is None
    assert summary["validation_report"] == "v.md" and summary["note"] == "chosen on the validation split"
    assert summary["corpora"] == ["shakespeare", "package_code"] and summary["validation_retention"] == []
    assert sorted(p.name for p in assets.iterdir()) == [dest.name, dest.with_suffix(".summary.json").name]


def test_target_span_spreads_the_stores_targets_and_is_part_of_the_run(tmp_path, docs):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = str(tmp_path / "store")
    plain = train(_cfg(tmp_path / "a", docs, scorer="mlp", val_docs=0, steps=4, store=store), model, tok)
    spread = train(
        _cfg(tmp_path / "b", docs, scorer="mlp", val_docs=0, steps=4, store=store, target_span=2), model, tok
    )
    assert [h["loss"] for h in spread["history"]] != pytest.approx([h["loss"] for h in plain["history"]], rel=1e-3)
    # read from the store or captured in the run, the spread targets are the same
    fresh = train(_cfg(tmp_path / "c", docs, scorer="mlp", val_docs=0, steps=4, target_span=2), model, tok)
    assert [h["loss"] for h in fresh["history"]] == pytest.approx([h["loss"] for h in spread["history"]], rel=1e-3)
    with pytest.raises(ValueError, match="other settings.*target_span"):
        train(_cfg(tmp_path / "b", docs, scorer="mlp", val_docs=0, steps=6, store=store, target_span=3), model, tok)
    with pytest.raises(ValueError, match="target_span must be an integer >= 0"):
        _cfg(tmp_path / "d", docs, target_span=-1).validate()
