"""kvpop adapt: the KL and its gradients, the joint scorer step, the StreamingLLM+ control,
checkpoints / resume, bundles loadable by kvpop.load_model, DDP, config errors, the report helper."""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvpop
from kvpop.adapt import AdaptConfig, adapt, compare_adapted
from kvpop.adapt.loop import prepare_model, student_step, teacher_topk, topk_kl
from kvpop.bundle import AdapterMismatchError, load_adapter_bundle, read_bundle_meta, teacher_mode
from kvpop.checkpoint import load_scorer, model_fingerprint, save_scorer
from kvpop.cli.adapt import main
from kvpop.compat import enable_checkpointing
from kvpop.mask import learned_priority_fn
from kvpop.policies import LearnedPolicy
from kvpop.testing import save_tiny_model, tiny_model, tiny_tokenizer, write_word_docs
from kvpop.train import TrainConfig
from kvpop.train.loop import build_run_scorer, trained_for

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return write_word_docs(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def scorer_path(tmp_path_factory, docs):
    """A (freshly initialised) mLSTM scorer checkpoint for the tiny Llama, trained for B=24, window 8."""
    model = tiny_model("llama")
    tcfg = TrainConfig(docs_from=str(docs), seq_len=64, budgets=(24,), window=8, sinks=2, observed=(None, 4, 1))
    path = tmp_path_factory.mktemp("scorer") / "scorer.safetensors"
    save_scorer(
        build_run_scorer(tcfg, model), path, {"fingerprint": model_fingerprint(model), "trained_for": trained_for(tcfg)}
    )
    return path


def _cfg(out, docs, scorer=None, **kw):
    base = {
        "out": str(out),
        "docs_from": str(docs),
        "seq_len": 64,
        "budgets": (24,),
        "sinks": 2,
        "steps": 4,
        "val_every": 2,
        "ckpt_every": 2,
        "val_docs": 0,
        "progress": False,
        "lr": 1e-2,
        "scorer_lr": 1e-2,
        "lora_r": 4,
        "scorer": None if scorer is None else str(scorer),
    }
    base.update(kw)
    return AdaptConfig(**base)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _base_weights_unchanged(adapted, fresh):
    want = dict(fresh.named_parameters())
    for name, p in adapted.named_parameters():
        if "lora_" in name:
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(p, want[key]), key


IDS = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------
# the loss
# --------------------------------------------------------------------------------------------


def test_topk_kl_bucket_and_renormalize():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 5, 40, generator=g) * 3
    s = torch.randn(2, 5, 40, generator=g) * 3
    full = (F.softmax(t, -1) * (F.log_softmax(t, -1) - F.log_softmax(s, -1))).sum(-1)
    for k in (1, 8, 40):
        v, i = t.topk(k, -1)
        lse = torch.logsumexp(t, -1)
        bucket = topk_kl(s, v, i, lse)
        assert (bucket >= -1e-6).all() and (bucket <= full + 1e-5).all()  # coarse-graining never adds KL
        assert topk_kl(t, v, i, lse).abs().max() < 1e-5  # zero at the teacher itself
        assert (topk_kl(s, v, i, lse, tail="renormalize") >= -1e-6).all()
    v, i = t.topk(40, -1)
    torch.testing.assert_close(topk_kl(s, v, i, torch.logsumexp(t, -1)), full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(topk_kl(s, v, i, None, tail="renormalize"), full, rtol=1e-4, atol=1e-5)


def _student(scorer_path, lr=3e-3):
    model = tiny_model("llama")
    cfg = _cfg("unused", "unused", scorer_path, lr=lr)
    scorer, _ = load_scorer(scorer_path, model=model)
    model, frozen = prepare_model(cfg, model)
    assert frozen is None
    ev = cfg.eviction(24)
    fn = learned_priority_fn(scorer, ev.window, ev.lam, sinks=ev.sinks)
    return model, cfg, ev, fn


def test_student_gradients_reach_only_lora_and_the_kl_falls(scorer_path):
    model, cfg, ev, fn = _student(scorer_path)
    assert (ev.sinks, ev.window, ev.k) == (2, 8, 14)  # the window comes from the scorer's checkpoint
    with teacher_mode(model):
        t = teacher_topk(model, IDS, cfg.top_k, 16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    kls = []
    for _ in range(12):
        opt.zero_grad(set_to_none=True)
        rec = student_step(model, IDS, *t, priority_fn=fn, ev=ev, cfg=cfg, budget=24)
        kls.append(rec["kl_evicted"])
        if len(kls) == 1:
            assert abs(rec["kl_before_budget"]) < 1e-6  # a fresh adapter is the base model; no eviction before B
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert grads and all("lora_" in n for n in grads)
            assert all(torch.isfinite(g).all() for g in grads.values())
            assert sum(float(g.abs().sum()) for g in grads.values()) > 0
        opt.step()
    assert all(torch.isfinite(torch.tensor(kls)))
    assert kls[-1] < 0.5 * kls[0], kls
    _base_weights_unchanged(model, tiny_model("llama"))


def test_gradient_checkpointing_gives_the_same_gradients(scorer_path):
    grads = []
    for gc in (False, True):
        model, cfg, ev, fn = _student(scorer_path)
        with torch.no_grad():  # a non-identity adapter, so every LoRA weight gets a gradient
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.05)
        if gc:
            enable_checkpointing(model)
        with teacher_mode(model):
            t = teacher_topk(model, IDS, cfg.top_k, 16)
        student_step(model, IDS, *t, priority_fn=fn, ev=ev, cfg=cfg, budget=24)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-7, msg=n)


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("joint", [True, False])
def test_adapt_runs_and_trains_lora_and_scorer(tmp_path, docs, scorer_path, joint):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    s = adapt(_cfg(tmp_path, docs, scorer_path, joint=joint, val_docs=1, steps=4), model, tok)
    hist = s["history"]
    assert len(hist) == 4 and all(torch.isfinite(torch.tensor([h["kl"] for h in hist])))
    assert all((h["scorer_loss"] is not None) == joint for h in hist)
    _base_weights_unchanged(model, tiny_model("llama"))  # the base model was not touched: only LoRA trained
    start, _ = load_scorer(scorer_path)
    bundle = load_adapter_bundle(tiny_model("llama"), tmp_path / "adapter")
    changed = [not torch.equal(a, b) for a, b in zip(start.state_dict().values(), bundle.scorer.state_dict().values())]
    assert any(changed) == joint
    umask = os.umask(0)
    os.umask(umask)
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in (tmp_path / "adapter").iterdir())  # readable
    meta = bundle.meta["meta"]
    assert meta["mask"] == "kvpop" and meta["steps"] == 4 and meta["joint"] == joint
    assert meta["trained_for"]["windows"] == {"24": 8} and meta["tokens_seen"] == 4 * 64
    assert meta["trained_from"]["scorer"] == str(scorer_path)
    # validation: retention against the base dense model, the adapted model's own dense retention, best kept
    val = [h["val"] for h in hist if "val" in h]
    assert len(val) == 2 and 0 < val[-1]["24"]["retention"] and 0 < val[-1]["dense"]["retention"]
    # both tasks, per window (selection stays on lm: mean_retention is the lm mean, as in stored baselines)
    assert 0 < val[-1]["24"]["continuation"]["retention"] != val[-1]["24"]["retention"]
    assert all(set(d) == {"corpus", "retention", "continuation", "window", "sums"} for d in val[-1]["24"]["per_doc"])
    assert val[-1]["mean_retention"] == val[-1]["24"]["retention"]
    assert "24" in s["baseline"] and (tmp_path / "best" / "kvpop_adapter.json").is_file()
    assert read_bundle_meta(tmp_path / "best")["meta"]["steps"] == s["best"]["step"]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4


