"""Early exit with lookup candidates, measured before it is built: would n-gram lookup's candidate beside the draft
head's top-4 let early exit leave more often, or let the head be skipped where lookup is confident?

    python -m specee.bench.exit_lookup --data-dir questions [--per-category 2] [-n 64] [-t 2] [-m FILE]

Each prompt (the six datasets' first turns and the code-editing set, in the chat template) decodes once in mode
early-exit (greedy, the default draft head with its exit predictors): its exits and rejected firings (a predictor fired
and the exit layer's token was not among the candidates) per token, and the head's share of the decode time. Then,
offline over the same tokens: the head's top-4 at each position (teacher-forced: the head over the full model's
features of those tokens; the run's own exited tokens had the exit layer's) and the candidate n-gram lookup's rule
gives there (the longest match of 4 down to 2 tokens, its most frequent continuation, the latest on a tie; its running
acceptance per match length as the runtime keeps it: decayed 0.9 an observation, read with 2 trials at 0.8), confident
as the hybrid means it (a match of 4 and that acceptance >= 0.85). Prints per category: lookup's candidate right; the
token outside the head's top-4 and lookup's candidate right (every extra exit a fifth candidate could give is one of
these: a bound); confident tokens and how often lookup was right there (the head calls a confident lookup could skip);
and the bound on decode time saved by skipping the head there (head share x confident-and-right share).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specee import chat_apply_template
from specee.bench.code_edit import code_edit_messages
from specee.bench.lookup import CATEGORIES, category_messages
from specee.model import Model
from specee.paths import default_draft_head_path, default_model_path

N_MIN, N_MAX = 2, 4  # lookup's default match lengths
DECAY, PRIOR, PRIOR_WEIGHT, CONFIDENT = 0.9, 0.8, 2.0, 0.85  # as csrc/decode/specee-lookup.cpp and specee-hybrid.cpp


@dataclass
class Counts:
    tokens: int = 0
    exits: int = 0
    rejected: int = 0
    decode_ms: float = 0.0
    head_ms: float = 0.0
    in_top4: int = 0
    lookup_right: int = 0
    lookup_only: int = 0  # outside the head's top-4, lookup's candidate right
    confident: int = 0
    confident_right: int = 0
    rows: list[str] = field(default_factory=list)


def lookup_candidates(seq: list[int], start: int) -> list[tuple[int, int, bool]]:
    """For each position j >= start: (lookup's candidate for seq[j] from seq[:j], or -1; its match length; whether
    it is confident), with the running acceptance observed on every step that had a match."""
    index: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> the positions it ends at
    succ = dict.fromkeys(range(N_MIN, N_MAX + 1), 0.0)
    trials = dict.fromkeys(range(N_MIN, N_MAX + 1), 0.0)

    def add(i: int) -> None:
        for n in range(N_MIN, min(N_MAX, i + 1) + 1):
            index[tuple(seq[i - n + 1:i + 1])].append(i)

    for i in range(start - 2):
        add(i)
    out = []
    for j in range(start, len(seq)):
        add(j - 2)  # n-grams ending at j - 2 and before: each has a continuation in seq[:j]
        cand, n_match = -1, 0
        for n in range(min(N_MAX, j), N_MIN - 1, -1):
            ends = [p for p in index.get(tuple(seq[j - n:j]), []) if p < j - 1]
            if ends:
                counts: dict[int, tuple[int, int]] = {}
                for p in ends:
                    c, last = counts.get(seq[p + 1], (0, -1))
                    counts[seq[p + 1]] = (c + 1, max(last, p + 1))
                cand = max(counts, key=lambda t: counts[t])
                n_match = n
                break
        a = (succ[n_match] + PRIOR * PRIOR_WEIGHT) / (trials[n_match] + PRIOR_WEIGHT) if n_match else 0.0
        out.append((cand, n_match, n_match == N_MAX and a >= CONFIDENT))
        if n_match:
            succ[n_match] = DECAY * succ[n_match] + (cand == seq[j])
            trials[n_match] = DECAY * trials[n_match] + 1.0
    return out


def measure(m: Model, text: str, n_predict: int, c: Counts) -> None:
    prompt = m.tokenize(text, parse_special=True)
    out = m.generate_tokens(prompt, n_predict, temp=0, mode="early-exit")
    st = m.last_stats
    c.tokens += st.n_decoded
    c.exits += st.n_exits
    c.rejected += st.n_rejected
    c.decode_ms += st.t_decode_ms
    c.head_ms += st.t_head_ms
    seq = list(prompt) + list(out)
    m.kv_clear()
    m.eval(seq, output="all")
    feats = m.norm()
    head_logits, _ = m.draft_head_eval(np.asarray(seq[1:], np.int32), feats[:-1])
    vocab = np.asarray(m.draft_vocab) if m.draft_vocab is not None else None
    m.kv_clear()
    # the first output token comes from the prompt's pass, not an early-exit step: from the second on
    start = len(prompt) + 1
    for j, (cand, _, conf) in zip(range(start, len(seq)), lookup_candidates(seq, start)):
        top = np.argsort(-head_logits[j - 2])[:4]
        top4 = set((vocab[top] if vocab is not None else top).tolist())
        right = cand == seq[j]
        c.in_top4 += seq[j] in top4
        c.lookup_right += right
        c.lookup_only += right and seq[j] not in top4
        c.confident += conf
        c.confident_right += conf and right


def pct(a: float, b: float) -> str:
    return f"{100.0 * a / b:.1f} %" if b else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.exit_lookup", description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True, help="SpecEE's specee-bench folder (<category>/question.jsonl)")
    ap.add_argument("-m", "--model", default=default_model_path())
    ap.add_argument("--draft-head", default=default_draft_head_path())
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    args = ap.parse_args(argv)

    totals: dict[str, Counts] = {}
    with Model(args.model, n_ctx=args.ctx_size, n_batch=args.ctx_size, n_threads=args.threads,
               draft_head=args.draft_head, ngram_cache=0) as m:
        sets = {name: category_messages(Path(args.data_dir), name, args.per_category) for name in CATEGORIES}
        sets["code-edit"] = code_edit_messages()[:max(args.per_category, 1)]
        for name, chats in sets.items():
            c = totals.setdefault(name, Counts())
            for chat in chats:
                text = chat_apply_template(m.chat_template(), chat)
                if len(m.tokenize(text, parse_special=True)) + args.n_predict + 8 <= args.ctx_size:
                    measure(m, text, args.n_predict, c)
    print("| category | tokens | exits/token | rejected firings/token | head's share of decode | in head's top-4 | "
          "lookup right | lookup right, not in top-4 (bound on extra exits) | confident (precision) | "
          "bound on time saved by skipping the head |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_c = Counts()
    for name, c in list(totals.items()) + [("all", all_c)]:
        if name != "all":
            for k in ("tokens", "exits", "rejected", "decode_ms", "head_ms", "in_top4", "lookup_right", "lookup_only",
                      "confident", "confident_right"):
                setattr(all_c, k, getattr(all_c, k) + getattr(c, k))
        head = c.head_ms / c.decode_ms if c.decode_ms else 0.0
        n = c.tokens  # decoded tokens; the offline counts run over the same positions
        print(f"| {name} | {c.tokens} | {c.exits / max(n, 1):.2f} | {c.rejected / max(n, 1):.2f} | "
              f"{100 * head:.0f} % | "
              f"{pct(c.in_top4, n)} | {pct(c.lookup_right, n)} | {pct(c.lookup_only, n)} | "
              f"{pct(c.confident, n)} ({pct(c.confident_right, c.confident)}) | "
              f"{100 * head * c.confident_right / max(n, 1):.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
