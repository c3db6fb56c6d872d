"""Public names imported on first use (PEP 562), for the package and its subpackages.

``import kvpop`` (and ``import kvpop.train``, ``kvpop.adapt``, ``kvpop.evaluate``) loads no torch or
model code: a package lists its public names per submodule, and :func:`lazy_exports` gives it the
module-level ``__getattr__`` and ``__dir__`` that import a name's submodule the first time the name is
read. Plain Python, no kvpop import.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: dict[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[dict[str, str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(exports, __getattr__, __dir__)`` of ``package`` (its ``__name__``): ``exports`` maps each public
    name to the submodule that defines it (``modules``: submodule -> names); ``__getattr__`` imports a
    name's submodule on first use and keeps the value in ``namespace`` (the package's ``globals()``), and
    gives a submodule by attribute (``kvpop.models``), as after an eager import; ``__dir__`` lists both."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
            namespace[name] = value
            return value
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return exports, __getattr__, __dir__
