"""Evaluation of KV-cache policies: teacher-forced LM metrics (all tokens and long-dependency
tokens), continuation, needle, multi-key recall, agreement; resumable and splittable runs.

Python API::

    from kvpop import EvictionConfig
    from kvpop.evaluate import teacher_forced, EvalConfig, run_eval
    m = teacher_forced(model, ids, "knorm", EvictionConfig.from_budget(512))   # one document, metrics over positions >= B
    results = run_eval(model, tok, EvalConfig(tasks=("lm",)), documents={"mine": [ids]}, out="runs/x")

CLI: ``kvpop eval ...`` (see :mod:`kvpop.evaluate.cli`).
"""

from .core import (
    ALL_POLICIES,
    DENSE,
    DenseCache,
    PolicyUnavailable,
    Sums,
    make_policy,
    policy_available,
    policy_cache,
    sums_from_logits,
    teacher_forced,
)
from .harness import (
    IN_DOMAIN,
    EvalConfig,
    build_results,
    check_policies,
    merge,
    quick_config,
    run_eval,
    table,
    write_results,
)
from .stats import aggregate, bootstrap_mean, bootstrap_pooled
from .tasks import (
    DEFAULT_TASKS,
    TASKS,
    agreement_doc,
    continuation_doc,
    greedy,
    lm_doc,
    multikey_cases,
    needle_case,
    needle_cases,
)

__all__ = [
    "ALL_POLICIES",
    "DEFAULT_TASKS",
    "DENSE",
    "IN_DOMAIN",
    "TASKS",
    "DenseCache",
    "EvalConfig",
    "PolicyUnavailable",
    "Sums",
    "aggregate",
    "agreement_doc",
    "bootstrap_mean",
    "bootstrap_pooled",
    "build_results",
    "check_policies",
    "continuation_doc",
    "greedy",
    "lm_doc",
    "make_policy",
    "merge",
    "multikey_cases",
    "needle_case",
    "needle_cases",
    "policy_available",
    "policy_cache",
    "quick_config",
    "run_eval",
    "sums_from_logits",
    "table",
    "teacher_forced",
    "write_results",
]
