#!/usr/bin/env bash
# The GPU tests, then `kvdepot bench gpu`, on a machine with an NVIDIA GPU and torch with CUDA. Needs
# nothing but this repository and that torch: kvdepot's own dependencies come from the environment, or
# from wheels in .whl/ where it lacks them (scripts/gpu-wheels.sh fetches those where pip works).
#
#   bash scripts/test-gpu.sh                   # the tests marked gpu, and the benchmark
#   bash scripts/test-gpu.sh --no-bench        # the tests only
#   bash scripts/test-gpu.sh --json out.json   # arguments after the flag go to `kvdepot bench gpu`
#   bash scripts/test-gpu.sh --diagnose        # also the benchmarks that take the paths apart (mover, host memory)
#   bash scripts/test-gpu.sh --connector       # also the vLLM connector's worker half on CUDA (below)
#
# KVDEPOT_REQUIRE_GPU=1: a test marked gpu is never skipped for want of CUDA here: it runs, and fails.
# --connector: the vLLM connector's worker half on CUDA too (tests/e2e/test_connector_device.py, its CUDA
# cases), with vLLM where it is installed, else with vLLM's two metadata base classes stood in (the
# worker half imports nothing else of vLLM; tests/support/vllm_bases.py). Not yet in the default run:
# it has not run on a GPU (README, "What has run where").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bench=1
diagnose=0
tests=(tests/gpu tests/unit/test_gpu_paged.py)
while [ $# -gt 0 ]; do
    case "$1" in
        --no-bench) bench=0 ;;
        --diagnose) diagnose=1 ;;
        --connector) tests+=(tests/e2e/test_connector_device.py) ;;
        *) break ;;
    esac
    shift
done

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "test-gpu: this needs torch with CUDA and an NVIDIA GPU ($PY)" >&2
    exit 1
fi
if ! "$PY" -c 'import zmq, msgspec, blake3, fastapi, uvicorn, xxhash, sortedcontainers, prometheus_client, numpy' 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "test-gpu: kvdepot's dependencies are missing and there is no .whl/ (run scripts/gpu-wheels.sh where pip works)" >&2
        exit 1
    fi
    site=${TMPDIR:-/tmp}/kvdepot-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export KVDEPOT_REQUIRE_GPU=1
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"test-gpu: {p.name}, torch {torch.__version__}, CUDA {torch.version.cuda}")'

"$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="-ra --strict-markers" "${tests[@]}"
if [ "$bench" = 1 ]; then
    "$PY" -m kvdepot.cli bench gpu "$@"
fi
if [ "$diagnose" = 1 ]; then
    "$PY" benchmarks/gpu_mover.py
    "$PY" benchmarks/gpu_host_memory.py
fi
