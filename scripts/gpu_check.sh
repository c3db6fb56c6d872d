#!/usr/bin/env bash
# Issue #14's CUDA checks in one run on a machine with a CUDA GPU (kvpop.bench.gpu): parity of
# the cache on the GPU with the CPU, the FlexAttention target pass against the CPU fused pass
# and the references at 8k-32k, and decode steps of every row at 8k-32k (batch 1, then batch 32
# at 8k and 32k). Writes bench_gpu*.json/.png/.log under $OUT (default results/). About 9 min on
# one H200 (5.4 + 3.2 min).
#
#   bash scripts/gpu_check.sh
#
# A machine without this project's transformers can take it from wheels in .whl/ (not tracked).
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/bench_gpu_smi.txt"
python3 -m kvpop.cli bench gpu --out "$OUT/bench_gpu" 2>&1 | tee "$OUT/bench_gpu.log"
# then batch 32 at 8k and 32k (after the chunk path's CUDA layout fix, checked by its own parity rows)
python3 -m kvpop.cli bench gpu --parity streaming,kvpop-mlstm --sizes '' --contexts 8192,32768 --batch 32 \
  --rows floor,dense,dense-static,streaming,kvpop-mlstm,kvpop-mlstm+compile,kvpop-mlp+compile --out "$OUT/bench_gpu_batch32" \
  2>&1 | tee "$OUT/bench_gpu_batch32.log"
