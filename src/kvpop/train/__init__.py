"""Training KVpop scorers with the LLM frozen (method.md sections 3-6).

* :mod:`.config`  -- :class:`TrainConfig`, validated before anything loads;
* :mod:`.data`    -- the stream of training windows, their captures, the capture store;
* :mod:`.teacher` -- teacher labels: which token the cache should evict at each step;
* :mod:`.labels`  -- teacher labels per layer, the boundary (or MSE) loss, decision diagnostics;
* :mod:`.quality` -- retention under the real cache on validation windows (model selection);
* :mod:`.runs`    -- the run around the steps (ranks, resume state, checkpoints), shared with :mod:`kvpop.adapt`;
* :mod:`.loop`    -- the loop: DDP, atomic checkpoints, resume.

The command line is :mod:`kvpop.cli.train`::

    kvpop train --kind mlstm --out runs/mlstm --steps 200
    torchrun --nproc_per_node 2 -m kvpop.train --kind mlp --out runs/mlp --batch-size 2
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .config import HELD_OUT, TRAIN_CORPORA, TrainConfig
    from .loop import train

# the module (in this package) -> the public names it defines, imported on first use
_MODULES: dict[str, tuple[str, ...]] = {
    "config": ("HELD_OUT", "TRAIN_CORPORA", "TrainConfig"),
    "loop": ("train",),
}

__all__ = [
    "HELD_OUT",
    "TRAIN_CORPORA",
    "TrainConfig",
    "train",
]

# a public name from its module, imported on first use: importing a submodule (the command lines read
# ``kvpop.train.config``) loads no torch or model code it does not need
_EXPORTS, __getattr__, __dir__ = lazy_exports(__name__, _MODULES, globals())
