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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -e '.[test]'
    touch "$stamp"
fi
