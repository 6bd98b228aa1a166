#!/usr/bin/env bash
# Installs ggml (the PyPI package libggml-python, pinned below) the way this project needs it.
#
#   ggml/install.sh            native: built from the sdist for this CPU with llamafile sgemm and OpenMP, as upstream
#                              llama.cpp builds (default; ~2 min; matmul speed on par with upstream's own build).
#                              OpenMP rather than ggml's own threadpool: the threadpool's barrier spins without
#                              yielding, so a thread that is not running (other jobs, or more threads than CPUs)
#                              stalls every step: SmolLM2 at -t 4 on 2 idle CPUs took 98 s for 32 tokens against
#                              0.7 s with OpenMP, and on an idle machine the two decode at 0.97-1.01x of each other
#                              (docs/benchmarks.md, "Threads")
#   ggml/install.sh prebuilt   the prebuilt wheel (AVX2 only, no llamafile sgemm: prefill 2-3x slower)
#   ggml/install.sh cuda       built from the sdist with CUDA as well: needs the CUDA toolkit (nvcc); cuBLAS from
#                              the toolkit, else from the PyPI wheel nvidia-cublas (installed here when missing).
#                              SPECEE_CUDA_ARCHS: the GPU architectures (CMAKE_CUDA_ARCHITECTURES); default: the
#                              GPUs this machine has, else 86-real;89-real;90 (RTX 30xx/40xx laptops, H100/H200,
#                              PTX for later GPUs). Without a driver (libcuda) it builds without CUDA's virtual
#                              memory management (GGML_CUDA_NO_VMM): it compiles and links but runs nothing.
#                              SPECEE_CUDA_FA=OFF leaves out the CUDA flash-attention kernels' code (CI's
#                              compile-only build). SPECEE_GGML_VERBOSE=1 shows the build's own log (each file compiled).
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
    native)   cmake_args="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=ON -DGGML_RPC=ON" ;;
    cuda)     cmake_args="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=ON -DGGML_RPC=ON -DGGML_CUDA=ON" ;;
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
ldflags=""
if [ "$mode" = cuda ]; then
    # nvcc itself, not a wrapper script on PATH (CMake asks the compiler where its toolkit is)
    nvcc="${CUDACXX:-}"
    if [ -z "$nvcc" ]; then
        for c in "${CUDA_HOME:-}/bin/nvcc" "${CUDA_PATH:-}/bin/nvcc"; do [ -x "$c" ] && { nvcc="$c"; break; }; done
    fi
    if [ -z "$nvcc" ] && command -v nvcc >/dev/null; then
        here=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
        nvcc="${here:+$here/nvcc}"
        [ -x "$nvcc" ] || nvcc="$(command -v nvcc)"
    fi
    [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
    if [ -z "$nvcc" ]; then
        echo "ggml: SPECEE_GGML=cuda needs the CUDA toolkit's nvcc (on PATH, in CUDA_HOME, or CUDACXX=/path/to/nvcc)" >&2
        exit 1
    fi
    cuda_root="$(cd "$(dirname "$nvcc")/.." && pwd)"
    cuda_version=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
    echo "ggml: CUDA $cuda_version at $cuda_root"
    cmake_args="$cmake_args -DCMAKE_CUDA_COMPILER=$nvcc"
    archs="${SPECEE_CUDA_ARCHS:-}"
    if [ -z "$archs" ]; then
        if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then archs=native; else archs="86-real;89-real;90"; fi
    fi
    cmake_args="$cmake_args -DCMAKE_CUDA_ARCHITECTURES=$archs"
    [ "${SPECEE_CUDA_FA:-ON}" = OFF ] && cmake_args="$cmake_args -DGGML_CUDA_FA=OFF"
    # cuBLAS: the toolkit's, else the PyPI wheel of the toolkit's version (it ships versioned .so files only,
    # so CMake is told where they are, and the libraries find them at run time through their RPATH)
    if ! ls "$cuda_root"/lib64/libcublas.so* "$cuda_root"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
        find_cublas='import nvidia, pathlib; print(next(p for d in nvidia.__path__ for p in pathlib.Path(d).glob("cu*") if (p / "include" / "cublas_v2.h").exists()))'
        cublas_root=$("$py" -c "$find_cublas" 2>/dev/null || true)
        if [ -z "$cublas_root" ]; then
            major="${cuda_version%%.*}"
            "$py" -m pip install --quiet --no-deps "nvidia-cublas==$cuda_version.*" ||
                "$py" -m pip install --quiet --no-deps "nvidia-cublas==$major.*"
            cublas_root=$("$py" -c "$find_cublas")
        fi
        lib="$cublas_root/lib"
        echo "ggml: cuBLAS from the nvidia-cublas wheel: $cublas_root"
        cmake_args="$cmake_args -DCUDA_cublas_LIBRARY=$(ls "$lib"/libcublas.so.* | head -1)"
        cmake_args="$cmake_args -DCUDA_cublasLt_LIBRARY=$(ls "$lib"/libcublasLt.so.* | head -1)"
        cmake_args="$cmake_args -DCMAKE_CUDA_FLAGS=-I$cublas_root/include"
        ldflags="-Wl,-rpath,$lib"
        cmake_args="$cmake_args -DCMAKE_SHARED_LINKER_FLAGS=$ldflags"
    fi
    # no driver library: CUDA's virtual memory management (the driver API) cannot link; what runs needs a driver
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
        echo "ggml: no CUDA driver (libcuda.so.1) here: building with GGML_CUDA_NO_VMM=ON (compiles and links; runs nothing)"
        cmake_args="$cmake_args -DGGML_CUDA_NO_VMM=ON"
    fi
    export CMAKE_GENERATOR=Ninja  # with Makefiles, the CUDA objects' directories were not made (argsort.cu.o)
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
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
    # from PyPI's sdist, or from a local copy of it (a folder or archive: scripts/gpu-run.sh on a machine without
    # network, built with the build tools already installed)
    source=(--no-binary libggml-python "libggml-python==$GGML_VERSION")
    [ -n "${SPECEE_GGML_SDIST:-}" ] && source=(--no-index --no-build-isolation "$SPECEE_GGML_SDIST")
    echo "ggml: building libggml-python $GGML_VERSION from ${SPECEE_GGML_SDIST:-source} ($cmake_args; CFLAGS=$cflags)"
    CFLAGS="${CFLAGS:-} $cflags" CXXFLAGS="${CXXFLAGS:-} $cflags" CMAKE_ARGS="$cmake_args" "$py" -m pip install \
        --force-reinstall --no-deps --no-cache-dir ${SPECEE_GGML_VERBOSE:+-v} "${source[@]}"
fi
m="$(marker)"
echo "$want" > "$m"
echo "ggml: installed ($mode)"
