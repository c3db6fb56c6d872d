"""scripts/rename_policy.py: a folder that names the mLSTM ``kvpop`` reads as ``kvpop-mlstm`` afterwards, and a
folder that already holds the new name is refused before anything is rewritten."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rename_policy.py"


def _module():
    spec = importlib.util.spec_from_file_location("rename_policy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _folder(root: Path, policies: list[str]) -> Path:
    (root / "records").mkdir(parents=True)
    fp = {"fingerprint": {"model": "m", "policy_kwargs": {"kvpop": {"sha256": "aa"}, "kvpop-mlp": {"sha256": "bb"}}}}
    (root / "run.json").write_text(json.dumps(fp))
    recs = [
        {"key": f"case/{i}|{p}|512", "item_id": f"case/{i}", "policy": p, "budget": 512} for i, p in enumerate(policies)
    ]
    (root / "records" / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (root / "sessions.jsonl").write_text(json.dumps({"policies": policies, "config": {"policies": policies}}) + "\n")
    return root


def test_renames_records_hashes_and_sessions(tmp_path):
    d = _folder(tmp_path / "run", ["dense", "kvpop", "kvpop-mlp"])
    assert _module().rename_folder(d, "kvpop", "kvpop-mlstm") == 1
    recs = [json.loads(x) for x in (d / "records" / "main.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in recs] == ["dense", "kvpop-mlstm", "kvpop-mlp"]
    assert recs[1]["key"] == "case/1|kvpop-mlstm|512"
    kw = json.loads((d / "run.json").read_text())["fingerprint"]["policy_kwargs"]
    assert kw == {"kvpop-mlstm": {"sha256": "aa"}, "kvpop-mlp": {"sha256": "bb"}}
    s = json.loads((d / "sessions.jsonl").read_text())
    assert s["policies"] == s["config"]["policies"] == ["dense", "kvpop-mlstm", "kvpop-mlp"]


def test_refuses_a_folder_that_has_the_new_name(tmp_path):
    d = _folder(tmp_path / "run", ["kvpop", "kvpop-mlstm"])
    before = (d / "records" / "main.jsonl").read_text()
    with pytest.raises(SystemExit, match="already holds"):
        _module().rename_folder(d, "kvpop", "kvpop-mlstm")
    assert (d / "records" / "main.jsonl").read_text() == before
