"""Every evaluation corpus the setup installs has documents in each split."""

import pytest

from kvpop import data
from kvpop.data import CorpusNotFoundError

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", list(data.EVALUATION_CORPORA))
def test_real_corpus_splits(name):
    try:
        stats = data.corpus_stats(name)
    except CorpusNotFoundError:  # pragma: no cover - corpus_stats reports instead of raising
        stats = {"available": False}
    if not stats["available"]:
        pytest.skip(f"{name} not installed: {data.CORPORA[name].install}")
    for split in data.SPLITS:
        assert stats["splits"][split]["documents"] > 0, (name, split)
        assert stats["splits"][split]["characters"] > 0, (name, split)
