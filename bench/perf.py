"""Reading the timing lines a llama-cli prints at the end (this runtime's specee-cli and upstream llama.cpp's).

    llama_perf_context_print: prompt eval time =      12.34 ms /    17 tokens (...)
    llama_perf_context_print:        eval time =      99.90 ms /   127 runs   (...)

Upstream's newer tools print the same lines under common_perf_print; both are read. Used by bench.cli, bench.spec
and the evaluations' CLI runners (specee.eval.runners).
"""

from __future__ import annotations

import re

# "... prompt eval time =     12.34 ms /    17 tokens (..." and "...        eval time =    99.9 ms /   127 runs   (..."
PERF_RE = re.compile(r"(prompt eval|\beval) time =\s*([0-9.]+) ms /\s*([0-9]+) (tokens|runs)")


def parse_perf(stderr: str) -> tuple[float, int, float, int]:
    """(prompt ms, prompt tokens, eval ms, eval runs) from a CLI's timing lines."""
    found: dict[str, tuple[float, int]] = {}
    for kind, ms, n, _ in PERF_RE.findall(stderr):
        found[kind.strip()] = (float(ms), int(n))
    if "eval" not in found or "prompt eval" not in found:
        raise ValueError("no 'prompt eval time' / 'eval time' lines in the output")
    return (*found["prompt eval"], *found["eval"])
