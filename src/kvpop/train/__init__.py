"""Training KVpop scorers with the LLM frozen (method.md sections 3-6).

* :mod:`.config`  -- :class:`TrainConfig`, validated before anything loads;
* :mod:`.data`    -- the stream of training windows, their captures, the capture store;
* :mod:`.labels`  -- teacher labels, the boundary (or MSE) loss, decision diagnostics;
* :mod:`.quality` -- retention under the real cache on validation windows (model selection);
* :mod:`.loop`    -- the loop: DDP, atomic checkpoints, resume.

    kvpop train --kind mlstm --out runs/mlstm --steps 200
    torchrun --nproc_per_node 2 -m kvpop.train --kind mlp --out runs/mlp --batch-size 2
"""

from .cli import build_parser, config_from_args, main
from .config import HELD_OUT, TRAIN_CORPORA, TrainConfig
from .loop import train

__all__ = ["HELD_OUT", "TRAIN_CORPORA", "TrainConfig", "build_parser", "config_from_args", "main", "train"]
