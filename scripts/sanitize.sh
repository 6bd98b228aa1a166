#!/usr/bin/env bash
# The fast tests under AddressSanitizer + UndefinedBehaviorSanitizer: builds this package with SPECEE_SANITIZE=ON
# (the runtime, the _core module and the tools; ggml stays as installed) into build/sanitize/site, puts it first on
# PYTHONPATH with the sanitizer runtimes preloaded into Python, and runs pytest there (then short runs of the GGUF
# fuzzer and of the RPC protocol fuzzer, whose server is the sanitized specee-rpc-server).
# Run from an environment set up by ./install.sh and tests/requirements.txt:
#   scripts/sanitize.sh                       # the fast tests (-m "not slow"), 3000 GGUF inputs, 1000 RPC messages
#   scripts/sanitize.sh tests/test_bad_input.py tests/test_hardening.py     # chosen tests only
#   scripts/sanitize.sh --fuzz-rpc 10000      # only the RPC fuzzer, this many messages
# Any sanitizer report ends the process with an error (exit status 1 for pytest's run, a crash for the fuzzer).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
site=build/sanitize/site

"$py" -m pip install --quiet --no-deps --no-build-isolation --upgrade --target "$site" \
    -Ccmake.define.SPECEE_SANITIZE=ON -Cbuild-dir=build/sanitize/build -Cinstall.strip=false .

ggml_lib=$("$py" -c "from specee._ggml import ggml_lib_dir; print(ggml_lib_dir())")
export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$ggml_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # the tools' rpath expects site-packages
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# Python itself leaks by design: no leak check; a huge allocation returns NULL as it would without ASan
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
"$py" -c "import specee, sys; assert '$site' in specee.__file__, specee.__file__"

if [ "${1:-}" = --fuzz-rpc ]; then
    "$py" tests/fuzz_rpc.py --messages "${2:-10000}" --seed "${3:-25}" --out build/sanitize/fuzz_rpc
elif [ "$#" -gt 0 ]; then
    "$py" -m pytest -q -p no:cacheprovider "$@"
else
    "$py" -m pytest -q -p no:cacheprovider -m "not slow" tests
    "$py" tests/fuzz_gguf.py --mode random --random 3000 --seed 18 --limit-mb 0 --out build/sanitize/fuzz
    "$py" tests/fuzz_rpc.py --messages 1000 --seed 25 --out build/sanitize/fuzz_rpc
fi
