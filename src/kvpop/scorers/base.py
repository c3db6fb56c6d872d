"""Shared pieces of the KVpop scorers: configuration, input features, base class.

Every scorer holds ONE set of weights per KV head of ONE layer, stored with a
leading ``kv_heads`` dimension, so all heads are evaluated with batched matmuls
(no Python loop over heads). Inputs are the cached (post-RoPE) keys and values
of the layer, ``[batch, kv_heads, T, head_dim]``; they are detached here, the
scorer never back-propagates into the LLM. Scores are ``[batch, kv_heads, T]``,
higher = more future attention = keep.

Input features (``input_norm=True``, the default): for each token, ``k`` and
``v`` are RMS-normalised separately (no learned affine: a per-feature gain would
be redundant with the first linear layer that follows), and the log of their
two RMS values is appended, so the scorer is insensitive to the (head- and
layer-dependent) scale of the cache but still sees the key/value norms (the
key norm is itself a known eviction signal)::

    x_t = [k_t / rms(k_t) ; v_t / rms(v_t) ; log rms(k_t) ; log rms(v_t)]   (2*head_dim + 2)

With ``input_norm=False`` the raw ``[k_t ; v_t]`` (2*head_dim) is used.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = ["BaseScorer", "ScorerConfig", "across_heads", "feature_dim", "head_linear", "head_score", "kv_features"]


@dataclass
class ScorerConfig:
    """Configuration of a model-level scorer stack (one scorer module per layer).

    kind:         "mlp" (KVpop-MLP, stateless) or "mlstm" (KVpop, stateful mLSTM).
    num_layers, kv_heads, head_dim: shapes of the LLM's KV cache.
    hidden:       MLP hidden width (kind "mlp"); width of the per-token feature
                  MLP that feeds the mLSTM score head (kind "mlstm", if read_mlp).
    dk, dv:       mLSTM key/query and value dims of the matrix memory C [dk, dv].
    input_norm:   see module docstring (RMS-normalised k, v + log norms).
    read_mlp:     mLSTM: add SiLU(W x_t + b) of the exiting token to the score head.
    h_norm:       mLSTM: RMS-normalise the memory readout h (no affine) before the
                  linear head (the xLSTM output norm; keeps h bounded when
                  |n^T q| is small).
    forget_gate:  mLSTM: "sigmoid" (log f = logsigmoid(f~)) or "exp" (log f = f~).
    forget_bias:  mLSTM forget-gate bias init, linearly spaced over the kv heads.
    chunk_size:   mLSTM chunkwise-parallel training form: steps per chunk.
    seed:         init seed; layer l uses seed + l.
    eps:          epsilon of the RMS norms.
    position_free: undo RoPE on the keys before scoring (``kvpop.rope``): the scorer sees the
                  key's content, not its position (the RoPE frequencies are stored with the
                  weights, ``rope_scaling`` beside them).
    observed:     observation windows (None = the whole protected window) whose observed
                  attention (``kvpop.observed``: what the token received while protected) is an
                  extra input, as the log mean attention per query; () = keys and values only.
    tilt:         a learned per-head recency tilt ``lam_h * t`` added to the score
                  (``lam_h = softplus(theta_h) / 1000``, per token).
    cross_heads:  MLP: each KV head's network reads the exiting token's features in every KV head
                  of the layer (its keys, values and observed attention there), not only its own:
                  a token leaves the window at the same position in all heads, and together the
                  heads' keys and values carry most of the layer's hidden state (``across_heads``).
    """

    kind: Literal["mlp", "mlstm"] = "mlstm"
    num_layers: int = 1
    kv_heads: int = 1
    head_dim: int = 64
    hidden: int = 64
    dk: int = 32
    dv: int = 32
    input_norm: bool = True
    read_mlp: bool = True
    h_norm: bool = True
    forget_gate: Literal["sigmoid", "exp"] = "sigmoid"
    forget_bias: tuple[float, float] = (3.0, 6.0)
    chunk_size: int = 128
    seed: int = 0
    eps: float = 1e-6
    position_free: bool = False
    rope_scaling: float = 1.0
    observed: tuple[int | None, ...] = ()
    tilt: bool = False
    cross_heads: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "mlstm"):
            raise ValueError(f"ScorerConfig.kind must be 'mlp' or 'mlstm', got {self.kind!r}")
        if self.forget_gate not in ("sigmoid", "exp"):
            raise ValueError(f"forget_gate must be 'sigmoid' or 'exp', got {self.forget_gate!r}")
        for name in ("num_layers", "kv_heads", "head_dim", "dk", "dv", "chunk_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ScorerConfig.{name} must be >= 1")
        if self.hidden < 0:
            raise ValueError("ScorerConfig.hidden must be >= 0")
        if self.kind == "mlp" and self.hidden < 1:
            raise ValueError("ScorerConfig.hidden must be >= 1 for kind 'mlp'")
        if self.cross_heads and self.kind != "mlp":
            raise ValueError("ScorerConfig.cross_heads is a kind 'mlp' option (the mLSTM reads each head's own stream)")
        self.forget_bias = tuple(float(x) for x in self.forget_bias)  # type: ignore[assignment]
        self.observed = tuple(None if o is None else int(o) for o in self.observed)  # type: ignore[assignment]
        if any(o is not None and o < 1 for o in self.observed):
            raise ValueError(f"ScorerConfig.observed windows must be >= 1 or None, got {self.observed}")

    @property
    def n_extra(self) -> int:
        """Extra per-token inputs of the read path (the observed-attention features)."""
        return len(self.observed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["forget_bias"] = list(self.forget_bias)
        d["observed"] = list(self.observed)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScorerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown ScorerConfig fields: {sorted(unknown)}")
        d = dict(d)
        if "forget_bias" in d:
            d["forget_bias"] = tuple(d["forget_bias"])
        if "observed" in d:
            d["observed"] = tuple(d["observed"])
        return cls(**d)


def feature_dim(head_dim: int, input_norm: bool) -> int:
    return 2 * head_dim + (2 if input_norm else 0)


def kv_features(
    k: Tensor, v: Tensor, input_norm: bool = True, eps: float = 1e-6, dtype: torch.dtype | None = None
) -> Tensor:
    """[b, h, T, D] keys and values -> [b, h, T, feature_dim] (detached, cast to dtype)."""
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    k = k.detach()
    v = v.detach()
    if dtype is not None:
        k = k.to(dtype)
        v = v.to(dtype)
    if not input_norm:
        return torch.cat([k, v], dim=-1)
    x = torch.stack([k, v], dim=-2)  # [b, h, T, 2, D]
    ms = (x * x).sum(dim=-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(eps)  # (mean is slower)
    x = x * torch.rsqrt(ms)
    return torch.cat([x.flatten(-2), torch.log(ms).mul_(0.5).flatten(-2)], dim=-1)


def across_heads(x: Tensor) -> Tensor:
    """[b, h, T, I] per-head features -> [b, h, T, h * I]: every head gets all heads' features of
    the same token, in head order (the cross-head input of ``ScorerConfig.cross_heads``)."""
    b, h, T, i = x.shape
    return x.transpose(1, 2).reshape(b, 1, T, h * i).expand(b, h, T, h * i)


def head_linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Per-head affine map: x [B, H, N, I] @ w [H, I, O] + b [H, O] -> [B, H, N, O] (one baddbmm)."""
    B, H, N, I = x.shape
    if B == 1:
        return torch.baddbmm(b.unsqueeze(1), x[0], w).unsqueeze(0)
    out = torch.baddbmm(b.unsqueeze(1), x.transpose(0, 1).reshape(H, B * N, I), w)
    return out.view(H, B, N, -1).transpose(0, 1)


