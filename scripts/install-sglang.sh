#!/usr/bin/env bash
# Installs real SGLang (CPU) into .venv-sglang for the SGLang backend's end-to-end tests and benchmark,
# with kvdepot (editable) beside it. Idempotent: a no-op when nothing it depends on changed.
#
# SGLang's own metadata pulls CUDA-only kernels and another torch, so its pinned pure-Python
# dependencies are installed with --no-deps (tests/e2e/sglang/requirements.txt), and five import-time
# shims make it run on a CPU-only torch (tests/e2e/sglang/README.md says what each does and why). The
# shims go into the venv only, loaded by one .pth file; no file of SGLang is changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVDEPOT_SGLANG_VENV:-.venv-sglang}
here=tests/e2e/sglang
stamp=$VENV/.kvdepot-sglang-installed

# SGLang JIT-compiles its page hasher with g++ against OpenSSL on first use.
if ! command -v g++ >/dev/null || [ ! -f /usr/include/openssl/sha.h ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ libssl-dev >/dev/null
    else
        echo "SGLang needs g++ and libssl-dev (OpenSSL headers): install them" >&2
        exit 1
    fi
fi

if [ -f "$stamp" ] && [ "$stamp" -nt "$here/requirements.txt" ] && [ "$stamp" -nt scripts/install-sglang.sh ] \
    && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/share_packages.py ] && [ -z "$(find "$here/shim" -newer "$stamp" -type f | head -1)" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip >/dev/null
sp=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# torch, triton and ~90 other pins are the very versions .venv holds: hard-link them rather than hold
# ~1.9 GB twice (a CI machine's disk ran out here). pip then sees them installed and skips them.
if [ -x .venv/bin/python ]; then
    .venv/bin/python scripts/share_packages.py "$sp" "$here/requirements.txt" 'torch==2.13.0'
fi
"${pip[@]}" install -q 'torch==2.13.0'
"$VENV/bin/python" -c 'import sys, torch; sys.exit(f"torch {torch.__version__} is a CUDA build; a CPU build is needed" if torch.version.cuda else 0)'
"${pip[@]}" install -q --no-deps -r "$here/requirements.txt"

rm -rf "$sp/kvdepot_sglang_cpu_shim"
cp -r "$here/shim" "$sp/kvdepot_sglang_cpu_shim"
printf '%s\n' "$sp/kvdepot_sglang_cpu_shim" "import _tv_cpu_shim, sglang_cpu_hooks" >"$sp/kvdepot_sglang_cpu_shim.pth"

# kvdepot's own dependencies, without moving torch or any of SGLang's pins.
"${pip[@]}" freeze --exclude-editable >"$VENV/sglang-constraints.txt"
"${pip[@]}" install -q -c "$VENV/sglang-constraints.txt" -e .

# Fail here, not in the tests, if the result cannot be imported.
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
    "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.mem_cache.pool_host.mha as m, kvdepot.connectors.sglang as k; assert hasattr(m, 'transfer_kv_direct'); k.KVDepotHiCacheStorage"
touch "$stamp"
echo "install-sglang.sh: SGLang $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))') ready in $VENV"
