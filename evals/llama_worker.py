"""Upstream llama.cpp through llama-cpp-python, in a process of its own (runners.LlamaCppPythonRunner starts it).

Run as a script, not imported: llama-cpp-python ships its own libggml, and a process that has loaded this
runtime's ggml would resolve upstream's symbols against it. Nothing of specee is imported here.

    python llama_worker.py '{"model": PATH, "n_ctx": 4096, "threads": 2, "seed": 0, "eog": [2, ...]}'

Then one JSON request a line on stdin ({"tokens", "max_tokens", "temp", "top_k", "top_p", "min_p",
"seed"}), one JSON reply a line on stdout ({"tokens", "stop", "n_p_eval", "t_p_eval_ms", "n_eval",
"t_eval_ms"}: llama.cpp's own performance counters). Anything the library prints goes to stderr.
"""

import json
import os
import sys


def main() -> None:
    out = os.fdopen(os.dup(1), "w")  # replies on a private copy of stdout; fd 1 itself goes to stderr
    os.dup2(2, 1)
    import llama_cpp

    cfg = json.loads(sys.argv[1])
    eog = set(cfg["eog"])
    llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_batch=512, n_ubatch=512,
                          n_threads=cfg["threads"], n_threads_batch=cfg["threads"], flash_attn=True, seed=cfg["seed"],
                          verbose=False)
    ctx = llm._ctx.ctx
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()
        llm.set_seed(req["seed"])
        llama_cpp.llama_perf_context_reset(ctx)
        tokens, stop = [], "length"
        for tok in llm.generate(req["tokens"], top_k=req["top_k"], top_p=req["top_p"], min_p=req["min_p"],
                                temp=req["temp"], repeat_penalty=1.0, reset=True):
            if tok in eog:
                stop = "eog"
                break
            tokens.append(int(tok))
            if len(tokens) >= req["max_tokens"]:
                break
        perf = llama_cpp.llama_perf_context(ctx)
        out.write(json.dumps({"tokens": tokens, "stop": stop, "n_p_eval": perf.n_p_eval, "t_p_eval_ms": perf.t_p_eval_ms,
                              "n_eval": perf.n_eval, "t_eval_ms": perf.t_eval_ms}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
