"""Adapting the LLM to the bounded cache (method.md section 5, "Adapting the LLM"; the joint stage).

* :mod:`.config`  -- :class:`AdaptConfig`, validated before anything loads;
* :mod:`.loop`    -- the loop: top-k KL(dense base || masked student) into LoRA weights, the
  boundary loss into the scorer, DDP, atomic checkpoints (adapter bundles), resume;
* :mod:`.quality` -- retention against the base model's dense outputs (validation, report table).

    kvpop adapt --scorer runs/mlstm/best.safetensors --out runs/adapt --budget 512
    kvpop adapt --mask streaming --out runs/adapt-streaming --budget 512      # StreamingLLM+ control
    torchrun --nproc_per_node 2 -m kvpop.adapt --scorer S --out runs/adapt --batch-size 2
"""

from .cli import build_parser, config_from_args, main
from .config import AdaptConfig
from .loop import adapt
from .quality import AdaptProbe, compare_adapted

__all__ = ["AdaptConfig", "AdaptProbe", "adapt", "build_parser", "compare_adapted", "config_from_args", "main"]