def test_validate_bundle_script_reproduces_the_runs_own_validation(tmp_path, docs, scorer_path):
    """scripts/validate_bundle.py gives any bundle the run's validation: on the run's final adapter it
    must reproduce the run's own last validation (same windows, budgets, scorer settings, base model)."""
    save_tiny_model(tmp_path / "base", seed=0)
    run = tmp_path / "run"
    s = adapt(_cfg(run, docs, scorer_path, model=str(tmp_path / "base"), steps=2, val_docs=1))
    out = tmp_path / "val.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "validate_bundle.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(run), str(run / "adapter"), "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    want = s["history"][-1]["val"]
    assert got["windows"] == {"24": 8} and got["baseline"]["24"]["retention"] == s["baseline"]["24"]["retention"]
    for key in ("retention", "kl"):
        assert got["validation"]["24"][key] == pytest.approx(want["24"][key], rel=1e-5, abs=1e-7)
    assert got["validation"]["24"]["continuation"]["retention"] == pytest.approx(
        want["24"]["continuation"]["retention"], rel=1e-5
    )
    bad = subprocess.run(
        [sys.executable, str(script), str(run), str(tmp_path), "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "is not an adapter bundle" in bad.stderr


def test_validate_bundle_shards_merge_to_the_unsharded_validation(tmp_path, docs, scorer_path):
    """Windows split over processes (--shard 1/2, 2/2), then --merge: the same report as one pass, to
    the last bit (every window's sums pooled in window order); a partial or overlapping set is refused."""
    save_tiny_model(tmp_path / "base", seed=0)
    run = tmp_path / "run"
    adapt(_cfg(run, docs, scorer_path, model=str(tmp_path / "base"), steps=2, val_docs=3))
    script = Path(__file__).resolve().parents[2] / "scripts" / "validate_bundle.py"

    def call(*args):
        return subprocess.run(
            [sys.executable, str(script), *map(str, args)], check=False, capture_output=True, text=True, timeout=300
        )

    outs = {name: tmp_path / f"{name}.json" for name in ("all", "s1", "s2", "merged")}
    for name, extra in (("all", []), ("s1", ["--shard", "1/2"]), ("s2", ["--shard", "2/2"])):
        proc = call(run, run / "adapter", "--out", outs[name], *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = call("--merge", outs["s2"], outs["s1"], "--out", outs["merged"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    whole, merged = (json.loads(outs[k].read_text())["validation"] for k in ("all", "merged"))
    s1 = json.loads(outs["s1"].read_text())["validation"]
    assert [r["window"] for r in s1["24"]["per_doc"]] == [0, 2]
    assert merged == whole  # every metric, every window row, the dense rows and the mean
    assert len(merged["24"]["per_doc"]) == 3 and merged["24"]["retention"] != s1["24"]["retention"]
    bad = call("--merge", outs["s1"], "--out", outs["merged"])
    assert bad.returncode != 0 and "not 1/2 .. 2/2" in bad.stderr
    bad = call("--merge", outs["s1"], outs["all"], "--out", outs["merged"])
    assert bad.returncode != 0 and "--shard I/N run" in bad.stderr
    bad = call(run, run / "adapter", "--out", outs["merged"], "--shard", "3/2")
    assert bad.returncode != 0 and "--shard" in bad.stderr


def test_joint_diagnosis_scripts_read_the_run(tmp_path, docs, scorer_path):
    """research/adapt_validations.py returns a run's own validations; research/scorer_loss_check.py
    measures the very loss joint training descends: on the run's first training sequence, the starting
    scorer's loss is the one the run logged at step 1."""
    save_tiny_model(tmp_path / "base", seed=0)
    run = tmp_path / "run"
    s = adapt(_cfg(run, docs, scorer_path, model=str(tmp_path / "base"), steps=2, val_docs=1, joint=True))
    scripts = Path(__file__).resolve().parents[2] / "research"
    out = tmp_path / "v.json"
    proc = subprocess.run(
        [sys.executable, str(scripts / "adapt_validations.py"), str(run), "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = json.loads(out.read_text())
    assert rec["baseline"]["24"]["lm"] == s["baseline"]["24"]["retention"]
    vals = [h for h in s["history"] if h.get("val")]
    assert [v["step"] for v in rec["validations"]] == [h["step"] for h in vals]
    assert rec["validations"][-1]["24"]["lm"] == vals[-1]["val"]["24"]["retention"]
    assert rec["validations"][-1]["24"]["continuation"] == vals[-1]["val"]["24"]["continuation"]["retention"]

    trained = run / "adapter" / "scorer.safetensors"
    proc = subprocess.run(
        [
            sys.executable,
            str(scripts / "scorer_loss_check.py"),
            "--run",
            str(run),
            "--scorers",
            str(scorer_path),
            str(trained),
            "--train",
            "1",
            "--val",
            "1",
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())["scorers"]
    assert got[str(scorer_path)]["train"]["24"]["per_sequence"][0] == pytest.approx(
        s["history"][0]["scorer_loss"], rel=1e-4
    )
    assert got[str(trained)]["train"]["24"]["mean"] != got[str(scorer_path)]["train"]["24"]["mean"]
    assert all(math.isfinite(got[p]["validation"]["24"]["mean"]) for p in got)


def test_streaming_control(tmp_path, docs):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    s = adapt(
        _cfg(
            tmp_path,
            docs,
            mask="streaming",
            val_docs=1,
            steps=2,
            gradient_checkpointing=True,
            kl_positions="evicted",
            kl_tail="renormalize",
        ),
        model,
        tok,
    )
    assert all(h["scorer_loss"] is None for h in s["history"])
    assert s["trained_for"]["windows"] == {"24": 22}  # StreamingLLM at equal budget: window = B - sinks
    bundle = load_adapter_bundle(tiny_model("llama"), tmp_path / "adapter")
    assert bundle.scorer is None and bundle.meta["meta"]["mask"] == "streaming"
    assert s["history"][-1]["val"]["24"]["retention"] > 0


def test_resume_equals_uninterrupted_run(tmp_path, docs, scorer_path):
    tok = tiny_tokenizer()
    adapt(_cfg(tmp_path / "full", docs, scorer_path), tiny_model("llama"), tok)
    adapt(_cfg(tmp_path / "part", docs, scorer_path, stop_after=2), tiny_model("llama"), tok)
    s = adapt(_cfg(tmp_path / "part", docs, scorer_path), tiny_model("llama"), tok)
    assert [h["step"] for h in s["history"]] == [1, 2, 3, 4]
    a = load_adapter_bundle(tiny_model("llama"), tmp_path / "full" / "adapter")
    b = load_adapter_bundle(tiny_model("llama"), tmp_path / "part" / "adapter")
    for (n, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    for (n, p), q in zip(a.scorer.state_dict().items(), b.scorer.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize(
    "change,needle",
    [({"budgets": (28,)}, "budgets"), ({"lr": 3e-3}, "lr"), ({"lora_r": 2}, "lora_r"), ({"window": 6}, "windows")],
)
def test_resume_refuses_other_settings(tmp_path, docs, scorer_path, change, needle):
    adapt(_cfg(tmp_path, docs, scorer_path, stop_after=2), tiny_model("llama"), tiny_tokenizer())
    with pytest.raises(ValueError, match=f"other settings.*{needle}: checkpoint"):
        adapt(_cfg(tmp_path, docs, scorer_path, **change), tiny_model("llama"), tiny_tokenizer())


def test_bundle_loads_with_load_model(tmp_path, docs, scorer_path):
    save_tiny_model(tmp_path / "base", seed=0)
    cfg = _cfg(tmp_path / "run", docs, scorer_path, model=str(tmp_path / "base"), steps=2)
    adapt(cfg)
    base, _ = kvpop.load_model(tmp_path / "base", progress=False)
    model, _ = kvpop.load_model(tmp_path / "base", adapter=tmp_path / "run" / "adapter", progress=False)
    want = _logits(model, IDS)
    assert (want - _logits(base, IDS)).abs().max() > 0  # the adapter moved the model
    with teacher_mode(model):
        assert torch.equal(_logits(model, IDS), _logits(base, IDS))  # adapter off: exactly the base model
    scorer = model.kvpop_adapter.scorer
    policy = LearnedPolicy(scorer)
    cache = kvpop.make_cache(model, policy, budget=24, window=8, sinks=2)
    out = model.generate(input_ids=IDS[:, :40], past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 44)
    assert model.kvpop_adapter.meta["meta"]["trained_for"]["windows"] == {"24": 8}
    # policy "kvpop-mlstm" by name on a model loaded with a bundle: the bundle's scorer, its trained window
    named = kvpop.make_cache(model, "kvpop-mlstm", budget=24, sinks=2)
    assert named.policy.scorer is scorer and "adapter bundle" in named.policy.source and named.eviction.window == 8
    assert torch.equal(
        model(input_ids=IDS[:, :40], past_key_values=named).logits,
        model(
            input_ids=IDS[:, :40], past_key_values=kvpop.make_cache(model, policy, budget=24, window=8, sinks=2)
        ).logits,
    )
    # an explicit path still wins over the bundle's scorer
    assert (
        kvpop.make_cache(model, "kvpop-mlstm", budget=24, window=8, sinks=2, path=scorer_path).policy.scorer
        is not scorer
    )
    with pytest.raises(ValueError, match='adapter="default" is the shipped bundle of the embedded'):
        kvpop.load_model(tmp_path / "base", adapter="default", progress=False)
    save_tiny_model(tmp_path / "other", seed=3)
    with pytest.raises(AdapterMismatchError):
        kvpop.load_model(tmp_path / "other", adapter=tmp_path / "run" / "adapter", progress=False)


def test_full_finetune_writes_a_model_folder(tmp_path, docs, scorer_path):
    base, tok = tiny_model("llama"), tiny_tokenizer()
    emb = base.get_input_embeddings().weight.clone()
    adapt(_cfg(tmp_path, docs, scorer_path, full_finetune=True, steps=2, lr=1e-3), base, tok)
    model, _ = kvpop.load_model(tmp_path / "adapter", progress=False)
    assert torch.equal(model.get_input_embeddings().weight, emb)  # embeddings / head stay frozen
    assert (_logits(model, IDS) - _logits(tiny_model("llama"), IDS)).abs().max() > 0
    _, meta = load_scorer(tmp_path / "adapter" / "scorer.safetensors", model=model)
    assert meta["steps"] == 2


def test_ddp_two_processes_keep_identical_weights(tmp_path, docs, scorer_path):
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
        "29533",
        "-m",
        "kvpop.adapt",
        "--out",
        str(out),
        "--model",
        str(model_dir),
        "--scorer",
        str(scorer_path),
        "--docs-from",
        str(docs),
        "--seq-len",
        "64",
        "--budget",
        "24",
        "--sinks",
        "2",
        "--lora-r",
        "4",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--ckpt-every",
        "2",
        "--val-every",
        "3",
        "--val-docs",
        "1",
        "--lr",
        "1e-2",
        "--check-sync",
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["tokens_seen"] == 3 * 2 * 64
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "best").is_dir()


# --------------------------------------------------------------------------------------------
# configuration and the command line
# --------------------------------------------------------------------------------------------


def test_bad_config_fails_before_loading(tmp_path, docs, scorer_path):
    def bad(needle, **kw):
        with pytest.raises(ValueError, match=needle):
            _cfg(tmp_path, docs, **kw).validate()

    bad("needs a trained scorer")  # mask kvpop without --scorer
    bad("uses no scorer", scorer=str(scorer_path), mask="streaming")
    bad("mask must be", mask="tova")
    with pytest.raises(FileNotFoundError):
        _cfg(tmp_path, docs, scorer=str(tmp_path / "nope.safetensors")).validate()
    bad("must exceed the budget", scorer=str(scorer_path), seq_len=24)
    bad("smaller than sinks", scorer=str(scorer_path), budgets=(6,))
    bad("no long-range slot", scorer=str(scorer_path), budgets=(10,))
    bad("kl_tail", scorer=str(scorer_path), kl_tail="nope")
    bad("kl_positions", scorer=str(scorer_path), kl_positions="nope")
    bad("top_k", scorer=str(scorer_path), top_k=0)
    bad("lr must be", scorer=str(scorer_path), lr=0.0)
    bad("unknown corpus", scorer=str(scorer_path), docs_from=None, corpora=("nope",))
    bad("lora_targets", scorer=str(scorer_path), lora_targets=())
    if not torch.cuda.is_available():
        bad("not available", scorer=str(scorer_path), device="cuda")
    _cfg(tmp_path, docs, scorer=str(scorer_path)).validate()
    _cfg(tmp_path, docs, mask="streaming").validate()


def test_cli_validates_first(tmp_path, capsys, scorer_path):
    from kvpop.cli import main as kvpop_main

    assert kvpop_main(["adapt", "--out", str(tmp_path), "--budget", "512"]) == 2
    assert "needs a trained scorer" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--mask", "streaming", "--budget", "8192"]) == 2
    assert "must exceed the budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--mask", "nope"])


def test_cli_joint_is_opt_in(tmp_path):
    """The scorer stays fixed unless --joint asks to train it too (the one joint run lowered retention)."""
    from kvpop.cli.adapt import build_parser, config_from_args

    def joint(*flags):
        return config_from_args(build_parser().parse_args(["--out", str(tmp_path), *flags])).joint

    assert joint() is False and joint("--no-joint") is False and joint("--joint") is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--out", str(tmp_path), "--joint", "--no-joint"])


def test_compare_adapted(tmp_path, docs, scorer_path):
    tok = tiny_tokenizer()
    adapt(_cfg(tmp_path / "kv", docs, scorer_path, steps=2), tiny_model("llama"), tok)
    adapt(_cfg(tmp_path / "st", docs, mask="streaming", steps=2), tiny_model("llama"), tok)
    base = tiny_model("llama")
    ids = [torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    res = compare_adapted(base, tmp_path / "kv" / "adapter", ids, streaming_bundle=tmp_path / "st" / "adapter")
    rows = res["budgets"]["24"]
    assert set(rows) == {
        "adapted kvpop",
        "adapted streaming",
        "base kvpop",
        "base streaming",
        "adapted dense",
        "streaming+ dense",
    }
    assert all(0 < r["retention"] and r["n_tokens"] == 2 * 39 for r in rows.values())
    # the continuation task next to lm: the last 64 / 16 = 4 predictions of each document, as kvpop eval scores it
    assert all(r["continuation"]["n_tokens"] == 2 * 4 and 0 < r["continuation"]["retention"] for r in rows.values())
    assert all(set(d) == {"doc", "retention", "continuation"} for d in rows["base kvpop"]["per_doc"])
    assert res["settings"]["windows"] == {"24": 8} and res["settings"]["base_scorer"] == str(scorer_path)
    assert not any("lora_" in n for n, _ in base.named_parameters())  # the caller's model is left alone


def test_compare_adapted_command(tmp_path, docs, scorer_path, monkeypatch, capsys):
    """`kvpop compare-adapted`: split over two shards, resumable, the same numbers as compare_adapted."""
    from kvpop.cli import compare_adapted as report
    from kvpop.cli import main as kvpop_main
    from kvpop.evaluate import harness
    from kvpop.testing import save_tiny_model

    tok = tiny_tokenizer()
    save_tiny_model(tmp_path / "base")
    adapt(_cfg(tmp_path / "kv", docs, scorer_path, steps=2), tiny_model("llama"), tok)
    adapt(_cfg(tmp_path / "st", docs, mask="streaming", steps=2), tiny_model("llama"), tok)
    ids = [torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    monkeypatch.setattr(
        harness,
        "corpus_documents",
        lambda tokenizer, cfg, notes: [("in_domain", "a", ids[:2]), ("out_of_domain", "b", ids[2:])],
    )
    args = [
        "--bundle",
        str(tmp_path / "kv" / "adapter"),
        "--streaming-bundle",
        str(tmp_path / "st" / "adapter"),
        "--model",
        str(tmp_path / "base"),
        "--out",
        str(tmp_path / "rep"),
        "--compression",
        "0.625",
        "--doc-tokens",
        "64",
        "--no-progress",
    ]
    # the base-model rows first (as while the adapters still train), then the rest in two shards
    assert kvpop_main(["compare-adapted", *args, "--rows", "base kvpop", "base streaming"]) == 0
    assert "3 documents, 3 in this shard, 6 of 6 units to run" in capsys.readouterr().err
    res = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert set(res["aggregate"]["all"]["24"]) == {"base kvpop", "base streaming"}
    assert report.main([*args, "--shard", "1/2"]) == 0
    assert "3 documents, 2 in this shard, 8 of 12 units to run" in capsys.readouterr().err
    assert report.main([*args, "--shard", "2/2"]) == 0
    assert report.main([*args, "--shard", "1/2"]) == 0  # resumed: nothing left to run
    assert "2 in this shard, 0 of 12 units to run" in capsys.readouterr().err
    res = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert len(res["documents"]) == 3 and (tmp_path / "rep" / "adapt.png").stat().st_size > 0
    agg = res["aggregate"]
    assert agg["in_domain"]["n_docs"] == 2 and agg["out_of_domain"]["n_docs"] == 1 and agg["all"]["n_docs"] == 3
    want = compare_adapted(
        tiny_model("llama"), tmp_path / "kv" / "adapter", ids, streaming_bundle=tmp_path / "st" / "adapter", merge=True
    )["budgets"]["24"]
    for row, e in agg["all"]["24"].items():
        assert e["retention"] == pytest.approx(want[row]["retention"], rel=1e-6), row
        assert e["ci"]["retention"][0] <= e["ci"]["retention"][1]
    wl = agg["all"]["24"]["base kvpop"]
    assert wl["subject_wins"] + wl["subject_losses"] <= 3 and "subject_wins" not in agg["all"]["24"]["adapted kvpop"]
    assert "kvpop, adapted" in (tmp_path / "rep" / "table.md").read_text()
    for row, e in agg["all"]["24"].items():  # the continuation is recorded next to lm, with its own W-L
        assert e["continuation"]["retention"] == pytest.approx(want[row]["continuation"]["retention"], rel=1e-6), row
        assert e["continuation"]["n_tokens"] == 3 * 4
    assert "continuation" in (tmp_path / "rep" / "table.md").read_text().splitlines()[2]
    # another StreamingLLM+ bundle: only the two rows that run it are run again
    adapt(_cfg(tmp_path / "st2", docs, mask="streaming", steps=3), tiny_model("llama"), tok)
    assert report.main([*args[:2], "--streaming-bundle", str(tmp_path / "st2" / "adapter"), *args[4:]]) == 0
    assert "3 documents, 3 in this shard, 6 of 18 units to run" in capsys.readouterr().err
    # bad input: one clear error, exit 2, before any model loads
    assert report.main([*args, "--compression", "1.5"]) == 2
    assert "--compression values must be in (0, 1)" in capsys.readouterr().err
    assert report.main([*args[:1], str(tmp_path), *args[2:]]) == 2
    assert "is not a kvpop adapter bundle" in capsys.readouterr().err
    assert report.main([*args, "--shard", "3/2"]) == 2


def test_adapt_over_a_budget_range(tmp_path, docs, scorer_path):
    """--budget-range: B log-uniform per step with the scorer's trained fraction of B as the window (the
    mask is built on the fly, so any window is exact); the bundle records the range and the fraction."""
    from kvpop.config import TrainedSettings

    cfg = _cfg(tmp_path, docs, scorer_path, budget_range=(16, 40), steps=5, val_docs=1, val_every=5)
    evs = [cfg.step_eviction(s) for s in range(40)]
    assert {e.budget for e in evs} <= set(range(16, 41)) and len({e.budget for e in evs}) > 5
    assert all(e.window == 8 for e in evs)  # the start scorer was trained at a fixed window 8
    assert cfg.validation_budgets() == (20, 25, 32)
    s = adapt(cfg, tiny_model("llama"), tiny_tokenizer())
    assert {h["budget"] for h in s["history"]} <= set(range(16, 41))
    meta = read_bundle_meta(tmp_path / "adapter")["meta"]
    t = TrainedSettings.from_meta(meta["trained_for"])
    assert t.budget_range == (16, 40) and t.window == 8


def test_compare_adapted_report_reads_records_from_before_the_continuation():
    """Records written before compare-adapted scored the continuation aggregate as before (lm only); the
    table gets continuation columns only when every document has them."""
    from kvpop.adapt.report import aggregate, table

    def rec(doc, lm, cont=None):
        sums = {
            r: {"n": 10, "nll_dense": 10.0, "nll_policy": 10.0 + lm[i], "kl": 0.1, "top1": 9.0}
            for i, r in enumerate(("adapted kvpop", "base kvpop"))
        }
        out = {"domain": "in_domain", "corpus": "c", "doc": doc, "sums": {"24": sums}, "wall_s": 1.0}
        if cont is not None:
            out["continuation"] = {"24": {r: {**s, "nll_policy": 10.0 + cont} for r, s in sums.items()}}
        return out

    old = [rec(0, (0.1, 0.2)), rec(1, (0.1, 0.3))]
    agg = aggregate(old, [24], n_boot=10)
    e = agg["all"]["24"]["base kvpop"]
    assert (e["subject_wins"], e["subject_losses"]) == (2, 0) and "continuation" not in e
    assert "continuation" not in table({"aggregate": agg})
    mixed = aggregate([*old, rec(2, (0.1, 0.2), cont=0.5)], [24], n_boot=10)
    assert "continuation" not in mixed["all"]["24"]["base kvpop"]
    new = aggregate([rec(0, (0.1, 0.2), cont=0.5), rec(1, (0.1, 0.3), cont=0.2)], [24], n_boot=10)
    c = new["all"]["24"]["base kvpop"]["continuation"]
    assert c["n_tokens"] == 20 and c["retention"] == pytest.approx(math.exp(-0.035))
    assert "| continuation | W-L" in table({"aggregate": new})


@pytest.mark.parametrize("joint", [False, True])
def test_adapt_on_a_hybrid_model(tmp_path, docs, joint):
    """kvpop adapt on Gemma 3's sliding/full layout: the student is masked on the full-attention layers only
    (one scorer per full layer), the bundle loads and serves a bounded cache whose sliding layers stay the
    model's own."""
    save_tiny_model(tmp_path / "base", "gemma3", seed=0)
    base, _ = kvpop.load_model(tmp_path / "base", progress=False)
    tcfg = TrainConfig(docs_from=str(docs), seq_len=64, budgets=(24,), window=8, sinks=2, observed=(None, 4, 1))
    scorer = tmp_path / "scorer.safetensors"
    save_scorer(
        build_run_scorer(tcfg, base), scorer, {"fingerprint": model_fingerprint(base), "trained_for": trained_for(tcfg)}
    )
    s = adapt(_cfg(tmp_path / "run", docs, scorer, model=str(tmp_path / "base"), steps=2, val_docs=1, joint=joint))
    assert all(math.isfinite(h["kl"]) for h in s["history"]) and s["history"][-1]["val"]["24"]["retention"] > 0
    model, _ = kvpop.load_model(tmp_path / "base", adapter=tmp_path / "run" / "adapter", progress=False)
    assert (_logits(model, IDS) - _logits(base, IDS)).abs().max() > 0  # the adapter moved the model
    assert model.kvpop_adapter.scorer.config.num_layers == 2  # layers 1 and 3 are the full-attention ones
    cache = kvpop.make_cache(model, "kvpop-mlstm", budget=24, sinks=2)
    assert cache.policy.scorer is model.kvpop_adapter.scorer and cache.eviction.window == 8
    out = model.generate(input_ids=IDS[:, :48], **kvpop.compat.cache_kwargs(cache), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 52)
    assert [tuple(layer.keys.shape[-2:]) for layer in cache.layers if hasattr(layer, "policy_layer")] == [(24, 16)] * 2


def test_from_bundle_continues_a_run_whose_state_is_lost(tmp_path, docs, scorer_path, monkeypatch):
    """--from-bundle: a bundle the run wrote at step 2 continues it at step 3 (the bundle's LoRA
    weights, the schedule where it was, the same data), with fresh optimizer moments, recorded; the
    validation baseline is read from the bundle's summary.json when that matches, not recomputed."""
    import shutil

    from kvpop.adapt import quality as adapt_quality
    from kvpop.adapt.restart import BundleStart, load_bundle_weights
    from kvpop.files import write_json

    tok = tiny_tokenizer()
    full = adapt(_cfg(tmp_path / "full", docs, scorer_path, steps=4), tiny_model("llama"), tok)
    adapt(_cfg(tmp_path / "lost", docs, scorer_path, steps=4, stop_after=2), tiny_model("llama"), tok)
    bundle = tmp_path / "step2"
    shutil.copytree(tmp_path / "lost" / "adapter", bundle)
    assert read_bundle_meta(bundle)["meta"]["steps"] == 2

    # the weights: a fresh LoRA model given the bundle's weights computes what load_adapter_bundle gives
    cfg = _cfg(tmp_path / "x", docs, scorer_path, steps=4)
    student, _ = prepare_model(cfg, tiny_model("llama"))
    assert load_bundle_weights(student, BundleStart(bundle, 2, None)) == sum(
        p.requires_grad for p in student.parameters()
    )
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = load_adapter_bundle(tiny_model("llama"), bundle).model
    torch.testing.assert_close(_logits(student, ids), _logits(ref, ids))
    other, _ = prepare_model(cfg, tiny_model("llama", seed=5))  # same shapes, other base weights
    with pytest.raises(ValueError, match="another base model"):
        load_bundle_weights(other, BundleStart(bundle, 2, None))

    s = adapt(_cfg(tmp_path / "again", docs, scorer_path, steps=4, from_bundle=str(bundle)), tiny_model("llama"), tok)
    assert [h["step"] for h in s["history"]] == [3, 4]
    assert [h["lr"] for h in s["history"]] == pytest.approx([h["lr"] for h in full["history"][2:]], rel=1e-9)
    assert [h["budget"] for h in s["history"]] == [h["budget"] for h in full["history"][2:]]
    assert s["restarts"] == [
        {
            "from_bundle": str(bundle),
            "step": 2,
            "optimizer": "AdamW moments reset to zero",
            "baseline": "recomputed",
            "train_seconds_before": None,
        }
    ]
    # once the run has its own state, a rerun resumes from that (the bundle is not read again)
    s2 = adapt(_cfg(tmp_path / "again", docs, scorer_path, steps=4, from_bundle=str(bundle)), tiny_model("llama"), tok)
    assert s2["restarts"] == s["restarts"] and [h["step"] for h in s2["history"]] == [3, 4]

    # a stored baseline with the same validation settings is reused
    cfg_val = _cfg(tmp_path / "v", docs, scorer_path, steps=4, val_docs=1, from_bundle=str(bundle))
    stored = {"24": {"retention": 0.5}, "mean_retention": 0.5}
    write_json(
        bundle / "summary.json",
        {
            "config": json.loads(json.dumps(vars(cfg_val), default=list)),
            "baseline": stored,
            "train_seconds": 12.5,
            "shipped_step": 2,
        },
    )
    calls = []
    monkeypatch.setattr(adapt_quality.AdaptProbe, "baseline", lambda self, scorer: calls.append(1) or {})
    s3 = adapt(cfg_val, tiny_model("llama"), tok)
    assert (
        calls == [] and s3["baseline"] == stored and s3["restarts"][0]["baseline"] == "from the bundle's summary.json"
    )
    # the bundle's training seconds are kept, so that a shipped checkpoint's wall time counts its first steps
    assert s3["restarts"][0]["train_seconds_before"] == 12.5
    # a summary written for another step (copied beside a later LoRA) gives no seconds rather than wrong ones
    write_json(
        bundle / "summary.json",
        {
            "config": json.loads(json.dumps(vars(cfg_val), default=list)),
            "baseline": stored,
            "train_seconds": 12.5,
            "shipped_step": 1,
        },
    )
    s4 = adapt(
        _cfg(tmp_path / "v2", docs, scorer_path, steps=4, val_docs=1, from_bundle=str(bundle)), tiny_model("llama"), tok
    )
    assert s4["restarts"][0]["train_seconds_before"] is None and s4["baseline"] == stored


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"lora_r": 2}, "adapter"),
        ({"seq_len": 48}, "seq_len"),
        ({"steps": 2}, "nothing to train"),
        ({"lam": 0.01}, "trained_for"),
    ],
)
def test_from_bundle_refuses_another_run(tmp_path, docs, scorer_path, change, needle):
    adapt(_cfg(tmp_path / "run", docs, scorer_path, steps=4, stop_after=2), tiny_model("llama"), tiny_tokenizer())
    cfg = _cfg(tmp_path / "new", docs, scorer_path, steps=4, from_bundle=str(tmp_path / "run" / "adapter"))
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=needle):
        adapt(cfg, model=None)  # refused before any model is loaded


def test_shipped_wall_time_counts_the_steps_before_a_restart():
    """ship_adapter.py --bundle: a run restarted from a bundle keeps only its own steps' times; the
    bundle's seconds (recorded by the restart, or --seconds-before) are added, and a restart that did
    not record them is refused rather than under-reported."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "ship_adapter.py"
    spec = importlib.util.spec_from_file_location("ship_adapter", path)
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    history = [{"step": 3, "seconds": 10.0}, {"step": 4, "seconds": 20.0}, {"step": 5, "seconds": 40.0}]
    assert ship._seconds_to({"history": history}, 4) == 30.0
    restarted = {"history": history, "restarts": [{"from_bundle": "b", "step": 2, "train_seconds_before": 7.5}]}
    assert ship._seconds_to(restarted, 4) == 37.5
    assert ship._seconds_to(restarted, 4, before=1.0) == 31.0
    unknown = {"history": history, "restarts": [{"from_bundle": "b", "step": 2}]}
    with pytest.raises(SystemExit, match="--seconds-before"):
        ship._seconds_to(unknown, 4)
    assert ship._seconds_to(unknown, 4, before=100.0) == 130.0
    # the run's own best/ or adapter/ (no --bundle) is counted the same way, not by seconds_this_process,
    # which after a resume covers only the last session
    resumed = {"history": history, "seconds_this_process": 40.0}
    assert ship._train_seconds(resumed, 5) == 70.0
    assert ship._train_seconds({"seconds_this_process": 12.0}, 5) == 12.0
    with pytest.raises(SystemExit, match="--seconds-before"):
        ship._train_seconds({**unknown, "seconds_this_process": 40.0}, 5)


def test_ship_adapter_writes_the_bundle_with_its_summary_and_note(tmp_path, monkeypatch):
    """ship_adapter.py main(): the four bundle files are copied, the old shipped folder is replaced,
    and summary.json carries the wall time to the shipped step and the --note (what is estimated)."""
    import importlib.util
    import json
    import sys

    path = Path(__file__).resolve().parents[2] / "scripts" / "ship_adapter.py"
    spec = importlib.util.spec_from_file_location("ship_adapter", path)
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    run, bundle, target = tmp_path / "run", tmp_path / "bundle", tmp_path / "assets" / "shipped"
    run.mkdir()
    (run / "summary.json").write_text(
        json.dumps(
            {
                "history": [{"step": 1, "seconds": 5.0}, {"step": 2, "seconds": 6.0, "val": {"mean_retention": 0.9}}],
                "restarts": [],
                "best": {"step": 2},
                "tokens_seen": 8,
            }
        )
    )
    bundle.mkdir()
    for name in ship.BUNDLE_FILES:
        (bundle / name).write_bytes(b"x")
    (bundle / "kvpop_adapter.json").write_text(json.dumps({"meta": {"steps": 2, "tokens_seen": 8}}))
    target.mkdir(parents=True)
    (target / "stale.txt").write_text("old")
    monkeypatch.setattr(ship, "DEFAULT_ADAPTER", target)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "ship_adapter.py",
            str(run),
            "--bundle",
            str(bundle),
            "--command",
            "kvpop adapt",
            "--seconds-before",
            "100",
            "--note",
            "steps 1-2 estimated",
        ],
    )
    ship.main()
    summary = json.loads((target / "summary.json").read_text())
    assert summary["note"] == "steps 1-2 estimated"
    assert summary["train_seconds"] == 111.0  # the run's own steps plus --seconds-before
    assert summary["shipped_step"] == 2 and summary["validation"] == [{"mean_retention": 0.9}]
    assert sorted(p.name for p in target.iterdir()) == sorted([*ship.BUNDLE_FILES, "summary.json"])


def test_adapting_from_a_scorer_whose_tilt_scales_with_the_budget(tmp_path, docs):
    """The mask of each step uses the starting scorer's lam_scale / B, and the bundle records the rule."""
    model = tiny_model("llama")
    tcfg = TrainConfig(
        docs_from=str(docs), seq_len=64, budget_range=(16, 32), sinks=2, observed=(None, 4, 1), lam_scale=0.32
    )
    path = tmp_path / "scorer.safetensors"
    save_scorer(
        build_run_scorer(tcfg, model), path, {"fingerprint": model_fingerprint(model), "trained_for": trained_for(tcfg)}
    )
    cfg = _cfg(tmp_path / "run", docs, scorer=path, budgets=(16, 32))
    assert cfg.eviction(16).lam == pytest.approx(0.02) and cfg.eviction(32).lam == pytest.approx(0.01)
    assert cfg.trained_for()["lam_scale"] == 0.32 and cfg.resume_view()["lam_scale"] == 0.32
    assert "lam_scale" not in _cfg(tmp_path / "plain", docs, scorer=path, lam=0.001).resume_view()
