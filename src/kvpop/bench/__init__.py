"""Micro-benchmarks (``kvpop bench ...``)."""
