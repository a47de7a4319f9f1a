#!/usr/bin/env bash
# The lint tier (seconds; scripts/test.sh runs it first and stops on a failure):
#   ruff check            the rules in pyproject.toml [tool.ruff.lint] (unused imports/variables, redefinitions,
#                         bare excepts, mutable defaults);
#   lint-imports          the import layering contracts in pyproject.toml [tool.importlinter];
# Needs the project's venv on PATH (source scripts/setup_env.sh, or /work/.../env.sh in a worktree).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
echo "[lint] ruff"
ruff check --no-cache --quiet .
echo "[lint] import layering"
out=$(lint-imports --no-logo --no-cache 2>&1) || { echo "$out"; exit 1; }
echo "$out" | tail -n 1
