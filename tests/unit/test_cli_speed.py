"""The command line answers at once: `kvpop --help`, a subcommand's --help and a bad argument import no
torch, transformers or model code (importing torch alone takes seconds).

Asserted as what the process imported, not as a wall time: a loaded CI machine makes timings flaky, an
import is exact. The measured times are printed (`pytest -s`) for the record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# runs kvpop's main in a fresh interpreter and writes the names of every module it imported
DRIVER = """
import json, os, sys
import kvpop.cli
try:
    code = kvpop.cli.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
with open(os.environ["KVPOP_TEST_MODULES"], "w") as f:
    json.dump(sorted(sys.modules), f)
sys.exit(code)
"""
HEAVY = ("torch", "transformers", "peft", "safetensors", "kvpop.models", "kvpop.policies", "kvpop.cache")


def _run(argv: list, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str], float]:
    out = tmp_path / "modules.json"
    env = {**os.environ, "KVPOP_TEST_MODULES": str(out)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", DRIVER, *argv], check=False, capture_output=True, env=env, timeout=300)
    seconds = time.perf_counter() - t0
    return proc, json.loads(out.read_text()), seconds


def _config_only_model(root: Path) -> Path:
    """A model folder with only its config.json: the position limit is read from it, no weights needed."""
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    return root / "model"


ANSWERS_AT_ONCE = [
    (["--help"], 0),
    (["generate", "--help"], 0),
    (["info", "--help"], 0),
    (["bench", "--help"], 0),
    (["generate", "--budget", "0"], 2),  # no prompt: argparse's own error
    (["generate", "--prompt", "hi", "--budget", "0"], 2),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0", "--policy", "dense"], 2),
    (["generate", "--prompt", "hi", "--compare", "dense,streaming", "--sinks", "600"], 2),
    (["generate", "--prompt", "hi", "--sinks", "600"], 2),
    (["generate", "--prompt", "hi", "--policy", "nope"], 2),
    (["generate", "--prompt", b"ab\xffc"], 2),  # bytes that are not UTF-8, as a shell passes them
    (["generate", "--model", "{model}", "--prompt", "hi", "--budget", "100000"], 2),
    (["info", "--sinks", "600"], 2),
]


@pytest.mark.parametrize("argv,code", ANSWERS_AT_ONCE, ids=[" ".join(map(str, argv)) for argv, _ in ANSWERS_AT_ONCE])
def test_the_parser_and_bad_arguments_import_no_torch(argv, code, tmp_path):
    model = str(_config_only_model(tmp_path))
    argv = [model if a == "{model}" else a for a in argv]
    proc, modules, seconds = _run(argv, tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    if code == 2 and "--help" not in argv:
        assert err.strip().splitlines()[-1].startswith(("kvpop: error: ", "kvpop generate: error: ")), err
    heavy = [m for m in HEAVY if m in modules]
    assert not heavy, f"kvpop {' '.join(map(str, argv))} imported {heavy}"
    print(f"kvpop {' '.join(map(str, argv))}: {seconds:.2f} s")


def test_the_console_script_answers_help(tmp_path):
    """The installed `kvpop` script (the entry point kvpop.cli:main), timed for the record."""
    script = Path(sys.executable).with_name("kvpop")
    if not script.exists():
        pytest.skip("the kvpop console script is not installed next to this interpreter")
    t0 = time.perf_counter()
    proc = subprocess.run([str(script), "--help"], check=False, capture_output=True, timeout=300)
    assert proc.returncode == 0 and b"generate" in proc.stdout
    print(f"kvpop --help (console script): {time.perf_counter() - t0:.2f} s")


def test_import_kvpop_is_lazy_and_keeps_its_api():
    """`import kvpop` loads nothing heavy; every public name still resolves, to its module's object."""
    code = f"""
import sys, kvpop
assert not [m for m in {HEAVY!r} if m in sys.modules], sorted(sys.modules)
import kvpop.generate, kvpop.models
from kvpop.generate import generate
assert kvpop.generate is generate and kvpop.load_model is kvpop.models.load_model  # the function, not the module
assert kvpop.compat.__name__ == "kvpop.compat"  # a submodule by attribute, as after the eager import
missing = [n for n in kvpop.__all__ if not hasattr(kvpop, n)]
assert not missing and set(kvpop.__all__) <= set(dir(kvpop)), missing
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()


def test_the_cli_policy_names_are_the_registry_s():
    """The parser's policy names (kept torch-free in kvpop.names) are the registry's."""
    from kvpop import names, policies

    assert list(names.GENERATE_POLICIES) == policies.policy_names(teacher_forced=False, alias=True)
    assert list(names.ALL_POLICIES) == policies.policy_names()  # kvpop eval's default grid, without the alias
    assert names.DEFAULT_POLICY == policies.DEFAULT_POLICY
    assert list(names.POLICY_NAMES) == policies.policy_names(dense=False, alias=True)


# Every subcommand that parses its own options: its --help imports no torch either (its parser lives in
# kvpop.cli, or in a module whose imports of the runtime wait until the command runs).
SUBCOMMANDS = ("train", "adapt", "eval", "diagnose", "compare-adapted", "serve", "bench generate")


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_imports_no_torch(name, tmp_path):
    proc, modules, seconds = _run([*name.split(), "--help"], tmp_path)
    print(f"kvpop {name} --help: {seconds:.2f} s")
    assert proc.returncode == 0, proc.stderr.decode()
    assert not [m for m in HEAVY if m in modules]
