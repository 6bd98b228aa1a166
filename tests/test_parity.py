"""Logits of the runtime against Hugging Face transformers (float32, eager attention)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specee

TOKENS = np.random.default_rng(3).integers(0, 256, 40).tolist()  # smallest top-1 margin 0.049
# Tiny random model, F32 weights. The runtime keeps K/V in F16 and ggml's CPU flash attention rounds Q
# to F16 and, below 64 query rows, accumulates V in F16; that bounds the agreement. Measured max abs
# error 0.0138 (all positions) and 0.0136 (decode), logit std ~1.2, smallest reference top-1 margin 0.049.
TINY_ATOL = 0.03


def assert_logits_close(got: np.ndarray, ref: np.ndarray, atol: float) -> None:
    """Max abs error under atol, and the same top-1 token at every position. Where the reference's
    top two logits are closer than atol (a near-tie, which rounding may order either way), the
    runtime's top-1 must be one of the reference's near-tied tokens."""
    assert got.shape == ref.shape
    err = np.abs(got - ref).max(axis=-1)
    assert err.max() < atol, f"max abs error {err.max():.3g} at position {err.argmax()} (atol {atol})"
    rows = np.arange(len(ref))
    top_got = got.argmax(-1)
    shortfall = ref.max(-1) - ref[rows, top_got]  # 0 where the top-1 tokens agree
    bad = np.flatnonzero(shortfall >= atol)
    assert bad.size == 0, f"top-1 differs at positions {bad.tolist()} (reference shortfall {shortfall[bad]})"


def test_tiny_model_facts(tiny_gguf: Path) -> None:
    m = specee.Model(tiny_gguf, n_ctx=64, n_threads=2)
    assert (m.n_layer, m.n_embd, m.n_ff, m.n_head, m.n_head_kv, m.n_vocab) == (4, 64, 160, 4, 2, 256)
    assert m.n_ctx_train == 512
    assert m.metadata["general.architecture"] == "llama"


def test_tiny_logits_all_positions(tiny_gguf: Path, tiny_hf, hf_forward) -> None:
    m = specee.Model(tiny_gguf, n_ctx=128, n_threads=2)
    got = m.eval(TOKENS, output="all")
    assert got.dtype == np.float32
    assert_logits_close(got, hf_forward(tiny_hf, TOKENS), TINY_ATOL)
    last = specee.Model(tiny_gguf, n_ctx=128, n_threads=2).eval(TOKENS)
    np.testing.assert_allclose(last, got[-1:], atol=1e-5)  # lm_head over 1 row vs 40: f32 rounding only


def test_tiny_decode_one_token_at_a_time(tiny_gguf: Path, tiny_hf, hf_forward) -> None:
    m = specee.Model(tiny_gguf, n_ctx=128, n_threads=2)
    rows = [m.eval(TOKENS[:10], output="all")]
    for tok in TOKENS[10:]:
        rows.append(m.eval([tok]))
    assert m.kv_n_used == len(TOKENS) and m.kv_pos_max == len(TOKENS) - 1
    assert_logits_close(np.concatenate(rows), hf_forward(tiny_hf, TOKENS), TINY_ATOL)


# ---- SmolLM2-135M (real weights): the Q4_1 file dequantized to F32, so both sides use the same weights

SMOL_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels of cables; later, stored programs let the same hardware run any sequence of instructions. "
    "Assembly languages gave names to those instructions, and compilers turned readable formulas into "
    "machine code. Operating systems hid the details of disks, memory and devices behind files and "
    "processes. Each layer let people think about larger problems without the details of the layer "
    "below. Networks connected the machines, and the web connected the documents on them. Today a "
    "student can write a few lines of Python that train a neural network on a graphics card, a task "
    "that would have needed a research laboratory and years of work a few decades ago. Yet every "
    "layer still rests on the ones beneath it: a bug in a compiler, a driver or a processor can "
    "surface as a wrong answer many levels above. Good engineers therefore learn to look through "
    "the abstractions when they must, to measure instead of guessing, and to test every assumption "
    "against the real system. They write small programs that check large ones, compare two "
    "implementations of the same idea, and keep the simplest version that is still correct. When a "
    "result looks too good, they run it again on a different machine, with a different seed and a "
    "larger input, and they write down what changed. A number without its conditions is only a rumour; "
    "a number with its conditions, its code and its data is a fact that anyone can check tomorrow."
)
# Measured on the 301 tokens below: max abs error 0.016; top-1 equal at every position, although the
# smallest reference top-1 margin is 0.0032 (a near-tie: assert_logits_close accepts either token there).
SMOL_ATOL = 0.05


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_f32: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_f32.parent, gguf_file=smollm2_f32.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = smol_tokens(smollm2_f32)
    assert len(tokens) >= 280
    with torch.no_grad():
        ref = hf(torch.as_tensor([tokens])).logits[0].numpy()
    m = specee.Model(smollm2_f32, n_ctx=512)
    assert_logits_close(m.eval(tokens, output="all"), ref, SMOL_ATOL)


def smol_tokens(path: Path) -> list[int]:
    """SMOL_TEXT tokenized by transformers' tokenizer built from the GGUF vocabulary."""
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return tok(SMOL_TEXT)["input_ids"]
