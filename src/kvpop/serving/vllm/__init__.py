"""kvpop as a vLLM plugin: every full-attention layer keeps exactly ``B`` slots per request.

Switch it on per engine::

    LLM(model=DIR, additional_config={"kvpop": {"budget": 512, "policy": "kvpop-mlp"}})
    vllm serve DIR --additional-config '{"kvpop": {"budget": 512, "policy": "kvpop-mlp"}}'

Without the ``"kvpop"`` key vLLM runs exactly as it would without kvpop installed.

vLLM loads :func:`register` in each of its processes through the ``vllm.general_plugins`` entry
point (declared by the ``kvpop`` package; install ``kvpop[vllm]``). It does three things, all
no-ops for an engine whose ``additional_config`` has no ``"kvpop"`` key:

1. registers kvpop's attention backend under the name ``KVPOP`` (vLLM's ``register_backend``);
2. wraps the current platform's ``check_and_update_config`` (called once per engine config,
   before any model loads): it checks the kvpop settings and the engine options (one clear
   ``ValueError`` naming the setting), and turns prefix caching off for the engine (a bounded cache
   has no reusable prefix);
3. wraps the platform's ``get_attn_backend_cls``: decoder full-attention layers get the ``KVPOP``
   backend (:mod:`kvpop.serving.vllm.backend`); anything else (sliding window, MLA, ...) is refused.

vLLM's platform classes have no per-engine attention-backend hook on the CPU (its backend choice
ignores ``attention_backend``), which is why 2 and 3 wrap the two methods on the platform object;
the wrappers call the originals first and are installed once per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .settings import KEY, ServeSettings, SettingsError

__all__ = ["KEY", "ServeSettings", "SettingsError", "check_engine", "register"]

_MARK = "kvpop_plugin_installed"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (vLLM calls it in every process; idempotent)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import backend
    from .settings import ServeSettings

    if vars(current_platform).get(_MARK, False):  # (getattr would ask the platform, which warns)
        return
    if backend.NAME not in AttentionBackendEnum.__members__:
        register_backend(backend.NAME, backend.PATH)
    base_select = current_platform.get_attn_backend_cls
    base_check = current_platform.check_and_update_config

    def get_attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
        path = base_select(selected_backend, attn_selector_config, num_heads)
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is None or ServeSettings.from_additional_config(config.additional_config) is None:
            return path
        _check_layer(attn_selector_config)
        return backend.PATH

    def check_and_update_config(vllm_config) -> None:
        base_check(vllm_config)
        settings = ServeSettings.from_additional_config(vllm_config.additional_config)
        if settings is not None:
            check_engine(vllm_config, settings)

    current_platform.get_attn_backend_cls = get_attn_backend_cls
    current_platform.check_and_update_config = check_and_update_config
    setattr(current_platform, _MARK, True)


def _check_layer(sel) -> None:
    """A layer kvpop cannot serve is refused (at model construction, in the worker)."""
    from vllm.v1.attention.backend import AttentionType

    bad = {
        "multi-head latent attention": sel.use_mla,
        "sparse attention": sel.use_sparse,
        "a sliding window": sel.has_sliding_window,
        "attention sinks": sel.has_sink,
        "multimodal prefix attention": sel.use_mm_prefix,
        f"attention type {sel.attn_type!r}": sel.attn_type != AttentionType.DECODER,
        f"KV cache dtype {sel.kv_cache_dtype!r}": sel.kv_cache_dtype not in (None, "auto"),
    }
    found = [what for what, hit in bad.items() if hit]
    if found:
        raise ValueError(f"kvpop serves decoder full-attention layers; this model has a layer with {', '.join(found)}")


def check_engine(vllm_config, settings: ServeSettings) -> None:
    """Engine options kvpop cannot serve, checked before any model loads (one ``SettingsError`` naming
    them all); prefix caching goes off. Called by the plugin for every engine config with the key."""
    from .settings import KEY, SettingsError

    where = f"additional_config[{KEY!r}]"
    model = vllm_config.model_config
    if model is None:
        return
    settings.build_cache(model.hf_config)  # the budget, the policy, the scorer against this model: SettingsError
    problems = []
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding (a draft's rejected tokens cannot be un-evicted)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        problems.append(f"kv_cache_dtype={cache_dtype!r} (kvpop keeps keys and values in the model dtype)")
    par = vllm_config.parallel_config
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        if getattr(par, name, 1) > 1:
            problems.append(f"{name}={getattr(par, name)} (kvpop runs on one worker)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("KV transfer / offloading connectors (a page is kvpop's own state, not vLLM's token blocks)")
    if vllm_config.lora_config is not None:
        problems.append("LoRA adapters (merge an adapter into the model folder instead)")
    if problems:
        raise SettingsError(f"{where} is set, and kvpop does not support {'; '.join(problems)}")
    if vllm_config.cache_config.enable_prefix_caching:
        vllm_config.cache_config.enable_prefix_caching = False
        from vllm.logger import init_logger

        init_logger(__name__).info("kvpop: prefix caching is off (a request's cache is its own bounded state)")


def __getattr__(name: str) -> Any:
    """The settings' names, imported on first use: the settings import the cache (torch), which ``kvpop serve``'s
    parser (:mod:`.serve`, in this package) does not need."""
    if name in ("KEY", "ServeSettings", "SettingsError"):
        from . import settings

        return getattr(settings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
