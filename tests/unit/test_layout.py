"""The import graph of the whole package: one-way imports, no cycles, no private names across modules,
and the runtime (cache, rule, policies, scorers, ...) never depends on training, evaluation, serving,
the CLI or the test oracles."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvpop"
# what runs inside a model with a KVpop cache, and what it loads (checkpoints, adapter bundles, the corpora): the top
# level of the package. targets and capture compute the future-attention targets the oracle policy runs on; mask is
# the masked simulation of the cache that evaluation and adaptation use. (kvpop/__init__.py, the public names,
# loads a few from kvpop.train and kvpop.adapt on first use: it is the facade, not a runtime module.)
RUNTIME_MODULES = (
    "attention",
    "bundle",
    "cache",
    "capture",
    "checkpoint",
    "compat",
    "compiled",
    "config",
    "files",
    "generate",
    "lazy",
    "mask",
    "models",
    "names",
    "observed",
    "rope",
    "rule",
    "state",
    "step",
    "targets",
    "validate",
)
RUNTIME = (*RUNTIME_MODULES, "policies", "scorers", "data")
# above the runtime: training, adaptation, evaluation, benchmarks, serving, the command lines, the plain references
# of kvpop.testing
NOT_RUNTIME = ("train", "adapt", "evaluate", "bench", "serving", "cli", "testing")
# the top level of src/kvpop: the runtime modules and the subpackages, nothing else
SUBPACKAGES = (
    "adapt",
    "assets",
    "bench",
    "cli",
    "data",
    "evaluate",
    "policies",
    "scorers",
    "serving",
    "testing",
    "train",
)
# No exceptions: every cycle and private import above the core is gone (issue #27). A new one fails.
ALLOWED_CYCLES: list[set[str]] = []
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """``(edges, private)``: every kvpop module each module imports (at the top or inside a function),
    and each ``(importer, module, name)`` of a private name taken from another module."""
    edges, private = {}, []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                for alias in node.names if target.startswith("kvpop") else ():
                    full = f"{target}.{alias.name}"
                    out.add(full if full in MODULES else target)
                    if full not in MODULES and alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append((name, target, alias.name))
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.startswith("kvpop")}
        edges[name] = {m for m in out if m in MODULES and m != name}
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            on.difference_update(comp)
            if len(comp) > 1:
                found.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return found


def _under(module: str, names) -> bool:
    return any(module == f"kvpop.{n}" or module.startswith(f"kvpop.{n}.") for n in names)


def test_no_import_cycles():
    cycles = [c for c in _cycles(_graph()[0]) if c not in ALLOWED_CYCLES]
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_modules():
    taken = [p for p in _graph()[1] if p not in ALLOWED_PRIVATE]
    assert not taken, f"private names imported from other modules (make them public in the lower one): {taken}"


def _reaches(layer: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """What of ``forbidden`` the modules of ``layer`` import, directly or through others, each with its importer.
    A ``__main__`` (``python -m kvpop.train``) is an entry point like the console script: it is not a root."""
    edges = _graph()[0]
    roots = [m for m in MODULES if _under(m, layer) and not m.endswith(".__main__")]
    seen, todo, via = set(), list(roots), {}
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            for w in edges[v]:
                via.setdefault(w, v)
                todo.append(w)
    return [f"{m} (imported by {via[m]})" for m in sorted(seen) if _under(m, forbidden)]


def test_runtime_never_imports_training_evaluation_serving_cli_or_testing():
    bad = _reaches(RUNTIME, NOT_RUNTIME)
    assert not bad, "the runtime reaches " + ", ".join(bad)


def test_evaluation_never_imports_training_adaptation_or_the_cli():
    bad = _reaches(("evaluate",), ("train", "adapt", "cli"))
    assert not bad, "kvpop.evaluate reaches " + ", ".join(bad)


def test_training_never_imports_adaptation_or_the_cli():
    bad = _reaches(("train",), ("adapt", "cli"))
    assert not bad, "kvpop.train reaches " + ", ".join(bad)


def test_the_top_level_is_the_runtime_and_the_subpackages():
    """``ls src/kvpop`` shows the architecture: a new module goes into the layer it belongs to."""
    found = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert found == set(RUNTIME_MODULES), (
        f"stray top-level modules: {sorted(found - set(RUNTIME_MODULES))}; gone: {sorted(set(RUNTIME_MODULES) - found)}"
    )
    dirs = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert dirs == set(SUBPACKAGES), (
        f"stray: {sorted(dirs - set(SUBPACKAGES))}; gone: {sorted(set(SUBPACKAGES) - dirs)}"
    )
    other = sorted(p.name for p in SRC.iterdir() if p.is_file() and p.suffix != ".py" and p.name != "py.typed")
    assert not other, f"stray files at the top of src/kvpop: {other}"


def test_the_graph_sees_imports():
    """The checks above read the real graph: known edges are found, a cycle and a private import are caught."""
    edges, _ = _graph()
    assert "kvpop.rule" in edges["kvpop.step"] and "kvpop.state" in edges["kvpop.cache"]
    assert "kvpop.rule" in edges["kvpop.testing.rule"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert not _under("kvpop.rule", NOT_RUNTIME) and _under("kvpop.testing.rule", NOT_RUNTIME)
    assert "kvpop.train.teacher" in edges["kvpop.train.labels"] and "kvpop.bundle" in edges["kvpop.serving.merged"]


def test_caches_are_built_in_one_place():
    """kvpop.make_cache (cache.py) is the only builder: no other module constructs KVpopCache or defines make_cache."""
    for f in sorted(SRC.rglob("*.py")):
        if f == SRC / "cache.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                assert name != "KVpopCache", f"{f.relative_to(SRC)}:{node.lineno} builds a KVpopCache; use make_cache"
            if isinstance(node, ast.FunctionDef):
                assert node.name != "make_cache", f"{f.relative_to(SRC)} defines another make_cache"


def test_pyproject_license_is_an_spdx_string():
    """A TOML-table license makes setuptools print deprecation warnings at every install."""
    import tomllib

    meta = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])  # PEP 639 support
