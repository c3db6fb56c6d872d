"""The switch: ``additional_config={"kvpop": {...}}`` on ``vllm.LLM`` / ``vllm serve``.

Plain Python (no vLLM import), so the settings can be checked, and tested, anywhere. The budget
split (sinks / window / k, the recency tilt, a learned scorer's trained window) is resolved by
building a :class:`kvpop.KVpopCache` for the model's config with :func:`kvpop.make_cache`: the
same code path a local ``KVpopCache`` takes, so a served model and a local one evict alike.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...cache import KVpopCache, make_cache
from ...config import BudgetArgs
from ...policies import ALIAS, DEFAULT_POLICY, DENSE, LEARNED_POLICIES, POLICIES, TEACHER_FORCED_ONLY

KEY = "kvpop"  # the additional_config key that switches the plugin on


class SettingsError(ValueError):
    """``additional_config["kvpop"]`` is not usable; the message names the offending key."""


@dataclass(frozen=True)
class ServeSettings(BudgetArgs):
    """What ``additional_config["kvpop"]`` may hold (every key optional but one of budget/k/compression).

    The budget keywords are :class:`kvpop.config.BudgetArgs`' (``budget``, ``k``, ``compression`` +
    ``reference_length``, ``window``, ``sinks``, ``lam``, ``prefill_chunk``), as for ``KVpopCache``.
    ``policy``: a kvpop policy name (default :data:`kvpop.policies.DEFAULT_POLICY`, the shipped MLP scorer;
    ``"kvpop"``: the model's default learned policy, or with ``scorer`` the policy of that scorer).
    ``scorer``: a
    scorer checkpoint for a learned policy (default: the one shipped for the embedded
    SmolLM2-135M-Instruct). ``seed``: for ``policy="random"``. ``compile``: compile the decode steady
    state (``KVpopCache(compile=True)``: faster steps after a compilation of a few seconds per batch
    size; the same decisions, outputs equal up to rounding).
    """

    policy: str = DEFAULT_POLICY
    scorer: str | None = None
    seed: int | None = None
    compile: bool = False

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> ServeSettings | None:
        """The settings under ``additional_config["kvpop"]``, or None when the key is absent (plugin off)."""
        if not isinstance(additional_config, Mapping) or KEY not in additional_config:
            return None
        raw = additional_config[KEY]
        where = f"additional_config[{KEY!r}]"
        if not isinstance(raw, Mapping):
            raise SettingsError(
                f'{where} must be a dict such as {{"budget": 512, "policy": "kvpop"}}, got {type(raw).__name__}'
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise SettingsError(f"{where} has unknown key(s) {unknown}; known keys: {', '.join(known)}")
        settings = cls(**dict(raw))
        if (
            not isinstance(settings.policy, str)
            or settings.policy not in POLICIES
            or settings.policy in TEACHER_FORCED_ONLY
        ):
            usable = [p for p in POLICIES if p not in TEACHER_FORCED_ONLY]
            hint = " (leave the kvpop key out for vLLM's own dense cache)" if settings.policy == DENSE else ""
            raise SettingsError(
                f"{where}['policy'] = {settings.policy!r} is not a servable policy{hint}; "
                f"choose one of {', '.join(usable)}"
            )
        if settings.scorer is not None and settings.policy not in (ALIAS, *LEARNED_POLICIES):
            raise SettingsError(
                f"{where}['scorer'] is for the learned policies ({', '.join((ALIAS, *LEARNED_POLICIES))}), "
                f"not {settings.policy!r}"
            )
        if settings.seed is not None and settings.policy != "random":
            raise SettingsError(f"{where}['seed'] is for policy 'random', not {settings.policy!r}")
        if not isinstance(settings.compile, bool):
            raise SettingsError(f"{where}['compile'] must be true or false, got {settings.compile!r}")
        return settings

    def build_cache(self, hf_config) -> KVpopCache:
        """A ``KVpopCache`` for ``hf_config`` (copied: the model's own config is not touched) under
        these settings: its ``eviction`` and ``policy``, and its layers, are what the plugin serves with.
        Any error names the ``additional_config["kvpop"]`` key it comes from."""
        kwargs: dict[str, Any] = {}
        if self.scorer is not None:
            kwargs["path"] = self.scorer
        if self.seed is not None:
            kwargs["seed"] = self.seed
        try:
            budget = {f.name: getattr(self, f.name) for f in fields(BudgetArgs)}
            return make_cache(copy.deepcopy(hf_config), self.policy, compile=self.compile, **budget, **kwargs)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise SettingsError(f"additional_config[{KEY!r}]: {exc}") from exc
