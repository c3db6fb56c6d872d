"""What an adaptation run is: one dataclass, validated before any model or data is touched."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..config import EvictionConfig, TrainedSettings, resolve_eviction
from ..data import CORPORA
from ..train.config import TRAIN_CORPORA, RunSettings

MASKS = ("kvpop", "streaming")
KL_POSITIONS = ("all", "evicted")
KL_TAILS = ("bucket", "renormalize")
# the rows of the adaptation report (kvpop compare-adapted), in table order: its parser offers them
ROW_ORDER = ("adapted kvpop", "base kvpop", "adapted streaming", "base streaming", "adapted dense", "streaming+ dense")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Fields that change what a checkpoint means: a resumed run must agree on them (plus the resolved
# windows and lam, the starting scorer's content hash and the base model's fingerprint).
RESUME_KEYS = (
    "mask",
    "joint",
    "corpora",
    "docs_from",
    "seq_len",
    "batch_size",
    "budgets",
    "budget_range",
    "sinks",
    "tau",
    "weighting",
    "scorer_loss",
    "lora_r",
    "lora_alpha",
    "lora_targets",
    "full_finetune",
    "lr",
    "scorer_lr",
    "weight_decay",
    "steps",
    "top_k",
    "temperature",
    "kl_tail",
    "kl_positions",
    "seed",
)


@dataclass
class AdaptConfig(RunSettings):
    """An adaptation run (LoRA or full fine-tune under the eviction mask). See ``kvpop adapt --help``."""

    out: str = "runs/adapt"
    model: str | None = None
    mask: str = "kvpop"  # "kvpop": the learned scorer's mask; "streaming": StreamingLLM+ (k = 0, window = B - sinks)
    scorer: str | None = None  # scorer checkpoint to start from (required for mask kvpop; its kind/config decide)
    # also train the scorer (boundary loss on the adapted model's detached keys/values); off by default:
    # on a trained scorer the boundary-loss step lowers retention even with the LLM frozen, while the
    # loss itself keeps falling (docs/adaptation.md, "Why joint training does not help")
    joint: bool = False
    corpora: tuple[str, ...] = TRAIN_CORPORA
    docs_from: str | None = None
    seq_len: int = 4096
    batch_size: int = 1  # sequences per step, over all ranks
    budgets: tuple[int, ...] = (512,)  # one is drawn per step
    budget: int | None = None  # shorthand for budgets=(budget,)
    budget_range: tuple[int, int] | None = None  # (lo, hi): B log-uniform per step instead of --budgets
    val_budgets: tuple[int, ...] = ()  # budgets of the validation probe (default: --budgets, or 3 over the range)
    window: int | None = None  # None: window_fraction * B, else the scorer's trained fraction of B, else B / 2
    window_fraction: float | None = None
    sinks: int = 4
    lam: float | None = None  # None: the scorer's trained lam, else 0
    tau: float = 1.0
    weighting: str = "mass"
    scorer_loss: str = "boundary"  # "boundary" | "mse"
    lora_r: int = 16
    lora_alpha: float | None = None  # None: 2 r
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    full_finetune: bool = False  # train every decoder weight (embeddings / LM head stay frozen) instead of LoRA
    lr: float = 2e-4
    scorer_lr: float = 1e-3
    weight_decay: float = 0.0
    steps: int = 200
    top_k: int = 64  # teacher logits kept per position
    temperature: float = 1.0
    kl_tail: str = "bucket"  # the teacher's mass outside its top-k: one extra outcome, or "renormalize" it away
    kl_positions: str = "all"  # "all" positions, or only "evicted" ones (q >= B, where the mask differs from dense)
    logit_chunk: int = 512  # positions per LM-head call (memory: chunk x vocab)
    query_block: int = 128  # masked_eviction's query block (sdpa backend)
    gradient_checkpointing: bool = False
    val_docs: int = 2
    val_every: int = 50
    ckpt_every: int = 25
    device: str = "cpu"
    seed: int = 0
    stop_after: int | None = None  # end this process after that many total steps (as if killed); rerun resumes
    check_sync: bool = False  # DDP test aid: assert identical weights on all ranks after each step
    progress: bool = True
    extra: dict = field(default_factory=dict)
    # a bundle this run wrote at some step: with no train_state.pt in ``out``, the run continues from that
    # step with the bundle's LoRA weights and fresh optimizer moments (kvpop.adapt.restart); not a resume key
    from_bundle: str | None = None

    @classmethod
    def from_saved(cls, saved: dict, **overrides) -> AdaptConfig:
        """The config a checkpoint's ``config`` (the run's ``asdict``) describes, with ``overrides``:
        how tools re-create a run's windows, budgets and data streams from ``train_state.pt``."""
        names = {f.name for f in fields(cls) if f.init}
        return cls(**{**{k: v for k, v in saved.items() if k in names}, **overrides})

    def __post_init__(self) -> None:
        self.normalise_budgets()
        if isinstance(self.lora_targets, str):
            self.lora_targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        self.lora_targets = tuple(self.lora_targets)
        self._scorer_header: dict | None = None

    # --- the starting scorer ------------------------------------------------------------
    def scorer_header(self) -> dict:
        """The starting scorer checkpoint's header (read once; ``{}`` without a scorer)."""
        if self.scorer is None:
            return {}
        if self._scorer_header is None:
            from ..checkpoint import read_header  # torch: the parser and the other checks load none

            self._scorer_header = read_header(self.scorer)
        return self._scorer_header

    def scorer_sha256(self) -> str | None:
        if self.scorer is None:
            return None
        return hashlib.sha256(Path(self.scorer).read_bytes()).hexdigest()[:16]

    def _trained_for(self) -> dict:
        return self.scorer_header().get("meta", {}).get("trained_for") or {}

    # --- derived ------------------------------------------------------------------------
    def trained_settings(self) -> TrainedSettings | None:
        """The starting scorer's trained settings (None without a scorer)."""
        return TrainedSettings.from_meta(self._trained_for()) if self.scorer else None

    def rule(self) -> TrainedSettings | None:
        """The window and recency tilt of a kvpop-mask run at every budget, as the one resolver states them:
        the run's ``window`` / ``window_fraction`` / ``lam`` where set, else the starting scorer's trained
        ones, else the library defaults (what its bundle records). None for the streaming mask (StreamingLLM+:
        window ``B - sinks``, no long-range slot, lam 0)."""
        if self.mask == "streaming":
            return None
        trained = self.trained_settings()
        window, fraction = self.window, self.window_fraction
        if window is None and fraction is None and trained is not None:
            window, fraction = trained.window, trained.window_fraction
        if self.lam is not None:
            lam, lam_scale = float(self.lam), None
        else:
            lam, lam_scale = (0.0, None) if trained is None else (trained.lam, trained.lam_scale)
        return TrainedSettings(
            window=None if window is None else int(window), window_fraction=fraction, lam=lam, lam_scale=lam_scale
        )

    def eviction(self, budget: int) -> EvictionConfig:
        rule = self.rule()
        if rule is None:
            return resolve_eviction(budget, window=budget - self.sinks, sinks=self.sinks, lam=0.0, warn=False)
        return resolve_eviction(budget, sinks=self.sinks, trained=rule, warn=False)

    def budget_windows(self) -> dict[str, int]:
        """``{budget: window}`` of ``budgets`` (what the resume check and a ``--budgets`` bundle record)."""
        rule = self.rule()
        return {str(b): b - self.sinks if rule is None else rule.window_at(b, self.sinks) for b in self.budgets}

    def step_eviction(self, step: int) -> EvictionConfig:
        """The budget and split of step ``step`` (deterministic per seed and step): one of ``budgets``, or
        ``B`` log-uniform over ``budget_range`` with the window the one resolver gives at ``B`` (the mask
        is built on the fly, so any window is exact)."""
        rng = random.Random(self.seed * 100003 + step)
        if self.budget_range is None:
            return self.eviction(rng.choice(self.budgets))
        lo, hi = self.budget_range
        return self.eviction(round(lo * (hi / lo) ** rng.random()))

    def trained_for(self) -> dict:
        """What the bundle's scorer (and caches built from it) default to (``TrainedSettings``): the
        budget range adapted over, the window as a fraction of B (the starting scorer's, unless the run
        set one), the lam; ``budgets`` / ``windows`` list what a ``--budgets`` run drew."""
        lo_hi = self.budget_range or (min(self.budgets), max(self.budgets))
        rule = self.rule()
        return {
            "budget_range": list(lo_hi),
            "window": None if rule is None else rule.window,
            "window_fraction": self.window_fraction if rule is None else rule.window_fraction,
            "budgets": list(self.budgets) if self.budget_range is None else None,
            "windows": self.budget_windows() if self.budget_range is None else None,
            "sinks": self.sinks,
            "lam": 0.0 if rule is None else rule.lam,
            "lam_scale": None if rule is None else rule.lam_scale,
            "seq_len": self.seq_len,
        }

    def resume_view(self) -> dict:
        d = asdict(self)
        view = {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in RESUME_KEYS}
        rule = self.rule()
        view["windows"] = self.budget_windows()
        view["lam"] = 0.0 if rule is None else rule.lam
        if rule is not None and rule.lam_scale is not None:  # only runs from such a scorer record it: older runs
            view["lam_scale"] = rule.lam_scale  # resume as before
        view["scorer_sha256"] = self.scorer_sha256()
        return view

    def validate(self) -> None:
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.kl_positions not in KL_POSITIONS:
            raise ValueError(f"kl_positions must be one of {KL_POSITIONS}, got {self.kl_positions!r}")
        if self.kl_tail not in KL_TAILS:
            raise ValueError(f"kl_tail must be one of {KL_TAILS}, got {self.kl_tail!r}")
        if self.weighting not in ("uniform", "mass"):
            raise ValueError(f"weighting must be 'uniform' or 'mass', got {self.weighting!r}")
        if self.scorer_loss not in ("boundary", "mse"):
            raise ValueError(f"scorer_loss must be 'boundary' or 'mse', got {self.scorer_loss!r}")
        if self.mask == "kvpop":
            if not self.scorer:
                raise ValueError("mask kvpop needs a trained scorer to start from (--scorer PATH, from kvpop train)")
            self.scorer_header()  # raises for a missing or unreadable checkpoint
        elif self.scorer:
            raise ValueError("mask streaming uses no scorer (StreamingLLM+ control); drop --scorer")
        if not self.budgets:
            raise ValueError("give at least one budget")
        if self.budget_range is not None and not (2 <= self.budget_range[0] <= self.budget_range[1]):
            raise ValueError(f"budget_range must be (lo, hi) with 2 <= lo <= hi, got {self.budget_range}")
        if self.window_fraction is not None and not (0.0 < self.window_fraction < 1.0):
            raise ValueError(f"window_fraction must be in (0, 1), got {self.window_fraction}")
        if self.lam is not None and (not math.isfinite(self.lam) or self.lam < 0):
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        for name in (
            "steps",
            "batch_size",
            "val_every",
            "ckpt_every",
            "seq_len",
            "top_k",
            "logit_chunk",
            "query_block",
            "lora_r",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for b in self.budget_range or self.budgets:
            if b < 2:
                raise ValueError(f"budget must be >= 2, got {b}")
            ev = self.eviction(b)  # raises for a budget below sinks + window
            if self.mask == "kvpop" and ev.k < 1:
                raise ValueError(f"budget {b} leaves no long-range slot (sinks {ev.sinks} + window {ev.window})")
            if self.seq_len <= b:
                raise ValueError(f"seq_len={self.seq_len} must exceed the budget {b} (else nothing is ever evicted)")
            if self.mask == "kvpop" and self.joint and self.seq_len < ev.sinks + 2 * ev.window + 2:
                raise ValueError(
                    f"seq_len={self.seq_len} too short for window={ev.window}: the scorer's labels "
                    "need > sinks + 2 * window"
                )
        if self.val_docs < 0:
            raise ValueError(f"val_docs must be >= 0, got {self.val_docs}")
        for name in ("lr", "scorer_lr", "tau", "temperature"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not self.full_finetune and not self.lora_targets:
            raise ValueError("lora_targets must name at least one module")
        if self.from_bundle is not None and not Path(self.from_bundle).is_dir():
            raise ValueError(f"from_bundle {self.from_bundle} is not a folder (an adapter bundle kvpop adapt wrote)")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {self.stop_after}")
        if not self.docs_from:
            for c in self.corpora:
                if c not in CORPORA:
                    raise ValueError(f"unknown corpus {c!r}; known: {', '.join(CORPORA)}")
        elif not Path(self.docs_from).exists():
            raise ValueError(f"docs_from {self.docs_from} does not exist")
        if self.device != "cpu":
            if self.gradient_checkpointing:
                # the recomputation runs in autograd's device thread, outside the mask's context
                raise ValueError("gradient_checkpointing is for CPU runs (on a GPU, memory is not the limit)")
            import torch  # only a device other than the CPU needs it

            if not torch.device(self.device).type == "cuda" or not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} is not available here (use cpu, or cuda on a CUDA machine)")
