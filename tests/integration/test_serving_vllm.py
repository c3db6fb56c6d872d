"""The vLLM plugin on vLLM's CPU build, with the embedded SmolLM2-135M-Instruct (float32).

* greedy tokens through vLLM with ``additional_config={"kvpop": ...}`` equal a ``KVpopCache`` +
  ``model.generate`` on the same prompts (longer than B, different lengths, in one batch with
  unaligned prefill chunks mixed with decode steps, and alone), for kvpop, kvpop-mlp, streaming;
* with B at least prompt + generation, the plugin equals vLLM without it;
* vLLM's own KV accounting is one kvpop page per request and layer;
* bad settings are refused before the engine starts;
* ``kvpop serve`` (vLLM's server with the plugin) answers OpenAI-client requests with the offline tokens;
* ``kvpop serve`` without a model serves ``kvpop generate``'s default (the adapted model, its scorer) on
  127.0.0.1, with its greedy tokens.

Each engine runs in its own process (``tests/integration/vllm_run.py``). Skipped where vllm is not importable
(the main suite needs no vLLM); ``.ci/run`` runs these in the vLLM virtualenv.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import kvpop

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install kvpop[vllm])"
    ),
]

HELPER = Path(__file__).with_name("vllm_run.py")
BUDGET, NEW_TOKENS = 128, 64
LENGTHS = ((0, 210), (400, 700), (900, 1310))  # token ranges of the test text: prompts of 210, 300, 410 > B
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="module")
def real():
    from kvpop.data import load_documents
    from kvpop.models import convert_gguf, default_gguf_path

    folder = str(convert_gguf(default_gguf_path(), progress=False))
    model, tok = kvpop.load_model(progress=False)
    text = "\n\n".join(d.text for d in load_documents("wikipedia", "test")[:40])
    ids = tok(text)["input_ids"]
    prompts = [ids[a:b] for a, b in LENGTHS]
    return folder, model, tok, prompts


_RUNS: dict = {}


def _vllm(real, engine: dict, batches, tmp_path_factory, max_tokens=NEW_TOKENS) -> dict:
    """One engine (memoised per configuration), each of ``batches`` one ``generate`` call."""
    key = json.dumps([engine, batches, max_tokens], sort_keys=True)
    if key not in _RUNS:
        folder, _, _, prompts = real
        d = tmp_path_factory.mktemp("vllm")
        spec = {"model": folder, "prompts": prompts, "batches": batches, "max_tokens": max_tokens, "engine": engine}
        (d / "spec.json").write_text(json.dumps(spec))
        r = subprocess.run(
            [sys.executable, str(HELPER), str(d / "spec.json"), str(d / "out.json")],
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if r.returncode != 0:
            pytest.fail(f"vLLM run failed ({r.returncode}):\n{r.stderr[-4000:]}")
        _RUNS[key] = json.loads((d / "out.json").read_text())
    return _RUNS[key]


def _kvpop_engine(policy, budget=BUDGET, **kw):
    # a small token budget per step: prefill chunks that do not end on the prefill chunk's multiples,
    # and prefill chunks of some requests in the same steps as decode tokens of others
    return {
        "max_model_len": 1024,
        "max_num_batched_tokens": 256,
        "additional_config": {"kvpop": {"budget": budget, "policy": policy}},
        **kw,
    }


_REFS: dict = {}


@torch.no_grad()
def _reference(model, prompt, policy=None, budget=BUDGET):
    """Greedy tokens of ``model.generate`` with a ``KVpopCache`` (``policy=None``: transformers' dense cache)."""
    key = (tuple(prompt), policy, budget)
    if key not in _REFS:
        cache = None if policy is None else kvpop.make_cache(model, policy, budget=budget)
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            past_key_values=cache,
        )
        _REFS[key] = out[0, len(prompt) :].tolist()
    return _REFS[key]


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.parametrize("policy", ["kvpop-mlstm", "kvpop-mlp", "streaming"])
def test_vllm_plugin_equals_kvpop_cache(real, policy, tmp_path_factory):
    _, model, _, prompts = real
    out = _vllm(real, _kvpop_engine(policy), [[0, 1, 2], [1]], tmp_path_factory)
    batched, alone = out["tokens"]
    evicting = False
    for i, prompt in enumerate(prompts):
        want = _reference(model, prompt, policy)
        assert len(batched[i]) == NEW_TOKENS
        assert _first_difference(batched[i], want) is None, f"prompt {i} ({len(prompt)} tokens), in a batch"
        evicting |= want != _reference(model, prompt)  # the budget matters for this prompt
        if i == 1:
            assert _first_difference(alone[0], want) is None, "prompt 1 alone"
    assert evicting, "no prompt's output depends on the budget: the test would not see a wrong eviction"
    # vLLM's own accounting: one kvpop page per request and layer, whatever max_model_len
    from kvpop.serving.paged import PageLayout

    cache = kvpop.make_cache(model, policy, budget=BUDGET)
    c = model.config
    page = PageLayout(cache.layers[0], c.num_key_value_heads, c.head_dim, c.head_dim, torch.float32).page_bytes
    assert out["num_blocks"] == out["kv_cache_bytes"] // (c.num_hidden_layers * page)
    assert out["max_concurrency"] == out["num_blocks"] and out["prefix_caching"] is False


