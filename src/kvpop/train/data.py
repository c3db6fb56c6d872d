"""Training data: a stream of token windows, their captures, and an optional store on disk.

A training example is one forward of the frozen LLM over a window of ``seq_len`` tokens with
everything the loss needs recorded per layer (``kvpop.capture``): post-RoPE keys and values,
the future-attention targets for every window the run trains at, and the observed-attention
statistics. Sequences are numbered in the deterministic order of
:func:`kvpop.data.training_windows`, so sequence ``j`` is the same on every rank and after a
resume. A :class:`CaptureStore` keeps captures on disk (keys and values in float16) so a sweep
of scorer settings, or a second scorer, reuses them instead of running the LLM again; a run over
a store trains on every sequence at the store's precision, whether it was read back or captured
just now, so it does not depend on what the store already held. Without one every sequence is
captured on the fly, used at full precision and dropped after its step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .. import data
from ..capture import collect
from ..checkpoint import fingerprint_diff, model_fingerprint
from ..files import atomic_write
from ..targets import spread_targets
from .config import TrainConfig, rotating_windows

STORE_FORMAT = "kvpop-capture-store-v1"


@dataclass
class Example:
    """Captures of ``b`` sequences; ``L`` layers, ``h`` KV heads, ``S`` tokens."""

    keys: Tensor  # [L, b, h, S, d] post-RoPE, as the cache holds them
    values: Tensor  # [L, b, h, S, d]
    targets: dict[int, Tensor]  # window -> [L, b, h, S] log future attention (-inf: undefined)
    observed: dict[int, Tensor]  # window -> [L, b, h, S, n] observed-attention statistics
    corpora: list[str]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[3]

    def float(self, device="cpu") -> Example:
        return Example(
            self.keys.to(device, torch.float32),
            self.values.to(device, torch.float32),
            {w: t.to(device, torch.float32) for w, t in self.targets.items()},
            {w: o.to(device, torch.float32) for w, o in self.observed.items()},
            self.corpora,
        )

    def only(self, windows, observed: bool = True) -> Example:
        """The same capture with the targets (and statistics) of ``windows`` only (those it has)."""
        keep = [w for w in windows if w in self.targets]
        return Example(
            self.keys,
            self.values,
            {w: self.targets[w] for w in keep},
            {w: self.observed[w] for w in keep if w in self.observed} if observed else {},
            self.corpora,
        )

    def spread(self, span: int) -> Example:
        """The same capture with each target spread over ``span`` tokens either side
        (``kvpop.targets.spread_targets``; 0: this capture itself)."""
        if not span:
            return self
        targets = {w: spread_targets(t, span) for w, t in self.targets.items()}
        return Example(self.keys, self.values, targets, self.observed, self.corpora)

    @staticmethod
    def cat(parts: list[Example]) -> Example:
        return Example(
            torch.cat([p.keys for p in parts], 1),
            torch.cat([p.values for p in parts], 1),
            {w: torch.cat([p.targets[w] for p in parts], 1) for w in parts[0].targets},
            {w: torch.cat([p.observed[w] for p in parts], 1) for w in parts[0].observed},
            [c for p in parts for c in p.corpora],
        )


@torch.no_grad()
def capture_example(
    model, ids: Tensor, windows, sinks: int, obs_windows, corpora: list[str], power: float = 1.0
) -> Example:
    """One no-grad forward of ``ids [b, S]`` recording what training needs (``kvpop.capture.collect``);
    ``power`` is the targets' power mean (1: the mean future attention)."""
    windows = sorted({int(w) for w in windows})
    caps = collect(
        model,
        ids.to(next(model.parameters()).device),
        window=windows[0],
        extra_windows=windows[1:],
        observed_windows=windows if obs_windows else (),
        sinks=sinks,
        obs_windows=tuple(obs_windows) or (None,),
        power=power,
    )
    return Example(
        keys=torch.stack([c.keys for c in caps]),
        values=torch.stack([c.values for c in caps]),
        targets={w: torch.stack([c.targets[w].float() for c in caps]) for w in windows},
        observed={w: torch.stack([c.observed[w] for c in caps]) for w in windows} if obs_windows else {},
        corpora=list(corpora),
    )


