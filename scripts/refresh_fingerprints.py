"""Add fingerprint fields the shipped files predate, metadata only.

    python scripts/refresh_fingerprints.py [--check]

When ``kvpop.checkpoint.model_fingerprint`` gains a field, the shipped scorers
(``src/kvpop/assets/scorers/*.safetensors``) and the shipped adapter bundle's ``kvpop_adapter.json``
record only the old ones (which still match: a field a checkpoint lacks is not a mismatch). This
computes the embedded model's fingerprint, checks that every field a file records equals it (else
it stops: the file is for another model), adds the missing fields, and rewrites only the metadata:
a scorer file is rewritten with the same tensors (verified bit-identical after the write), the
bundle's JSON in place. The bundle's own ``scorer.safetensors`` is left untouched (its bytes key
``kvpop compare-adapted`` results). ``--check`` only reports what would change.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvpop.bundle import ADAPTER_META_FILE
from kvpop.checkpoint import DEFAULT_ADAPTER, DEFAULT_SCORERS, atomic_write, model_fingerprint
from kvpop.models import load_model


def _merged(path, recorded: dict, now: dict) -> dict:
    differ = {
        k: (v, now[k])
        for k, v in recorded.items()
        if k in now and json.dumps(v, sort_keys=True) != json.dumps(now[k], sort_keys=True)
    }
    if differ:
        sys.exit(f"{path}: recorded fingerprint fields differ from the embedded model's ({differ}); not touching it")
    return {**recorded, **{k: v for k, v in now.items() if k not in recorded}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="report only")
    args = p.parse_args()
    model, _ = load_model(progress=False)
    now = model_fingerprint(model)
    for path in DEFAULT_SCORERS.values():
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        header = json.loads(meta["kvpop"])
        recorded = header.get("meta", {}).get("fingerprint") or {}
        new = _merged(path, recorded, now)
        added = sorted(set(new) - set(recorded))
        print(f"{path.name}: adds {added or 'nothing'}")
        if not added or args.check:
            continue
        header["meta"]["fingerprint"] = new
        meta["kvpop"] = json.dumps(header)
        atomic_write(path, lambda tmp, tensors=tensors, meta=meta: save_file(tensors, tmp, metadata=meta))
        with safe_open(str(path), framework="pt") as f:
            assert sorted(f.keys()) == sorted(tensors)
            for k, want in tensors.items():
                got = f.get_tensor(k)
                assert got.dtype == want.dtype and torch.equal(
                    got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
                ), k
        print(f"  rewritten; {len(tensors)} tensors verified bit-identical")
    meta_file = DEFAULT_ADAPTER / ADAPTER_META_FILE
    header = json.loads(meta_file.read_text(encoding="utf-8"))
    recorded = header.get("fingerprint") or {}
    new = _merged(meta_file, recorded, now)
    added = sorted(set(new) - set(recorded))
    print(f"{meta_file.name}: adds {added or 'nothing'}")
    if added and not args.check:
        header["fingerprint"] = new
        text = json.dumps(header, indent=2) + "\n"  # the file's own key order: a diff of the new fields only
        atomic_write(meta_file, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


if __name__ == "__main__":
    main()
