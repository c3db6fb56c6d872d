"""Learned KVpop policies: a trained scorer (MLP or mLSTM) behind the policy protocol.

The stateless MLP scores the exiting token's ``[k; v]``. The stateful mLSTM advances its
per-head state with every new token of the layer and reads it when a token exits, at the
exit step (new token ``j`` of the chunk pushes out token ``j - window``), so a chunked
prefill, decode, and the training-time parallel form all see the same state. That state
(``kvpop.scorers.MLSTMState``) belongs to the cache layer, not to the policy: one policy
serves any number of caches and batch rows.

A policy built from a checkpoint carries the checkpoint's base-model fingerprint and refuses
a model config it was not trained for (:meth:`LearnedPolicy.validate`, called by every
``KVpopCache``); the weight hash is checked when the model itself is given to the factory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import TrainedSettings, attention_shape
from ..names import KIND_TO_POLICY
from ..scorers import ScorerStack
from .base import ExitBatch, Policy, PolicyKernels


@dataclass(frozen=True, eq=False, repr=False)
class LearnedPolicy(Policy):
    """A trained scorer behind the policy protocol; ``trained_for`` (a checkpoint's metadata) says
    what it was trained for. Caches call its per-device kernels (:meth:`prepare`)."""

    scorer: ScorerStack
    fingerprint: dict | None = None  # base-model fingerprint of the checkpoint (None: not from a checkpoint)
    source: str | None = None
    trained_for: dict | None = None  # checkpoint metadata: budget range, window fraction, lam
    # the scorer on each other device it was asked for (scorer_for): [copy, the original's parameter versions]
    _copies: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.scorer.eval()
        object.__setattr__(self, "source", self.source or "(in memory)")

    @property
    def name(self) -> str:
        """``"kvpop-mlstm"`` for an mLSTM scorer, ``"kvpop-mlp"`` for an MLP."""
        return KIND_TO_POLICY[self.scorer.config.kind]

    @property
    def trained(self) -> TrainedSettings | None:
        return TrainedSettings.from_meta(self.trained_for)

    @property
    def stateful(self) -> bool:
        return bool(self.scorer.is_stateful)

    @property
    def needs_attention(self) -> bool:
        return bool(self.scorer.config.observed)  # the scorer reads observed attention

    def validate(self, config, eviction) -> None:
        from ..checkpoint import ScorerMismatchError, check_fingerprint

        check_fingerprint(self.fingerprint, self.source, config=config)
        cfg = self.scorer.config
        shape = attention_shape(config)
        n = len(shape.bounded)  # one scorer per full-attention layer (a sliding layer keeps its own window)
        if (cfg.num_layers, cfg.kv_heads, cfg.head_dim) != (n, shape.kv_heads, shape.head_dim):
            raise ScorerMismatchError(
                f"scorer {self.source} was built for {cfg.num_layers} layers x {cfg.kv_heads} KV heads x head_dim "
                f"{cfg.head_dim}; this model has {n} full-attention layers x {shape.kv_heads} x {shape.head_dim}"
            )

    def observation_windows(self, window: int) -> tuple[int, ...]:
        return tuple(window if o is None else min(o, window) for o in self.scorer.config.observed)

    def init_state(self, batch: int, num_kv_heads: int, layer_idx: int, device):
        return self.scorer_for(device)[layer_idx].init_state(batch, device=device, dtype=torch.float32)

    def prepare(self, device) -> LearnedKernels:
        """The scorer on ``device`` (:meth:`scorer_for`) and its decode kernels per layer."""
        return LearnedKernels(self, torch.device(device))

    def scorer_for(self, device, refresh: bool = True) -> ScorerStack:
        """The scorer on ``device``: ``self.scorer`` where it lives, else a copy made for that device
        once and kept, so caches on two devices sharing this policy never move weights under each
        other. With ``refresh`` (when a cache on that device prepares, and when its decode kernels
        are rebuilt), a copy whose original's weights changed since is brought up to date in place,
        so its kernels' views stay valid; between those it is what it was then. ``refresh=False``:
        a dictionary lookup (``score``)."""
        device = torch.device(device)
        hit = self._copies.get(device)
        if hit is not None and (hit[1] is None or not refresh):
            return hit[0]
        home = self.scorer
        p = next(home.parameters(), None)
        if p is None or p.device == device:
            self._copies[device] = [home, None]  # the original itself: never copied
            return home
        versions = tuple(q._version for q in home.parameters())
        if hit is None:
            import copy

            hit = self._copies[device] = [copy.deepcopy(home).to(device), versions]
        elif hit[1] != versions:
            with torch.no_grad():
                for mine, theirs in zip(hit[0].parameters(), home.parameters(), strict=True):
                    mine.copy_(theirs)
            hit[1] = versions
        return hit[0]

    def to(self, device) -> LearnedPolicy:
        """Move ``self.scorer`` to ``device`` (the meta device is never a target: it would strip the
        weights). Caches do not call this (they use :meth:`scorer_for`); per-device copies are made anew."""
        device = torch.device(device)
        p = next(self.scorer.parameters(), None)
        if p is not None and p.device != device and device.type != "meta":
            self.scorer.to(device)
            self._copies.clear()
        return self

    @torch.no_grad()
    def score(self, state, batch: ExitBatch):
        return learned_score(self.scorer_for(batch.new_keys.device, refresh=False), state, batch)

    def __repr__(self) -> str:
        return f"LearnedPolicy({self.name}, {os.path.basename(self.source)})"


@torch.no_grad()
def learned_score(scorer: ScorerStack, state, batch: ExitBatch):
    """``Policy.score`` of a learned scorer: one new and one exiting token per row takes the scorer's
    single-step decode path, anything else its chunk form (``step_and_read``); a stateless scorer
    scores the exits alone (``kvpop.scorers.decode.exit_scores``)."""
    c = batch.new_keys.shape[2]
    observed = batch.attention
    if scorer.config.observed and observed is None:  # a step without exits (the state still advances)
        b, h, x, _ = batch.keys.shape
        observed = batch.keys.new_zeros(b, h, x, len(scorer.config.observed), dtype=torch.float32)
    if not scorer.is_stateful:
        from ..scorers.decode import decode_params, exit_scores

        spec, params = scorer.decode_spec(batch.window), decode_params(scorer, batch.layer_idx)
        return state, exit_scores(spec, params, batch.keys, batch.values, batch.index, observed)
    if c == 1 and batch.all_valid and batch.keys.shape[2] == 1:
        b = batch.new_keys.shape[0]
        state, scores = scorer.decode_scores(
            batch.layer_idx,
            state,
            batch.new_keys,
            batch.new_values,
            batch.keys,
            batch.values,
            batch.new_index.view(b),
            batch.index.view(b),
            batch.attention,
            batch.window,
        )
        return state, scores.unsqueeze(-1)
    mask = None if batch.all_valid else batch.new_index >= 0
    read_steps = None if c == 1 else torch.arange(c, device=batch.new_keys.device)
    state, scores = scorer.step_and_read(
        batch.layer_idx,
        state,
        batch.new_keys.float(),
        batch.new_values.float(),
        batch.keys.float(),
        batch.values.float(),
        read_steps,
        mask,
        new_positions=batch.new_index,
        read_positions=batch.index,
        observed=observed,
        window=batch.window,
    )
    return state, scores.float()


class LearnedKernels(PolicyKernels):
    """A learned policy on one device: its scorer there, and each layer's decode kernel
    (``kvpop.scorers.decode``: the spec and the layer's weights as detached views, so in-place weight
    updates show through them). A kernel is the same tuple object until the scorer's recency tilt
    changes (it is computed, not a view), so a compiled cache can tell by identity that its bound
    step is current; the lookup reads no module attribute (``nn.Module.__getattr__`` alone took
    ~0.5 us, once per layer and decode step)."""

    def __init__(self, policy: LearnedPolicy, device: torch.device) -> None:
        super().__init__(policy, device)
        self.scorer = policy.scorer_for(device)
        self._theta = getattr(self.scorer, "tilt_theta", None)
        self._kernels: dict[tuple[int, int], tuple] = {}  # (layer, window) -> (tilt version, kernel)

    def init_state(self, batch: int, kv_heads: int, layer_idx: int):
        return self.scorer[layer_idx].init_state(batch, device=self.device, dtype=torch.float32)

    def score(self, state, batch: ExitBatch):
        return learned_score(self.scorer, state, batch)

    def decode_kernel(self, layer_idx: int, window: int) -> tuple:
        version = None if self._theta is None else self._theta._version
        hit = self._kernels.get((layer_idx, window))
        if hit is None or hit[0] != version:
            from ..scorers.decode import decode_params

            scorer = self.scorer = self.policy.scorer_for(self.device)  # brought up to date (refresh)
            hit = self._kernels[(layer_idx, window)] = (
                version,
                (scorer.decode_spec(window), decode_params(scorer, layer_idx)),
            )
        return hit[1]

    def steady_score(self, layer_idx: int) -> None:
        return None


ADAPTER_ATTR = "kvpop_adapter"  # config attribute set by load_model(adapter=...): the bundle's folder


@functools.lru_cache(maxsize=8)
def _bundle_scorer(folder: str, mtime_ns: int):
    """The scorer of an adapter bundle folder and its ``trained_for`` (read once per file version)."""
    from ..bundle import read_bundle_meta
    from ..checkpoint import load_scorer

    header = read_bundle_meta(folder)
    if not header.get("scorer"):
        return None, None
    scorer, _ = load_scorer(Path(folder) / header["scorer"])
    return scorer, (header.get("meta") or {}).get("trained_for")


def adapter_scorer(model=None, config=None):
    """``(folder, scorer, trained_for)`` of the adapter bundle a model was loaded with
    (``load_model(adapter=...)``), found through the model or through its config; None without one
    (or when the bundle has no scorer)."""
    info = getattr(model, ADAPTER_ATTR, None)
    if info is not None:
        if info.scorer is None:
            return None
        return str(info.path), info.scorer, (info.meta.get("meta") or {}).get("trained_for")
    if config is None and model is not None:
        config = getattr(model, "config", None)
    folder = getattr(config, ADAPTER_ATTR, None) if config is not None else None
    if not folder:
        return None
    meta_file = Path(folder) / "kvpop_adapter.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"this model's config names adapter bundle {folder} ({ADAPTER_ATTR}), which is gone")
    scorer, trained = _bundle_scorer(str(folder), meta_file.stat().st_mtime_ns)
    return None if scorer is None else (str(folder), scorer, trained)


def learned_policy_factory(kind: str):
    """Factory registered as ``kvpop-mlstm`` / ``kvpop-mlp``: a given scorer, a checkpoint path, the scorer
    of the adapter bundle the model was loaded with, or the shipped one.

    One rule for adapted models: on a model loaded with ``load_model(adapter=...)`` the learned
    policy uses the bundle's scorer, whether the cache is built from the model (``make_cache``)
    or from its config (``KVpopCache(model.config)``: the config names the bundle). A bundle whose
    scorer is of the other kind is an error naming the policy that serves it; ``path=`` or
    ``scorer=`` choose another scorer explicitly.

    ``model=``: also check the checkpoint's weight hash against it (the config part is checked
    by every cache the policy is used in). ``budget=``: the budget of the cache it is for, which picks among
    the model's shipped scorers the one trained for it (:func:`kvpop.checkpoint.scorer_for_budget`; None:
    the model's default scorer).
    """

    def make(
        scorer: ScorerStack | None = None, path=None, model=None, config=None, budget: int | None = None
    ) -> LearnedPolicy:
        from ..checkpoint import default_scorer_path, load_scorer

        fingerprint = source = trained = None
        if scorer is None and path is None:
            bundle = adapter_scorer(model, config)
            if bundle is not None:
                folder, bundled, trained = bundle
                if bundled.config.kind != kind:
                    raise ValueError(
                        f"this model was loaded with adapter bundle {folder}, whose scorer is a "
                        f"{bundled.config.kind} (policy {KIND_TO_POLICY[bundled.config.kind]!r}); use that policy, "
                        f"or pass path= a {kind} scorer for policy {KIND_TO_POLICY[kind]!r}"
                    )
                return LearnedPolicy(bundled, source=f"{folder} (adapter bundle)", trained_for=trained)
        if scorer is None:
            path = path or default_scorer_path(
                kind, config if config is not None else getattr(model, "config", None), budget=budget
            )
            scorer, meta = load_scorer(path, model=model)
            fingerprint, source, trained = meta.get("fingerprint"), str(path), meta.get("trained_for")
        if scorer.config.kind != kind:
            raise ValueError(
                f"policy {KIND_TO_POLICY[kind]} needs a {kind} scorer, got a {scorer.config.kind} one "
                f"(that is policy {KIND_TO_POLICY[scorer.config.kind]})"
            )
        return LearnedPolicy(scorer, fingerprint=fingerprint, source=source, trained_for=trained)

    return make


def policy_for_scorer(path: str, policy: str | None = None) -> str:
    """The learned policy a scorer checkpoint belongs to (its kind, read from the file's header); a named
    ``policy`` it cannot serve is a ``ValueError`` (worded for the command line's ``--scorer``)."""
    from ..checkpoint import scorer_kind

    kind = scorer_kind(path)
    name = KIND_TO_POLICY[kind]
    if policy is not None and policy != name:
        raise ValueError(f"--scorer {path} is a {kind} scorer (policy {name}); it cannot serve --policy {policy}")
    return name


def scorer_policy_kwargs(paths) -> dict[str, dict]:
    """``--scorer`` files as each learned policy's keyword arguments (``{"kvpop-mlp": {"path": ...}}``, the policy read
    from each file's header); two files for one policy are an error."""
    kw: dict[str, dict] = {}
    for path in paths:
        name = policy_for_scorer(path)
        if name in kw:
            raise ValueError(f"two --scorer checkpoints of policy {name}: {kw[name]['path']} and {path}")
        kw[name] = {"path": path}
    return kw
