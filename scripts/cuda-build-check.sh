#!/usr/bin/env bash
# CI's CUDA check on a machine without a GPU: the README's set-up with SPECEE_GGML=cuda in a fresh virtual
# environment, reduced to what fits CI's time (one GPU architecture, SPECEE_CUDA_ARCHS=89-real, and without the
# CUDA flash-attention kernels' code, SPECEE_CUDA_FA=OFF: about 25 minutes on 2 cores instead of about an hour for
# the three default architectures), then the fast tests against that build (the gpu tests skip: no driver, no GPU).
# It shows what was compiled: each file (the build's own log), the architectures in libggml-cuda.so, what it links.
#   scripts/cuda-build-check.sh            # both parts; skips, saying why, where nvcc is missing
#   scripts/cuda-build-check.sh --build    # the set-up only
#   scripts/cuda-build-check.sh --test [TEST...]   # the fast tests (of TEST... only) against what --build made
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -z "${CUDACXX:-}" ] && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "cuda-build-check: skipped: no CUDA toolkit (nvcc) on this machine"
    exit 0
fi
part="${1:-all}"
case "$part" in all|--build|--test) ;; *) echo "usage: $0 [--build|--test [TEST...]]" >&2; exit 2 ;; esac
tests=(tests)
if [ "$part" = --test ] && [ "$#" -gt 1 ]; then
    shift
    tests=("$@")
fi
venv=.venv-cuda
if [ "$part" != --test ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    t0=$SECONDS
    SPECEE_GGML_VERBOSE=1 SPECEE_GGML=cuda SPECEE_CUDA_ARCHS="${SPECEE_CUDA_ARCHS:-89-real}" SPECEE_CUDA_FA="${SPECEE_CUDA_FA:-OFF}" \
        ./install.sh
    echo "cuda-build-check: ggml with CUDA and specee built in $((SECONDS - t0)) s"
    [ "$part" = --build ] && exit 0
fi
[ -x "$venv/bin/python" ] || { echo "cuda-build-check: no $venv here: run $0 --build first" >&2; exit 1; }
# shellcheck disable=SC1091
. "$venv/bin/activate"
lib=$(python -c "from specee._ggml import ggml_lib_dir; print(ggml_lib_dir())")
cuda_lib=$(ls "$lib"/libggml-cuda.so* | head -1)
echo "cuda-build-check: $cuda_lib ($(du -h "$cuda_lib" | cut -f1)); the GPU architectures named in its device code:"
grep -a -o 'sm_[0-9][0-9]*[a-z]*' "$cuda_lib" | sort | uniq -c || true
echo "cuda-build-check: what it links:"
ldd "$cuda_lib" | grep -E "cublas|cudart|libcuda|not found" || true
python -c "import specee; print('devices:', specee.devices())"
python -m pip install -q -r tests/requirements.txt
python -m pytest -q -rs -p no:cacheprovider -m "not slow" "${tests[@]}"
