"""python -m specee.bench.modes: plain decoding, EAGLE-2, early exit and tree exit side by side in one process.

One Model (loaded once; each generation keeps the prompt's cached prefix, so only decoding differs), the four modes in
rotating order for --rounds rounds; per mode and prompt the fastest round counts (on a machine shared with other work a
run is only ever slowed), and the table gives tokens per second, the ratios to plain and to EAGLE-2, tokens per step,
layers run per step (per token for early exit) and the share of steps that exited. --replay forces the cost
benchmark's figures on a file whose drafts and exits mean nothing (the 7B-shaped synthetic file): each step accepts
the replayed counts (--eagle-replay) and every pass exits after --exit-layer. --compare-head adds early exit and tree
exit with a second draft head file's predictors (e.g. ones trained on tree data) as two more rows of the same run.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import specee
from specee import EagleParams, ExitParams
from specee.bench.spec import mt_bench_prompts, pick
from specee.generate import MODES as LIBRARY_MODES

# plain decoding, EAGLE-2, and every mode that exits (the runtime's mode table)
MODES = ("plain", "eagle2") + tuple(name for name, m in LIBRARY_MODES.items() if m.exits)
EXIT_MODES = MODES[2:]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.modes", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--draft-head", default="default", help="draft head file with exit predictors (default: the "
                                                             "shipped one for the default model)")
    ap.add_argument("--mt-bench", type=int, default=4, help="MT-Bench first turns in the chat template (0: one "
                                                            "prompt of 48 random token ids, for synthetic files)")
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--replay", action="store_true", help="replayed acceptance and exits (cost only)")
    ap.add_argument("--eagle-replay", default="2,0,2,1,2,2,0,2,1,2",
                    help="--replay: drafted tokens accepted per step, in turn")
    ap.add_argument("--exit-layers", help="early exit's and tree exit's schedule, comma-separated (default: the draft "
                                          "head file's)")
    ap.add_argument("--compare-head", metavar="FILE", help="also early exit and tree exit with this draft head file")
    ap.add_argument("--exit-layer", type=int, help="--replay: the layer every pass exits after (default: n_layer - 9, "
                                                   "24 of 32 layers run)")
    return ap.parse_args(argv)


def mode_options(m: specee.Model, args: argparse.Namespace) -> dict[str, dict]:
    eagle, exit_ = EagleParams(), ExitParams()
    if args.exit_layers:
        exit_ = ExitParams(layers=[int(x) for x in args.exit_layers.split(",")])
    if args.replay:
        eagle = EagleParams(replay=[int(x) for x in args.eagle_replay.split(",")])
        exit_ = ExitParams(replay=[args.exit_layer if args.exit_layer is not None else m.n_layer - 9])
    out = {}
    for name in MODES:  # each mode with the settings it reads (the mode table's reads)
        reads = LIBRARY_MODES[name].reads
        out[name] = dict(mode=name, **({"eagle": eagle} if {"eagle1_tree", "eagle2_tree"} & set(reads) else {}),
                         **({"exit": exit_} if "exit" in reads else {}))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m = specee.Model(args.model, draft_head=args.draft_head, n_ctx=1024, n_threads=args.threads)
    if args.mt_bench > 0:
        prompts = [m.tokenize(p.text, add_special=True, parse_special=True)
                   for p in pick(mt_bench_prompts(m.chat_template(), None), args.mt_bench)]
    else:
        prompts = [np.random.default_rng(0).integers(100, min(30000, m.n_vocab), 48).tolist()]
    options = mode_options(m, args)
    rows = {k: (m, options[k]) for k in MODES}  # row label: (model, generation options)
    if args.compare_head:
        b = specee.Model(args.model, draft_head=args.compare_head, n_ctx=1024, n_threads=args.threads)
        rows.update({f"{k} ({args.compare_head.rsplit('/', 1)[-1]})": (b, options[k]) for k in EXIT_MODES})
    labels = list(rows)
    ms_per_token: dict[str, list[list[float]]] = {k: [[] for _ in prompts] for k in labels}
    stats: dict[str, list[specee.GenerationStats]] = {k: [] for k in labels}
    for r in range(args.rounds):
        for k in labels[r % len(labels):] + labels[:r % len(labels)]:  # rotated, so no mode always runs first
            model, opts = rows[k]
            for i, p in enumerate(prompts):
                model.generate_tokens(p, args.n_predict, temp=0, ignore_eos=True, **opts)
                st = model.last_stats
                ms_per_token[k][i].append(st.t_decode_ms / st.n_decoded)
                stats[k].append(st)
    fastest = {k: float(np.mean([min(v) for v in ms_per_token[k]])) for k in labels}
    print(f"{m.desc}, {len(prompts)} prompt(s) x {args.n_predict} tokens, -t {args.threads}, greedy, the fastest of "
          f"{args.rounds} rounds{', replayed acceptance and exits' if args.replay else ''}")
    print("| mode | decode t/s | x plain | x EAGLE-2 | tokens/step | layers run/step | steps exited |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in labels:
        sts = stats[k]
        steps = sum(s.n_steps for s in sts)
        layers = sum(s.n_layers_run for s in sts) / steps if "exit" in k else m.n_layer
        exited = sum(s.n_exits for s in sts) / steps
        print(f"| {k} | {1000 / fastest[k]:.2f} | {fastest['plain'] / fastest[k]:.2f}x | "
              f"{fastest['eagle2'] / fastest[k]:.2f}x | {sum(s.n_decoded for s in sts) / steps:.2f} | "
              f"{layers:.2f} of {m.n_layer} | {exited:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
