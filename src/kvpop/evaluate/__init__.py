"""Evaluation of KV-cache policies: teacher-forced LM metrics (all tokens and long-dependency
tokens), continuation, needle, multi-key recall, agreement; resumable and splittable runs.

Python API::

    from kvpop import EvictionConfig
    from kvpop.evaluate import teacher_forced, EvalConfig, run_eval
    # one document, metrics over positions >= B
    m = teacher_forced(model, ids, "knorm", EvictionConfig.from_budget(512))
    results = run_eval(model, tok, EvalConfig(tasks=("lm",)), documents={"mine": [ids]}, out="runs/x")

The measurement itself (one forward under the cache, scored against the dense forward) is
:mod:`kvpop.quality`, the probe that training and adaptation use too.

CLI: ``kvpop eval ...`` (see :mod:`kvpop.evaluate.cli`).
"""

from ..quality import DenseOutputs, Sums, sums_from_logits
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
from .stats import aggregate, bootstrap_mean, bootstrap_pooled
from .tasks import DEFAULT_TASKS, TASKS, greedy, multikey_cases, needle_cases

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


def __getattr__(name: str):
    if name == "IN_DOMAIN":  # read on first use, not at import (kvpop.evaluate.harness.shipped_training_corpora)
        return shipped_training_corpora()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
