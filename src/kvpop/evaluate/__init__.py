"""Evaluation of KV-cache policies: teacher-forced LM metrics, continuation, needle, agreement.

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
from .harness import IN_DOMAIN, EvalConfig, quick_config, run_eval, table, write_results
from .tasks import TASKS, agreement_doc, continuation_doc, greedy, lm_doc, needle_case, needle_cases

__all__ = [
    "ALL_POLICIES",
    "DENSE",
    "IN_DOMAIN",
    "TASKS",
    "DenseCache",
    "EvalConfig",
    "PolicyUnavailable",
    "Sums",
    "agreement_doc",
    "continuation_doc",
    "greedy",
    "lm_doc",
    "make_policy",
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
