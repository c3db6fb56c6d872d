"""Text corpora for training and evaluating KV-cache eviction, without internet.

Every corpus comes from files that an ordinary package client installs (pip or apt), so
experiments are reproducible offline. Splits are fixed *by document* from a hash of the
document id, so they are identical on every machine and Python version and no document
leaks from train into validation/test.

* :mod:`.base` -- documents, corpora, locating and reading files;
* one module per corpus: :mod:`.shakespeare`, :mod:`.paul_graham`, :mod:`.wikipedia`,
  :mod:`.python_docs`, :mod:`.python_code`, :mod:`.human_eval`, :mod:`.perl_docs`, :mod:`.git_docs`;
* :mod:`.corpora` -- the registry by name; :mod:`.splits` -- the fixed splits;
* :mod:`.user` -- the user's own texts (``--docs-from``);
* :mod:`.packing` -- packed sequences, evaluation documents, training and validation windows.
"""

from .base import Corpus, CorpusNotFoundError, Document
from .corpora import CORPORA, EVALUATION_CORPORA, corpus_stats, list_corpora, load_documents
from .packing import iter_packed, long_documents, round_robin_windows, training_windows
from .splits import SPLITS, split_documents, split_of
from .user import read_user_documents

__all__ = [
    "CORPORA",
    "EVALUATION_CORPORA",
    "SPLITS",
    "Corpus",
    "CorpusNotFoundError",
    "Document",
    "corpus_stats",
    "iter_packed",
    "list_corpora",
    "load_documents",
    "long_documents",
    "read_user_documents",
    "round_robin_windows",
    "split_documents",
    "split_of",
    "training_windows",
]