def head_score(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Per-head linear score: x [B, H, N, I] . w [H, I, 1] + b [H] -> [B, H, N] (:func:`head_linear`), or
    x [B, H, I] (one row per head: a decode step) -> [B, H] as a broadcast-and-sum, which ``torch.compile``
    fuses into its loops instead of calling BLAS for a dot product."""
    if x.dim() == 3:
        return (x * w.squeeze(-1)).sum(-1) + b
    return head_linear(x, w, b.unsqueeze(-1)).squeeze(-1)


class BaseScorer(nn.Module):
    """Common interface. Subclasses implement forward / init_state / step / read / step_and_read.

    Uniform inference interface (the stateless MLP implements it trivially, with
    state ``None``), so a cache can drive either scorer the same way:

    * ``init_state(batch, device=None, dtype=None) -> state``
    * ``step(state, k_new, v_new, mask=None) -> state``          (consume new tokens in order)
    * ``read(state, k_exit, v_exit) -> [b, h, n]``                (score exiting tokens now)
    * ``step_and_read(state, k_new, v_new, k_read, v_read, read_steps=None, mask=None)
      -> (state, [b, h, m])``
    """

    is_stateful: bool = False
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: ScorerConfig, layer_idx: int = 0):
        """The scorer of layer ``layer_idx`` that ``config`` describes: each constructor argument is the
        config's field of the same name, the seed the config's plus ``layer_idx``."""
        names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "seed")]
        return cls(**{n: getattr(config, n) for n in names}, seed=config.seed + layer_idx)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _with_extra(self, x: Tensor, extra: Tensor | None) -> Tensor:
        """Append the extra read features (observed attention) to per-token features ``x``."""
        n = getattr(self, "n_extra", 0)
        if n == 0:
            if extra is not None and extra.shape[-1]:
                raise ValueError(f"this scorer takes no extra features, got {tuple(extra.shape)}")
            return x
        if extra is None or extra.shape[:-1] != x.shape[:-1] or extra.shape[-1] != n:
            got = None if extra is None else tuple(extra.shape)
            raise ValueError(f"this scorer needs extra features [b, h, T, {n}] (observed attention), got {got}")
        return torch.cat([x, extra.to(x.dtype)], dim=-1)

    def _check_kv(self, k: Tensor, v: Tensor) -> None:
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"expected k, v of shape [batch, kv_heads, T, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if k.shape[1] != self.kv_heads or k.shape[3] != self.head_dim:
            raise ValueError(f"expected kv_heads={self.kv_heads}, head_dim={self.head_dim}, got shape {tuple(k.shape)}")


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: scorer weights start the same on every device."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def normal_init_(t: Tensor, std: float, g: torch.Generator) -> None:
    """Fill ``t`` in place with N(0, std^2) draws from ``g`` (drawn in float32 on the CPU)."""
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(std).to(t.dtype))
