#!/usr/bin/env bash
# Fetch, where pip works, the wheels of kvdepot's dependencies that a GPU machine without a package
# index may lack, into .whl/ (git-ignored), for scripts/test-gpu.sh to install there. The versions are
# the ones installed in .venv (run scripts/setup.sh first); the platform is the GPU machine's
# (CPython 3.12, manylinux x86_64, by default; PY_VERSION=3.11 for another).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
PACKAGES=(pyzmq msgspec blake3 fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn)
[ -x .venv/bin/python ] || { echo "no .venv: run scripts/setup.sh first (the versions come from it)" >&2; exit 1; }
mkdir -p .whl
for name in "${PACKAGES[@]}"; do
    version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name==$version" ||
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
        --platform any -d .whl "$name==$version"
done
ls .whl
