#!/usr/bin/env bash
# Settings sweep for the learned scorer: settings chosen by measurement, on the validation split only.
# Every run trains on the same first $CYCLE captured sequences of the store (fill it first with
# `kvpop train --capture-only`, see README), for $STEPS steps, and ends with retention under the real
# KVpopCache on validation windows of the training corpora (never the test split, never the held-out corpora).
# Usage: bash research/sweep.sh [NAME ...]   (no names: all runs; runs already finished are skipped)
# Two shells can split the list: bash research/sweep.sh base no_obs ... & bash research/sweep.sh wf25 ...
set -euo pipefail
cd "$(dirname "$0")/.."
STORE=${STORE:-runs/capture/smollm2-4096}
OUT=${OUT:-runs/sweep}
CYCLE=${CYCLE:-48}
STEPS=${STEPS:-144}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
COMMON="--store $STORE --cycle $CYCLE --steps $STEPS --val-every $STEPS --ckpt-every 24 --val-docs 6 --no-progress --extra-windows 128,512"
declare -A RUNS=(
  [base]="--kind mlp --budgets 512"
  [no_obs]="--kind mlp --budgets 512 --observed none"
  [no_posfree]="--kind mlp --budgets 512 --no-position-free"
  [no_tilt]="--kind mlp --budgets 512 --no-tilt"
  [uniform]="--kind mlp --budgets 512 --weighting uniform"
  [mse]="--kind mlp --budgets 512 --loss mse"
  [h16]="--kind mlp --budgets 512 --hidden 16"
  [h128]="--kind mlp --budgets 512 --hidden 128"
  [lam5e-4]="--kind mlp --budgets 512 --lam 0.0005"
  [wf25]="--kind mlp --budgets 512 --window-fraction 0.25"
  [multi]="--kind mlp --budgets 256,512,1024"
  [b1024_wf125]="--kind mlp --budgets 1024 --window-fraction 0.125"
  [b1024_wf25]="--kind mlp --budgets 1024 --window-fraction 0.25"
  [b1024_wf50]="--kind mlp --budgets 1024 --window-fraction 0.5"
  [mlstm]="--kind mlstm --budgets 512"
  [mlstm_multi]="--kind mlstm --budgets 256,512,1024"
)
ORDER=(base no_obs no_tilt no_posfree uniform wf25 mse multi mlstm h16 h128 lam5e-4 b1024_wf125 b1024_wf25 b1024_wf50 mlstm_multi)
mkdir -p "$OUT"  # each run's log is written beside its folder, before the run creates anything
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ORDER[@]}")
for name in "${names[@]}"; do
  args=${RUNS[$name]:?unknown run $name}
  if [ -f "$OUT/$name/summary.json" ]; then echo "[sweep] $name: done"; continue; fi
  echo "[sweep] $name: kvpop train $args"
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m kvpop.train --out "$OUT/$name" $args $COMMON > "$OUT/$name.log" 2>&1 || { echo "[sweep] $name failed (see $OUT/$name.log)"; continue; }
  echo "[sweep] $name: $(( $(date +%s) - start )) s"
done
