"""scripts/rehash_scorers.py: when a scorer for other budgets ships beside a model's default, an earlier
evaluation folder keeps the records the default still serves, sets the others aside, and records the
hash of today's set (so it resumes, and the rerun computes exactly the records set aside)."""

import importlib.util
import json
from pathlib import Path

import torch

from kvpop import checkpoint
from kvpop.evaluate.harness import content_kwargs, file_sha256, shipped_scorers_sha256
from kvpop.evaluate.store import check_fingerprint
from kvpop.scorers import ScorerConfig, build_scorer
from kvpop.testing import tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rehash_scorers.py"


def _module():
    spec = importlib.util.spec_from_file_location("rehash_scorers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ship(assets, name, model, budget_range, seed):
    torch.manual_seed(seed)
    meta = {
        "fingerprint": checkpoint.model_fingerprint(model),
        "trained_for": {"budget_range": list(budget_range), "window_fraction": 0.5},
    }
    cfg = ScorerConfig(kind="mlp", num_layers=2, kv_heads=2, head_dim=16)
    return checkpoint.save_scorer(build_scorer(cfg), assets / f"{name}.safetensors", meta)


def test_a_folder_keeps_the_records_the_default_still_serves(tmp_path, monkeypatch):
    model = tiny_model("qwen2")
    model.config.save_pretrained(tmp_path / "model")
    assets = tmp_path / "assets"
    assets.mkdir()
    monkeypatch.setattr(checkpoint, "ASSETS", assets)
    main = _ship(assets, "tiny-qwen2-mlp", model, (64, 4096), 0)
    before = content_kwargs(model, None)
    assert before["kvpop-mlp"] == {"sha256": file_sha256(main)}
    folder = tmp_path / "eval"
    (folder / "records").mkdir(parents=True)
    fp = {"model": str(tmp_path / "model"), "policy_kwargs": before}
    (folder / "run.json").write_text(json.dumps({"fingerprint": fp}))

    def rec(policy, budget):
        r = {"key": f"x|{policy}|{budget}", "policy": policy, "budget": budget}
        return {**r, "scorer": str(main)} if policy == "kvpop-mlp" else r

    lines = [rec("kvpop-mlp", 100), rec("kvpop-mlp", 32), rec("h2o", 32), rec("kvpop-mlstm", 32)]
    (folder / "records" / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rehash = _module().rehash_folder
    assert rehash(folder) == {}  # nothing shipped beside the default: the folder is right as it is

    _ship(assets, "tiny-qwen2-mlp-b24-48", model, (24, 48), 1)
    now = content_kwargs(model, None)
    assert now["kvpop-mlp"] == now["kvpop"] == {"sha256": shipped_scorers_sha256(model.config, "mlp")}
    assert now["kvpop-mlp"] != before["kvpop-mlp"]
    assert rehash(folder) == {"kvpop-mlp": 1}
    kept = [json.loads(x) for x in (folder / "records" / "main.jsonl").read_text().splitlines()]
    aside = [json.loads(x) for x in (folder / "records" / "stale" / "main.jsonl").read_text().splitlines()]
    assert [r["key"] for r in kept] == ["x|kvpop-mlp|100", "x|h2o|32", "x|kvpop-mlstm|32"]
    assert [r["key"] for r in aside] == ["x|kvpop-mlp|32"]  # B = 32 reads the new scorer now
    fp_now = json.loads((folder / "run.json").read_text())["fingerprint"]
    assert fp_now["policy_kwargs"]["kvpop-mlp"] == fp_now["policy_kwargs"]["kvpop"] == now["kvpop-mlp"]
    assert check_fingerprint(folder, {**fp, "policy_kwargs": now}) is not None  # it resumes under today's set
    assert rehash(folder) == {}
    # a folder made with a scorer that no longer ships stays the record of that scorer
    gone = {"kvpop-mlp": {"sha256": "0" * 64}}
    (folder / "run.json").write_text(json.dumps({"fingerprint": {**fp, "policy_kwargs": gone}}))
    assert rehash(folder) == {}
    assert json.loads((folder / "run.json").read_text())["fingerprint"]["policy_kwargs"] == gone
