"""Imports above the runtime core (training, adaptation, evaluation, benchmarks, data, the command lines):
no cycles, no private names taken from another module, and imports inside functions only where they are
there for a reason (listed below with it)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvpop"
ABOVE = [
    "train",
    "adapt",
    "evaluate",
    "bench",
    "data",
    "cli",
    "serving",
]
# (file, imported module) -> why it is imported inside a function
DEFERRED = {
    ("evaluate/plotting.py", "matplotlib"): "heavy (~0.5 s); only the PNG writers need it",
    ("evaluate/plotting.py", "matplotlib.pyplot"): "heavy (~0.5 s); only the PNG writers need it",
    ("bench/gpu.py", "torch._dynamo"): "only the CUDA target rows raise dynamo's cache limit",
    ("bench/gpu.py", "..testing"): "test scaffolding (tiny models) for the parity part, kept out of the CLI's imports",
    ("serving/vllm/__init__.py", "."): "the backend module imports vLLM: loaded when vLLM calls the plugin",
    # the parsers of the command lines read these modules: torch loads when a command runs, so every subcommand's
    # --help and a bad argument answer at once (tests/unit/test_cli_speed.py)
    ("serving/vllm/__init__.py", ".settings"): "the settings import the cache (torch); `kvpop serve`'s parser not",
    ("evaluate/__init__.py", ".harness"): "IN_DOMAIN is read on first use, not at import",
    ("train/config.py", "torch"): "only a device other than the CPU is checked with torch",
    ("adapt/config.py", "torch"): "only a device other than the CPU is checked with torch",
    ("adapt/config.py", "..checkpoint"): "the starting scorer's header (torch, safetensors), read when a run checks it",
    ("data/packing.py", "torch"): "the corpora's names and splits are read without torch (the parsers' defaults)",
    ("evaluate/tasks.py", "torch"): "the task names and case text are read without torch (`kvpop eval`'s parser)",
    (
        "evaluate/humaneval.py",
        "..data.base",
    ): "the corpora import torch: HumanEval's problems are read when cases are built",
    (
        "evaluate/humaneval.py",
        "..data.splits",
    ): "the corpora import torch: HumanEval's problems are read when cases are built",
    ("evaluate/humaneval.py", ".tasks"): "the chat prompt helper (torch): the sandbox and extraction need none",
    ("evaluate/ruler.py", ".tasks"): "the chat prompt helper (torch): case text and scoring need none",
    ("serving/merged.py", "transformers"): "the tokenizer is saved only when a folder is merged",
    ("serving/merged.py", "transformers.utils"): "transformers' progress bars, switched only while a folder is merged",
}
# command modules whose every import of the runtime waits until the command runs (their parsers and refusals
# answer without torch): each in-function import there is deferred on purpose
COMMAND = "a command line: the runtime (torch, the model code) loads when the command runs, its parser needs none"
DEFERRED_MODULES = {
    "evaluate/suite.py": "`kvpop eval tasks`: parser, refusals and --report answer without loading a model",
    "serving/vllm/serve.py": "`kvpop serve`: the model is resolved and refused offline before vLLM or torch loads",
    "bench/generate.py": "`kvpop bench generate`: " + COMMAND,
    **{
        f"cli/{name}.py": COMMAND
        for name in (
            "__init__",
            "generate",
            "compare",
            "options",
            "train",
            "adapt",
            "eval",
            "diagnose",
            "compare_adapted",
        )
    },
}


def _optional(name: str) -> bool:
    """vLLM is optional (kvpop[vllm]): `kvpop serve --help`, the settings check, the benchmark's parent
    process and the plugin's entry point import without it, so vLLM itself is imported where it is used."""
    return name == "vllm" or name.startswith("vllm.")


def _files():
    for entry in ABOVE:
        p = SRC / entry
        yield from sorted(p.rglob("*.py")) if p.is_dir() else [p]


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path, node) -> list[str]:
    """The kvpop modules an import statement names (``from . import x`` names ``pkg.x`` when it is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _module(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
    mod = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
    subs = [
        f"{mod}.{a.name}"
        for a in node.names
        if (SRC.parent / f"{mod}.{a.name}".replace(".", "/")).exists()
        or (SRC.parent / (f"{mod}.{a.name}".replace(".", "/") + ".py")).exists()
    ]
    return subs or [mod]


def test_no_import_cycles_above_the_core():
    graph = {}
    for f in _files():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= {t for t in _targets(f, node) if t.startswith("kvpop.")}
        graph[_module(f)] = deps - {_module(f)}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph.get(m, ()):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_private_names_from_other_modules():
    for f in _files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                bad = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not bad, f"{f.relative_to(SRC)} imports private {bad} from {node.module}"


def test_imports_inside_functions_are_the_listed_ones():
    found = set()
    for f in _files():
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom):
                        found.add((str(f.relative_to(SRC)), "." * node.level + (node.module or "")))
                    elif isinstance(node, ast.Import):
                        found |= {(str(f.relative_to(SRC)), a.name) for a in node.names}
    found = {(f, m) for f, m in found if not _optional(m) and f not in DEFERRED_MODULES}
    assert found == set(DEFERRED), (
        f"unlisted: {sorted(found - set(DEFERRED))}; listed but gone: {sorted(set(DEFERRED) - found)}"
    )
