"""Building blocks of the evaluation: policies by name, the oracle's targets, the window-only run,
and :func:`teacher_forced`, the probe (:mod:`kvpop.evaluate.quality`) on one document.

Teacher-forced evaluation under a policy is ONE forward of the whole document through a fresh
:class:`kvpop.KVpopCache` (the chunked prefill equals token-by-token feeding), scored against the
dense forward of the same document (:func:`kvpop.evaluate.quality.score_document`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import KVpopCache, make_cache
from ..capture import capturing
from ..config import EvictionConfig, attention_shape, resolve_eviction
from ..mask import masked_eviction
from ..policies import (
    ALIAS,
    DENSE,
    LEARNED_POLICIES,
    POLICIES,
    TEACHER_FORCED_ONLY,
    OraclePolicy,
    Policy,
    policy_names,
    resolve_policy,
)
from .quality import CHUNK, DenseOutputs, decoder_and_head, hidden_states, logits_of, score_document

ORACLE = TEACHER_FORCED_ONLY[0]
ALL_POLICIES = tuple(policy_names())


class PolicyUnavailable(RuntimeError):
    """A policy is not registered / cannot be built here; the harness records it as skipped."""


def policy_available(name: str) -> str | None:
    """``None`` when ``name`` can be evaluated here, else the reason it cannot."""
    if name in (DENSE, ORACLE):
        return None
    if name not in POLICIES:
        return f"policy {name!r} is not registered (known: {', '.join(sorted(POLICIES))})"
    return None


def concrete_policies(model, policies, policy_kwargs: dict | None = None) -> tuple[tuple[str, ...], dict]:
    """``(policies, policy_kwargs)`` with the alias ``kvpop`` replaced by the learned policy it stands for on
    ``model``, so records name the policy that ran: the policy of the scorer its own kwargs give (``path=``,
    ``scorer=``), else of the one learned policy given a scorer (``--scorer``), else the model's default
    (:func:`kvpop.policies.resolve_policy`). Its kwargs go to that policy; a name run twice runs once."""
    kwargs = dict(policy_kwargs or {})
    if ALIAS not in policies and ALIAS not in kwargs:
        return tuple(policies), kwargs
    own = kwargs.pop(ALIAS, None) or {}
    given = [p for p in LEARNED_POLICIES if {"path", "scorer"} & set(kwargs.get(p) or {})]
    if own or len(given) != 1:
        name = resolve_policy(ALIAS, model, scorer=own.get("scorer"), path=own.get("path"))
    else:
        name = given[0]
    if own:
        kwargs[name] = {**kwargs.get(name, {}), **own}
    return tuple(dict.fromkeys(name if p == ALIAS else p for p in policies)), kwargs


@torch.no_grad()
def oracle_targets_multi(model, input_ids: Tensor, windows, power: float = 1.0) -> dict[int, list[Tensor]]:
    """``{window: per-layer targets [1, kv_heads, S]}`` for several windows from ONE captured forward.

    Runs the decoder only (no LM head over the whole sequence) under ``kvpop.capture.capturing``;
    only the targets are kept. ``power``: the targets' power mean (1: the mean future attention).
    """
    ws = sorted({int(w) for w in windows})
    if not ws:
        return {}
    ids = input_ids.view(1, -1).to(model.device)
    dec, _ = decoder_and_head(model)
    with capturing(model, window=ws[0], extra_windows=ws[1:], power=power) as state:
        (dec or model)(input_ids=ids, use_cache=False)
    caps = state.result()
    n_layers = len(attention_shape(model.config).bounded)  # the capture records the full-attention layers
    if len(caps) != n_layers:
        raise RuntimeError(f"captured {len(caps)} attention layers of {n_layers}; cannot build the oracle")
    out = {w: [c.targets.get(w, c.target if w == ws[0] else None) for c in caps] for w in ws}
    for w, ts in out.items():
        if any(t is None for t in ts):
            raise RuntimeError(f"the capture returned no targets for window {w}")
    return out


def build_cache(
    model,
    name: str | Policy,
    budget: int,
    *,
    sinks: int = 4,
    window: int | None = None,
    oracle: dict[int, list[Tensor]] | None = None,
    lam: float | None = None,
    **policy_kwargs,
) -> KVpopCache | None:
    """The cache of policy ``name`` at ``budget`` slots per KV head (``None`` for dense).

    ``window=None`` is passed through to :func:`kvpop.make_cache`, so every policy gets its own
    default (StreamingLLM: ``sinks`` + a window of the rest of the budget); the resolved layout is
    ``cache.eviction``. ``oracle``: ``{window: targets}`` (:func:`oracle_targets_multi`) holding the
    oracle's window (``kvpop.config.resolve_eviction(budget, window=window, sinks=sinks).window``).
    ``name`` may be a policy instance (resolved once per run: no checkpoint read, no weight hash).
    Anything that keeps the policy from being built is raised as :class:`PolicyUnavailable`.
    """
    reason = None if isinstance(name, Policy) else policy_available(name)
    if reason is not None:
        raise PolicyUnavailable(reason)
    if name == DENSE:
        return None
    try:
        if name == ORACLE:
            ev = resolve_eviction(budget, window=window, sinks=sinks, lam=lam or 0.0)
            if oracle is None or ev.window not in oracle:
                raise PolicyUnavailable(
                    f"oracle needs the targets of window {ev.window} (the whole sequence in advance)"
                )
            return make_cache(model, OraclePolicy(oracle[ev.window]), eviction=ev)
        return make_cache(model, name, budget=budget, window=window, sinks=sinks, lam=lam, **policy_kwargs)
    except PolicyUnavailable:
        raise
    except (TypeError, ValueError, KeyError, OSError, RuntimeError) as exc:
        raise PolicyUnavailable(f"cannot build policy {name!r}: {exc}") from exc


def cache_record(cache: KVpopCache) -> dict:
    """What a unit record keeps of the cache it ran with: its layout (``sinks``, ``window``, ``k``) and, for a
    learned policy, the ``scorer`` it read."""
    e = cache.eviction
    out = {"sinks": e.sinks, "window": e.window, "k": e.k}
    src = getattr(cache.policy, "source", None)
    if src is not None:
        out["scorer"] = str(src)
    return out


@torch.no_grad()
def teacher_forced(
    model,
    input_ids: Tensor,
    policy: str,
    budget: EvictionConfig,
    *,
    dense: DenseOutputs | None = None,
    policy_kwargs: dict | None = None,
) -> dict:
    """Teacher-forced metrics of one document (1-D ids) under ``policy`` at ``budget``: the ``lm`` task
    of :func:`kvpop.evaluate.quality.score_document` (positions ``>= B``; every position when ``B`` leaves none,
    where the policy equals dense). ``"oracle"`` captures the document's true targets first. Returns
    :meth:`kvpop.evaluate.quality.Sums.metrics` plus ``scored_from``, ``continuation_retention`` and the
    policy's ``wall_s``."""
    input_ids = input_ids.view(-1).cpu()
    if input_ids.numel() < 2:
        raise ValueError("a document needs at least 2 tokens")
    dense = dense if dense is not None else DenseOutputs()
    dh, _ = dense.get(model, input_ids)
    t0 = time.perf_counter()
    oracle = oracle_targets_multi(model, input_ids, [budget.window]) if policy == ORACLE else None
    cache = build_cache(
        model,
        policy,
        budget.budget,
        sinks=budget.sinks,
        window=budget.window,
        lam=budget.lam,
        oracle=oracle,
        **(policy_kwargs or {}),
    )
    ph = dh if cache is None else hidden_states(model, input_ids, cache)
    doc = score_document(model, input_ids, dh, ph, budget.budget)
    out = doc.lm.metrics()
    out.update(
        scored_from=doc.lm_from, continuation_retention=doc.continuation.retention, wall_s=time.perf_counter() - t0
    )
    return out


