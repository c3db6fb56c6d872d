"""Serving: kvpop layers running inside a serving engine's own KV memory.

``kvpop.serving.paged`` is engine-agnostic (plain torch): it lays one request's state of one
layer out in one fixed-size page and runs :class:`kvpop.KVpopLayer` steps on a batch of such
pages. ``kvpop.serving.vllm`` is the vLLM plugin built on it (install ``kvpop[vllm]``).
"""
