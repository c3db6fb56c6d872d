"""Shared pytest setup for kvpop.

- Forces offline Hugging Face access for the whole test session (nothing may download).
- Fixture ``kvpop_cache``: points ``KVPOP_CACHE_DIR`` at a fresh temp dir and returns it
  (use it in any test that converts a GGUF, so the user's cache is never touched).
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def kvpop_cache(tmp_path, monkeypatch):
    """A fresh, empty kvpop cache dir (``KVPOP_CACHE_DIR``) for this test."""
    cache = tmp_path / "kvpop-cache"
    monkeypatch.setenv("KVPOP_CACHE_DIR", str(cache))
    return cache