# ------------------------------------------------------------------------------ long-dependency tokens


@torch.no_grad()
def nll_positions(model, hidden: Tensor, input_ids: Tensor, lo: int, hi: int, chunk: int = CHUNK) -> Tensor:
    """Per-position NLL (float64) of ``hidden`` ``[S, H]`` predicting ``input_ids[p + 1]``, ``p`` in ``[lo, hi)``."""
    ids = input_ids.view(-1)
    out = []
    for a in range(lo, hi, chunk):
        b = min(hi, a + chunk)
        lp = F.log_softmax(logits_of(model, hidden[a:b]).double(), -1)
        out.append(-lp.gather(1, ids[a + 1 : b + 1].view(-1, 1).to(lp.device))[:, 0].cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def window_only_hidden(model, input_ids: Tensor, sinks: int, window: int) -> Tensor:
    """Final hidden states ``[S, H]`` of a dense forward in which every position sees only the
    ``sinks`` first tokens and its ``window`` most recent ones (a sliding-window causal mask with
    attention sinks, ``kvpop.mask.masked_eviction`` with ``k = 0``, no cache).

    The sinks matter: without them SmolLM2-135M loses its attention sink and a window of 512
    raised the NLL of 45% of the tokens of a 4,096-token essay by more than 0.5 nats (7.8% with
    4 sinks), which would flag nearly every token as long-range."""
    dec, _ = decoder_and_head(model)
    if dec is None:
        raise RuntimeError("model has no get_decoder(); cannot evaluate")
    ids = input_ids.view(1, -1).to(model.device)
    with masked_eviction(model, None, sinks=sinks, window=window, k=0):
        return dec(input_ids=ids, use_cache=False).last_hidden_state[0]
