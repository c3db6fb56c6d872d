"""``kvpop serve``'s arguments, resolved without vLLM: what MODEL stands for, the offline refusals, the
address it listens on, the settings it hands the plugin."""

import importlib.util
import json
import time

import pytest

from kvpop.checkpoint import default_adapter_path
from kvpop.models import default_gguf_path
from kvpop.serving.vllm import serve
from kvpop.serving.vllm.serve import ServeError, parse_args, prepare, resolve_model, settings_from_args, vllm_argv
from kvpop.testing import save_tiny_model


def _choice(*argv):
    return resolve_model(parse_args(list(argv))[0])


@pytest.mark.parametrize("model", ["someorg/somemodel", "/nonexistent/model", "not-an-embedded-model"])
def test_unknown_model_is_one_offline_error_line_before_vllm(model, capsys):
    t = time.perf_counter()
    assert serve.main([model, "--budget", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("kvpop serve: error: "), err
    assert repr(model) in err and "offline" in err, err
    assert "vLLM is not installed" not in err  # refused before vLLM is even looked for
    assert time.perf_counter() - t < 20  # no hub lookup (it took 29 s to fail)


def test_a_folder_without_config_and_a_non_gguf_file_are_refused(tmp_path):
    with pytest.raises(ServeError, match="no config.json"):
        _choice(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ServeError, match="not a .gguf file"):
        _choice(str(tmp_path / "weights.bin"))


def test_embedded_names_resolve_to_their_gguf():
    for name in ("smollm2-135m-instruct", "SmolLM2", "default"):
        choice = _choice(name)
        assert (choice.kind, choice.path, choice.bundle) == ("gguf", default_gguf_path(), None)


def test_no_model_is_the_adapted_default_as_kvpop_generate():
    bundle = default_adapter_path()
    choice = _choice("--budget", "128")
    assert (choice.kind, choice.path, choice.bundle) == ("adapted", default_gguf_path(), bundle)
    assert _choice("--policy", "kvpop-mlp").kind == "adapted"  # the policy the bundle's scorer serves
    assert _choice("--policy", "kvpop").kind == "adapted"  # the model's default learned policy: the bundle's
    for argv in (
        ["--base-model"],
        ["--policy", "streaming"],
        ["--policy", "kvpop-mlstm"],
        ["--scorer", "s.safetensors"],
    ):
        assert _choice(*argv).kind == "gguf", argv  # the base model, as `kvpop generate` with the same options
    args, _ = parse_args(["--budget", "128", "--policy", "kvpop"])  # the settings name the concrete policy
    assert settings_from_args(args)["policy"] == "kvpop-mlp" == settings_from_args(args, "kvpop-mlp")["policy"]
    assert settings_from_args(args, "kvpop-mlstm")["policy"] == "kvpop-mlstm"
    args, _ = parse_args(["--budget", "128"])
    raw = settings_from_args(args, "kvpop-mlp", "/m/scorer.safetensors")
    assert raw == {"budget": 128, "policy": "kvpop-mlp", "scorer": "/m/scorer.safetensors"}
    args, _ = parse_args(["--budget", "128", "--scorer", "mine.safetensors", "--policy", "kvpop-mlstm"])
    assert settings_from_args(args, "kvpop-mlp", "/m/scorer.safetensors")["scorer"] == "mine.safetensors"


def _address(argv):
    i = argv.index("--host")
    assert argv.count("--host") == 1 and argv.count("--port") == 1
    return argv[i + 1], argv[argv.index("--port") + 1]


def test_listens_on_localhost_unless_host_is_given():
    args, rest = parse_args(["--budget", "64", "--dtype", "float32"])
    argv = vllm_argv("/m", args, rest, {"budget": 64})
    assert argv[:2] == ["serve", "/m"] and _address(argv) == ("127.0.0.1", "8000")
    assert "--dtype" in argv and json.loads(argv[argv.index("--additional-config") + 1]) == {"kvpop": {"budget": 64}}
    args, rest = parse_args(["--budget", "64", "--host", "0.0.0.0", "--port", "9001"])
    assert _address(vllm_argv("/m", args, rest, {})) == ("0.0.0.0", "9001")


def test_prepare_a_folder_without_vllm(tmp_path):
    save_tiny_model(tmp_path / "m")
    plan = prepare(
        [str(tmp_path / "m"), "--budget", "16", "--policy", "streaming", "--max-model-len", "64"],
        progress=False,
        need_vllm=False,
    )
    assert plan.model == tmp_path / "m" and plan.settings == {"budget": 16, "policy": "streaming"}
    assert _address(plan.vllm_argv) == ("127.0.0.1", "8000") and "--max-model-len" in plan.vllm_argv
    with pytest.raises(ServeError, match="budget"):  # the plugin's own check, before vLLM
        prepare([str(tmp_path / "m"), "--budget", "0", "--policy", "streaming"], progress=False, need_vllm=False)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--budget", "64", "--additional-config", "{}"], ["--additional-config"]),
        (["--budget", "64", "--port", "0"], ["--port"]),
        (["m", "--base-model"], ["--base-model"]),
    ],
)
def test_bad_options_are_refused(argv, words):
    with pytest.raises(ServeError) as err:
        parse_args(argv)
    assert all(w in str(err.value) for w in words)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_says_so_before_building_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(serve, "build_model", lambda *a, **k: pytest.fail("built a model without vLLM"))
    assert serve.main(["--budget", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpop serve: error: vLLM is not installed") and "\n" not in err


def test_the_default_model_has_a_name_for_clients():
    args, rest = parse_args(["--budget", "64"])
    choice = resolve_model(args)
    argv = vllm_argv("/cache/models/x--y-123", args, rest, {}, choice.name)
    assert argv[argv.index("--served-model-name") + 1] == "smollm2-135m-instruct-kvpop"
    assert _choice("--base-model").name == "smollm2-135m-instruct" and _choice("smollm2").name is None
    args, rest = parse_args(["--budget", "64", "--served-model-name", "mine"])
    argv = vllm_argv("/m", args, rest, {}, "smollm2-135m-instruct-kvpop")
    assert argv.count("--served-model-name") == 1 and argv[argv.index("--served-model-name") + 1] == "mine"


def test_vllm_option_values_are_not_taken_for_the_model():
    args, rest = parse_args(["--budget", "512", "--dtype", "float32", "--max-model-len", "8192", "--enforce-eager"])
    assert args.model is None and rest == ["--dtype", "float32", "--max-model-len", "8192", "--enforce-eager"]
    args, rest = parse_args(["/m", "--dtype", "float32", "--budget", "64"])
    assert (args.model, args.budget, rest) == ("/m", 64, ["--dtype", "float32"])
