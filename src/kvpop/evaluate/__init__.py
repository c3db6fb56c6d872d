"""Evaluation of KV-cache policies: teacher-forced LM metrics (all tokens and long-dependency
tokens), continuation, needle, multi-key recall, agreement; resumable and splittable runs.

Python API::

    from kvpop import EvictionConfig
    from kvpop.evaluate import teacher_forced, EvalConfig, run_eval
    # one document, metrics over positions >= B
    m = teacher_forced(model, ids, "knorm", EvictionConfig.from_budget(512))
    results = run_eval(model, tok, EvalConfig(tasks=("lm",)), documents={"mine": [ids]}, out="runs/x")

The measurement itself (one forward under the cache, scored against the dense forward) is
:mod:`kvpop.evaluate.quality`, the probe that training and adaptation use too.

CLI: ``kvpop eval ...`` (see :mod:`kvpop.cli.eval`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..lazy import lazy_exports

if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .core import ALL_POLICIES, DENSE, PolicyUnavailable, build_cache, policy_available, teacher_forced
    from .harness import (
        EvalConfig,
        build_results,
        check_policies,
        merge,
        quick_config,
        run_eval,
        shipped_training_corpora,
        table,
        write_results,
    )
    from .quality import DenseOutputs, Sums, sums_from_logits
    from .stats import aggregate, bootstrap_mean, bootstrap_pooled
    from .tasks import DEFAULT_TASKS, TASKS, greedy, multikey_cases, needle_cases

# the module (in this package) -> the public names it defines, imported on first use
_MODULES: dict[str, tuple[str, ...]] = {
    "quality": ("DenseOutputs", "Sums", "sums_from_logits"),
    "core": ("ALL_POLICIES", "DENSE", "PolicyUnavailable", "build_cache", "policy_available", "teacher_forced"),
    "harness": (
        "EvalConfig",
        "build_results",
        "check_policies",
        "merge",
        "quick_config",
        "run_eval",
        "shipped_training_corpora",
        "table",
        "write_results",
    ),
    "stats": ("aggregate", "bootstrap_mean", "bootstrap_pooled"),
    "tasks": ("DEFAULT_TASKS", "TASKS", "greedy", "multikey_cases", "needle_cases"),
}

__all__ = [
    "ALL_POLICIES",
    "DEFAULT_TASKS",
    "DENSE",
    "IN_DOMAIN",
    "TASKS",
    "DenseOutputs",
    "EvalConfig",
    "PolicyUnavailable",
    "Sums",
    "aggregate",
    "bootstrap_mean",
    "bootstrap_pooled",
    "build_cache",
    "build_results",
    "check_policies",
    "greedy",
    "merge",
    "multikey_cases",
    "needle_cases",
    "policy_available",
    "quick_config",
    "run_eval",
    "shipped_training_corpora",
    "sums_from_logits",
    "table",
    "teacher_forced",
    "write_results",
]


_EXPORTS, _getattr, __dir__ = lazy_exports(__name__, _MODULES, globals())


def __getattr__(name: str) -> Any:
    """A public name from its module, imported on first use: importing a submodule (the command lines read
    ``kvpop.evaluate.store``) loads no torch or model code it does not need."""
    if name == "IN_DOMAIN":  # read on first use, not at import (kvpop.evaluate.harness.shipped_training_corpora)
        from .harness import shipped_training_corpora

        return shipped_training_corpora()
    return _getattr(name)
