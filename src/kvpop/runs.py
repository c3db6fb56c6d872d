"""What ``kvpop train`` and ``kvpop adapt`` share: the run around the optimisation steps.

A *program* (the scorer training of :mod:`kvpop.train`, the LLM adaptation of :mod:`kvpop.adapt`)
owns its models, optimisers and one optimisation step. :class:`Run` owns everything around the
steps, written once for both:

* the ranks (one process, or several under ``torchrun``: gloo on CPU, NCCL on CUDA);
* the resume check: ``out/train_state.pt`` is read before the model loads and refused when its
  settings (the config's ``resume_view``) or its model (fingerprint) differ from this run's;
* the schedule: ``steps`` steps, validation every ``val_every`` and at the end (rank 0; the best
  by ``mean_retention`` is kept), a checkpoint every ``ckpt_every`` and at the end (rank 0),
  ``stop_after`` to end a process early as if killed, and with ``check_sync`` a digest of the
  weights compared over ranks after every step;
* the checkpoint's common part (step, history, best, config, resume view, fingerprint), an
  ``OSError`` that says what is still whole when a write fails, and the summary
  (``out/summary.json``, strict JSON).

A program implements :class:`Program`; the files it writes use :mod:`kvpop.files` (atomic).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .checkpoint import fingerprint_diff
from .files import check_writable_dir, clean_leftovers, write_json

__all__ = ["STATE_FILE", "Program", "Run", "RunSettings", "check_in_sync", "cosine_schedule", "digest",
           "dist_setup", "resume_mismatch"]  # fmt: skip

STATE_FILE = "train_state.pt"  # what a resume reads (the name predates kvpop adapt, which uses it too)


def dist_setup(device: str) -> tuple[int, int]:
    """``(rank, world size)``: the process group is started under ``torchrun`` (``WORLD_SIZE > 1``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def cosine_schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``min(20, steps / 10)`` steps, then a cosine decay to 0 at ``steps``."""
    warmup = max(1, min(20, steps // 10))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )


def digest(params) -> torch.Tensor:
    """One number per process that differs when the weights differ (the sum of every parameter)."""
    return torch.stack([p.detach().double().sum() for p in params]).sum().view(1)


def check_in_sync(params, step: int, world: int) -> None:
    """Raise when the ranks hold different weights after ``step`` (``--check-sync``, a test aid)."""
    d = digest(params)
    all_d = [torch.zeros_like(d) for _ in range(world)]
    dist.all_gather(all_d, d)
    if not all(torch.equal(all_d[0], x) for x in all_d):
        raise RuntimeError(f"ranks diverged at step {step}: {[float(x) for x in all_d]}")


def resume_mismatch(saved: dict, now: dict) -> list[str]:
    """The settings on which a checkpoint's ``resume`` view and this run's differ, one line each."""
    keys = list(dict.fromkeys([*now, *saved]))
    return [f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


class RunSettings:
    """What the two run configs (:class:`kvpop.train.TrainConfig`, :class:`kvpop.adapt.AdaptConfig`)
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


class Program(Protocol):
    """One training program, driven by :meth:`Run.loop`."""

    validates: bool  # whether this process measures validation quality (rank 0 with validation documents)

    def step(self, step: int) -> dict:
        """Optimisation step ``step`` (0-based); returns its history record (``"step": step + 1`` first)."""

    def synced(self) -> list[torch.Tensor]:
        """The weights every rank must hold equal after a step."""

    def validate(self, step: int) -> dict:
        """Validation quality after ``step`` steps, with a ``mean_retention`` (higher is better)."""

    def describe(self, quality: dict) -> str:
        """One line of :meth:`validate`'s result for the progress bar."""

    def save_best(self, step: int, quality: dict) -> None:
        """Keep the weights after ``step`` as the best so far."""

    def checkpoint(self, step: int) -> None:
        """Write the checkpoint after ``step`` (its state from :meth:`Run.state`)."""

    def postfix(self, record: dict) -> dict[str, str]:
        """What the progress bar shows after a step."""


class Run:
    """One run of a program: ranks, the folder ``out``, resume state, the step loop and the summary.

    ``name`` is the command (``train`` or ``adapt``), used in messages; ``cfg`` any config with
    ``device``, ``batch_size``, ``seq_len``, ``steps``, ``val_every``, ``ckpt_every``,
    ``stop_after``, ``check_sync``, ``progress`` and ``resume_view()``.
    """

    def __init__(self, name: str, cfg, out: str | os.PathLike) -> None:
        self.name, self.cfg = name, cfg
        self.rank, self.world = dist_setup(cfg.device)
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the number of processes ({self.world})")
        self.out = Path(out)
        self.state_file = self.out / STATE_FILE
        self.step, self.history = 0, []
        self.best: dict[str, Any] = {"mean_retention": float("-inf"), "step": 0}
        self.fingerprint: dict | None = None
        self.seconds = 0.0

    def saved_state(self) -> dict | None:
        """The checkpoint to resume from (``None`` for a new run), refused when its settings differ.
        Call it before the model loads: a wrong ``--out`` is an error before any work."""
        if not self.state_file.exists():
            return None
        blob = torch.load(self.state_file, map_location="cpu", weights_only=False)
        diff = resume_mismatch(blob.get("resume", {}), self.cfg.resume_view())
        if diff:
            raise ValueError(f"{self.out} holds a run with other settings; use another --out or the same settings ("
                             + "; ".join(diff) + ")")  # fmt: skip
        return blob

    def prepare_folder(self) -> None:
        """Rank 0: ``out`` must be writable (an error before the model loads); temporary files of a
        killed run are removed (the folder itself is made by the first write)."""
        if self.rank == 0:
            check_writable_dir(self.out)
            clean_leftovers(self.out)

    def check_model(self, fingerprint: dict, saved: dict | None) -> None:
        """Record the model's fingerprint; refuse a checkpoint made on another model (``saved``: its
        fingerprint): a run trained on two models would record only the second one."""
        self.fingerprint = fingerprint
        diff = fingerprint_diff(saved or {}, fingerprint) if saved is not None else {}
        if diff:
            raise ValueError(f"{self.out} holds a run on a different model ({', '.join(sorted(diff))} differ); use "
                             "another --out, or the model it was started with")  # fmt: skip

    def restore(self, blob: dict) -> None:
        """Step, history and best of a checkpoint (the program restores its own weights)."""
        self.step, self.history, self.best = blob["step"], blob["history"], blob.get("best", self.best)
        if self.rank == 0 and self.cfg.progress:
            print(f"[kvpop {self.name}] resuming from step {self.step} ({self.state_file})", file=sys.stderr)

    def state(self, **parts) -> dict:
        """A checkpoint's state: the program's ``parts`` and what every checkpoint holds."""
        return {**parts, "step": self.step, "history": self.history, "best": self.best, "config": asdict(self.cfg),
                "resume": self.cfg.resume_view(), "fingerprint": self.fingerprint}  # fmt: skip

    def write_failed(self, exc: OSError, step: int, whole: str) -> OSError:
        """The error of a failed checkpoint write: which step, and what is still whole (``whole``)."""
        return OSError(exc.errno, f"writing the step-{step} checkpoint to {self.out} failed ({exc.strerror or exc}); "
                       f"{whole}")  # fmt: skip

    def loop(self, program: Program, desc: str) -> None:
        """Run the remaining steps of ``program`` (see the module docstring for the schedule)."""
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not (cfg.progress and self.rank == 0), desc=desc)
        t_start = time.perf_counter()
        while self.step < cfg.steps:
            record = program.step(self.step)
            self.step = step = self.step + 1
            if cfg.check_sync and self.world > 1:
                check_in_sync(program.synced(), step, self.world)
            if self.rank == 0 and program.validates and (step % cfg.val_every == 0 or step == cfg.steps):
                q = record["val"] = program.validate(step)
                if q["mean_retention"] > self.best["mean_retention"]:
                    self.best = {"mean_retention": q["mean_retention"], "step": step}
                    program.save_best(step, q)
                bar.write(f"[kvpop {self.name}] step {step}: " + program.describe(q))
            self.history.append(record)
            bar.set_postfix(**program.postfix(record))
            bar.update(1)
            if self.rank == 0 and (step % cfg.ckpt_every == 0 or step == cfg.steps):
                program.checkpoint(step)
            if self.world > 1:
                dist.barrier()
            if cfg.stop_after is not None and step >= cfg.stop_after:
                break
        bar.close()
        self.seconds = time.perf_counter() - t_start

    def summary(self, timing: dict, trained_for: dict, extra: dict | None = None) -> dict:
        """The run's summary, written to ``out/summary.json`` by rank 0 (strict JSON: no best
        retention yet is null, not -Infinity)."""
        cfg = self.cfg
        summary = {
            "steps": self.step, "tokens_seen": self.step * cfg.batch_size * cfg.seq_len,
            "seconds_this_process": self.seconds, **timing, "history": self.history, "best": self.best,
            "config": asdict(cfg), "trained_for": trained_for, **(extra or {}),
        }  # fmt: skip
        if self.rank == 0:
            write_json(self.out / "summary.json", summary)
        return summary
