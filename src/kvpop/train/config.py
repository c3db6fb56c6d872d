"""What a training run is: one dataclass, validated before any model or data is touched."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..config import EvictionConfig

# Held out of training so the out-of-domain columns of the evaluation stay honest: one prose
# corpus (Paul Graham's essays) and one code corpus (the CPython standard library).
HELD_OUT = ("paul_graham", "python_code")
TRAIN_CORPORA = ("shakespeare", "wikipedia", "python_docs", "human_eval", "perl_docs", "git_docs")

# Fields that change what a checkpoint means: a resumed run must agree on them.
RESUME_KEYS = ("scorer", "seq_len", "budgets", "window", "window_fraction", "sinks", "lam", "loss", "weighting",
               "lr", "hidden", "dk", "dv", "position_free", "observed", "tilt", "corpora", "docs_from", "seed",
               "steps", "batch_size", "cycle")


@dataclass
class TrainConfig:
    """A scorer training run (LLM frozen). See ``kvpop train --help`` for each field."""

    scorer: str = "mlstm"  # "mlp" | "mlstm"
    out: str = "runs/scorer"
    model: str | None = None
    corpora: tuple[str, ...] = TRAIN_CORPORA
    docs_from: str | None = None  # a folder of .txt / a .jsonl of the user's own texts instead of corpora
    seq_len: int = 4096
    batch_size: int = 1  # sequences per step, over all ranks
    budgets: tuple[int, ...] = (512,)  # one is drawn per step: one scorer can serve several budgets
    budget: int | None = None  # shorthand for budgets=(budget,)
    window: int | None = None  # protected window; None: window_fraction * budget
    window_fraction: float = 0.5
    sinks: int = 4
    lam: float = 0.0  # global recency tilt: teacher ranks by target + lam*t, the margin compares priorities
    loss: str = "boundary"  # "boundary" | "mse"
    weighting: str = "mass"  # boundary decisions weighted "uniform" or by the attention "mass" at stake
    tau: float = 1.0
    steps: int = 100
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    hidden: int = 64
    dk: int = 32
    dv: int = 32
    position_free: bool = True  # undo RoPE on the keys the scorer sees
    observed: tuple[int | None, ...] = (None, 32, 1)  # observed-attention inputs (() = keys and values only)
    tilt: bool = True  # learned per-head recency tilt
    store: str | None = None  # capture store folder (None: capture every sequence on the fly, keep nothing)
    cycle: int = 0  # >0: step sequences cycle over the first `cycle` of the stream (sweeps over a filled store)
    capture_only: bool = False  # fill the store and stop (no scorer training)
    extra_windows: tuple[int, ...] = ()  # also capture targets for these windows (a store serving later runs)
    val_docs: int = 4  # validation documents for retention under the real KVpopCache
    val_every: int = 50
    ckpt_every: int = 25
    device: str = "cpu"
    stop_after: int | None = None  # end this process after that many total steps (as if killed); rerun resumes
    check_sync: bool = False  # DDP test aid: assert identical weights on all ranks after each step
    progress: bool = True
    extra: dict = field(default_factory=dict)  # free-form notes recorded in the summary

    def __post_init__(self) -> None:
        if self.budget is not None:
            self.budgets = (int(self.budget),)
            self.budget = None
        self.budgets = tuple(int(b) for b in self.budgets)
        self.corpora = tuple(self.corpora)
        self.observed = tuple(None if o is None else int(o) for o in self.observed)
        self.extra_windows = tuple(int(w) for w in self.extra_windows)

    # --- derived ------------------------------------------------------------------------
    def window_for(self, budget: int) -> int:
        if self.window is not None:
            return int(self.window)
        return max(1, round(self.window_fraction * budget))

    def eviction(self, budget: int) -> EvictionConfig:
        return EvictionConfig.from_budget(budget, window=self.window_for(budget), sinks=self.sinks, lam=self.lam)

    def windows(self) -> tuple[int, ...]:
        """Every protected window the run trains at (the capture computes targets for each)."""
        return tuple(sorted({self.window_for(b) for b in self.budgets}))

    def capture_windows(self) -> tuple[int, ...]:
        """The windows a capture records: the run's own and ``extra_windows``."""
        return tuple(sorted(set(self.windows()) | set(self.extra_windows)))

    def resume_view(self) -> dict:
        d = asdict(self)
        return {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in RESUME_KEYS}

    def validate(self) -> None:
        if self.scorer not in ("mlp", "mlstm"):
            raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {self.scorer!r}")
        if self.loss not in ("boundary", "mse"):
            raise ValueError(f"loss must be 'boundary' or 'mse', got {self.loss!r}")
        if self.weighting not in ("uniform", "mass"):
            raise ValueError(f"weighting must be 'uniform' or 'mass', got {self.weighting!r}")
        if not self.budgets:
            raise ValueError("give at least one budget")
        if not (0.0 < self.window_fraction < 1.0):
            raise ValueError(f"window_fraction must be in (0, 1), got {self.window_fraction}")
        for b in self.budgets:
            ev = self.eviction(b)  # raises for a budget below sinks + window
            if ev.k < 1:
                raise ValueError(f"budget {b} leaves no long-range slot (sinks {ev.sinks} + window {ev.window})")
            if self.seq_len < ev.sinks + 2 * ev.window + 2:
                raise ValueError(
                    f"seq_len={self.seq_len} too short for window={ev.window}: need > sinks + 2 * window"
                )
        for name in ("steps", "batch_size", "val_every", "ckpt_every", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cycle < 0:
            raise ValueError(f"cycle must be >= 0, got {self.cycle}")
        if self.val_docs < 0:
            raise ValueError(f"val_docs must be >= 0, got {self.val_docs}")
        for name in ("lr", "tau"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        for name in ("hidden", "dk", "dv"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.docs_from and not Path(self.docs_from).exists():
            raise ValueError(f"docs_from {self.docs_from} does not exist")
        if not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        if self.capture_only and not self.store:
            raise ValueError("capture_only needs a store folder (--store DIR) to fill")
        if not self.docs_from:
            from ..data import CORPORA

            for c in self.corpora:
                if c not in CORPORA:
                    raise ValueError(f"unknown corpus {c!r}; known: {', '.join(CORPORA)}")
        if self.device != "cpu":
            import torch

            if not torch.device(self.device).type == "cuda" or not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} is not available here (use cpu, or cuda on a CUDA machine)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