class SequenceSource:
    """Sequence ``j`` of the run's deterministic stream: ``(corpus, ids [seq_len])``.

    Access is sequential (each rank asks for increasing ``j``); asking for an earlier ``j`` restarts.
    """

    def __init__(
        self, cfg: TrainConfig, tokenizer, split: str = "train", seed: int | None = None, seq_len: int | None = None
    ) -> None:
        self.cfg, self.tokenizer, self.split = cfg, tokenizer, split
        # kvpop adapt's config has no separate data seed: its stream follows its seed
        self.seed = getattr(cfg, "stream_seed", cfg.seed) if seed is None else seed
        self.seq_len = cfg.seq_len if seq_len is None else seq_len
        self._it: Iterator | None = None
        self._next = 0

    def _stream(self) -> Iterator[tuple[str, Tensor]]:
        cfg = self.cfg
        if cfg.docs_from:
            docs = data.read_user_documents(cfg.docs_from)
            docs = data.split_documents(docs, self.split) or docs
            epoch = 0
            while True:
                n = 0
                for ids in data.iter_packed(self.tokenizer, docs, self.seq_len, add_bos=False, seed=self.seed + epoch):
                    n += 1
                    yield "user", ids
                if n == 0:
                    raise ValueError(f"no {self.split} sequence of {self.seq_len} tokens in {cfg.docs_from}")
                epoch += 1
        else:
            yield from data.training_windows(self.tokenizer, cfg.corpora, self.seq_len, self.split, self.seed)

    def get(self, j: int) -> tuple[str, Tensor]:
        if self._it is None or j < self._next:
            self._it, self._next = self._stream(), 0
        while self._next < j:
            next(self._it)
            self._next += 1
        self._next += 1
        return next(self._it)


