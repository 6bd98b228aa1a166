"""Benchmarks of this runtime against upstream llama.cpp, installed as `specee.bench` (not part of the API).

    python -m specee.bench.runtime   specee-bench vs llama-bench: prompt and generation speed, memory, the cost
                                     of one verification pass, layers offloaded to RPC servers
    python -m specee.bench.cli       this runtime's llama-cli vs upstream's: end-to-end decode speed per prompt
    python -m specee.bench.spec      EAGLE speculative decoding on MT-Bench and HumanEval: identity with plain
                                     decoding, and speed against both CLIs' plain decoding
    python -m specee.bench.grammar   structured output: a JSON Schema's cost per decode step (masks during or after
                                     the pass), jump-forward's speedup, and llama-server with the same json_schema
"""
