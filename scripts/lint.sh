#!/usr/bin/env bash
# The lint tier (scripts/test.sh runs it first; any failure fails the build). About 20 s, most of it the
# phone-install check:
#   ruff check                      the rules of pyproject.toml [tool.ruff.lint] (pycodestyle, pyflakes, bugbear,
#                                   isort, pyupgrade, simplify);
#   lint-imports                    the import-layering contracts of pyproject.toml [tool.importlinter];
#   mypy                            the types of the engine-agnostic core, the wire, the engine contract and the
#                                   model seam (pyproject.toml [tool.mypy]: its paths, no untyped definitions);
#   scripts/check_file_sizes.py     no Python file over 500 lines;
#   scripts/check_citations.py      every path and symbol cited in code and docs exists, none outside the repo;
#   scripts/check_phone_install.sh  the phone package installs without vLLM, torch or fixture weights.
# Needs the project's venv on PATH (source scripts/setup_env.sh). HYCO_LINT_FAST=1 skips the phone install;
# HYCO_MYPY_CACHE=DIR moves mypy's cache (default: under $TMPDIR, never in the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
start=$SECONDS
echo "[lint] ruff"
ruff check --no-cache --quiet .
echo "[lint] import layering"
out=$(lint-imports --no-logo --no-cache 2>&1) || { echo "$out"; exit 1; }
echo "$out" | tail -n 1
echo "[lint] types"
# incremental, with its cache outside the checkout (HYCO_MYPY_CACHE): about 10 s cold, under 1 s warm
mypy --cache-dir "${HYCO_MYPY_CACHE:-${TMPDIR:-/tmp}/hyco-mypy-cache-$(id -u)}"
echo "[lint] file sizes"
"$PY" scripts/check_file_sizes.py
echo "[lint] citations"
"$PY" scripts/check_citations.py
if [ "${HYCO_LINT_FAST:-0}" != "1" ]; then
  echo "[lint] phone install"
  PYTHON="$PY" bash scripts/check_phone_install.sh
fi
echo "[lint] passed in $((SECONDS - start)) s"
