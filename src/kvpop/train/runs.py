"""What ``kvpop train`` and ``kvpop adapt`` share: the run around the optimisation steps.

A *program* (the scorer training of :mod:`kvpop.train`, the LLM adaptation of :mod:`kvpop.adapt`)
owns its models, optimisers and one optimisation step. :class:`Run` owns everything around the
steps, written once for both:

* the ranks (one process, or several under ``torchrun``: gloo on CPU, NCCL on CUDA);
* the resume check: ``out/train_state.pt`` is read before the model loads and refused when its
  settings (the config's ``resume_view``, with the content hash of a starting scorer file) or its
  model (the weights' fingerprint) differ from this run's;
* the state file's safety: it holds tensors and plain Python values only (:func:`plain`) and is read
  with ``torch.load(weights_only=True)`` (:func:`read_state`), so reading it never runs code; a file
  that needs more (pickled objects) is refused, as is an empty, truncated or corrupt one;
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

import dataclasses
import enum
import errno
import math
import os
import pickle
import sys
import time
import zipfile
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..checkpoint import fingerprint_diff
from ..files import check_writable_dir, clean_leftovers, write_json

__all__ = [
    "STATE_FILE",
    "Program",
    "Run",
    "check_in_sync",
    "cosine_schedule",
    "digest",
    "dist_setup",
    "plain",
    "read_state",
    "resume_mismatch",
    "write_state",
]

STATE_FILE = "train_state.pt"  # what a resume reads (the name predates kvpop adapt, which uses it too)
# resume-view keys that hash a file's content, and the config field that names the file
CONTENT_KEYS = {"scorer_sha256": "scorer"}


def plain(obj: Any, where: str = "state") -> Any:
    """``obj`` as tensors and plain Python values (dict, list, tuple, str, int, float, bool, None) only:
    what ``torch.load(weights_only=True)`` reads back without running code. numpy values become Python
    numbers or tensors, paths strings, enums their values, dataclasses dicts; anything else is a
    ``TypeError`` here, when the state is written, rather than a run that cannot resume later."""
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj if kind is torch.Tensor else obj.detach()  # a Parameter or subclass as a plain tensor
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        return torch.from_numpy(obj.copy())
    if isinstance(obj, enum.Enum):
        return plain(obj.value, where)
    for base, exact in ((int, int.__int__), (float, float.__float__), (str, str.__str__)):
        if isinstance(obj, base):  # a subclass pickles as its own class
            return exact(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return plain(asdict(obj), where)
    if isinstance(obj, dict):
        out: dict = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            key = plain(k, f"{where} key")
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}, which a run state cannot hold")
            out[key] = plain(v, f"{where}[{k!r}]")
        if isinstance(obj, OrderedDict) and getattr(obj, "_metadata", None) is not None:  # a module's state_dict
            out._metadata = plain(obj._metadata, f"{where}._metadata")
        return out
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    raise TypeError(
        f"{where} holds a {kind.__module__}.{kind.__qualname__}: a run state holds tensors and plain "
        "Python values only, so that reading it back runs no code"
    )


def write_state(path: str | os.PathLike, state: dict) -> None:
    """Write a run state (through :func:`plain`) for :func:`read_state`; use it under ``atomic_write``."""
    torch.save(plain(state), path)


def read_state(path: str | os.PathLike) -> dict:
    """A run state written by :func:`write_state`, read without running code (``weights_only=True``).

    Raises ``ValueError``, one line naming the file, for a file that is empty, truncated or corrupt,
    and for one that holds pickled objects (a state of an older kvpop, or not kvpop's): unpickling
    those could run any code."""
    path = Path(path)
    corrupt = f"{path} is empty/truncated or corrupt: remove it to start over or use another --out"
    unsafe = (
        f"{path} cannot be loaded safely: it holds pickled Python objects, not only tensors and plain values "
        "(written by an older kvpop, or not by kvpop); start a new --out folder"
    )
    if path.stat().st_size == 0:
        raise ValueError(corrupt)
    if not zipfile.is_zipfile(path):  # kvpop writes torch's zip format; the legacy one is a bare pickle
        with open(path, "rb") as f:
            raise ValueError(unsafe if f.read(1) == b"\x80" else corrupt)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(unsafe if "weights only" in str(exc).lower() else corrupt) from exc
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, None):  # unreadable (permissions, I/O): the error says so already
            raise
        raise ValueError(corrupt) from exc
    except Exception as exc:  # a damaged archive fails in the zip reader, the unpickler or torch
        raise ValueError(corrupt) from exc
    if isinstance(blob, dict):
        return blob
    raise ValueError(corrupt)  # a file, but not a run state


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
            raise ValueError(
                f"batch_size={cfg.batch_size} must be a multiple of the number of processes ({self.world})"
            )
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
        blob = read_state(self.state_file)
        saved, now = blob.get("resume") or {}, self.cfg.resume_view()
        # a file the run trains under is compared by content (a path says nothing of what it holds)
        changed = [k for k in CONTENT_KEYS if None not in (saved.get(k), now.get(k)) and saved[k] != now[k]]
        diff = resume_mismatch(
            {k: v for k, v in saved.items() if k not in changed}, {k: v for k, v in now.items() if k not in changed}
        )
        if changed:
            key = changed[0]
            field = CONTENT_KEYS[key]
            also = f" (other settings differ too: {'; '.join(diff)})" if diff else ""
            raise ValueError(
                f"{self.out} holds a run that started from another {field}: {getattr(self.cfg, field)} is "
                f"not the file it started with (sha256 {now[key]} here, {saved[key]} in the run); use "
                f"that file, or another --out{also}"
            )
        if diff:
            raise ValueError(
                f"{self.out} holds a run with other settings; use another --out or the same settings ("
                + "; ".join(diff)
                + ")"
            )
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
            raise ValueError(
                f"{self.out} holds a run on a different model: the model changed ("
                f"{', '.join(sorted(diff))} differ from the run's); use another --out, or the model it "
                "was started with"
            )

    def restore(self, blob: dict) -> None:
        """Step, history and best of a checkpoint (the program restores its own weights)."""
        self.step, self.history, self.best = blob["step"], blob["history"], blob.get("best", self.best)
        if self.rank == 0 and self.cfg.progress:
            print(f"[kvpop {self.name}] resuming from step {self.step} ({self.state_file})", file=sys.stderr)

    def state(self, **parts) -> dict:
        """A checkpoint's state: the program's ``parts`` and what every checkpoint holds."""
        return {
            **parts,
            "step": self.step,
            "history": self.history,
            "best": self.best,
            "config": asdict(self.cfg),
            "resume": self.cfg.resume_view(),
            "fingerprint": self.fingerprint,
        }

    def write_failed(self, exc: OSError, step: int, whole: str) -> OSError:
        """The error of a failed checkpoint write: which step, and what is still whole (``whole``)."""
        return OSError(
            exc.errno, f"writing the step-{step} checkpoint to {self.out} failed ({exc.strerror or exc}); {whole}"
        )

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
            "steps": self.step,
            "tokens_seen": self.step * cfg.batch_size * cfg.seq_len,
            "seconds_this_process": self.seconds,
            **timing,
            "history": self.history,
            "best": self.best,
            "config": asdict(cfg),
            "trained_for": trained_for,
            **(extra or {}),
        }
        if self.rank == 0:
            write_json(self.out / "summary.json", summary)
        return summary
