#!/usr/bin/env bash
# Installs the Debian packages dsr1d's set-up, tests and demo need; skips those already there.
set -euo pipefail
PACKAGES=(python3 python3-venv python3-dev gcc g++ cmake make man-db pkg-config libsystemd-dev dbus dbus-daemon systemd debootstrap systemd-container linux-cpupower curl patch)
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "dsr1d set-up: missing Debian packages (${missing[*]}); run as root to install them" >&2
    exit 1
fi
echo "dsr1d set-up: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
