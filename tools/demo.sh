#!/usr/bin/env bash
# The README's run command: what dsr1d sees on this machine, then a profile applied, verified
# and restored for real. Every knob is put back even if a step fails.
set -euo pipefail
DSR1D=${DSR1D:-.venv/bin/dsr1d}
step() { printf '\n\033[1m$ dsr1d %s\033[0m\n' "$*"; "$DSR1D" "$@"; }
trap '"$DSR1D" restore >/dev/null 2>&1 || true' EXIT
step probe
step list
step apply sustained --dry-run
step apply sustained
step verify
step restore
