"""The policy names, in one table, readable without importing torch.

``kvpop.policies`` (the registry, which imports torch), the command lines (:mod:`kvpop.cli.options`)
and the vLLM server's launcher (:mod:`kvpop.serving.vllm.serve`) take the names from here, so a
parser answers ``--help`` and a bad argument before torch loads.

=================  =============================================================================
``kvpop``          the model's default learned policy, resolved to ``kvpop-mlp`` or ``kvpop-mlstm``
                   (:func:`kvpop.policies.resolve_policy`): the policy of its adapter bundle's scorer,
                   else of the scorer kind shipped as its default (:data:`DEFAULT_KIND`, the MLP);
                   with a scorer given (``path=``, ``--scorer``), the policy of that scorer
``kvpop-mlp``      a trained MLP scorer (stateless)
``kvpop-mlstm``    a trained mLSTM scorer (stateful)
=================  =============================================================================

Records name the concrete policy that ran (``kvpop-mlp`` or ``kvpop-mlstm``), never the alias.
"""

from __future__ import annotations

__all__ = [
    "ALIAS",
    "ALL_POLICIES",
    "DEFAULT_KIND",
    "DEFAULT_POLICY",
    "DENSE",
    "GENERATE_POLICIES",
    "KIND_TO_POLICY",
    "LEARNED_POLICIES",
    "POLICY_NAMES",
    "POLICY_TO_KIND",
    "TEACHER_FORCED_ONLY",
]

DENSE = "dense"  # not a policy: no eviction, a plain transformers cache
ALIAS = "kvpop"  # the model's default learned policy: one of KIND_TO_POLICY's values, resolved per model
KIND_TO_POLICY = {"mlp": "kvpop-mlp", "mlstm": "kvpop-mlstm"}  # scorer kind -> the learned policy it serves
LEARNED_POLICIES = tuple(KIND_TO_POLICY.values())  # built from a scorer checkpoint: accept path= and model=
POLICY_TO_KIND = {policy: kind for kind, policy in KIND_TO_POLICY.items()}
# the scorer kind shipped as every embedded model's default: both shipped kinds are trained over every budget
# 128..2,048, and the MLP is the better of the two on the test grids (docs/evaluation.md)
DEFAULT_KIND = "mlp"
# the policy a cache uses when none is named, on a model without an adapter bundle (with one:
# kvpop.policies.default_policy, the policy of the bundle's scorer)
DEFAULT_POLICY = KIND_TO_POLICY[DEFAULT_KIND]
TEACHER_FORCED_ONLY = ("oracle",)  # needs the whole sequence in advance: not for free generation
# every registered name in table order, the alias before the concrete learned policies
POLICY_NAMES = ("streaming", "tova", "h2o", "snapkv", "knorm", "random", "oracle", ALIAS, *LEARNED_POLICIES)
# a command line's choices: dense and every policy that can generate, the alias included
GENERATE_POLICIES = (DENSE, *(n for n in POLICY_NAMES if n not in TEACHER_FORCED_ONLY))
# kvpop eval's default grid: dense and every concrete policy (the alias would run one of them twice)
ALL_POLICIES = (DENSE, *(n for n in POLICY_NAMES if n != ALIAS))
