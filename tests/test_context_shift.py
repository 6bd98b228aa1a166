"""Context shift (specee.h's slots section, the server's --context-shift): a request whose generation fills its slot goes
on; the shift turns the cached K by RoPE exactly as a fresh evaluation at the new positions would (checked on a
one-layer model, where a layer's K/V depend on the token and its position only); off by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specee import DraftParams, Model
from specee.convert.hf import convert_hf_to_gguf
from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures: a tiny Llama with a BPE tokenizer, its GGUF)
from test_server import Server, call

N_CTX = 64
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("shift_hf")
    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=160, vocab_size=256, tie_word_embeddings=False, initializer_range=0.15,
                      max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    out = folder / "one-layer-f32.gguf"
    convert_hf_to_gguf(folder, out, "f32")
    return out


def run(model: Model, max_tokens: int, shift: bool, n_keep: int = 0, **options) -> tuple[list[int], str, int]:
    """One request on a slot of N_CTX cells: its tokens, finish reason and shifts."""
    slots = model.slots(1, 0)
    slots.set_context_shift(shift, n_keep)
    slot = slots.submit(PROMPT, max_tokens, temp=0, ignore_eos=True, **options)
    out: list[int] = []
    for _ in range(10 * max_tokens):  # bounded: a step emits one token at least
        slots.step()
        r = slots.read(slot)
        out += r.tokens
        if r.finish:
            break
    n_shifted = slots.n_shifted(slot)
    slots.release(slot)
    slots.close()
    return out, r.finish, n_shifted


def test_off_by_default_the_request_ends_with_its_context(one_layer: Path) -> None:
    m = Model(one_layer, n_ctx=N_CTX, n_threads=1)
    out, finish, n_shifted = run(m, 100, shift=False, mode="plain")
    assert finish == "context" and len(PROMPT) + len(out) == N_CTX + 1 and n_shifted == 0


@pytest.mark.parametrize("n_keep", [0, 4, -1])
def test_a_shift_equals_a_fresh_run_on_the_shifted_tokens(one_layer: Path, n_keep: int) -> None:
    m = Model(one_layer, n_ctx=N_CTX, n_threads=1)
    out, finish, n_shifted = run(m, 120, shift=True, n_keep=n_keep, mode="plain")
    assert finish == "length" and len(out) == 120 and n_shifted >= 2  # generated well past the context
    seq = PROMPT + out
    # the first shift, with the root at position N_CTX: n_keep tokens kept, half of the rest dropped
    keep = len(PROMPT) if n_keep < 0 else n_keep
    drop = (N_CTX - keep) // 2
    shifted = seq[:keep] + seq[keep + drop:N_CTX + 1]
    n_next = N_CTX - len(shifted) + 1  # the tokens until the next shift
    fresh = Model(one_layer, n_ctx=2 * N_CTX, n_threads=1)
    assert fresh.generate_tokens(shifted, n_next, temp=0, mode="plain", ignore_eos=True) == \
        seq[N_CTX + 1:N_CTX + 1 + n_next]


@pytest.mark.parametrize("mode, extra", [("ngram", {}), ("draft", {"draft": DraftParams(n_max=4)})])
def test_speculative_modes_shift_where_plain_decoding_does(one_layer: Path, mode: str, extra: dict) -> None:
    """A step never passes the slot's end, so the shifts fall where plain decoding's do: the same tokens."""
    m = Model(one_layer, n_ctx=N_CTX, n_threads=1, draft_model=one_layer)
    plain = run(m, 120, shift=True, mode="plain")
    assert run(m, 120, shift=True, mode=mode, **extra) == plain


def test_server_context_shift(bpe_gguf: Path) -> None:  # noqa: F811
    model = bpe_gguf
    body = {"prompt": "a b c a b c", "n_predict": 200, "ignore_eos": True}
    for flags, n, truncated in (([], None, True), (["--context-shift", "--keep", "2"], 200, True)):
        s = Server(model, "-np", "1", "-c", "64", "--mode", "plain", "--temp", "0", *flags)
        try:
            r = call(s.port, "POST", "/completion", body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["truncated"] is truncated
            assert got["tokens_predicted"] == n if n else got["tokens_predicted"] < 64
        finally:
            s.stop()
