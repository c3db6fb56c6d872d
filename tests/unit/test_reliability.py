"""Issue 25: a cache that refuses the wrong model, and the other reliability fixes."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvpop
from kvpop import KVpopCache
from kvpop.compat import cache_kwargs
from kvpop.testing import tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)


def _ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, n), generator=g)


# --- item 1: a cache built from one model's config, used with another model ------------------


def test_cache_from_another_model_instance_is_refused():
    """Same weights, separately loaded: m2's attention is not routed through kvpop, so the cache would
    never fill and the tokens would silently differ; it must be an error naming the cause."""
    m1, m2 = tiny_model("llama"), tiny_model("llama")
    cache = KVpopCache(m1.config, budget=24, window=6, sinks=2, policy="h2o")
    with pytest.raises(RuntimeError, match="another model's config"):
        m2.generate(_ids(40), **cache_kwargs(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_cache_from_another_one_layer_model_is_refused_at_the_next_forward():
    m1, m2 = tiny_model("llama", num_hidden_layers=1), tiny_model("llama", num_hidden_layers=1)
    cache = KVpopCache(m1.config, budget=24, window=6, sinks=2, policy="h2o")
    with pytest.raises(RuntimeError, match="another model's config"):
        m2.generate(_ids(40), **cache_kwargs(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_layer_count_mismatch_is_a_clear_error():
    small = tiny_model("llama", num_hidden_layers=2)
    big = tiny_model("llama", num_hidden_layers=3)
    cache = KVpopCache(small.config, budget=24, window=6, sinks=2, policy="h2o")
    routes_big = KVpopCache(
        big.config, budget=24, window=6, sinks=2, policy="h2o"
    )  # routes big's attention while it lives
    with pytest.raises(ValueError, match="2 layers.*layer 2"), torch.no_grad():
        big(_ids(30), **cache_kwargs(cache))
    del routes_big
    cache = KVpopCache(big.config, budget=24, window=6, sinks=2, policy="h2o")  # 3 layers on a 2-layer model
    with torch.no_grad(), kvpop.routed(small):  # small's own cache is gone: route its attention for the block
        small(_ids(30), **cache_kwargs(cache))
        with pytest.raises(ValueError, match="3 layers.*only 2"):
            small(_ids(1), **cache_kwargs(cache))


def test_head_shape_mismatch_is_a_clear_error():
    a = tiny_model("llama", num_key_value_heads=2)
    b = tiny_model("llama", num_key_value_heads=4)
    cache = KVpopCache(a.config, budget=24, window=6, sinks=2, policy="h2o")
    routes_b = KVpopCache(b.config, budget=24, window=6, sinks=2, policy="h2o")  # routes b's attention while it lives
    with pytest.raises(ValueError, match="KV heads"), torch.no_grad():
        b(_ids(30), **cache_kwargs(cache))
    del routes_b


def test_same_model_still_works_after_the_checks():
    model = tiny_model("llama")
    cache = KVpopCache(model.config, budget=24, window=6, sinks=2, policy="h2o")
    out = model.generate(_ids(40), **cache_kwargs(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 44 and cache.get_seq_length() == 43


# --- item 9: use_cache=False with a cache -------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_use_cache_false_with_a_kvpop_cache_is_refused(arch):
    model = tiny_model(arch)
    cache = KVpopCache(model.config, budget=24, window=6, sinks=2, policy="h2o")
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(
            _ids(30), **cache_kwargs(cache), use_cache=False, max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    assert cache.get_seq_length() == 0  # refused before anything was inserted
    with pytest.raises(ValueError, match="use_cache=False"), torch.no_grad():
        model(_ids(30), **cache_kwargs(cache), use_cache=False)
    with torch.no_grad():
        model(_ids(30), **cache_kwargs(cache), use_cache=True)  # still usable
    assert cache.get_seq_length() == 30


def test_kvpop_generate_refuses_use_cache_false():
    import kvpop
    from kvpop.testing import tiny_tokenizer

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="use_cache=False"):
        kvpop.generate(model, tiny_tokenizer(), "hello there", policy="h2o", budget=24, use_cache=False)


# --- items 2 and 3: the compiled step fails safe -------------------------------------------------


@torch.no_grad()
def _decode(model, cache, ids, prefill):
    outs = [model(ids[:, :prefill], **cache_kwargs(cache)).logits[:, -1:]]
    outs += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(outs, 1)


class _WritesThenFails:
    """A compiled step that compiles fine and fails at run time after its in-place writes (as a shape
    bug or an out-of-memory inside the compiled code would)."""

    def __init__(self, name):
        from kvpop.compiled import STEPS

        self.fn = STEPS[name]
        self.calls = 0

    def prepare(self, args):
        pass

    def __call__(self, *args):
        self.calls += 1
        self.fn(*args)  # the writes happen
        raise RuntimeError("boom inside the compiled step")


def test_a_runtime_error_of_the_compiled_step_propagates_and_is_not_rerun():
    steps = {}
    model = tiny_model("llama", num_hidden_layers=1)
    cache = KVpopCache(model.config, policy="knorm", budget=20, window=6, sinks=2, compile=True)
    cache.compiled_step.compiler = lambda name, device_type="cpu": steps.setdefault(name, _WritesThenFails(name))
    with pytest.raises(RuntimeError, match="boom inside the compiled step"):
        _decode(model, cache, _ids(40), 30)
    assert cache.compiled_step.error is None  # compilation stays on: the compiler did not fail
    assert steps["decode_scored"].calls == 1


def test_a_compile_failure_runs_eagerly_but_a_failing_eager_step_is_not_blamed_on_the_compiler(monkeypatch):
    from kvpop import compiled

    def broken(name, device_type="cpu"):
        raise compiled.CompileFailed("no compiler here")

    def eager_bug(*args):
        raise IndexError("a bug of the step itself")

    monkeypatch.setitem(compiled.STEPS, "decode_scored", eager_bug)
    model = tiny_model("llama", num_hidden_layers=1)
    cache = KVpopCache(model.config, policy="knorm", budget=20, window=6, sinks=2, compile=True)
    cache.compiled_step.compiler = broken
    with pytest.raises(IndexError, match="a bug of the step itself"):
        _decode(model, cache, _ids(40), 30)
    assert cache.compiled_step.error is None


@pytest.mark.slow
def test_two_threads_compiling_at_once_keep_compilation_on(monkeypatch):
    """Two caches in two threads reach their first compiled step together: compilations take turns
    (make_fx's tracer is process-global; concurrent ones failed 3 times in 7 and turned compilation
    off for the process), compilation stays on, and both give the eager results."""
    import threading
    import time

    from kvpop import compiled
    from kvpop.testing import compile_unavailable

    store = compiled.CodeStore()  # fresh graphs: both threads compile
    active, most = [0], [0]
    build = compiled.Direct._build

    def spy(self, *args):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.3)  # a wide window for the other thread to enter too, were it not held back
        try:
            return build(self, *args)
        finally:
            active[0] -= 1

    monkeypatch.setattr(compiled.Direct, "_build", spy)
    models = [tiny_model("llama", num_hidden_layers=1) for _ in range(2)]
    ids = _ids(34)
    want = _decode(models[0], KVpopCache(models[0].config, policy="knorm", budget=20, window=6, sinks=2), ids, 30)
    caches = [KVpopCache(m.config, policy="knorm", budget=20, window=6, sinks=2, compile=True) for m in models]
    for c in caches:
        c.compiled_step.compiler = store
    for m, c in zip(models, caches):
        _decode(m, c, ids[:, :30], 30)  # prefill: the next step is the first steady one
    start, results, errors = threading.Barrier(2), [None, None], []

    def run(i):
        try:
            start.wait()
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a failed compile warns: make it an error
                with torch.no_grad():
                    results[i] = torch.cat(
                        [models[i](ids[:, j : j + 1], **cache_kwargs(caches[i])).logits for j in range(30, 34)], 1
                    )
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    error = next((c.compiled_step.error for c in caches if c.compiled_step.error), None)
    if error is not None and "CURRENT_PATCHER" not in error and most[0] == 1:
        compile_unavailable(error)
    assert not errors, errors
    assert most[0] == 1  # one compilation at a time
    assert error is None
    for r in results:
        torch.testing.assert_close(r, want[:, 1:], rtol=1e-4, atol=1e-4)


# --- item 4: one learned policy, caches on two devices ------------------------------------------


def test_a_learned_policy_keeps_one_scorer_per_device():
    """A cache on a second device (here ``meta``: the only other device a CPU-only machine has) gets
    its own copy of the scorer and its own decode kernels; the CPU cache sharing the policy keeps
    its weights where they were and its results. What this cannot show: real transfers to a GPU."""
    from kvpop.testing import random_learned_policy

    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(50)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    solo = _decode(model, KVpopCache(model.config, policy=random_learned_policy(model, extra=True), **kw), ids, 30)
    policy = random_learned_policy(model, extra=True)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    cache = KVpopCache(model.config, policy=policy, **kw)
    with torch.no_grad():
        first = [model(ids[:, :30], **cache_kwargs(cache)).logits[:, -1:]]
        first += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(30, 40)]
    cpu_kernel = cache.prepared.on(cpu).decode_kernel(0, 6)
    # what a cache on the other device does when it starts: its state and kernels on its device
    on_meta = policy.prepare(meta)
    state = on_meta.init_state(1, 2, 0)
    meta_kernel = on_meta.decode_kernel(0, 6)
    assert all(t.device == meta for t in state)
    assert all(p.device == meta for p in meta_kernel[1] if isinstance(p, torch.Tensor))
    assert all(p.device == cpu for p in policy.scorer.parameters())
    assert cache.prepared.on(cpu).decode_kernel(0, 6) is cpu_kernel  # untouched
    with torch.no_grad():
        rest = [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(40, 50)]
    torch.testing.assert_close(torch.cat(first + rest, 1), solo, rtol=1e-5, atol=1e-5)


def test_a_device_copy_of_the_scorer_follows_weight_updates():
    from kvpop.testing import random_learned_policy

    model = tiny_model("llama", num_hidden_layers=1)
    policy = random_learned_policy(model)
    meta_scorer = policy.scorer_for(torch.device("meta"))
    assert meta_scorer is not policy.scorer and policy.scorer_for(torch.device("cpu")) is policy.scorer
    p_meta = next(meta_scorer.parameters())
    with torch.no_grad():
        next(policy.scorer.parameters()).add_(1.0)
    assert policy.scorer_for(torch.device("meta")) is meta_scorer  # refreshed in place, same object
    assert next(meta_scorer.parameters()) is p_meta


def test_a_second_device_starting_does_not_move_the_first_devices_scorer(monkeypatch):
    """The bug itself, with a stand-in second device: ``cpu:1`` (a distinct torch.device whose tensors
    live on the CPU), where moving a scorer turns it into float64 (as a move to a GPU replaces the
    weights' storage). Before the fix, a cache starting there moved the shared scorer and dropped
    the kernels of the running CPU cache, whose next steps then ran on the moved weights."""
    from kvpop.scorers import ScorerStack
    from kvpop.testing import random_learned_policy

    other = torch.device("cpu", 1)
    real_to = ScorerStack.to

    def to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if device is not None and torch.device(device) == other:
            return self.double()  # "moved": new weight tensors
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(ScorerStack, "to", to)
    model = tiny_model("llama", num_hidden_layers=2)
    ids = _ids(50)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    solo = _decode(model, KVpopCache(model.config, policy=random_learned_policy(model, extra=True), **kw), ids, 30)
    policy = random_learned_policy(model, extra=True)
    cache = KVpopCache(model.config, policy=policy, **kw)
    with torch.no_grad():
        outs = [model(ids[:, :30], **cache_kwargs(cache)).logits[:, -1:]]
        outs += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(30, 40)]
        for layer in range(2):
            policy.init_state(1, 2, layer, other)  # a cache on the other device starts
        outs += [model(ids[:, i : i + 1], **cache_kwargs(cache)).logits for i in range(40, 50)]
    assert all(p.dtype == torch.float32 for p in policy.scorer.parameters())
    torch.testing.assert_close(torch.cat(outs, 1), solo, rtol=1e-5, atol=1e-5)


def test_compile_tests_fail_instead_of_skipping_under_ci(monkeypatch):
    from kvpop.testing import compile_unavailable

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no working compiler under CI=true"):
        compile_unavailable("no cc")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        compile_unavailable("no cc")


# --- item 7: the weight fingerprint covers every layer ------------------------------------------


def _scorer_file(model, path):
    from kvpop.checkpoint import model_fingerprint, save_scorer
    from kvpop.scorers import ScorerConfig, build_scorer

    cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16)
    return save_scorer(build_scorer(cfg), path, {"fingerprint": model_fingerprint(model)})


def test_a_model_fine_tuned_in_a_later_layer_is_another_model(tmp_path):
    import copy

    from kvpop.checkpoint import WEIGHTS_BF16_KEY, ScorerMismatchError, load_scorer, model_fingerprint

    model = tiny_model("llama")
    path = _scorer_file(model, tmp_path / "s.safetensors")
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight.add_(0.01)  # layer 0's k_proj and the embeddings untouched
    assert model_fingerprint(tuned)[WEIGHTS_BF16_KEY] == model_fingerprint(model)[WEIGHTS_BF16_KEY]
    with pytest.raises(ScorerMismatchError, match="weights_sampled_bf16_sha256"):
        load_scorer(path, model=tuned)
    load_scorer(path, model=copy.deepcopy(model).to(torch.bfloat16))  # the same model in bfloat16 still fits


def test_a_merged_lora_without_k_proj_is_another_model_and_an_unmerged_one_the_base(tmp_path):
    import copy

    from kvpop.adapt.lora import add_lora, lora_config
    from kvpop.checkpoint import ScorerMismatchError, load_scorer, model_fingerprint

    model = tiny_model("llama")
    path = _scorer_file(model, tmp_path / "s.safetensors")
    peft_model = add_lora(copy.deepcopy(model), lora_config(r=2, targets=("q_proj", "v_proj")))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    assert model_fingerprint(peft_model) == model_fingerprint(model)  # unmerged: its base model's fingerprint
    merged = peft_model.merge_and_unload()
    with pytest.raises(ScorerMismatchError, match="weights_sampled_bf16_sha256"):
        load_scorer(path, model=merged)


def test_a_capture_store_refuses_a_model_fine_tuned_in_a_later_layer(tmp_path):
    import copy
    import json

    from kvpop.checkpoint import WEIGHTS_SAMPLED_KEY
    from kvpop.train.config import TrainConfig
    from kvpop.train.data import CaptureStore

    model = tiny_model("llama")
    cfg = TrainConfig(seq_len=64, budgets=(24,), observed=())
    CaptureStore(tmp_path / "store", cfg, model)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[1].self_attn.o_proj.weight.mul_(1.1)
    with pytest.raises(ValueError, match="capture store .* other settings \\(fingerprint"):
        CaptureStore(tmp_path / "store", cfg, tuned)
    # a store from before the sampled hash still matches its model
    meta = json.loads((tmp_path / "store" / "store.json").read_text())
    del meta["fingerprint"][WEIGHTS_SAMPLED_KEY]
    (tmp_path / "store" / "store.json").write_text(json.dumps(meta))
    CaptureStore(tmp_path / "store", cfg, model)


# --- item 8: evaluation domains follow the evaluated scorer ------------------------------------


def test_evaluation_domains_come_from_the_evaluated_scorer(tmp_path):
    from pathlib import Path

    from kvpop.checkpoint import model_fingerprint, save_scorer
    from kvpop.evaluate import EvalConfig, run_eval
    from kvpop.scorers import ScorerConfig, build_scorer
    from kvpop.testing import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    path = save_scorer(
        build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16)),
        tmp_path / "mine.safetensors",
        {"fingerprint": model_fingerprint(model), "corpora": ["python_code"]},
    )
    fixtures = Path(__file__).parents[1] / "fixtures" / "corpora"
    roots = {name: fixtures / name for name in ("paul_graham", "python_code")}
    cfg = EvalConfig(
        tasks=("lm",),
        policies=("dense", "kvpop-mlp"),
        compressions=(0.5,),
        reference_length=64,
        docs=1,
        doc_tokens=64,
        corpora=tuple(roots),
        corpus_root=roots,
        bootstrap=50,
        policy_kwargs={"kvpop-mlp": {"path": str(path)}},
    )
    res = run_eval(model, tok, cfg, progress=False, plots=False)
    domains = {r["source"]: r["domain"] for r in res["units"]}
    assert domains == {"python_code": "in_domain", "paul_graham": "out_of_domain"}
    assert res["in_domain"] == ["python_code"]


def test_shipped_domains_do_not_name_a_held_out_corpus():
    from kvpop.evaluate.harness import IN_DOMAIN
    from kvpop.train.config import HELD_OUT

    assert IN_DOMAIN and not set(IN_DOMAIN) & set(HELD_OUT)


# --- items 12, 15, 16: one clear error per bad argument, before any work ------------------------


def _no_model_load(monkeypatch):
    import kvpop.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(kvpop.models, "load_model", refuse)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--prompt", "hi", "--budget", "0"], "--budget must be a positive int"),
        (["--prompt", "hi", "--budget", "64", "--window", "0"], "--window must be a positive int"),
        (["--prompt", "hi", "--budget", "64", "--lam", "nan"], "--lam must be a finite number"),
        (["--prompt", "hi", "--budget", "64", "--lam", "-1"], "--lam must be >= 0"),
        (["--prompt", "hi", "--budget", "64", "--sinks", "-2"], "--sinks must be an int >= 0"),
        (["--prompt", "hi", "--budget", "8", "--window", "8"], "budget=8 is smaller than sinks + window"),
        (["--prompt", "hi", "--compression", "1.5"], "--compression must be in (0, 1)"),
        (
            ["--prompt", "hi", "--compression", "0.5", "--reference-length", "0"],
            "--reference-length must be a positive int",
        ),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be a positive int"),
        (["--prompt", ""], "--prompt is empty"),
    ],
)
def test_generate_cli_refuses_bad_arguments_before_loading(argv, needle, monkeypatch, capsys):
    from kvpop.cli import main

    _no_model_load(monkeypatch)
    assert main(["generate", "--policy", "knorm", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_generate_cli_refuses_an_empty_prompt_file(tmp_path, monkeypatch, capsys):
    from kvpop.cli import main

    _no_model_load(monkeypatch)
    (tmp_path / "empty.txt").write_text("")
    assert main(["generate", "--policy", "knorm", "--prompt-file", str(tmp_path / "empty.txt")]) == 2
    assert main(["generate", "--policy", "knorm", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is empty" in err[0] and "--prompt-file" in err[1] and "missing.txt" in err[1]


def test_kvpop_generate_refuses_an_empty_prompt():
    import kvpop
    from kvpop.testing import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    with pytest.raises(ValueError, match="prompt is empty"):
        kvpop.generate(model, tok, "", policy="h2o", budget=24)
    with pytest.raises(ValueError, match="item 1 of the list"):
        kvpop.generate(model, tok, ["hi", ""], policy="h2o", budget=24)


def test_cache_arguments_are_checked_by_type_and_integral_numbers_accepted():
    np = pytest.importorskip("numpy")
    cfg = tiny_model("llama").config
    cache = KVpopCache(cfg, budget=np.int64(24), window=np.int32(6), sinks=np.int64(2), policy="h2o")
    assert cache.budget == 24 and type(cache.eviction.k) is int
    with pytest.raises(TypeError, match="lam must be a number, got True"):
        KVpopCache(cfg, budget=24, window=6, lam=True, policy="h2o")
    with pytest.raises(TypeError, match="lam must be a number, got 'x'"):
        KVpopCache(cfg, budget=24, window=6, lam="x", policy="h2o")
    with pytest.raises(TypeError, match="reference_length must be an int, got 64.5"):
        KVpopCache(cfg, compression=0.5, reference_length=64.5, policy="h2o")
    with pytest.raises(TypeError, match="budget must be an int, got 24.0"):
        KVpopCache(cfg, budget=24.0, policy="h2o")
    from kvpop.config import EvictionConfig

    with pytest.raises(TypeError, match="lam"):
        EvictionConfig(sinks=2, window=6, k=4, lam=True)


def test_a_budget_beyond_the_models_positions_is_refused():
    cfg = tiny_model("llama", max_position_embeddings=128).config
    with pytest.raises(ValueError, match="budget=100000 exceeds the model's position limit"):
        KVpopCache(cfg, budget=100000, policy="h2o")
    KVpopCache(cfg, budget=128, policy="h2o")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--lr", "nan"], "lr"),
        (["--hidden", "0"], "hidden"),
        (["--dk", "0"], "dk"),
        (["--docs-from", "/no/such/folder"], "docs_from"),
    ],
)
def test_train_cli_refuses_bad_arguments_before_loading(tmp_path, extra, needle, monkeypatch, capsys):
    from kvpop.cli.train import main

    _no_model_load(monkeypatch)
    out = tmp_path / "run"
    argv = ["--out", str(out), "--seq-len", "64", "--budget", "24", "--window", "8", *extra]
    if "--docs-from" not in extra:
        argv += ["--docs-from", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()  # nothing created


# --- item 14: broken bundles and scorers are clear errors at load -------------------------------


@pytest.fixture
def bundle(tmp_path):
    from kvpop.adapt.lora import add_lora, lora_config, save_adapter_bundle
    from kvpop.scorers import ScorerConfig, build_scorer

    model = tiny_model("llama")
    scorer = build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16))
    return save_adapter_bundle(add_lora(model, lora_config(r=2)), scorer, tmp_path / "bundle")


def test_a_bundle_without_its_weights_is_a_clear_error(bundle):
    from kvpop.bundle import load_adapter_bundle

    (bundle / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors"):
        load_adapter_bundle(tiny_model("llama"), bundle)


def test_a_truncated_bundle_is_a_clear_error(bundle):
    from kvpop.bundle import load_adapter_bundle

    data = (bundle / "adapter_model.safetensors").read_bytes()
    (bundle / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="adapter_model.safetensors is not a readable safetensors file"):
        load_adapter_bundle(tiny_model("llama"), bundle)


def test_load_model_checks_the_bundle_before_loading_the_model(bundle, tmp_path, monkeypatch):
    import kvpop.models
    from kvpop.testing import save_tiny_model

    save_tiny_model(tmp_path / "model")
    (bundle / "adapter_config.json").unlink()
    monkeypatch.setattr(kvpop.models, "_load_folder", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        kvpop.models.load_model(str(tmp_path / "model"), adapter=bundle)


@pytest.mark.parametrize("poison", ["nan", "zeros"])
def test_a_scorer_with_nan_or_all_zero_weights_is_refused_at_load(tmp_path, poison):
    from kvpop.checkpoint import load_scorer, save_scorer
    from kvpop.scorers import ScorerConfig, build_scorer

    scorer = build_scorer(ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16))
    with torch.no_grad():
        for i, p in enumerate(scorer.parameters()):
            if poison == "zeros":
                p.zero_()
            elif i == 1:
                p.view(-1)[0] = float("nan")
    path = save_scorer(scorer, tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match="NaN or infinite" if poison == "nan" else "every weight is zero"):
        load_scorer(path)


# --- behaviours: generation features that crop the cache ---------------------------------------


@pytest.mark.parametrize("feature", ["prompt_lookup", "assistant"])
def test_assisted_decoding_and_prompt_lookup_are_refused(feature):
    """Both roll the cache back (crop) after rejected draft tokens; evicted tokens cannot come back.
    transformers refuses a cache that is not croppable right after the prompt's forward."""
    import kvpop
    from kvpop.testing import tiny_tokenizer

    model = tiny_model("llama")
    ids = _ids(40)
    ids = torch.cat([ids, ids[:, :20]], 1)  # repeats, so prompt lookup has drafts to propose
    kw = (
        {"prompt_lookup_num_tokens": 3}
        if feature == "prompt_lookup"
        else {"assistant_model": tiny_model("llama", seed=1)}
    )
    cache = KVpopCache(model.config, budget=24, window=6, sinks=2, policy="h2o")
    assert not cache.is_croppable
    # transformers >= 5.20 refuses a non-croppable cache after the prompt's forward; 5.19 (vLLM's pin)
    # asks the cache to crop, which refuses: an error either way, never a rolled-back cache
    with pytest.raises((ValueError, NotImplementedError), match="cache that can be cropped|cannot be cropped"):
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(1)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} .*cannot be rolled back"):  # kvpop.generate: before any work
        kvpop.generate(model, tiny_tokenizer(), "hello there", policy="h2o", budget=24, **kw)


