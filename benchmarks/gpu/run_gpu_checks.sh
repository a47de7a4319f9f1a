#!/usr/bin/env bash
# Prepared GPU check of what the engine launches (torch + Triton, no vLLM needed); at most 7.5 minutes, the
# sum of the step timeouts below (each step keeps its partial results when it times out):
#   1. tests/kernels/test_kernels_tree_rows.py (+ test_kernels_mla_tree.py) compiled: the engine's tree-rows function,
#      the MLA tree kernel on DeepSeek's latent layout, compaction and the
#      int8 hand-off gather through vllm_adapter/tree_step (needs pytest; skipped without), 100 s cap;
#   2. benchmarks/gpu/gpu_checks.py: the engine's variants on vLLM's default Triton cache layout (bf16,
#      sliding 256 / full 512 with 8 query heads per KV head, separate K and V, with and without key splits),
#      30-layer compaction, the hand-off quantizer, the decision at 262,144 tokens, and the synthetic
#      32-tree x 30-layer step timed (attention, decision, compaction, hand-off), 270 s cap;
#   3. benchmarks/bench_verify_host.py: bytes device->host and host ms per step, before and after, 80 s cap.
# Run from anywhere:  bash benchmarks/gpu/run_gpu_checks.sh            (a GPU machine)
#                     bash benchmarks/gpu/run_gpu_checks.sh --dry-run  (CPU: TRITON_INTERPRET=1, tiny shapes)
# Results go to $OUT (set by the device tool) or benchmarks/out/gpu; commit them under
# benchmarks/results/<gpu name>/ (see docs/kernels.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }

{ nvidia-smi 2>/dev/null || echo "no nvidia-smi"; "$PY" -c "import torch, triton; print('torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; } \
  > "$OUT/env.txt" 2>&1
log "env: $(tail -1 "$OUT/env.txt") dry_run=$DRY"

if "$PY" -c "import pytest" 2>/dev/null; then
  K=""; [ "$DRY" = 1 ] && K="-k compaction or handoff"
  timeout "${TREE_ROWS_S:-100}" "$PY" -u -m pytest tests/kernels/test_kernels_tree_rows.py \
    tests/kernels/test_kernels_mla_tree.py -q -p no:cacheprovider \
    ${K:+"$K"} --junitxml="$OUT/pytest_tree_rows.xml" > "$OUT/pytest_tree_rows.txt" 2>&1
  log "pytest tree_rows rc=$? ($(tail -1 "$OUT/pytest_tree_rows.txt"))"
else
  log "pytest not installed: tree_rows tests skipped (gpu_checks.py still runs)"
fi

SMOKE=""; [ "$DRY" = 1 ] && SMOKE="--smoke"
timeout "${CHECKS_S:-270}" "$PY" -u benchmarks/gpu/gpu_checks.py $SMOKE --out "$OUT/gpu_checks.json" \
  > "$OUT/gpu_checks.txt" 2>&1
log "gpu_checks rc=$? ($(tail -1 "$OUT/gpu_checks.txt"))"

BENCH=""; [ "$DRY" = 1 ] && BENCH="--trees 3 --vocab 4096 --reps 1"
timeout "${BENCH_S:-80}" "$PY" -u benchmarks/bench_verify_host.py $BENCH > "$OUT/bench_verify_host.txt" 2>&1
log "bench_verify_host rc=$? ($(tail -2 "$OUT/bench_verify_host.txt" | head -1))"
cp benchmarks/out/bench_verify_host.json "$OUT/" 2>/dev/null || true
