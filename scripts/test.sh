#!/usr/bin/env bash
# Run the test suite exactly as CI does: build/reuse the venv, then the tiers.
#   tier 1 unit (no engine) + tier 3 integration (real vLLM in-process) + tier 4 e2e (real server):
#       one pytest process;
#   tier 2 kernels: their own pytest process with TRITON_INTERPRET=1 set before Triton is imported.
# Slow tests (soaks, benchmarks, training) and GPU tests are excluded; pass extra pytest args after --.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
extra=("$@")
echo "== tier: unit + integration + e2e =="
"$PY" -m pytest -m "not kernels and not slow and not gpu" "${extra[@]}" tests
echo "== tier: kernels (TRITON_INTERPRET=1) =="
TRITON_INTERPRET=1 "$PY" -m pytest -m "kernels and not slow and not gpu" "${extra[@]}" tests/kernels
