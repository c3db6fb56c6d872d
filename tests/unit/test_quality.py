"""The one quality probe (kvpop.evaluate.quality): what lm and continuation score, that one forward under the cache
equals feeding it token by token, pooling, wins, and that train, adapt and eval call the same measurement."""

import math

import pytest
import torch

from kvpop import make_cache
from kvpop.compat import cache_kwargs
from kvpop.evaluate.quality import (
    DenseOutputs,
    Probe,
    Sums,
    compare,
    continuation_start,
    hidden_states,
    lm_start,
    score_document,
    sums_from_logits,
    tally,
    wins,
)
from kvpop.testing import tiny_model
from kvpop.train.quality import continuation_tokens

IDS = torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(0))  # more than one LM-head chunk


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_lm_and_continuation_score_the_documented_positions(model):
    dense = hidden_states(model, IDS)
    cache = make_cache(model, "knorm", budget=24, window=8, sinks=2)
    hidden = hidden_states(model, IDS, cache)
    doc = score_document(model, IDS, dense, hidden, 24)
    assert (doc.lm_from, doc.continuation_from) == (24, 300 - 1 - 300 // 16)
    assert doc.lm.n == 300 - 1 - 24 and doc.continuation.n == 300 // 16
    # the same numbers from the logits of the two forwards, position p predicting token p + 1
    with torch.no_grad():
        dl, pl = model.lm_head(dense).float(), model.lm_head(hidden).float()
    for got, lo in ((doc.lm, 24), (doc.continuation, doc.continuation_from)):
        want = sums_from_logits(dl[lo:299], pl[lo:299], IDS[lo + 1 :]).metrics()
        for k, v in got.metrics().items():
            assert v == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    assert doc.lm.kl > 1e-4  # eviction changed something (a random model can even gain)
    # a budget that leaves nothing to evict scores every position (the policy equals dense there)
    assert lm_start(300, 299) == 0 and lm_start(300, 298) == 298
    assert continuation_start(300, 1000) == 0


def test_one_forward_equals_token_by_token(model):
    ids = IDS[:90]
    dense = hidden_states(model, ids)
    one = score_document(
        model, ids, dense, hidden_states(model, ids, make_cache(model, "h2o", budget=24, window=8, sinks=2)), 24
    )
    cache = make_cache(model, "h2o", budget=24, window=8, sinks=2)
    with torch.no_grad():
        steps = torch.cat(
            [
                model.model(
                    input_ids=ids.view(1, -1)[:, i : i + 1], **cache_kwargs(cache), use_cache=True
                ).last_hidden_state[0]
                for i in range(90)
            ]
        )
    tok = score_document(model, ids, dense, steps, 24)
    assert one.lm.retention == pytest.approx(tok.lm.retention, rel=1e-5)
    assert one.continuation.kl == pytest.approx(tok.continuation.kl, rel=1e-4, abs=1e-9)


def test_probe_pools_documents_and_computes_each_reference_once(model):
    docs = [("a", IDS[:120]), ("b", IDS[120:260])]
    calls = []
    dense = DenseOutputs()

    def reference(ids):
        calls.append(ids.numel())
        return dense.get(model, ids)[0]

    probe = Probe(docs, reference)
    s = probe.score(model, "streaming", 32, sinks=2)
    t = probe.score(model, "knorm", 32, window=8, sinks=2)
    assert calls == [120, 140]  # once per document, shared by every policy and budget
    assert s.labels == ["a", "b"] and len(s.per_doc()) == 2
    pooled = Sums.pool(d.lm for d in t.docs)
    assert t.lm() == pooled and t.lm().n == (120 - 1 - 32) + (140 - 1 - 32)
    assert t.continuation().n == 120 // 16 + 140 // 16
    dense_run = probe.score(model, None, 0)  # the model itself against its own dense outputs
    assert dense_run.lm().retention == pytest.approx(1.0) and dense_run.lm().n == 119 + 139
    assert dense_run.lm(start=32).n == t.lm().n


def test_probe_shows_a_progress_bar_only_when_labelled(model, capsys):
    """Validation passes run for many minutes: a labelled score shows a bar over the documents."""
    probe = Probe([("a", IDS[:60]), ("b", IDS[60:120])], lambda ids: hidden_states(model, ids))
    probe.score(model, "streaming", 32, sinks=2)
    assert "validation B=32" not in capsys.readouterr().err
    probe.score(model, "streaming", 32, sinks=2, progress="validation B=32")
    err = capsys.readouterr().err
    assert "validation B=32" in err and "0/2" in err  # the bar knows how many documents


def test_wins_count_paired_documents_with_a_tolerance():
    assert wins([0.9, 0.8, 0.7], [0.8, 0.8 + 1e-12, 0.75]) == {"wins": 1, "losses": 1, "ties": 1, "n": 3}
    assert compare(1.0, None) is None and compare(float("nan"), 1.0) is None
    assert tally([1, None, -1, 0, 1]) == {"wins": 2, "losses": 1, "ties": 1, "n": 4}
    with pytest.raises(ValueError):
        wins([1.0], [1.0, 2.0])  # documents are paired


def test_sums_pool_exactly():
    a, b = Sums(2, 1.0, 2.0, 0.5, 1.0), Sums(3, 3.0, 3.0, 0.0, 3.0)
    assert Sums.pool([a, b]) == a.add(b) == Sums(5, 4.0, 5.0, 0.5, 4.0)
    assert Sums.pool([]).n == 0 and math.isnan(Sums().retention)


def test_training_validation_scores_one_continuation_prediction_fewer_than_eval():
    """kvpop train's validation has always scored the last S/16 - 1 predictions (kvpop eval: S/16); kept, so
    resumed runs and a --val-cache folder's StreamingLLM baseline compare the same positions."""
    assert continuation_tokens(4096) == 255 and continuation_start(4096, continuation_tokens(4096)) == 4096 - 256
