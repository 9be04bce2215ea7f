#!/usr/bin/env bash
# Train-stage runs on one GPU whose measured peak memory checks dsflow's planner (dsflow.plan):
# dense vs MoE, two micro batches, plus the `small` preset run. Results land in $OUT (or ./out).
#   bash bench/gpu_memory_runs.sh
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
run() {  # name, then overlay YAML text
  local name=$1; shift
  printf '%s\n' "$@" > "/tmp/$name.yaml"
  rm -rf checkpoints models/final dvclive metrics/train.json
  python3 -m dsflow --profile profiles/h200.yaml --profile "/tmp/$name.yaml" train \
    > "$out/$name.log" 2>&1 || { echo "$name failed"; tail -20 "$out/$name.log"; return; }
  cp metrics/train.json "$out/$name.json"
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<16} tok/s {m['tokens_per_s']:>9.0f}  MFU {100 * (m['mfu'] or 0):5.1f}%  "
      f"alloc {m['peak_memory_gb_per_rank'][0]:6.2f} GB  reserved {m['peak_reserved_gb_per_rank'][0]:6.2f} GB  "
      f"val {m['val_loss']:.3f}  wall {m['wall_s']:.0f}s")
PY
}
# The planner-accuracy table (docs/performance.md) is measured at ZeRO-2 with HF's experts:
# every run pins them, so it reproduces whatever the defaults are.
short='train:
  gpus: 1
  zero_stage: 2
  perf: {experts: hf}
  max_steps: 12
  eval_every: 12
  checkpoint_every: 12'
run small-moe-m16 'train:
  gpus: 1
  zero_stage: 2
  perf: {experts: hf}
  max_steps: 150
  eval_every: 50
  checkpoint_every: 150'
run small-moe-m8 "$short" '  micro_batch: 8'
run small-dense-m16 "$short" 'model:
  overrides: {first_k_dense_replace: 16}'
run medium-moe-m4 "$short" '  micro_batch: 4
model:
  preset: medium'