def test_vllm_plugin_with_budget_beyond_length_equals_vllm_dense(real, tmp_path_factory):
    _, _, _, prompts = real
    budget = max(len(p) for p in prompts) + NEW_TOKENS
    dense = _vllm(real, {"max_model_len": 1024, "max_num_batched_tokens": 256}, [[0, 1, 2]], tmp_path_factory)
    big = _vllm(real, _kvpop_engine("kvpop-mlstm", budget=budget), [[0, 1, 2]], tmp_path_factory)
    for i, (a, b) in enumerate(zip(big["tokens"][0], dense["tokens"][0])):
        assert _first_difference(a, b) is None, f"prompt {i}"


def test_vllm_refuses_bad_settings_before_the_engine_starts(real):
    folder = real[0]
    cases = [
        ({"budget": 0}, "budget"),
        ({"budget": 64, "policy": "oracle"}, "policy"),
        ({"budget": 64, "windw": 8}, "windw"),
    ]
    for settings, word in cases:
        code = (
            f"from vllm import LLM\nLLM(model={folder!r}, dtype='float32', additional_config={{'kvpop': {settings!r}}})"
        )
        t = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert r.returncode != 0
        # vLLM's config is a pydantic dataclass: the error arrives as its ValidationError (a ValueError)
        # whose message is kvpop's, naming the key
        lines = [x for x in r.stderr.splitlines() if "additional_config['kvpop']" in x]
        assert lines and word in lines[-1] and "ValidationError" in r.stderr, r.stderr[-2000:]
        assert "Initializing a V1 LLM engine" not in r.stderr, "the engine started before the settings were checked"
        assert time.perf_counter() - t < 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_plugin_answers_like_the_offline_path(real, tmp_path_factory):
    from openai import OpenAI

    folder, _, _, prompts = real
    offline = _vllm(real, _kvpop_engine("kvpop-mlstm"), [[0, 1, 2], [1]], tmp_path_factory)["tokens"][0]
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # `kvpop serve` = `vllm serve --additional-config '{"kvpop": ...}'` (vllm-cpu 0.32.0's `vllm` script
    # fails at startup on its own version lookup; see kvpop.serving.vllm.serve)
    cmd = [
        sys.executable,
        "-m",
        "kvpop.cli",
        "serve",
        folder,
        "--budget",
        str(BUDGET),
        "--policy",
        "kvpop-mlstm",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        "256",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    with open(log, "w") as f:
        server = subprocess.Popen(
            cmd, env={**os.environ, **ENV}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
        _wait_up(client, server, log)

        def ask(prompt):
            r = client.completions.create(
                model=folder,
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            return r.choices[0].token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:  # the requests run concurrently in the server
            answers = list(pool.map(ask, prompts))
        for i, (got, want) in enumerate(zip(answers, offline)):
            assert _first_difference(list(got), want) is None, f"prompt {i}"
    finally:
        _stop(server)


def _wait_up(client, server, log: Path) -> None:
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            pytest.fail(f"kvpop serve exited ({server.returncode}):\n{log.read_text()[-4000:]}")
        try:
            client.models.list()
            return
        except Exception:  # noqa: BLE001 (not up yet)
            if time.monotonic() > deadline:
                pytest.fail(f"kvpop serve did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(2)


def test_kvpop_serve_default_is_kvpop_generates_adapted_model(tmp_path):
    """No model: the shipped bundle's LoRA merged (into a fresh cache) and its scorer, on 127.0.0.1 only;
    greedy tokens equal `kvpop generate`'s (its model: load_model(adapter="default", merge=True))."""
    import psutil
    from openai import OpenAI

    from kvpop.data import load_documents
    from kvpop.models import convert_gguf, default_gguf_path

    budget, new_tokens = 128, 16  # this prompt: the 11th token differs from dense's, the 8th from the base model's
    cache = tmp_path / "cache"  # the merged folder goes here; the converted model is the user's (linked)
    converted = convert_gguf(default_gguf_path(), progress=False)
    (cache / "models").mkdir(parents=True)
    (cache / "models" / converted.name).symlink_to(converted)
    port, log = _free_port(), tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "kvpop.cli",
        "serve",
        "--budget",
        str(budget),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    with open(log, "w") as f:
        server = subprocess.Popen(
            cmd,
            env={**os.environ, **ENV, "KVPOP_CACHE_DIR": str(cache)},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # the reference while the server starts: `kvpop generate --budget 128` on the same prompt
        model, tok = kvpop.load_model(adapter="default", merge=True, progress=False)
        text = "\n\n".join(d.text for d in load_documents("wikipedia", "test")[:40])
        prompt = tok.decode(tok(text)["input_ids"][400:700])
        res = kvpop.generate(
            model, tok, prompt, budget=budget, max_new_tokens=new_tokens, min_new_tokens=new_tokens, compile=False
        )
        assert res.cache.policy.name == "kvpop-mlp" and "adapter bundle" in res.cache.policy.source
        ids = res.sequences[0, : res.prompt_tokens].tolist()
        want = res.sequences[0, res.prompt_tokens :].tolist()

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
        _wait_up(client, server, log)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct-kvpop"]
        listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening
        extra = {"return_token_ids": True, "ignore_eos": True}
        r = client.completions.create(
            model="smollm2-135m-instruct-kvpop", prompt=ids, max_tokens=new_tokens, temperature=0, extra_body=extra
        )
        got = list(r.choices[0].token_ids)
        # serving the base model or a dense cache would fail here (tests/integration/test_serve_merged.py checks)
        assert _first_difference(got, want) is None, (got, want)
        merged = [p for p in (cache / "models").iterdir() if "--" in p.name]
        assert len(merged) == 1 and (merged[0] / "kvpop-merged.json").is_file()
    finally:
        _stop(server)


def _stop(server: subprocess.Popen) -> None:
    """Stop the server and its engine processes (its own process group), politely first."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
