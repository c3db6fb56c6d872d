"""scripts/rehash_scorers.py: a Qwen folder that recorded the default model's scorer hashes records Qwen's
shipped scorers afterwards (and its alias with them); an entry with a --scorer path is left alone."""

import importlib.util
import json
from pathlib import Path

from kvpop.checkpoint import ASSETS, DEFAULT_SCORERS
from kvpop.evaluate.harness import file_sha256
from kvpop.testing import embedded_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rehash_scorers.py"


def _module():
    spec = importlib.util.spec_from_file_location("rehash_scorers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_qwen_folder_gets_qwen_scorer_hashes(tmp_path):
    model = tmp_path / "qwen"
    embedded_config("qwen2.5-coder-0.5b").save_pretrained(model)
    old_mlp, old_mlstm = (file_sha256(DEFAULT_SCORERS[k]) for k in ("mlp", "mlstm"))
    kw = {
        "kvpop": {"sha256": old_mlp},
        "kvpop-mlp": {"sha256": old_mlp},
        "kvpop-mlstm": {"path": "runs/x.safetensors", "sha256": old_mlstm},
    }
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"fingerprint": {"model": str(model), "policy_kwargs": kw}}))
    rehash = _module().rehash_folder
    assert rehash(folder) == ["kvpop-mlp"]
    got = json.loads((folder / "run.json").read_text())["fingerprint"]["policy_kwargs"]
    qwen_mlp = file_sha256(ASSETS / "qwen2.5-coder-0.5b-mlp.safetensors")
    assert got["kvpop-mlp"] == got["kvpop"] == {"sha256": qwen_mlp}
    assert got["kvpop-mlstm"] == kw["kvpop-mlstm"]
    assert rehash(folder) == []
