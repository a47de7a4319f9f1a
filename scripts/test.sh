#!/usr/bin/env bash
# Run the test suite exactly as CI does: build/reuse the venv, then the tiers.
#   lint (first): ruff (pyproject.toml [tool.ruff.lint]), lint-imports (the import layering,
#       [tool.importlinter]), the citation check and the phone-install check (scripts/lint.sh, ~20 s);
#       `bash scripts/test.sh --lint-only` stops there;
#   unit + client (no engine), integration (real vLLM in-process) and e2e (real server on 127.0.0.1):
#       one pytest process;
#   kernels: their own pytest process with TRITON_INTERPRET=1 set before Triton is imported.
# Slow tests (soaks, benchmarks, training) and GPU tests are excluded. Extra pytest args (e.g. -x, -k NAME)
# go to both processes. A tier in which nothing passes fails (pytest's exit code 5 for "no tests ran",
# and HYCO_REQUIRE_PASSES=1 for "everything was skipped"; see tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
extra=("$@")
export HYCO_REQUIRE_PASSES=1
start=$SECONDS
echo "== tier: lint =="
PY="$PY" bash scripts/lint.sh
if [ "${1:-}" = "--lint-only" ]; then exit 0; fi
echo "== tier: unit + client + integration + e2e =="
"$PY" -m pytest -m "not kernels and not slow and not gpu" ${extra[@]+"${extra[@]}"} tests
echo "== tier: kernels (TRITON_INTERPRET=1) =="
TRITON_INTERPRET=1 "$PY" -m pytest -m "kernels and not slow and not gpu" ${extra[@]+"${extra[@]}"} tests/kernels
echo "== all tiers passed in $((SECONDS - start)) s =="
