#!/usr/bin/env bash
# Installs ggml (the PyPI package libggml-python, pinned below) the way this project needs it.
#
#   ggml/install.sh            native: built from the sdist for this CPU with llamafile sgemm and ggml's own
#                              threadpool instead of OpenMP (as upstream llama.cpp builds here; decode of F16
#                              models measured 37 vs 48 tokens/s with OpenMP) (default;
#                              ~30 s; matmul speed on par with upstream llama.cpp's own build)
#   ggml/install.sh prebuilt   the prebuilt wheel (AVX2 only, no llamafile sgemm: prefill 2-3x slower)
#   ggml/install.sh cuda       built from the sdist with CUDA (needs nvcc and cuBLAS)
#
# Source builds include ggml's RPC backend (-DGGML_RPC=ON): layers on another process or machine (--rpc,
# specee-rpc-server). The prebuilt wheel has no RPC backend.
#
# A marker file in the installed package records how it was built, so a second run is a no-op.
set -euo pipefail

GGML_VERSION="0.20.2.post1"
mode="${1:-native}"
py="${PYTHON:-python3}"

case "$mode" in
    native)   cmake_args="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=OFF -DGGML_RPC=ON" ;;
    cuda)     cmake_args="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=OFF -DGGML_RPC=ON -DGGML_CUDA=ON" ;;
    prebuilt) cmake_args="" ;;
    *) echo "usage: $0 [native|prebuilt|cuda]" >&2; exit 2 ;;
esac
# From-source builds leave out two instruction sets that -march=native would turn on here:
#  - AVX512-FP16: ggml 0.20.2's F16 dot product then accumulates in FP16 with a 128-wide step and a scalar tail
#    (n_embd 576, head size 64); F16 decode measured 0.78x upstream llama.cpp with it, 0.99x without;
#  - AMX: its tile kernels as GCC 12 builds them die with SIGILL on the Sapphire Rapids machines used here.
cflags=""
if [ "$mode" != prebuilt ]; then
    for f in -mno-avx512fp16 -mno-amx-tile -mno-amx-int8 -mno-amx-bf16; do
        if echo 'int main(void){return 0;}' | "${CC:-cc}" "$f" -x c -o /dev/null - 2>/dev/null; then
            cflags="$cflags $f"
        fi
    done
    cflags="${cflags# }"
fi
want="$mode $GGML_VERSION $cmake_args $cflags"

marker() {
    "$py" - <<'PY' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("libggml")
if spec and spec.submodule_search_locations:
    p = pathlib.Path(list(spec.submodule_search_locations)[0]) / "specee-ggml-build.txt"
    print(p)
PY
}

m="$(marker)"
if [ -n "$m" ] && [ -f "$m" ] && [ "$(cat "$m")" = "$want" ]; then
    echo "ggml: libggml-python $GGML_VERSION ($mode) already installed"
    exit 0
fi

if [ "$mode" = prebuilt ]; then
    "$py" -m pip install --force-reinstall --no-deps "libggml-python==$GGML_VERSION"
else
    echo "ggml: building libggml-python $GGML_VERSION from source ($cmake_args; CFLAGS=$cflags)"
    CFLAGS="${CFLAGS:-} $cflags" CXXFLAGS="${CXXFLAGS:-} $cflags" CMAKE_ARGS="$cmake_args" "$py" -m pip install --force-reinstall --no-deps --no-cache-dir \
        --no-binary libggml-python "libggml-python==$GGML_VERSION"
fi
m="$(marker)"
echo "$want" > "$m"
echo "ggml: installed ($mode)"
