"""Shared pytest setup for kvpop.

- Forces offline Hugging Face access for the whole test session (nothing may download).
- One torch thread (``KVPOP_TEST_THREADS`` overrides).
- Caches run their decode step eagerly unless a test asks for ``compile=True`` (``KVPOP_COMPILE=0``:
  compiling every tiny shape a test makes would take most of the suite's time; the compiled path
  has its own tests, and tests/unit/test_fused.py checks that the default compiles).
- ``tests/unit/``: tiny random-weight models, seconds each; ``tests/integration/``: the real embedded models
  (every test there is marked ``integration``, so ``-m "not integration"`` runs the unit tests alone).
- Fixture ``kvpop_cache``: points ``KVPOP_CACHE_DIR`` at a fresh temp dir and returns it
  (use it in any test that converts a GGUF, so the user's cache is never touched).
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("KVPOP_COMPILE", "0")
# Tests run tiny tensors: one intra-op thread avoids OpenMP spin overhead (and contention on shared CI cores).
torch.set_num_threads(int(os.environ.get("KVPOP_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration/ carries the ``integration`` marker."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def kvpop_cache(tmp_path, monkeypatch):
    """A fresh, empty kvpop cache dir (``KVPOP_CACHE_DIR``) for this test."""
    cache = tmp_path / "kvpop-cache"
    monkeypatch.setenv("KVPOP_CACHE_DIR", str(cache))
    return cache
