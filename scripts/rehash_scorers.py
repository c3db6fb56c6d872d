"""Record the right scorer hashes in ``kvpop eval`` / ``kvpop eval tasks`` folders of a non-default model.

Until this release the fingerprint of an evaluation folder hashed the *default* model's shipped scorer
for a learned policy given no ``--scorer``, although the policy ran the scorer shipped for the model
evaluated (on Qwen2.5-Coder-0.5B, Qwen's). Such a folder is refused on resume now (its recorded hash is
not that of the file the policy reads). This rewrites the hash of every learned policy recorded without
a path to the one of the scorer shipped for the folder's model, read from its ``run.json``:

    python scripts/rehash_scorers.py results/qwen/tasks-ruler results/qwen/grid4k-learned

Only do this for folders whose records were made with the scorer shipped now (the shipped file did not
change since); ``run.json`` is replaced atomically.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpop.evaluate.harness import file_sha256, shipped_scorer_file
from kvpop.files import atomic_write
from kvpop.policies import ALIAS, KIND_TO_POLICY


def rehash_folder(folder: Path) -> list[str]:
    """Rewrite ``folder/run.json``; returns the policies whose hash changed."""
    from transformers import AutoConfig

    run = folder / "run.json"
    if not run.is_file():
        raise SystemExit(f"{folder}: no run.json (not a kvpop eval output folder)")
    doc = json.loads(run.read_text())
    fp = doc.get("fingerprint", doc)
    config = AutoConfig.from_pretrained(fp["model"], local_files_only=True)
    kw = fp.get("policy_kwargs") or {}
    changed = []
    for kind, policy in KIND_TO_POLICY.items():
        entry = kw.get(policy)
        if not isinstance(entry, dict) or "path" in entry or "sha256" not in entry:
            continue
        path = shipped_scorer_file(config, kind)
        if path is None:
            continue
        digest = file_sha256(path)
        if entry["sha256"] != digest:
            for name in (policy, ALIAS):
                if kw.get(name) == entry:
                    kw[name] = {**entry, "sha256": digest}
            changed.append(policy)
    if changed:
        atomic_write(run, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1) + "\n"))
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    args = p.parse_args(argv)
    for folder in args.folders:
        changed = rehash_folder(folder)
        print(f"{folder}: {', '.join(changed) if changed else 'already right'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
