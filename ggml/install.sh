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
# A marker file in the installed package records how it was built, so a second run is a no-op.
set -euo pipefail

GGML_VERSION="0.20.2.post1"
mode="${1:-native}"
py="${PYTHON:-python3}"

case "$mode" in
    native)   cmake_args="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=OFF" ;;
    cuda)     cmake_args="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=OFF -DGGML_CUDA=ON" ;;
    prebuilt) cmake_args="" ;;
    *) echo "usage: $0 [native|prebuilt|cuda]" >&2; exit 2 ;;
esac
want="$mode $GGML_VERSION $cmake_args"

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
    echo "ggml: building libggml-python $GGML_VERSION from source ($cmake_args)"
    CMAKE_ARGS="$cmake_args" "$py" -m pip install --force-reinstall --no-deps --no-cache-dir \
        --no-binary libggml-python "libggml-python==$GGML_VERSION"
fi
m="$(marker)"
echo "$want" > "$m"
echo "ggml: installed ($mode)"
