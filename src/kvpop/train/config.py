"""What a training run is: one dataclass, validated before any model or data is touched."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..config import EvictionConfig, TrainedSettings, resolve_eviction
from ..data import CORPORA
from ..validate import check_number

# Held out of training so the out-of-domain columns of the evaluation stay honest: one prose
# corpus (Paul Graham's essays) and one code corpus (the CPython standard library).
HELD_OUT = ("paul_graham", "python_code")
# The default mix. The MLP that ships since December 2026 adds "package_code" (Python sources of kvpop's own
# dependencies; its command names all seven: docs/training.md); the default stays the six so run folders
# started before resume with their settings.
TRAIN_CORPORA = ("shakespeare", "wikipedia", "python_docs", "human_eval", "perl_docs", "git_docs")

# Fields that change what a checkpoint means: a resumed run must agree on them.
RESUME_KEYS = (
    "scorer",
    "seq_len",
    "budgets",
    "budget_range",
    "windows_per_octave",
    "windows_per_sequence",
    "window",
    "window_fraction",
    "sinks",
    "lam",
    "loss",
    "weighting",
    "lr",
    "hidden",
    "dk",
    "dv",
    "position_free",
    "observed",
    "tilt",
    "cross_heads",
    "corpora",
    "docs_from",
    "seed",
    "data_seed",
    "steps",
    "batch_size",
    "cycle",
)


class RunSettings:
    """What the two run configs (:class:`TrainConfig`, :class:`kvpop.adapt.AdaptConfig`)
    share beyond their fields: the budget fields' normal form and the validation budgets."""

    def normalise_budgets(self) -> None:
        """``budget`` is shorthand for ``budgets=(budget,)``; budgets are ints, the sequences tuples."""
        if self.budget is not None:
            self.budgets = (int(self.budget),)
            self.budget = None
        self.budgets = tuple(int(b) for b in self.budgets)
        if self.budget_range is not None:
            self.budget_range = (int(self.budget_range[0]), int(self.budget_range[1]))
        self.val_budgets = tuple(int(b) for b in self.val_budgets)
        self.corpora = tuple(self.corpora)

    def validation_budgets(self) -> tuple[int, ...]:
        """Budgets the validation probe measures: ``val_budgets``, else the training budgets, else three
        spanning the range (twice its low end, its geometric middle, half its high end)."""
        if self.val_budgets:
            return self.val_budgets
        if self.budget_range is None:
            return self.budgets
        lo, hi = self.budget_range
        return tuple(sorted({min(hi, 2 * lo), round(math.sqrt(lo * hi)), max(lo, hi // 2)}))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def rotating_windows(grid, m: int, j: int) -> tuple[int, ...]:
    """The ``m`` windows of ``grid`` sequence ``j`` carries: spread over it and rotating with ``j``
    (grid[j], grid[j + n/m], ... mod n), so consecutive sequences cover the grid (``m <= 0``: all)."""
    grid = tuple(grid)
    if m <= 0 or m >= len(grid):
        return grid
    stride = len(grid) / m
    return tuple(sorted({grid[(j + int(i * stride)) % len(grid)] for i in range(m)}))


@dataclass
class TrainConfig(RunSettings):
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
    # (lo, hi): draw B log-uniformly from [lo, hi] at every step instead (one scorer for every budget in
    # between); the step's window is the captured window nearest window_fraction * B (see window_grid)
    budget_range: tuple[int, int] | None = None
    windows_per_octave: int = 2  # budget_range runs: target windows captured per doubling of the window
    # >0: each sequence carries targets for only this many windows of the grid (round-robin over the
    # sequences, so every window is covered evenly), and its steps draw budgets whose window it has: the
    # store shrinks (keys and values stay whole) while budgets stay log-uniform over all sequences
    windows_per_sequence: int = 0
    val_budgets: tuple[int, ...] = ()  # budgets of the validation probe (default: the budgets, or 3 over the range)
    window: int | None = None  # protected window; None: window_fraction * budget
    window_fraction: float = 0.5
    sinks: int = 4
    lam: float = 0.0  # global recency tilt: teacher ranks by target + lam*t, the margin compares priorities
    # the tilt scales with the budget, lam = lam_scale / B at each step's B, never below lam (the same
    # priority difference then spans the same share of the k slots at every budget; caches resolve it so)
    lam_scale: float | None = None
    # the target's power mean over the future queries (kvpop.targets): 1 is the mean attention a token
    # receives; larger ranks a token a few queries read sharply (a needle the question reads) above one
    # many read faintly
    target_power: float = 1.0
    # > 0: each token's target is the largest within this many tokens either side (kvpop.targets.
    # spread_targets), so the teacher keeps or drops a fact's tokens together; applied when a capture is
    # read, so one store serves every span
    target_span: int = 0
    loss: str = "boundary"  # "boundary" | "mse"
    weighting: str = "mass"  # boundary decisions weighted "uniform" or by the attention "mass" at stake
    tau: float = 1.0
    steps: int = 100
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0  # the scorer's initialisation, each step's budget draw, and (without data_seed) the data
    # the training text's order and windows (None: seed); a run with another seed and the same data_seed
    # trains on the same sequences, so it reuses the capture store (a seed control costs no new capture)
    data_seed: int | None = None
    hidden: int = 64
    dk: int = 32
    dv: int = 32
    position_free: bool = True  # undo RoPE on the keys the scorer sees
    observed: tuple[int | None, ...] = (None, 32, 1)  # observed-attention inputs (() = keys and values only)
    tilt: bool = True  # learned per-head recency tilt
    cross_heads: bool = False  # MLP: each head reads the token's features in all KV heads of its layer
    store: str | None = None  # capture store folder (None: capture every sequence on the fly, keep nothing)
    cycle: int = 0  # >0: step sequences cycle over the first `cycle` of the stream (sweeps over a filled store)
    capture_only: bool = False  # fill the store and stop (no scorer training)
    extra_windows: tuple[int, ...] = ()  # also capture targets for these windows (a store serving later runs)
    val_docs: int = 4  # validation windows (round-robin over the corpora) for retention under the real KVpopCache
    val_seq_len: int | None = None  # tokens per validation window (None: seq_len)
    val_cache: str | None = None  # folder keeping the validation baseline (dense, StreamingLLM) across runs
    val_every: int = 50
    ckpt_every: int = 25
    device: str = "cpu"
    stop_after: int | None = None  # end this process after that many total steps (as if killed); rerun resumes
    check_sync: bool = False  # DDP test aid: assert identical weights on all ranks after each step
    progress: bool = True
    extra: dict = field(default_factory=dict)  # free-form notes recorded in the summary

    def __post_init__(self) -> None:
        self.normalise_budgets()
        if self.val_seq_len is None:
            self.val_seq_len = self.seq_len
        self.observed = tuple(None if o is None else int(o) for o in self.observed)
        self.extra_windows = tuple(int(w) for w in self.extra_windows)
        self.store_grid: tuple[int, ...] = ()  # set by use_store_grid: the windows a capture store fixes

    # --- derived ------------------------------------------------------------------------
    @property
    def stream_seed(self) -> int:
        """The seed of the training text's stream (``data_seed``, else ``seed``)."""
        return self.seed if self.data_seed is None else int(self.data_seed)

    def rule(self) -> TrainedSettings:
        """The window and recency tilt this run trains each budget at, as the one resolver states them
        (:class:`kvpop.config.TrainedSettings`): what its checkpoint records, so caches resolve the same."""
        fraction = None if self.window is not None else self.window_fraction
        lo_hi = self.budget_range or ((min(self.budgets), max(self.budgets)) if self.budgets else None)
        return TrainedSettings(
            budget_range=lo_hi, window_fraction=fraction, window=self.window, lam=self.lam, lam_scale=self.lam_scale
        )

    def eviction(self, budget: int) -> EvictionConfig:
        return resolve_eviction(budget, sinks=self.sinks, trained=self.rule(), warn=False)

    def window_grid(self) -> tuple[int, ...]:
        """The windows a budget-range run trains at: ``windows_per_octave`` per doubling, log-spaced from
        the window of the smallest budget to that of the largest (``budgets`` runs: their own windows)."""
        if self.store_grid:
            return self.store_grid
        rule = self.rule()
        if self.budget_range is None or self.window is not None:
            return tuple(sorted({rule.window_at(b, self.sinks) for b in self.budgets}))
        lo, hi = (rule.window_at(b, self.sinks) for b in self.budget_range)
        n = max(1, round(math.log2(hi / lo) * self.windows_per_octave))
        return tuple(sorted({round(lo * (hi / lo) ** (i / n)) for i in range(n + 1)}))

    def use_store_grid(self, store_grid) -> None:
        """Train at the windows of a capture store's grid that this run's budget range reaches, so a
        store captured for a wide range also serves a run over part of it (a small-budget scorer, say).

        The store's windows between those of the range's ends, each end within the tolerance
        :meth:`step_eviction` allows (``2 ** (1 / (2 * windows_per_octave))``) of a store window, so
        every budget of the range still trains at a window near the one inference gives it."""
        if self.budget_range is None or self.window is not None:
            raise ValueError("only a budget-range run (no fixed window) can train at a store's window grid")
        self.store_grid = ()
        own = self.window_grid()
        tol = 2 ** (1 / (2 * self.windows_per_octave))
        grid = tuple(w for w in sorted(store_grid) if own[0] / tol <= w <= own[-1] * tol)
        if not grid or grid[0] > own[0] * tol or grid[-1] < own[-1] / tol:  # every budget needs a window near its own
            raise ValueError(
                f"budget_range {self.budget_range} needs windows {own[0]}..{own[-1]}; "
                f"the capture store has {sorted(store_grid)}"
            )
        self.store_grid = grid

    def windows(self) -> tuple[int, ...]:
        """Every protected window the run trains at (the capture computes targets for each)."""
        return self.window_grid()

    def capture_windows(self) -> tuple[int, ...]:
        """The windows a capture records: the run's own and ``extra_windows``."""
        return tuple(sorted(set(self.windows()) | set(self.extra_windows)))

    def sequence_windows(self, j: int) -> tuple[int, ...]:
        """The windows sequence ``j`` carries targets for: all of the grid, or ``windows_per_sequence`` of
        them spread over it and rotating with ``j`` (sequence j holds grid[j], grid[j + n/m], ...)."""
        return rotating_windows(self.window_grid(), self.windows_per_sequence, j)

    def step_eviction(self, step: int, windows=None) -> EvictionConfig:
        """The budget and split of training step ``step`` (deterministic per seed and step).

        ``budgets``: one of them. ``budget_range``: ``B`` log-uniform in the range and the window of
        the grid nearest ``window_fraction * B`` (in log scale: within a factor
        ``2 ** (1 / (2 * windows_per_octave))``), so every budget in the range is trained at a
        window close to the one inference uses."""
        rng = random.Random(self.seed * 100003 + step)
        ok = set(self.window_grid() if windows is None else windows)
        if self.budget_range is None:
            rule = self.rule()
            choices = [b for b in self.budgets if rule.window_at(b, self.sinks) in ok]
            if not choices:
                raise ValueError(f"step {step}: no training budget has a window among {sorted(ok)}")
            return self.eviction(rng.choice(choices))
        lo, hi = self.budget_range
        for _ in range(10_000):  # log-uniform, restricted to the budgets whose window the sequences carry
            ev = self.grid_eviction(round(lo * (hi / lo) ** rng.random()))
            if ev.window in ok:
                return ev
        raise ValueError(f"step {step}: no budget in {self.budget_range} has a window among {sorted(ok)}")

    def grid_eviction(self, budget: int) -> EvictionConfig:
        """``budget`` with the captured window nearest the one inference uses (the targets exist for it)."""
        rule = self.rule()
        want = rule.window_at(budget, self.sinks)
        window = min(self.window_grid(), key=lambda w: abs(math.log(w / want)))
        return resolve_eviction(budget, window=window, sinks=self.sinks, trained=rule, warn=False)

    def trained_settings(self) -> dict:
        """The checkpoint's ``trained_for``: what caches default to (``kvpop.config.TrainedSettings``)."""
        return {
            **self.rule().to_meta(),
            "budgets": list(self.budgets) if self.budget_range is None else None,
            "window_grid": list(self.window_grid()),
            "sinks": self.sinks,
            "seq_len": self.seq_len,
        }

    def resume_view(self) -> dict:
        d = asdict(self)
        view = {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in RESUME_KEYS}
        if not view["cross_heads"]:  # runs from before the option resume as they always did
            del view["cross_heads"]
        if self.lam_scale is not None:  # likewise: only runs that set it record it
            view["lam_scale"] = self.lam_scale
        if self.target_power != 1.0:  # and the power-mean target
            view["target_power"] = self.target_power
        if self.target_span:  # and the spread target
            view["target_span"] = self.target_span
        return view

    def validate(self) -> None:
        if self.scorer not in ("mlp", "mlstm"):
            raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {self.scorer!r}")
        if self.cross_heads and self.scorer != "mlp":
            raise ValueError("cross_heads is an MLP option (--kind mlp); the mLSTM reads each head's own stream")
        if self.loss not in ("boundary", "mse"):
            raise ValueError(f"loss must be 'boundary' or 'mse', got {self.loss!r}")
        if self.weighting not in ("uniform", "mass"):
            raise ValueError(f"weighting must be 'uniform' or 'mass', got {self.weighting!r}")
        if not self.budgets:
            raise ValueError("give at least one budget")
        if self.lam_scale is not None:
            v = self.lam_scale
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"lam_scale must be a finite number > 0, got {v!r}")
        if not (0.0 < self.window_fraction < 1.0):
            raise ValueError(f"window_fraction must be in (0, 1), got {self.window_fraction}")
        if self.windows_per_sequence < 0:
            raise ValueError(f"windows_per_sequence must be >= 0, got {self.windows_per_sequence}")
        if self.budget_range is not None:
            lo, hi = self.budget_range
            if not (1 <= lo <= hi):
                raise ValueError(f"budget_range must be (lo, hi) with 1 <= lo <= hi, got {self.budget_range}")
            if self.windows_per_octave < 1:
                raise ValueError(f"windows_per_octave must be >= 1, got {self.windows_per_octave}")
        for b in self.budget_range or self.budgets:
            ev = self.eviction(b)  # raises for a budget below sinks + window
            if ev.k < 1:
                raise ValueError(f"budget {b} leaves no long-range slot (sinks {ev.sinks} + window {ev.window})")
            if self.seq_len < ev.sinks + 2 * ev.window + 2:
                raise ValueError(f"seq_len={self.seq_len} too short for window={ev.window}: need > sinks + 2 * window")
        for name in ("steps", "batch_size", "val_every", "ckpt_every", "seq_len", "val_seq_len"):
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
        if not (
            isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0
        ):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        for name in ("hidden", "dk", "dv"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.docs_from and not Path(self.docs_from).exists():
            raise ValueError(f"docs_from {self.docs_from} does not exist")
        if not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        check_number("target_power", self.target_power, minimum=1.0, optional=False)
        if isinstance(self.target_span, bool) or not isinstance(self.target_span, int) or self.target_span < 0:
            raise ValueError(f"target_span must be an integer >= 0, got {self.target_span!r}")
        if self.capture_only and not self.store:
            raise ValueError("capture_only needs a store folder (--store DIR) to fill")
        if not self.docs_from:
            for c in self.corpora:
                if c not in CORPORA:
                    raise ValueError(f"unknown corpus {c!r}; known: {', '.join(CORPORA)}")
        if self.device != "cpu":
            import torch  # only a device other than the CPU needs it: the parser and the CPU check load no torch

            if torch.device(self.device).type != "cuda" or not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} is not available here (use cpu, or cuda on a CUDA machine)")
