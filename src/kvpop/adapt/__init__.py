"""Adapting the LLM to the bounded cache (method.md section 5, "Adapting the LLM"; the joint stage).

* :mod:`.config`  -- :class:`AdaptConfig`, validated before anything loads;
* :mod:`.lora`    -- LoRA adapters (peft) and writing adapter bundles (:mod:`kvpop.bundle` loads them);
* :mod:`.loop`    -- the loop: top-k KL(dense base || masked student) into LoRA weights, the
  boundary loss into the scorer, DDP, atomic checkpoints (adapter bundles), resume;
* :mod:`.quality` -- retention against the base model's dense outputs (validation, report table).

The command line is :mod:`kvpop.cli.adapt`::

    kvpop adapt --scorer runs/mlstm/best.safetensors --out runs/adapt --budget 512
    kvpop adapt --mask streaming --out runs/adapt-streaming --budget 512      # StreamingLLM+ control
    torchrun --nproc_per_node 2 -m kvpop.adapt --scorer S --out runs/adapt --batch-size 2
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .config import AdaptConfig
    from .loop import adapt
    from .quality import AdaptProbe, compare_adapted

# the module (in this package) -> the public names it defines, imported on first use
_MODULES: dict[str, tuple[str, ...]] = {
    "config": ("AdaptConfig",),
    "loop": ("adapt",),
    "quality": ("AdaptProbe", "compare_adapted"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "AdaptConfig",
    "AdaptProbe",
    "adapt",
    "compare_adapted",
]


def __getattr__(name: str) -> Any:
    """A public name from its module, imported on first use: importing a submodule (the command lines read
    ``kvpop.train.config``) loads no torch or model code it does not need."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule, as after the eager imports of old
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
