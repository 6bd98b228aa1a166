"""python -m specee.bench.kernels: one matmul alone, this runtime's kernel (`auto`) against ggml's (`off`), from
memory: a random Q4_1 (or Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) matrix larger than the caches times n token rows, the cost of n
rows in units of the same mode's one-row product (where `auto` runs ggml's own vec_dot for one token of Q8_0 and the
K-quants), the one-row product's read rate, the largest n's rate of byte products against this CPU's peak (one
thread's vpmaddubsw chains, times the threads: the compute roofline) and ggml's time over the mode's at the largest n.
Q4_1, Q4_0 and the K-quants also in the loader's eight-row layout (`auto rows8`, what a model's matrices of those
types use; Q4_0's `auto` is its file's layout, what a tied lm_head keeps). ggml's
product here reads the file's layout (its vec_dot per pair), except Q4_0's, which ggml's repacked layout holds as its
loader does (its one-token GEMV, its GEMM from 4 tokens); ggml's repacked Q4_K is measured whole-model, against
llama-bench (python -m specee.bench.runtime).

    python -m specee.bench.kernels                      # 1536 x 73,728 Q4_1 (70.8 MB), 1 and 2 threads, n = 1, 2, 4, 8
    python -m specee.bench.kernels --type q8_0 --rows 49152 -k 576 --threads 2     # SmolLM2's tied lm_head
"""

from __future__ import annotations

import argparse

import numpy as np

from specee import _core

TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}  # ggml type ids
MODES = {"auto": (0, False), "auto rows8": (0, True), "off": (2, False)}  # enum specee_kernels_mode, eight-row layout


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", choices=list(TYPES), default="q4_1")
    ap.add_argument("-k", type=int, default=1536, help="row length (a multiple of 32, of 256 for the K-quants; default 1536)")
    ap.add_argument("--rows", type=int, default=73728, help="weight rows (default 73,728)")
    ap.add_argument("-n", type=ints, default=[1, 2, 4, 8], help="token rows, comma-separated (default 1,2,4,8)")
    ap.add_argument("--threads", type=ints, default=[1, 2], help="comma-separated (default 1,2)")
    ap.add_argument("--repeats", type=int, default=15, help="computes per figure; the fastest is kept (default 15)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    w = _core.quantize(TYPES[args.type], (rng.standard_normal((args.rows, args.k)) * 0.1).astype(np.float32))
    xs = {n: rng.standard_normal((n, args.k)).astype(np.float32) for n in args.n}
    peak = _core.kernels_int8_peak()
    print(f"{args.type} {args.k} x {args.rows} ({w.nbytes / 1e6:.1f} MB), fastest of {args.repeats}; cost = n rows in "
          f"units of the same mode's one-row product; this CPU's peak: "
          + (f"{peak / 1e9:.1f} G byte products/s a thread (vpmaddubsw)\n" if peak > 0 else "unknown (no AVX2)\n"))
    print("| threads | mode | " + " | ".join(f"n = {n}" for n in args.n) + f" | one row: ms, GB/s | n = {args.n[-1]}: "
          f"G products/s, of peak | off / mode at n = {args.n[-1]} |")
    print("| ---: | --- | " + " | ".join("---:" for _ in args.n) + " | ---: | ---: | ---: |")
    for th in args.threads:
        rows = {}
        for name, (mode, rows8) in MODES.items():
            if rows8 and (args.type not in ("q4_0", "q4_1", "q4_k", "q5_k", "q6_k") or args.rows % 8):
                continue
            rows[name] = {n: _core.kernels_mul_mat(w, args.k, xs[n], mode, th, repeats=args.repeats,
                                                   type=TYPES[args.type], rows8=rows8)[1] for n in args.n}
        for name, s in rows.items():
            one = s[args.n[0]]
            cells = " | ".join(f"{s[n] / one:.2f}" for n in args.n)
            rate = args.n[-1] * args.rows * args.k / s[args.n[-1]]
            of_peak = f"{rate / (peak * th):.0%}" if peak > 0 else "-"
            print(f"| {th} | {name} | {cells} | {one * 1e3:.2f}, {w.nbytes / one / 1e9:.1f} | {rate / 1e9:.0f}, "
                  f"{of_peak} | {rows['off'][args.n[-1]] / s[args.n[-1]]:.2f} |")

if __name__ == "__main__":
    main()
