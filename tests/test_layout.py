"""One-way imports: the cache, rule, policies and scorers never depend on training, evaluation or benchmarks."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpop"
CORE = ["rule.py", "cache.py", "config.py", "attention.py", "policies", "scorers", "targets.py", "teacher.py"]
FORBIDDEN = ("train", "evaluate", "bench", "cli")


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            yield ("." * node.level) + mod
            for alias in node.names:
                yield ("." * node.level) + (mod + "." if mod else "") + alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name


def test_core_modules_do_not_import_training_or_evaluation():
    files = []
    for entry in CORE:
        p = SRC / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    for f in files:
        for name in _imports(f):
            parts = [x for x in name.replace("kvpop.", ".").split(".") if x]
            assert not any(part in FORBIDDEN for part in parts), f"{f.relative_to(SRC)} imports {name}"


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
