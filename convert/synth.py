"""A synthetic Llama-2-7B-shaped GGUF with random weights, for cost benchmarks only (never quality).

The file is an ordinary `llama` GGUF with upstream llama.cpp's keys and tensor names, so llama.cpp's tools
(llama-bench, llama-cli) load it as this runtime does: Llama-2-7B's hyperparameters (32 layers, n_embd
4096, n_ff 11008, 32 heads and KV heads, vocab 32000, context 4096, rope base 10000, rms eps 1e-5; the
sizes are flags for smaller test files), untied token_embd and output, norms F32. Weights:
- f16: every matrix N(0, STD^2) in F16;
- q4_0: llama-quantize's default Q4_0 mixture for a Llama (output Q6_K, every other matrix Q4_0, as in
  upstream's "llama 7B Q4_0, 3.56 GiB" benchmark model): random quant bytes with one F16 scale per
  tensor chosen so the dequantized values have the same standard deviation STD;
- norms 1 + N(0, STD^2) in F32.
The vocabulary is SentencePiece-style (tokenizer.ggml.model "llama"): <unk>, <s>, </s>, the 256 byte
tokens <0x00>..<0xFF>, single characters, then made-up pieces, each the concatenation of two earlier
pieces (so that SentencePiece merges reach it), scores falling with the id. The file says what it is in
general.name and carries `specee.synthetic` = true. Written tensor by tensor (memory about the largest
tensor, token_embd); numpy's random generator with --seed makes it reproducible.

    python -m specee.convert synth -o synth-7b-q4_0.gguf --type q4_0
"""

from __future__ import annotations

import argparse
import math
import string
from typing import Callable

import gguf
import numpy as np

from specee import constants as C
from specee.convert.hf import LlamaConfig, fields_of, write_hparams
from specee.convert.output import OutTensor, write_gguf
from specee.convert.retype import Field
from specee.convert.vocab import SPACE_MARK

DESCRIPTION = "Write a Llama-2-7B-shaped GGUF with random weights and a made-up vocabulary (cost benchmarks only)"

NAME = "synthetic llama-2-7b-shaped (random weights, cost benchmarks only)"
KEY_SYNTHETIC = "specee.synthetic"
STD = 0.02  # standard deviation of the weights (Llama's initializer range)
MAX_PIECE_CHARS = 16

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType
T = gguf.TokenType
# --type -> (tensor type of the matrices, of output.weight, general.file_type)
TYPES = {
    "f16": (Q.F16, Q.F16, FT.MOSTLY_F16),
    "q4_0": (Q.Q4_0, Q.Q6_K, FT.MOSTLY_Q4_0),
}
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unknown, BOS, EOS
ALPHABET = SPACE_MARK + string.ascii_letters + string.digits + string.punctuation
N_FIXED = len(SPECIALS) + 256 + len(ALPHABET)  # the smallest vocabulary


