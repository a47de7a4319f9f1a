#!/usr/bin/env bash
# The demo, end to end on CPU, in one command on a fresh machine:
#   1. build (or reuse) the venv                      scripts/setup_env.sh
#   2. build (or reuse) the tiny Gemma-4 fixtures     python -m hyco_lab.fixtures (cached under $HYCO_CACHE)
#   3. start `vllm-hyco serve DIR/verifier --speculative-config '{"method": "hyco", "model": DIR/assistant,
#      "num_speculative_tokens": 4}'` on 127.0.0.1: an MTP deployment's spec with "mtp" changed to "hyco"
#   4. stream one chat completion with the official openai client (scripts/demo_chat.py): an ordinary
#      request, drafted by vLLM's MTP with the assistant (the server's log shows vLLM's acceptance counters)
#   5. run one whole HyCo session with `hyco-phone` (the phone's MTP head + SLM drafting trees, the server
#      verifying them over WS /v1/hyco/session): the answer streams, one statistics line per round
#   6. stop the server (by PID)
# The fixture family is a tiny model trained on Genesis 1-25 (docs/fixtures.md): the chat asks it for a
# verse, the phone session continues the opening words of Genesis 22:13 as a plain completion, both greedy
# (temperature 0: its most fluent setting; at T = 1 its answers drift between verses). The settings are
# printed before each answer.
# HYCO_DEMO_PORT (default 8011) picks the port; HYCO_DEMO_PROMPT, HYCO_DEMO_MAX_TOKENS (64) and
# HYCO_DEMO_TEMPERATURE (0) the phone session's request; the server log goes to $HYCO_CACHE/demo-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
port=${HYCO_DEMO_PORT:-8011}
mkdir -p "$HYCO_CACHE"
log="$HYCO_CACHE/demo-server.log"

echo "[demo] fixtures (first time: a few seconds)"
fixtures=$("$PY" -c 'import sys; from hyco_lab.fixtures import ensure_fixtures; print(ensure_fixtures(sys.argv[1]).root)' "$HYCO_CACHE")

spec="{\"method\": \"hyco\", \"model\": \"$fixtures/assistant\", \"num_speculative_tokens\": 4}"
echo "[demo] starting vllm-hyco serve $fixtures/verifier --speculative-config '$spec' (log: $log)"
"$HYCO_VENV/bin/vllm-hyco" serve "$fixtures/verifier" --host 127.0.0.1 --port "$port" \
  --served-model-name hyco-tiny --dtype float32 --max-model-len 2048 --max-num-seqs 4 \
  --enforce-eager --distributed-executor-backend uni --speculative-config "$spec" >"$log" 2>&1 &
server=$!
# --dtype float32: vLLM's CPU attention then keeps the KV layout the plugin verified on every x86 host (in
# bf16 an AMX host selects its 'amx' layout, which the plugin refuses with a clear error; docs/deploy.md)
stop() { kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap stop EXIT

for _ in $(seq 1 300); do
  if ! kill -0 "$server" 2>/dev/null; then echo "[demo] server exited; last log lines:"; tail -30 "$log"; exit 1; fi
  if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
       "http://127.0.0.1:$port/health" 2>/dev/null; then break; fi
  sleep 1
done
"$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "http://127.0.0.1:$port/health" \
  || { echo "[demo] server not healthy after 300 s; last log lines:"; tail -30 "$log"; exit 1; }

echo "[demo] server up; streaming a chat completion"
"$PY" scripts/demo_chat.py --base-url "http://127.0.0.1:$port/v1" --model hyco-tiny
echo
phone_prompt=${HYCO_DEMO_PROMPT:-And Abraham lifted up his eyes,}
phone_max=${HYCO_DEMO_MAX_TOKENS:-64}
phone_t=${HYCO_DEMO_TEMPERATURE:-0}
echo "[demo] a HyCo phone session: hyco-phone drafts trees, the server verifies them (stats per round on stderr)"
phone_mode=""
if [ "$phone_t" = 0 ]; then phone_mode=" (greedy)"; fi
echo "[demo] phone sampling: temperature $phone_t$phone_mode, exact verification, max_tokens $phone_max;" \
  "completion prompt: $phone_prompt"
"$HYCO_VENV/bin/hyco-phone" --server "http://127.0.0.1:$port" --model-dir "$fixtures" --model-name hyco-tiny \
  --prompt "$phone_prompt" --max-tokens "$phone_max" --temperature "$phone_t"
echo "[demo] stopping the server"
