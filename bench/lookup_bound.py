"""How far n-gram lookup can go on a prompt set: the bound of any drafter that copies from the sequence.

    python -m specee.bench.lookup_bound --data-dir questions [--categories sum,code-edit] [--per-category 3]
                                        [-m FILE] [-n 64] [-t 2] [--n-min 2] [--draft-max 8]

Each prompt (bench.lookup's: a first turn in the model's chat template) is decoded plainly, greedy. Then every step
of a lookup over that reply is replayed with an oracle's choice: of all the places where the sequence's last n_min
tokens stood before (in the prompt or the reply so far), the continuation that matches the most of the tokens to come,
at most draft_max. No drafter that copies from the sequence with a match of n_min tokens or more drafts more that is
right (a longer match is one of these places; the cross-request cache is off), and the oracle drafts nothing wrong, so
its steps are as few as such a drafter's can be and each verifies only the tokens it accepts. Printed per category:

- tokens a step: the oracle's, and mode ngram's on the same prompts (its stats; its output must equal plain's);
- the speed bound: the reply's tokens over the sum of the oracle's passes' costs, each a pass of (accepted + 1)
  rows with every row's logits, in single passes timed here on this model (a plain step costs one);
- mode ngram's measured speed over plain's in this run (decode time from the stats, the faster of --rounds).

A category whose bound is below a speed target cannot meet it with lookup on this model, whatever the kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import numpy as np

from specee.bench.lookup import CATEGORIES, load_prompts
from specee.paths import default_model_path

DEFAULT_N_MIN = 2  # the runtime's ngram.n_min and ngram.draft_max (docs/lookup.md, Settings)
DEFAULT_DRAFT_MAX = 8


def oracle_steps(prompt: list[int], reply: list[int], n_min: int, draft_max: int) -> list[int]:
    """Per decoding step the tokens the oracle's draft gets accepted (the first token of the reply comes from the
    prompt's pass, as in the runtime); a step emits its accepted tokens plus one."""
    seq = list(prompt) + reply[:1]
    steps = []
    while len(seq) < len(prompt) + len(reply):
        p = len(seq)
        future = reply[p - len(prompt):][:draft_max + 1]
        key = tuple(seq[p - n_min:p])
        best = 0
        for j in range(n_min, p):  # j: where a continuation starts, after an earlier occurrence of the key
            if tuple(seq[j - n_min:j]) != key:
                continue
            a = 0
            while a < draft_max and j + a < p and a + 1 < len(future) and seq[j + a] == future[a]:
                a += 1
            best = max(best, a)
        steps.append(best)
        seq += future[:best + 1]
    return steps


def pass_costs(m, sizes: range, rounds: int = 4, repeats: int = 5) -> dict[int, float]:
    """A pass of n rows, every row's logits, in single passes (fastest of rounds x repeats after a 64-token context,
    the sizes interleaved so a load change moves them all)."""
    rng = np.random.default_rng(0)
    ctx = rng.integers(100, 20000, 64).tolist()
    best = {n: float("inf") for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            for _ in range(repeats):
                m.kv_clear()
                m.eval(ctx)
                toks = rng.integers(100, 20000, n).tolist()
                t = time.perf_counter()
                m.eval(toks, output="all" if n > 1 else "last")
                best[n] = min(best[n], time.perf_counter() - t)
    return {n: best[n] / best[1] for n in sizes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.lookup_bound", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--data-dir", required=True, help="SpecEE's question folder (NAME/question.jsonl for the six datasets)")
    ap.add_argument("--categories", default="sum,code-edit", help=f"of {','.join(CATEGORIES)},code-edit (sum,code-edit)")
    ap.add_argument("--per-category", type=int, default=3, help="prompts per dataset (3; code-edit: twice as many)")
    ap.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per reply (64)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of plain and ngram; the faster kept (2)")
    ap.add_argument("--n-min", type=int, default=DEFAULT_N_MIN, help=f"shortest match drafted from ({DEFAULT_N_MIN})")
    ap.add_argument("--draft-max", type=int, default=DEFAULT_DRAFT_MAX, help=f"most tokens a step ({DEFAULT_DRAFT_MAX})")
    args = ap.parse_args(argv)
    args.model = args.model or str(default_model_path())
    wanted = args.categories.split(",")
    unknown = [c for c in wanted if c not in CATEGORIES + ("code-edit",)]
    if unknown:
        ap.error(f"--categories: unknown {','.join(unknown)}")
    if args.n_min < 1 or args.draft_max < 1:
        ap.error("--n-min and --draft-max must be >= 1")

    from specee.generate import NgramParams
    from specee.model import Model

    prompts = [(c, text) for c, text in load_prompts(args) if c in wanted]
    rows: dict[str, list] = defaultdict(list)
    with Model(args.model, n_ctx=args.ctx_size, n_threads=args.threads, ngram_cache=0) as m:
        costs = pass_costs(m, range(1, args.draft_max + 2))
        for i, (cat, text) in enumerate(prompts):
            toks = m.tokenize(text, parse_special=True)
            best = {}
            for _ in range(args.rounds):
                for mode in ("plain", "ngram"):
                    m.kv_clear()
                    opts = {"ngram": NgramParams(n_min=args.n_min, draft_max=args.draft_max)} if mode == "ngram" else {}
                    out = m.generate_tokens(toks, args.n_predict, temp=0, mode=mode, **opts)
                    s = m.last_stats
                    if mode not in best or s.t_decode_ms < best[mode][1].t_decode_ms:
                        best[mode] = (out, s)
            plain, ngram = best["plain"][0], best["ngram"][0]
            if ngram != plain:
                print(f"bench.lookup_bound: prompt {i} ({cat}): mode ngram's reply differs from plain's", file=sys.stderr)
                return 1
            steps = oracle_steps(toks, plain, args.n_min, args.draft_max)
            sp, sn = best["plain"][1], best["ngram"][1]
            rows[cat].append((len(plain) - 1, len(steps), sum(costs[a + 1] for a in steps), sn.n_decoded, sn.n_steps,
                              sp.t_decode_ms / max(sp.n_decoded, 1), sn.t_decode_ms / max(sn.n_decoded, 1)))
            print(f"  {cat} #{i}: {len(toks)} prompt tokens, oracle {len(plain) - 1} tokens in {len(steps)} steps, "
                  f"ngram {sn.n_decoded} in {sn.n_steps}", file=sys.stderr)

    print(f"\npass of n rows, every row's logits, in single passes (this run): "
          + ", ".join(f"{n}: {c:.2f}" for n, c in costs.items()))
    print(f"\n{args.model}, {args.threads} threads, greedy, {args.n_predict} tokens, n_min {args.n_min}, "
          f"draft_max {args.draft_max}\n")
    print("| category | prompts | oracle tokens a step | ngram tokens a step | oracle speed bound | ngram measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for cat, r in rows.items():
        a = np.array(r, dtype=float)
        print(f"| {cat} | {len(r)} | {a[:, 0].sum() / a[:, 1].sum():.2f} | {a[:, 3].sum() / max(a[:, 4].sum(), 1):.2f} "
              f"| {a[:, 0].sum() / a[:, 2].sum():.2f}x | {(a[:, 5] * a[:, 0]).sum() / (a[:, 6] * a[:, 0]).sum():.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