def llama2_7b(n_layer: int = 32, n_embd: int = 4096, n_ff: int = 11008, n_head: int = 32,
              n_vocab: int = 32000) -> LlamaConfig:
    """Llama-2-7B's hyperparameters, with the sizes replaceable for small test files."""
    return LlamaConfig(n_vocab=n_vocab, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head,
                       n_head_kv=n_head, head_dim=n_embd // n_head if n_head > 0 else 0, n_ctx_train=4096,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def check_config(cfg: LlamaConfig) -> None:
    # n_embd: whole Q6_K blocks (256) in output's rows; n_ff: whole Q4_0 blocks (32) in ffn_down's rows
    if cfg.n_layer < 1:
        raise ValueError(f"--layers must be at least 1, not {cfg.n_layer}")
    if cfg.n_embd < 256 or cfg.n_embd % 256:
        raise ValueError(f"--embd must be a positive multiple of 256, not {cfg.n_embd}")
    if cfg.n_ff < 32 or cfg.n_ff % 32:
        raise ValueError(f"--ff must be a positive multiple of 32, not {cfg.n_ff}")
    if cfg.n_head < 1 or cfg.n_embd % cfg.n_head or cfg.head_dim % 2:
        raise ValueError(f"--heads must divide --embd ({cfg.n_embd}) into heads of an even size, not {cfg.n_head}")
    if cfg.n_vocab < N_FIXED:
        raise ValueError(f"--vocab must be at least {N_FIXED} (specials, bytes and single characters), "
                         f"not {cfg.n_vocab}")


# ---- vocabulary


def synthetic_vocab(n_vocab: int, rng: np.random.Generator) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of a made-up SentencePiece vocabulary of n_vocab tokens."""
    tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    types = [int(T.UNKNOWN), int(T.CONTROL), int(T.CONTROL)] + [int(T.BYTE)] * 256
    pieces = list(ALPHABET)
    seen = set(pieces)
    while len(pieces) < n_vocab - len(tokens):
        # two earlier pieces, the shorter (earlier) ones more often; the space mark only at the start
        a, b = (pieces[int(len(pieces) * u * u)] for u in rng.random(2))
        piece = a + b
        if len(piece) > MAX_PIECE_CHARS or b.startswith(SPACE_MARK) or piece in seen:
            continue
        seen.add(piece)
        pieces.append(piece)
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [int(T.NORMAL)] * len(pieces)


# ---- weights


def uniform_int_rms(lo: int, hi: int) -> float:
    """Root mean square of an integer drawn uniformly from lo..hi."""
    n, mean = hi - lo + 1, (lo + hi) / 2
    return math.sqrt((n * n - 1) / 12 + mean * mean)


# Root mean square of a block's dequantized values per unit of its F16 scale d, when every other byte is
# random: Q4_0 = d * (nibble - 8); Q6_K = d * int8 sub-block scale * (6-bit quant - 32).
UNIT_RMS = {
    Q.Q4_0: uniform_int_rms(-8, 7),
    Q.Q6_K: uniform_int_rms(-128, 127) * uniform_int_rms(-32, 31),
}
SCALE_OFFSET = {Q.Q4_0: 0, Q.Q6_K: 208}  # where d lies in the block (block_q4_0: d first; block_q6_K: d last)


def random_normal(rng: np.random.Generator, shape: tuple[int, ...], mean: float, qtype: Q) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= STD
    x += mean
    return x.astype(np.float16) if qtype == Q.F16 else x


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Random quant bytes with the F16 scale of every block set so that the values have std about STD."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block
    data = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    d = np.array([STD / UNIT_RMS[qtype]], dtype="<f2").view(np.uint8)
    off = SCALE_OFFSET[qtype]
    data[:, off:off + 2] = d
    return data.reshape(*shape[:-1], shape[-1] // block * size)


def weight_loader(seed: int, index: int, shape: tuple[int, ...], qtype: Q, mean: float) -> Callable[[], np.ndarray]:
    """The data of tensor number `index` (from 1; 0 is the vocabulary's), from a generator of its own."""

    def load() -> np.ndarray:
        rng = np.random.default_rng([seed, index])
        if qtype in (Q.F32, Q.F16):
            return random_normal(rng, shape, mean, qtype)
        return random_blocks(rng, shape, qtype)

    return load


def plan_tensors(cfg: LlamaConfig, outtype: str, seed: int) -> list[OutTensor]:
    """token_embd, the blocks in llama.cpp's table order, output_norm, output: names, shapes, types, loaders."""
    matrix, output, _ = TYPES[outtype]
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    block = {  # numpy shapes: [rows (GGML ne1), cols (ne0)]
        C.ATTN_NORM: (cfg.n_embd,),
        C.ATTN_Q: (q, cfg.n_embd),
        C.ATTN_K: (kv, cfg.n_embd),
        C.ATTN_V: (kv, cfg.n_embd),
        C.ATTN_OUTPUT: (cfg.n_embd, q),
        C.FFN_NORM: (cfg.n_embd,),
        C.FFN_GATE: (cfg.n_ff, cfg.n_embd),
        C.FFN_UP: (cfg.n_ff, cfg.n_embd),
        C.FFN_DOWN: (cfg.n_embd, cfg.n_ff),
    }
    shapes = [(C.TOKEN_EMBD, (cfg.n_vocab, cfg.n_embd), matrix)]
    for il in range(cfg.n_layer):
        shapes += [(fmt % il, shape, Q.F32 if len(shape) == 1 else matrix) for fmt, shape in block.items()]
    shapes += [(C.OUTPUT_NORM, (cfg.n_embd,), Q.F32), (C.OUTPUT, (cfg.n_vocab, cfg.n_embd), output)]
    return [OutTensor(name, shape, qtype, weight_loader(seed, i, shape, qtype, 1.0 if len(shape) == 1 else 0.0))
            for i, (name, shape, qtype) in enumerate(shapes, start=1)]


# ---- the draft head file of such a file (`--draft-head`): a draft head and exit predictors

SPECEE_EXIT_LAYERS = [15, 16, 17, 19, 21, 24, 26, 28]  # SpecEE's static set for Llama-2-7B
N_CANDIDATES = 4
PRED_HIDDEN = 512


def plan_draft_head(cfg: LlamaConfig, outtype: str, seed: int, draft_vocab: int) -> list[OutTensor]:
    """A random EAGLE-1 head (its matrices in the file's matrix type, a reduced draft vocabulary of draft_vocab
    tokens) and random exit predictors for every layer but the last (F32): a draft head file, loaded with
    `--draft-head`, to time early exit and EAGLE (cost only: random weights accept and exit at random)."""
    matrix = TYPES[outtype][0]
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    head = [  # numpy shapes: [rows (GGML ne1), cols (ne0)]
        (C.EAGLE_FC, (cfg.n_embd, 2 * cfg.n_embd), matrix), (C.EAGLE_FC_BIAS, (cfg.n_embd,), Q.F32),
        (C.EAGLE_ATTN_Q, (q, cfg.n_embd), matrix), (C.EAGLE_ATTN_K, (kv, cfg.n_embd), matrix),
        (C.EAGLE_ATTN_V, (kv, cfg.n_embd), matrix), (C.EAGLE_ATTN_OUTPUT, (cfg.n_embd, q), matrix),
        (C.EAGLE_FFN_NORM, (cfg.n_embd,), Q.F32), (C.EAGLE_FFN_GATE, (cfg.n_ff, cfg.n_embd), matrix),
        (C.EAGLE_FFN_UP, (cfg.n_ff, cfg.n_embd), matrix), (C.EAGLE_FFN_DOWN, (cfg.n_embd, cfg.n_ff), matrix),
        (C.EAGLE_OUTPUT, (draft_vocab, cfg.n_embd), matrix),
    ]
    preds = []
    for il in range(cfg.n_layer - 1):
        preds += [(C.PRED_UP % il, (PRED_HIDDEN, 3 * N_CANDIDATES), Q.F32), (C.PRED_UP_BIAS % il, (PRED_HIDDEN,), Q.F32),
                  (C.PRED_DOWN % il, (1, PRED_HIDDEN), Q.F32), (C.PRED_DOWN_BIAS % il, (1,), Q.F32)]
    norms = {C.EAGLE_FFN_NORM}
    return [OutTensor(name, shape, qtype, weight_loader(seed + 1, i, shape, qtype, 1.0 if name in norms else 0.0))
            for i, (name, shape, qtype) in enumerate(head + preds, start=1)]


def draft_head_fields(cfg: LlamaConfig, draft_vocab: int) -> dict[str, Field]:
    meta = gguf.GGUFWriter(None, C.ARCH)
    meta.add_name(NAME + ": draft head file (draft head and exit predictors)")
    meta.add_uint32(C.KEY_EAGLE_VERSION, 1)
    meta.add_uint32(C.KEY_EAGLE_FEED_FORWARD_LENGTH, cfg.n_ff)
    meta.add_array(C.KEY_EAGLE_DRAFT_VOCAB, list(range(draft_vocab)))
    meta.add_array(C.KEY_EXIT_LAYERS, [il for il in SPECEE_EXIT_LAYERS if il < cfg.n_layer - 1])
    meta.add_float32(C.KEY_EXIT_THRESHOLD, 0.5)
    meta.add_uint32(C.KEY_EXIT_N_CANDIDATES, N_CANDIDATES)
    meta.add_bool(KEY_SYNTHETIC, True)
    return fields_of(meta)


# ---- the file


def synth_fields(cfg: LlamaConfig, outtype: str, seed: int) -> dict[str, Field]:
    meta = gguf.GGUFWriter(None, C.ARCH)
    write_hparams(meta, cfg, NAME, TYPES[outtype][2])
    tokens, scores, types = synthetic_vocab(cfg.n_vocab, np.random.default_rng([seed, 0]))
    meta.add_tokenizer_model("llama")
    meta.add_tokenizer_pre("default")
    meta.add_token_list(tokens)
    meta.add_token_scores(scores)
    meta.add_token_types(types)
    meta.add_unk_token_id(0)
    meta.add_bos_token_id(1)
    meta.add_eos_token_id(2)
    meta.add_add_bos_token(True)
    meta.add_add_eos_token(False)
    meta.add_quantization_version(gguf.GGML_QUANT_VERSION)
    meta.add_bool(KEY_SYNTHETIC, True)
    return fields_of(meta)


def write_synthetic(out: str, cfg: LlamaConfig, outtype: str, seed: int = 0, progress: bool = True) -> None:
    """Write a synthetic llama GGUF of cfg's shape with random weights of `outtype` (f16, q4_0)."""
    if outtype not in TYPES:
        raise ValueError(f"--type must be one of {list(TYPES)}, not {outtype!r}")
    if seed < 0:
        raise ValueError(f"--seed must be 0 or more, not {seed}")
    check_config(cfg)
    write_gguf(out, C.ARCH, synth_fields(cfg, outtype, seed), plan_tensors(cfg, outtype, seed),
               desc=f"writing synthetic {outtype}", progress=progress)


def write_synthetic_draft_head(out: str, cfg: LlamaConfig, outtype: str, seed: int = 0, draft_vocab: int = 8192,
                          progress: bool = True) -> None:
    """Write the draft head file of a random draft head and random exit predictors for a synthetic file of cfg."""
    if not 0 < draft_vocab <= cfg.n_vocab:
        raise ValueError(f"--draft-vocab must be in 1..{cfg.n_vocab}, not {draft_vocab}")
    check_config(cfg)
    write_gguf(out, C.ARCH, draft_head_fields(cfg, draft_vocab), plan_draft_head(cfg, outtype, seed, draft_vocab),
               desc=f"writing synthetic draft head file {outtype}", progress=progress)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-o", "--out", required=True, help="output .gguf path")
    ap.add_argument("--draft-head", action="store_true",
                    help="write the draft head file of such a file instead: a draft head (EAGLE-1, --draft-vocab "
                         "tokens, matrices in --type) and exit predictors, for loading with --draft-head")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="--draft-head: rows of the head's lm_head (default 8192)")
    ap.add_argument("--type", type=str.lower, choices=list(TYPES), default="q4_0",
                    help="q4_0: llama-quantize's default Q4_0 mixture (output Q6_K); f16 (default q4_0)")
    ap.add_argument("--layers", type=int, default=32, help="number of layers (default 32)")
    ap.add_argument("--embd", type=int, default=4096, help="hidden size, a multiple of 256 (default 4096)")
    ap.add_argument("--ff", type=int, default=11008, help="feed-forward size, a multiple of 32 (default 11008)")
    ap.add_argument("--heads", type=int, default=32, help="attention heads, also the KV heads (default 32)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run(args: argparse.Namespace) -> None:
    cfg = llama2_7b(args.layers, args.embd, args.ff, args.heads, args.vocab)
    if args.draft_head:
        write_synthetic_draft_head(args.out, cfg, args.type, args.seed, args.draft_vocab)
    else:
        write_synthetic(args.out, cfg, args.type, args.seed)
    print(f"wrote {args.out} (synthetic: random weights, for cost benchmarks only)")

