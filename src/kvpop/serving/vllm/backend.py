"""kvpop's vLLM attention backend: one fixed-size page per request and layer, the KVpop rule inside.

* :class:`KVpopSpec` (a ``CircularBufferSpec``) tells vLLM's KV cache manager that a kvpop layer
  needs exactly one block per request for the request's whole life, whatever its length, and that
  the layer writes that block itself (no slot mapping). vLLM's own ``CircularBufferManager`` hands
  out and frees the blocks, so its accounting (blocks, KV usage, admitted requests) is the truth.
  A block is one :class:`kvpop.serving.paged.PageLayout` page: the ``B`` slots of every KV head and
  the request's bookkeeping and policy state. The spec's ``block_size`` is nominal (vLLM's block
  size, so the scheduler's arithmetic is unchanged); the ``B`` slots are ``slots``.
* :class:`KVpopMetadataBuilder` turns vLLM's per-step batch description into kvpop's step plan once
  per step (:func:`kvpop.serving.paged.plan_step`).
* :class:`KVpopAttentionImpl` runs :func:`kvpop.serving.paged.step_layer` for its layer: the
  layer's ``KVpopLayer.attend`` on the requests' pages.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec

from ...cache import KVpopCache
from ..paged import Group, PageLayout, Request, plan_step, step_layer
from .settings import ServeSettings

logger = init_logger(__name__)

NAME = "KVPOP"  # the backend's name in vLLM's AttentionBackendEnum (registered by the plugin)
PATH = f"{__name__}.KVpopAttentionBackend"


@dataclass(frozen=True, kw_only=True)
class KVpopSpec(CircularBufferSpec):
    """One block per request for its whole life: ``slots`` (= B) slots per KV head plus bookkeeping,
    ``page_bytes`` in all (carried as the page's single state: ``num_head_slots = 1``,
    ``tokens_per_state = block_size``, ``state_content_bytes = page_bytes``)."""

    slots: int = 0


class Runtime:
    """What every kvpop layer of this process shares: the settings, the ``KVpopCache`` whose layers
    do the work (one per model layer), and each layer's page layout."""

    def __init__(self, vllm_config: VllmConfig, settings: ServeSettings):
        self.settings = settings
        self.cache: KVpopCache = settings.build_cache(vllm_config.model_config.hf_config)
        self.eviction = self.cache.eviction
        self.layouts: dict[int, PageLayout] = {}
        self.dtype = vllm_config.model_config.dtype

    def layout(self, layer_idx: int, kv_heads: int, head_dim: int, value_dim: int) -> PageLayout:
        lay = self.layouts.get(layer_idx)
        if lay is None:
            lay = self.layouts[layer_idx] = PageLayout(
                self.cache.layers[layer_idx], kv_heads, head_dim, value_dim, self.dtype
            )
        return lay


_RUNTIME: Runtime | None = None
_LOCK = threading.Lock()


def runtime(vllm_config: VllmConfig | None = None) -> Runtime:
    """This process's :class:`Runtime`, built on first use from ``vllm_config`` (default: the current one)."""
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is None:
            config = vllm_config or get_current_vllm_config()
            settings = ServeSettings.from_additional_config(config.additional_config)
            if settings is None:
                raise RuntimeError("the kvpop attention backend is in use but additional_config has no 'kvpop' key")
            _RUNTIME = Runtime(config, settings)
        return _RUNTIME


@dataclass
class KVpopMetadata:
    num_actual_tokens: int
    groups: list[Group]


class KVpopMetadataBuilder(AttentionMetadataBuilder[KVpopMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.eviction = runtime(vllm_config).eviction

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KVpopMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        starts = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].tolist()
        pages = m.block_table_tensor[:n, 0].tolist()
        prefilling = m.is_prefilling[:n].tolist() if m.is_prefilling is not None else [None] * n
        requests = []
        for i in range(n):
            length = starts[i + 1] - starts[i]
            seen = seq_lens[i] - length
            prefill = prefilling[i] if prefilling[i] is not None else length > 1
            requests.append(Request(pages[i], starts[i], length, seen, bool(prefill)))
        groups = plan_step(requests, self.eviction.budget, self.eviction.chunk, device=self.device)
        return KVpopMetadata(num_actual_tokens=m.num_actual_tokens, groups=groups)


class KVpopAttentionImpl(AttentionImpl[KVpopMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra,
    ) -> None:
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            f"a sliding window ({sliding_window})": sliding_window is not None,
            f"a logits soft cap ({logits_soft_cap})": bool(logits_soft_cap),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            f"KV cache dtype {kv_cache_dtype!r}": kv_cache_dtype != "auto",
            "attention sinks": extra.get("sinks") is not None,
        }
        bad = [what for what, hit in refused.items() if hit]
        if bad:
            raise ValueError(f"kvpop serves plain causal full attention; this layer has {', '.join(bad)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.runtime = runtime()
        self.layer_idx: int | None = None

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVpopMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvpop does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling / warm-up run: no requests, no pages
            return output
        if self.layer_idx is None:
            self.layer_idx = extract_layer_index(layer.layer_name)
        idx = self.layer_idx
        value_dim = value.shape[-1]
        layout = self.runtime.layout(idx, self.num_kv_heads, self.head_size, value_dim)
        # the layer's cache is [num_blocks, 1, 1, page] in the model dtype: one page per block
        pool = kv_cache.view(torch.uint8)[:, 0, 0, :]
        t = attn_metadata.num_actual_tokens
        step_layer(
            self.runtime.cache.layers[idx],
            layout,
            pool,
            attn_metadata.groups,
            query[:t],
            key[:t],
            value[:t],
            output[:t],
            self.scale,
        )
        return output


class KVpopAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # the layer writes its pages itself
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[KVpopAttentionImpl]:
        return KVpopAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVpopMetadataBuilder]:
        return KVpopMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """vLLM's full-attention spec of a layer -> the kvpop page spec (same for every layer)."""
        rt = runtime()
        lay = rt.layout(0, spec.num_kv_heads, spec.head_size, spec.head_size_v)
        if spec.dtype != rt.dtype:
            raise ValueError(f"kvpop keeps keys and values in the model dtype {rt.dtype}; the KV cache is {spec.dtype}")
        return KVpopSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            head_size_v=spec.head_size_v,
            dtype=spec.dtype,
            num_head_slots=1,
            tokens_per_state=spec.block_size,
            state_content_bytes=lay.page_bytes,
            dcp_sharded=False,
            slots=rt.eviction.budget,
        )