# --- behaviours: torch.compile(model) with a KVpopCache ------------------------------------------


@pytest.mark.slow
def test_torch_compile_of_the_model_with_a_kvpop_cache():
    """torch.compile(model) (inductor) traces through the kvpop attention and the cache (graph breaks
    where the cache reads a tensor into Python): the eager model's logits and decisions. Slow (~30 s
    here: dynamo recompiles while the cache's Python counters change), so one layer and few steps."""
    from kvpop.testing import random_learned_policy

    model = tiny_model("llama", num_hidden_layers=1)
    ids = _ids(34)
    kw = {"budget": 20, "window": 6, "sinks": 2}
    eager = KVpopCache(model.config, policy=random_learned_policy(model, extra=True), **kw)
    want = _decode(model, eager, ids, 30)
    torch._dynamo.reset()
    try:
        compiled = KVpopCache(model.config, policy=random_learned_policy(model, extra=True), **kw)
        got = _decode(torch.compile(model), compiled, ids, 30)
    except Exception as exc:
        from torch._dynamo.exc import BackendCompilerFailed

        if isinstance(exc, BackendCompilerFailed):
            from kvpop.testing import compile_unavailable

            compile_unavailable(str(exc))
        raise
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled.layers[0].slot_index, eager.layers[0].slot_index)
