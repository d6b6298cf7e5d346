#!/usr/bin/env bash
# Command 1: install, then run a kvdepot server on embedded defaults with a short demo workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvdepot demo "$@"
