#!/usr/bin/env bash
# Command 1: install what the demo needs (one line per step; installers' output in .kvdepot/install.log),
# then show a real vLLM engine (CPU) skipping prefill through kvdepot: `kvdepot demo`.
# `bash scripts/demo.sh --synthetic` runs the engine-free workload instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/kvdepot demo "$@"
