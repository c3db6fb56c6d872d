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

import os

import torch

from ..config import attention_shape
from ..scorers import ScorerStack
from .base import ExitBatch, Policy

KIND_TO_POLICY = {"mlstm": "kvpop", "mlp": "kvpop-mlp"}


def trained_window(trained_for: dict, budget: int) -> int | None:
    """The window a checkpoint's ``trained_for`` metadata implies at ``budget``: the trained window
    at that budget, else its window fraction, else its single window; None if it records none."""
    windows = trained_for.get("windows") or {}
    if str(budget) in windows:
        return int(windows[str(budget)])
    if trained_for.get("window_fraction"):
        return max(1, round(float(trained_for["window_fraction"]) * budget))
    if trained_for.get("window") is not None:
        return int(trained_for["window"])
    return None


class LearnedPolicy(Policy):
    name = "kvpop"

    def __init__(self, scorer: ScorerStack, name: str | None = None, fingerprint: dict | None = None,
                 source: str | None = None, trained_for: dict | None = None) -> None:  # fmt: skip
        self.scorer = scorer.eval()
        self.trained_for = trained_for or {}  # checkpoint metadata: budgets, window (fraction), lam
        self.name = name or KIND_TO_POLICY[scorer.config.kind]
        self.stateful = bool(scorer.is_stateful)
        self.needs_attention = bool(scorer.config.observed)  # the scorer reads observed attention
        self.fingerprint = fingerprint  # base-model fingerprint of the checkpoint (None: not from a checkpoint)
        self.source = source or "(in memory)"

    def validate(self, config, eviction) -> None:
        from ..checkpoint import ScorerMismatchError, check_fingerprint

        check_fingerprint(self.fingerprint, self.source, config=config)
        cfg = self.scorer.config
        shape = attention_shape(config)
        if (cfg.num_layers, cfg.kv_heads, cfg.head_dim) != (shape.num_layers, shape.kv_heads, shape.head_dim):
            raise ScorerMismatchError(
                f"scorer {self.source} was built for {cfg.num_layers} layers x {cfg.kv_heads} KV heads x head_dim "
                f"{cfg.head_dim}; this model has {shape.num_layers} x {shape.kv_heads} x {shape.head_dim}"
            )

    def default_window(self, budget: int) -> int | None:
        """The window the scorer was trained with at this budget (its window fraction at other budgets)."""
        return trained_window(self.trained_for, budget)

    def default_lam(self) -> float | None:
        lam = self.trained_for.get("lam")
        return None if lam is None else float(lam)

    def check_settings(self, eviction) -> str | None:
        """A warning text when ``eviction`` differs from what the scorer was trained for, else None."""
        if not self.trained_for:
            return None
        problems = []
        want = self.default_window(eviction.budget)
        if want is not None and abs(eviction.window - want) > max(1, 0.1 * want):
            problems.append(f"window {eviction.window} (trained: {want} at B={eviction.budget})")
        lam = self.default_lam()
        if lam is not None and abs(eviction.lam - lam) > 1e-12:
            problems.append(f"lam {eviction.lam} (trained: {lam})")
        if not problems:
            return None
        return (f"scorer {self.source} was not trained for " + " and ".join(problems)
                + "; its decisions may be worse than with the trained settings (leave window/lam unset to use them)")

    def observation_windows(self, window: int) -> tuple[int, ...]:
        return tuple(window if o is None else min(o, window) for o in self.scorer.config.observed)

    def init_state(self, batch: int, num_kv_heads: int, layer_idx: int, device):
        return self.scorer_for(device)[layer_idx].init_state(batch, device=device, dtype=torch.float32)

    def scorer_for(self, device, refresh: bool = True) -> ScorerStack:
        """The scorer on ``device``: ``self.scorer`` where it lives, else a copy made for that device
        once and kept, so caches on two devices sharing this policy never move weights under each
        other (before, each cache's first update moved the one scorer and the other cache found its
        weights on the wrong device). With ``refresh`` (when a cache on that device starts, in
        ``init_state``, and when its decode kernels are rebuilt), a copy whose original's weights
        changed since is brought up to date in place, so its kernels' views stay valid; between
        those it is what it was then. ``refresh=False``: a dictionary lookup (``score``)."""
        device = torch.device(device)
        replicas = self.__dict__.get("_replicas")
        if replicas is None:
            replicas = self.__dict__["_replicas"] = {}
        hit = replicas.get(device)
        if hit is not None and (hit[1] is None or not refresh):
            return hit[0]
        home = self.scorer
        p = next(home.parameters(), None)
        if p is None or p.device == device:
            replicas[device] = [home, None]  # the original itself: never copied
            return home
        versions = tuple(q._version for q in home.parameters())
        if hit is None:
            import copy

            hit = replicas[device] = [copy.deepcopy(home).to(device), versions]
        elif hit[1] != versions:
            with torch.no_grad():
                for mine, theirs in zip(hit[0].parameters(), home.parameters(), strict=True):
                    mine.copy_(theirs)
            hit[1] = versions
        return hit[0]

    def to(self, device) -> LearnedPolicy:
        """Move ``self.scorer`` to ``device`` (the meta device is never a target: it would strip the
        weights). Caches do not call this (they use :meth:`scorer_for`); per-device copies and
        kernels are rebuilt."""
        device = torch.device(device)
        p = next(self.scorer.parameters(), None)
        if p is not None and p.device != device and device.type != "meta":
            self.scorer.to(device)
            self.__dict__.pop("_kernels", None)
            self.__dict__.pop("_replicas", None)
        return self

    def decode_kernel(self, layer_idx: int, window: int, device=None):
        """The scorer's decode spec and this layer's weights on ``device`` (None: where ``self.scorer``
        is; see :meth:`scorer_for`) as detached views, kept between steps: in-place weight updates
        show through them; the tilt is recomputed when it changes.

        The same tuple object is returned until it changes, so a cache can tell by identity that
        its compiled step is still current; this runs once per layer and decode step, so it reads
        no module attribute (``nn.Module.__getattr__`` alone took ~0.5 us)."""
        kernels = self.__dict__.get("_kernels")
        if kernels is None:
            kernels = self.__dict__["_kernels"] = {}
        memo = kernels.get(device)
        if memo is None:
            scorer = self.scorer if device is None else self.scorer_for(device)
            memo = kernels[device] = {"scorer": scorer, "theta": getattr(scorer, "tilt_theta", None)}
        theta = memo["theta"]
        version = None if theta is None else theta._version
        hit = memo.get((layer_idx, window))
        if hit is None or hit[0] != version:
            from ..scorers.decode import decode_params

            scorer = memo["scorer"] if device is None else self.scorer_for(device)
            kernel = (scorer.decode_spec(window), decode_params(scorer, layer_idx))
            hit = memo[(layer_idx, window)] = (version, kernel)
        return hit[1]

    @torch.no_grad()
    def score(self, state, batch: ExitBatch):
        c = batch.new_keys.shape[2]
        dev = batch.new_keys.device
        scorer = self.scorer_for(dev, refresh=False)
        if c == 1 and batch.all_valid and batch.keys.shape[2] == 1:
            # decode: one new and one exiting token per row, the scorer's single-step fast path
            b = batch.new_keys.shape[0]
            state, scores = scorer.decode_scores(
                batch.layer_idx, state, batch.new_keys, batch.new_values, batch.keys, batch.values,
                batch.new_index.view(b), batch.index.view(b), batch.attention, batch.window,
            )
            return state, scores.unsqueeze(-1)
        mask = None if batch.all_valid else batch.new_index >= 0
        # decode (one new token): read after it, the scorer's single-step fast path
        read_steps = None if c == 1 else torch.arange(c, device=dev)
        observed = batch.attention
        if self.needs_attention and observed is None:  # a step without exits (the state still advances)
            b, h, x, _ = batch.keys.shape
            observed = batch.keys.new_zeros(b, h, x, len(self.scorer.config.observed), dtype=torch.float32)
        state, scores = scorer.step_and_read(
            batch.layer_idx, state, batch.new_keys.float(), batch.new_values.float(),
            batch.keys.float(), batch.values.float(), read_steps, mask,
            new_positions=batch.new_index, read_positions=batch.index,
            observed=observed, window=batch.window,
        )
        return state, scores.float()

    def __repr__(self) -> str:
        return f"LearnedPolicy({self.name}, {os.path.basename(self.source)})"


