"""Teacher labels, the losses, and the decision diagnostics (method.md sections 3-5).

The teacher runs the window-exit rule with the true targets (``kvpop.train.teacher``); at every exit
step it either keeps the exiting token or not (``y``), against ``t_bnd``, the weakest token of
its long-range set. The boundary loss trains the scorer's *priorities* on those decisions:

    margin = (r(t_new) + lam * t_new) - (r(t_bnd) + lam * t_bnd),   loss = omega * softplus(-y * margin / tau)

where ``r`` already contains the scorer's own per-head tilt, and ``lam`` is the global tilt
that the teacher and the cache both add: training and inference rank by the same quantity.
``omega`` is uniform, or (``"mass"``) the attention at stake, ``|exp(target_new) -
exp(target_bnd)|``, normalised to mean 1: a wrong call between two tokens nobody will look at
costs little; missing a token that future queries need costs a lot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..targets import loss_mask
from .teacher import teacher_labels


@dataclass
class Labels:
    """Teacher decisions per layer: all ``[L, b, h, Q]``."""

    t_new: Tensor
    t_bnd: Tensor
    y: Tensor
    valid: Tensor


def labels_for(targets: Tensor, window: int, k: int, sinks: int, lam: float) -> Labels:
    """Teacher labels of every layer at once from targets ``[L, b, h, S]``."""
    L, b, h, S = targets.shape
    lab = teacher_labels(targets.reshape(L * b, h, S), window, k, sinks, lam=lam, min_future=window)
    shape = (L, b, h, -1)
    return Labels(lab.t_new.reshape(shape), lab.t_bnd.reshape(shape), lab.y.reshape(shape), lab.valid.reshape(shape))


def margins(scores: Tensor, lab: Labels, layer: int, lam: float) -> Tensor:
    """Priority margins of one layer's decisions (``scores [b, h, S]``)."""
    t_new, t_bnd = lab.t_new[layer], lab.t_bnd[layer].clamp(min=0)
    m = scores.gather(2, t_new) - scores.gather(2, t_bnd)
    if lam:
        m = m + lam * (t_new - t_bnd).to(m.dtype)
    return m


def decision_weights(targets: Tensor, lab: Labels, layer: int, weighting: str) -> Tensor:
    """``omega`` of one layer's decisions, mean 1 over the valid ones."""
    valid = lab.valid[layer]
    if weighting == "uniform":
        return valid.float()
    tgt = targets[layer]
    w = (tgt.gather(2, lab.t_new[layer]).exp() - tgt.gather(2, lab.t_bnd[layer].clamp(min=0)).exp()).abs()
    w = torch.where(valid, w.nan_to_num(0.0), torch.zeros_like(w))
    mean = w[valid].mean() if bool(valid.any()) else w.new_tensor(1.0)
    return w / mean.clamp(min=1e-12)


def layer_loss(
    scores: Tensor,
    targets: Tensor,
    lab: Labels,
    layer: int,
    *,
    loss: str,
    lam: float,
    tau: float,
    weighting: str,
    window: int,
) -> Tensor:
    if loss == "mse":
        tgt = targets[layer]
        m = loss_mask(tgt.shape[-1], window, device=tgt.device).expand_as(tgt) & torch.isfinite(tgt)
        return ((scores - tgt)[m] ** 2).mean() if bool(m.any()) else scores.sum() * 0
    valid = lab.valid[layer]
    if not bool(valid.any()):
        return scores.sum() * 0
    y = lab.y[layer]
    omega = decision_weights(targets, lab, layer, weighting)
    return (F.softplus(-y * margins(scores, lab, layer, lam) / tau) * omega)[valid].mean()


# --- diagnostics ------------------------------------------------------------------------


def spearman(a: Tensor, b: Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.norm() * rb.norm()).item()
    return float((ra * rb).sum().item() / den) if den > 0 else 0.0


BASELINES = ("always_evict", "always_keep", "knorm", "random")


def baseline_margins(name: str, ex_keys: Tensor, lab: Labels, layer: int) -> Tensor:
    """Margins of trivial deciders on the same decisions (``>0`` keeps the exiting token).

    always_evict: never keep a new token; always_keep (pure recency, StreamingLLM's choice):
    always keep it; knorm: smaller key norm wins; random.
    """
    shape = lab.y[layer].shape
    if name == "always_evict":
        return torch.full(shape, -1.0)
    if name == "always_keep":
        return torch.full(shape, 1.0)
    if name == "knorm":
        s = -ex_keys[layer].float().norm(dim=-1)
        return s.gather(2, lab.t_new[layer]) - s.gather(2, lab.t_bnd[layer].clamp(min=0))
    if name == "random":
        return torch.rand(shape, generator=torch.Generator().manual_seed(1000 + layer)) - 0.5
    raise ValueError(f"unknown baseline {name!r}")


@torch.no_grad()
def decision_metrics(
    score_layers,
    targets: Tensor,
    lab: Labels,
    window: int,
    lam: float,
    keys: Tensor | None = None,
    weighting: str = "mass",
) -> dict:
    """Accuracy of the scorer's keep/evict calls against the teacher's, next to trivial deciders.

    ``score_layers(layer) -> [b, h, S]``. Reports the plain accuracy, the attention-mass-weighted
    accuracy (what the quality depends on), the rank correlation with the true targets, and the
    per-layer / per-head accuracy (where the scorer fails).
    """
    L = targets.shape[0]
    names = ["scorer"] + ([b for b in BASELINES] if keys is not None else [])
    correct = {n: 0.0 for n in names}
    wcorrect = {n: 0.0 for n in names}
    total = wtotal = 0.0
    per_layer, per_head, rhos = [], [], []
    S = targets.shape[-1]
    m_rank = loss_mask(S, window)
    for layer in range(L):
        scores = score_layers(layer).float()
        valid, y = lab.valid[layer], lab.y[layer]
        omega = decision_weights(targets, lab, layer, "mass")
        n_valid = float(valid.sum())
        total += n_valid
        wtotal += float(omega[valid].sum())
        for n in names:
            mg = margins(scores, lab, layer, lam) if n == "scorer" else baseline_margins(n, keys, lab, layer)
            ok = ((mg > 0) == (y > 0)) & valid
            correct[n] += float(ok.sum())
            wcorrect[n] += float((omega * ok).sum())
            if n == "scorer":
                per_layer.append(float(ok.sum()) / max(1.0, n_valid))
                per_head.append((ok.sum((0, 2)).float() / valid.sum((0, 2)).clamp(min=1).float()).tolist())
        for bi in range(scores.shape[0]):
            for hi in range(scores.shape[1]):
                t = targets[layer, bi, hi]
                keep = m_rank & torch.isfinite(t)
                if keep.sum() > 2:
                    rhos.append(spearman(scores[bi, hi][keep], t[keep]))
    out = {
        "decisions": int(total),
        "accuracy": correct["scorer"] / max(1.0, total),
        "mass_weighted_accuracy": wcorrect["scorer"] / max(1e-12, wtotal),
        "rank_correlation": sum(rhos) / max(1, len(rhos)),
        "per_layer_accuracy": per_layer,
        "per_head_accuracy": per_head,
    }
    if keys is not None:
        out["baselines"] = {
            n: {"accuracy": correct[n] / max(1.0, total), "mass_weighted_accuracy": wcorrect[n] / max(1e-12, wtotal)}
            for n in BASELINES
        }
    return out
