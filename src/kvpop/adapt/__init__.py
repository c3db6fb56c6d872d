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

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

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

__all__ = [
    "AdaptConfig",
    "AdaptProbe",
    "adapt",
    "compare_adapted",
]

# a public name from its module, imported on first use: importing a submodule (the command lines read
# ``kvpop.train.config``) loads no torch or model code it does not need
_EXPORTS, __getattr__, __dir__ = lazy_exports(__name__, _MODULES, globals())