def learned_policy_factory(kind: str):
    """Factory registered as ``kvpop`` / ``kvpop-mlp``: a given scorer, a checkpoint path, the scorer
    of the adapter bundle ``model`` was loaded with (``load_model(adapter=...)``), or the shipped one.

    ``model=``: also check the checkpoint's weight hash against it (the config part is checked
    by every cache the policy is used in).
    """

    def make(scorer: ScorerStack | None = None, path=None, model=None) -> LearnedPolicy:
        from ..checkpoint import default_scorer_path, load_scorer

        fingerprint = source = trained = None
        bundled = getattr(getattr(model, "kvpop_adapter", None), "scorer", None)
        if scorer is None and path is None and bundled is not None and bundled.config.kind == kind:
            # a model loaded with an adapter bundle: the scorer trained with that adapter
            info = model.kvpop_adapter
            return LearnedPolicy(bundled, source=f"{info.path} (adapter bundle)",
                                 trained_for=(info.meta.get("meta") or {}).get("trained_for"))  # fmt: skip
        if scorer is None:
            path = path or default_scorer_path(kind)
            scorer, meta = load_scorer(path, model=model)
            fingerprint, source, trained = meta.get("fingerprint"), str(path), meta.get("trained_for")
        if scorer.config.kind != kind:
            raise ValueError(
                f"policy {KIND_TO_POLICY[kind]} needs a {kind} scorer, got a {scorer.config.kind} one "
                f"(that is policy {KIND_TO_POLICY[scorer.config.kind]})"
            )
        return LearnedPolicy(scorer, fingerprint=fingerprint, source=source, trained_for=trained)

    return make
