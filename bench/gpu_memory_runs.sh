#!/usr/bin/env bash
# Train-stage runs on one GPU whose measured peak memory checks dsflow's planner (dsflow.plan),
# at params.yaml's defaults (every fast path the GPU takes; ZeRO-0 with the fused optimizer
# unless a run sets ZeRO-2): MoE and dense, the `small` and `medium` presets, micro 16 and 8.
# Each run prints the planned reserved peak beside torch.cuda.max_memory_reserved; results
# land in $OUT (or ./out).
#   bash bench/gpu_memory_runs.sh
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
run() {  # name, then overlay YAML text
  local name=$1; shift
  printf '%s\n' "$@" > "/tmp/$name.yaml"
  rm -rf checkpoints models/final dvclive metrics/train.json
  python3 -m dsflow --profile /tmp/gpu-memory-base.yaml --profile "/tmp/$name.yaml" train \
    > "$out/$name.log" 2>&1 || { echo "$name failed"; tail -20 "$out/$name.log"; return; }
  cp metrics/train.json "$out/$name.json"
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
alloc, rsv = m["peak_memory_gb_per_rank"][0], m["peak_reserved_gb_per_rank"][0]
plan = m["planned_reserved_gb"]
print(f"{sys.argv[2]:<22} alloc {alloc:6.2f} GB  reserved {rsv:6.2f} GB  planned {plan:6.2f} GB "
      f"({100 * (plan / rsv - 1):+.1f}%)")
PY
}
# One GPU in bf16, the `small` preset at seq 1024 x micro 16 unless a run says otherwise.
cat > /tmp/gpu-memory-base.yaml <<'YAML'
model:
  preset: small
train:
  device: cuda
  gpus: 1
  precision: bf16
  seq_len: 1024
  micro_batch: 16
  grad_accum: 1
YAML
# Memory needs no long run: 14 steps, no checkpoint before the end.
short='train:
  max_steps: 14
  eval_every: 14
  eval_batches: 2
  checkpoint_every: 1000'
medium='model:
  preset: medium'
medium_dense='model:
  preset: medium
  overrides: {first_k_dense_replace: 16}'
run small-moe-m16-z0 "$short"
run medium-moe-m16-z0 "$medium" "$short"
run medium-dense-m16-z0 "$medium_dense" "$short"
run small-moe-m16-z2 "$short" '  zero_stage: 2'
run medium-moe-m8-z2 "$medium" "$short" '  zero_stage: 2' '  micro_batch: 8'
run small-dense-m16-z0 'model:
  overrides: {first_k_dense_replace: 16}' "$short"
run small-moe-m8-z0 "$short" '  micro_batch: 8'
run medium-dense-m8-z2 "$medium_dense" "$short" '  zero_stage: 2' '  micro_batch: 8'