class CaptureStore:
    """A folder of captured sequences (``seq_000123.safetensors``), keyed by what made them.

    ``store.json`` records the model fingerprint, the data stream (corpora or user folder, split,
    seed, length), the sinks, observation windows and target windows; a run whose settings
    differ refuses the store rather than training on captures of something else. A run may use
    a subset of the store's windows.
    """

    def __init__(self, folder, cfg: TrainConfig, model, split: str = "train") -> None:
        self.folder = Path(folder)
        self.meta = {
            "format": STORE_FORMAT,
            "fingerprint": model_fingerprint(model),
            "data": {
                "corpora": list(cfg.corpora) if not cfg.docs_from else None,
                "docs_from": cfg.docs_from,
                "split": split,
                "seed": cfg.stream_seed,
                "seq_len": cfg.seq_len,
            },
            "sinks": cfg.sinks,
            "target_power": cfg.target_power,
            "obs_windows": list(cfg.observed),
            "windows": list(cfg.capture_windows()),
            "windows_per_sequence": cfg.windows_per_sequence,
        }
        path = self.folder / "store.json"
        if path.exists():
            have = json.loads(path.read_text())
            have.setdefault("windows_per_sequence", 0)
            have.setdefault("target_power", 1.0)  # stores made before the power mean hold the mean
            keys = ["format", "fingerprint", "data", "sinks", "target_power"] + (
                ["obs_windows"] if cfg.observed else []
            )
            if have["windows_per_sequence"] != cfg.windows_per_sequence:
                raise ValueError(
                    f"capture store {self.folder} holds {have['windows_per_sequence'] or 'all'} windows "
                    f"per sequence; this run asks for {cfg.windows_per_sequence or 'all'} "
                    "(--windows-per-sequence)"
                )
            if have["windows_per_sequence"] and have["windows"] != self.meta["windows"]:
                self.adopt_grid(have, cfg)

            def same(key: str) -> bool:  # a fingerprint field the store predates is not a mismatch
                if key == "fingerprint":
                    return not fingerprint_diff(have.get(key) or {}, self.meta[key])
                return have.get(key) == self.meta[key]

            for key in keys:  # a run without observed-attention inputs can read any store
                if not same(key):
                    raise ValueError(
                        f"capture store {self.folder} was made with other settings ({key}: {have.get(key)!r} vs "
                        f"{self.meta[key]!r}); use another --store folder"
                    )
            missing = sorted(set(self.meta["windows"]) - set(have["windows"]))
            if missing:
                raise ValueError(
                    f"capture store {self.folder} has no targets for windows {missing} "
                    f"(it has {have['windows']}); use another --store folder"
                )
            self.meta["windows"] = have["windows"]
            self.meta["obs_windows"] = have["obs_windows"]
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(self.meta, indent=1)))

    def adopt_grid(self, have: dict, cfg: TrainConfig) -> None:
        """A run whose grid differs from the store's (which keeps a few windows per sequence) trains at
        the store's windows in its budget range, if every sequence keeps one of them; else refused."""
        grid, m = have["windows"], have["windows_per_sequence"]
        refusal = (
            f"capture store {self.folder} holds {m} windows per sequence of the grid {grid}; "
            f"this run's grid is {self.meta['windows']}"
        )
        if cfg.extra_windows:  # a run that captures more windows cannot read them from this store
            raise ValueError(refusal)
        try:  # use_store_grid refuses a run without a budget range or with a fixed window
            cfg.use_store_grid(grid)
        except ValueError as e:
            raise ValueError(f"{refusal}: {e}") from None
        self.meta["windows"] = list(cfg.capture_windows())
        for j in range(len(grid)):  # the rotation repeats after len(grid) sequences
            if not set(rotating_windows(grid, m, j)) & set(cfg.store_grid):
                raise ValueError(
                    f"{refusal}: sequence {j} keeps none of the windows {list(cfg.store_grid)} "
                    "that budget_range reaches; widen --budget-range"
                )

    @property
    def windows(self) -> list[int]:
        return list(self.meta["windows"])

    def sequence_windows(self, j: int) -> tuple[int, ...]:
        """The windows the store keeps for sequence ``j`` (see ``TrainConfig.sequence_windows``)."""
        return rotating_windows(self.windows, self.meta.get("windows_per_sequence") or 0, j)

    @property
    def obs_windows(self) -> tuple:
        return tuple(self.meta["obs_windows"])

    def path(self, j: int) -> Path:
        return self.folder / f"seq_{j:06d}.safetensors"

    def has(self, j: int) -> bool:
        return self.path(j).is_file()

    def save(self, j: int, ex: Example) -> dict[str, Tensor]:
        """Write sequence ``j``'s capture; returns the tensors written (``ex`` at the store's precision)."""
        tensors = stored_tensors(ex)
        meta = {"corpus": ex.corpora[0]}
        atomic_write(self.path(j), lambda tmp: save_file(tensors, tmp, metadata={"kvpop": json.dumps(meta)}))
        return tensors

    def load(self, j: int, windows, observed: bool = True) -> Example:
        with safe_open(str(self.path(j)), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvpop", "{}"))
            return self.example(f.get_tensor, set(f.keys()), windows, observed, meta.get("corpus", "?"))

    def example(self, get, names: set[str], windows, observed: bool, corpus: str) -> Example:
        """The :class:`Example` of one stored sequence (tensor ``name`` is ``get(name)``, ``names`` those
        there) with the targets of those of ``windows`` it has: one constructor for a sequence read
        back and one just captured, so both reach the scorer at the same precision."""

        def one(name: str) -> Tensor:
            return get(name).unsqueeze(1)

        windows = [w for w in windows if f"target_{w}" in names]
        targets = {w: one(f"target_{w}") for w in windows}
        observed = {w: one(f"observed_{w}") for w in windows} if observed and self.meta["obs_windows"] else {}
        return Example(one("keys"), one("values"), targets, observed, [corpus])


def stored_tensors(ex: Example) -> dict[str, Tensor]:
    """The tensors a store file keeps of ``ex`` (one sequence), at the precision it keeps them."""
    if ex.keys.shape[1] != 1:
        raise ValueError("the store keeps one sequence per file")
    tensors = {"keys": ex.keys[:, 0].half().contiguous().cpu(), "values": ex.values[:, 0].half().contiguous().cpu()}
    # targets stay float32 (the teacher's labels come from their order, and close targets must not tie);
    # the observed statistics are scorer inputs, sums of attention: bfloat16's ~3 significant digits
    # halve them on disk (keys and values are float16)
    for w, t in ex.targets.items():
        tensors[f"target_{w}"] = t[:, 0].float().contiguous().cpu()
    for w, o in ex.observed.items():
        tensors[f"observed_{w}"] = o[:, 0].to(torch.bfloat16).contiguous().cpu()
    return tensors


def example_for(j: int, source: SequenceSource, store: CaptureStore | None, model, cfg: TrainConfig) -> Example:
    """Sequence ``j``'s capture with the targets of its windows (``cfg.sequence_windows(j)``, spread by
    ``cfg.target_span``): from the store, or captured now (and stored, with a store)."""
    return _capture_for(j, source, store, model, cfg).spread(cfg.target_span)


def _capture_for(j: int, source: SequenceSource, store: CaptureStore | None, model, cfg: TrainConfig) -> Example:
    stored = store.sequence_windows(j) if store is not None else None
    if stored is None:
        windows = cfg.sequence_windows(j)
    else:  # the store's rotation, less the windows a run over part of its grid does not train at
        run = set(cfg.windows())
        windows = tuple(w for w in stored if w in run)
    if store is not None and store.has(j):
        return store.load(j, windows, observed=bool(cfg.observed))
    corpus, ids = source.get(j)
    obs = store.obs_windows if store is not None else cfg.observed  # a store stays uniform
    ex = capture_example(
        model,
        ids.view(1, -1),
        windows if stored is None else stored,
        cfg.sinks,
        obs,
        [corpus],
        cfg.target_power,
    )
    if store is None:
        return ex.only(windows, observed=bool(cfg.observed))
    # as a later run (or this one, resumed) reads it back: a run over a store is the same run however
    # much of the store it filled itself
    tensors = store.save(j, ex)
    return store.example(tensors.__getitem__, set(tensors), windows, bool(cfg.observed), corpus)
