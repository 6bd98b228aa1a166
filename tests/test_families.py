"""Model families beyond Llama (csrc/base/specee-arch.cpp's table): tiny random Qwen2, Qwen3, Phi-3, Mistral, Gemma 2
and Gemma 3 models made with transformers, converted by `python -m specee.convert hf` and by upstream llama.cpp's
convert_hf_to_gguf.py (when its source is here). Logits against transformers' (F32), the two converters' files against
each other, EAGLE's greedy tokens against plain decoding, early exit's forced exits against a masked forward of the same
weights, Gemma's sliding windows, tokenizer and chat template, and the errors a file or checkpoint of a family gets when
it is incomplete."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Sequence

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, normalizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

import specee
from specee import EagleParams
from specee import constants as C
from specee.autoee.eagle_export import export_head
from specee.autoee.eagle_head import EagleHead, read_base
from specee.convert.hf import convert_hf_to_gguf
from specee.convert.merge import merge_gguf
from specee.convert.retype import read_gguf
from specee.convert.vocab import SPACE_MARK
import tokenizer_fixtures as tf
from conftest import rope
from test_convert_cli import CORPUS, eagle_state, upstream_binary
from test_devices import ATOL as RPC_ATOL
from test_devices import check_ngl, rpc_server  # noqa: F401 (fixture: a specee-rpc-server on 127.0.0.1)
from test_eagle import save_published
from test_early_exit import check_against_masked_forward, exit_decode
from test_parity import TINY_ATOL, assert_logits_close

# upstream's converter: $SPECEE_UPSTREAM_CONVERT, else the llama-cpp-python 0.3.36 sdist unpacked in ../up beside the
# repository; the tests that need it skip without it
UPSTREAM = Path(os.environ.get("SPECEE_UPSTREAM_CONVERT", Path(__file__).resolve().parents[2] / "up" /
                               "llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py"))

COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=160, vocab_size=320, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# family -> (config, what it adds, the GGUF architecture it is written as)
FAMILIES = {
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True), "qwen2"),  # Qwen2.5's small models tie their embeddings
    "qwen3": (Qwen3Config, dict(head_dim=32), "qwen3"),  # head_dim * heads != hidden_size, as in Qwen3
    "phi3": (Phi3Config, dict(original_max_position_embeddings=512), "phi3"),
    "mistral": (MistralConfig, dict(sliding_window=None), "llama"),
    # a window of 6 positions on prompts of up to 40 tokens; soft-capping low enough to bend these logits; the query
    # scale of the head size (llama.cpp assumes it; test_gemma_query_scale_other_than_the_head_size the other case)
    "gemma2": (Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, tie_word_embeddings=True,
                                  attn_logit_softcapping=3.0, final_logit_softcapping=5.0, bos_token_id=2,
                                  eos_token_id=1), "gemma2"),
    # six layers: five sliding (with their own RoPE base), one global
    "gemma3": (Gemma3TextConfig, dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=6, num_hidden_layers=6,
                                      tie_word_embeddings=True, rope_local_base_freq=100.0, bos_token_id=2,
                                      eos_token_id=1), "gemma3"),
}
GEMMA = ("gemma2", "gemma3")
GEMMA_MARKERS = ["<start_of_turn>", "<end_of_turn>"]  # Gemma's chat turns: user-defined pieces, special tokens
# Phi-3's added tokens (special; those of its chat turns strip the whitespace after them, as its tokenizer_config says);
# llama.cpp's vocabulary looks <|endoftext|> up in every file named Phi-3 and fails to load one without it
PHI3_MARKERS = {"<|endoftext|>": False, "<|assistant|>": True, "<|system|>": True, "<|end|>": True, "<|user|>": True}
TOKENS = np.random.default_rng(11).integers(3, 320, 40).tolist()
PROMPTS = [np.random.default_rng(s).integers(3, 320, 5 + 2 * s).tolist() for s in range(3)]


def save_family(family: str, path: Path, seed: int = 0, **config) -> None:
    """A tiny random model of the family (config: settings over the family's) with a SentencePiece tokenizer (both
    converters read one; Gemma's as Gemma has it: no space put in front, <pad> <eos> <bos> <unk> first, the chat
    turn markers; Phi-3's with its added tokens); norms, Q/K norms and biases random (transformers makes them 1 and
    0, Gemma's norms 0: they scale by 1 + weight), so that a missing or misplaced one shows."""
    config_cls, extra, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**{**COMMON, **extra, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's scale by 1 + weight: the same spread around 1
                p.copy_((0.0 if family in GEMMA else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    buf = io.BytesIO()
    gemma = family in GEMMA
    markers = dict.fromkeys(GEMMA_MARKERS, False) if gemma else PHI3_MARKERS if family == "phi3" else {}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=320, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2, user_defined_symbols=list(markers),
        **(dict(add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                bos_piece="<bos>") if gemma else {}))
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    added = {str(sp.PieceToId(t)): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                    "rstrip": rstrip, "single_word": False} for t, rstrip in markers.items()}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "chat_template": GEMMA3_TEMPLATE,
         "added_tokens_decoder": added}
        if gemma else
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
         "add_eos_token": False, "added_tokens_decoder": added}))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"{family}_hf")
    save_family(family, path)
    return path


@pytest.fixture(scope="module")
def hf_model(hf_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(hf_dir: Path, family: str) -> Path:
    out = hf_dir / f"{family}-specee-f32.gguf"
    convert_hf_to_gguf(hf_dir, out, "f32", progress=False)
    return out


@pytest.fixture(scope="module")
def upstream(hf_dir: Path, family: str) -> Path:
    """The same folder converted by upstream's convert_hf_to_gguf.py, run by this Python (its own gguf-py)."""
    if not UPSTREAM.is_file():
        pytest.skip(f"upstream's converter is not here ({UPSTREAM}; SPECEE_UPSTREAM_CONVERT names it)")
    out = hf_dir / f"{family}-upstream-f32.gguf"
    r = subprocess.run([sys.executable, str(UPSTREAM), str(hf_dir), "--outfile", str(out), "--outtype", "f32"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ModuleNotFoundError" in r.stderr:
        pytest.skip(f"upstream's converter needs a package this environment lacks: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor([tokens])).logits[0].float().numpy()


# ---- an explicit forward of every family with per-layer masks (the reference for early exit's skipped layers)


def family_forward(model: torch.nn.Module, tokens: list[int], pos: list[int] | None = None,
                   masks: list[np.ndarray] | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """conftest.llama_forward_masked for every family, through the model's own modules (biases, Q/K norms, fused QKV
    and gate/up as each has them; Gemma's scaled embeddings, post norms, GeGLU, query scale, soft-capping, sliding
    windows and local RoPE base); RoPE rotate-half on HF's rows. Returns logits and each layer's output."""
    cfg = model.config
    n = len(tokens)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rp = cfg.rope_parameters
    theta = float(rp.get("full_attention", rp)["rope_theta"])
    theta_swa = float(rp.get("sliding_attention", rp.get("full_attention", rp))["rope_theta"])
    gemma = cfg.model_type in ("gemma2", "gemma3_text")
    scale = float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else hd ** -0.5
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    types = getattr(cfg, "layer_types", None) if gemma else None
    p = torch.arange(n) if pos is None else torch.as_tensor(pos)
    if masks is None:
        masks = [np.tril(np.ones((n, n), dtype=bool))] * cfg.num_hidden_layers
    window = (p[:, None] - p[None, :]).numpy() < (cfg.sliding_window or 0)
    hiddens = []
    with torch.no_grad():
        x = model.model.embed_tokens.weight[torch.as_tensor(tokens)]
        if gemma:
            x = x * torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)
        for il, (layer, mask) in enumerate(zip(model.model.layers, masks)):
            att, mlp = layer.self_attn, layer.mlp
            slides = types is not None and types[il] == "sliding_attention"
            if slides:
                mask = mask & window
            h = layer.input_layernorm(x)
            if hasattr(att, "qkv_proj"):
                q, k, v = att.qkv_proj(h).split([n_head * hd, n_kv * hd, n_kv * hd], -1)
            else:
                q, k, v = att.q_proj(h), att.k_proj(h), att.v_proj(h)
            q, k, v = q.view(n, n_head, hd), k.view(n, n_kv, hd), v.view(n, n_kv, hd)
            if hasattr(att, "q_norm"):
                q, k = att.q_norm(q), att.k_norm(k)
            th = theta_swa if slides else theta
            q, k = rope(q.transpose(0, 1), p, th), rope(k.transpose(0, 1), p, th)
            k = k.repeat_interleave(n_head // n_kv, 0)
            v = v.transpose(0, 1).repeat_interleave(n_head // n_kv, 0)
            scores = q @ k.transpose(1, 2) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~torch.as_tensor(mask)[None], float("-inf"))
            a = att.o_proj((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, n_head * hd))
            if gemma:  # post_attention_layernorm is the attention output's norm there
                x = x + layer.post_attention_layernorm(a)
                h = layer.pre_feedforward_layernorm(x)
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
                x = x + layer.post_feedforward_layernorm(
                    mlp.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up))
            else:
                x = x + a
                h = layer.post_attention_layernorm(x)
                if hasattr(mlp, "gate_up_proj"):
                    gate, up = mlp.gate_up_proj(h).chunk(2, -1)
                else:
                    gate, up = mlp.gate_proj(h), mlp.up_proj(h)
                x = x + mlp.down_proj(torch.nn.functional.silu(gate) * up)
            hiddens.append(x.numpy().copy())
        logits = model.lm_head(model.model.norm(x))
        if getattr(cfg, "final_logit_softcapping", None):
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits.numpy(), hiddens


def test_the_explicit_forward_is_transformers(hf_model: torch.nn.Module) -> None:
    """The reference of the early-exit test computes what transformers computes."""
    np.testing.assert_allclose(family_forward(hf_model, TOKENS)[0], hf_logits(hf_model, TOKENS), atol=2e-4)


# ---- conversion and logits


def test_architecture_and_family_tensors(ours: Path, family: str) -> None:
    arch = FAMILIES[family][2]
    n_layer = FAMILIES[family][1].get("num_hidden_layers", COMMON["num_hidden_layers"])
    fields, tensors = read_gguf(ours)
    assert fields["general.architecture"].value == arch
    assert fields[C.KEY_BLOCK_COUNT.format(arch=arch)].value == n_layer
    layer0 = {n for n in tensors if n.startswith("blk.0.")}
    assert layer0 == {t % 0 for t in C.FAMILIES[arch].layer_tensors}
    m = specee.Model(ours, n_ctx=64, n_threads=2)
    assert m.desc.startswith(arch + " ")
    assert (m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.n_vocab) == (n_layer, 64, 4, 2, 320)


@pytest.mark.parametrize("converter", ["ours", "upstream"])
def test_logits_match_transformers(converter: str, request: pytest.FixtureRequest, hf_model) -> None:
    path: Path = request.getfixturevalue(converter)
    ref = hf_logits(hf_model, TOKENS)
    m = specee.Model(path, n_ctx=128, n_threads=2)
    assert_logits_close(m.eval(TOKENS, output="all"), ref, TINY_ATOL)
    m.kv_clear()
    rows = [m.eval(TOKENS[:10], output="all")] + [m.eval([t]) for t in TOKENS[10:]]  # one token at a time
    assert_logits_close(np.concatenate(rows), ref, TINY_ATOL)


def test_converters_write_the_same_tensors(ours: Path, upstream: Path, family: str) -> None:
    """The project's converter and upstream's: the same tensors, bit for bit, and the same values of the keys the
    runtime reads (upstream writes more keys: the tokenizer's extras, file metadata)."""
    f_ours, t_ours = read_gguf(ours)
    f_up, t_up = read_gguf(upstream)
    assert sorted(t_ours) == sorted(t_up)
    for name in t_ours:
        np.testing.assert_array_equal(t_ours[name], t_up[name], err_msg=name)
    arch = FAMILIES[family][2]
    for key in (getattr(C, k).format(arch=arch) for k in dir(C) if k.startswith("KEY_") and "{arch}" in getattr(C, k)):
        if key in f_up:
            assert key in f_ours and f_ours[key].value == pytest.approx(f_up[key].value), key
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        assert f_ours[key].value == f_up[key].value, key


# prompts for the greedy runs beside upstream: digits, code, unicode outside the training text (byte fallback); each
# longer than Gemma's window of 6
GREEDY_TEXTS = ["The quick brown fox, 12 and 4567 numbers", "def f(x):\n    return x * 2  # tabs\tand caf\u00e9",
                "z\u00fcrich \U0001f600 \u65e5\u672c \u2014 r\u00e9sum\u00e9"]
N_GREEDY = 32


def llama_completion_tokens(exe: str, path: Path, text: str, n: int, tmp: Path, extra: Sequence[str] = ()
                            ) -> list[int]:
    """upstream llama.cpp's llama-completion on a text, greedy, F16 V cache (-ctv f16), n tokens past any end token
    (with the flags `extra`): the prompt's tokens and the generated ones, read from the session file
    --prompt-cache-all writes (magic, version, a count, that many int32 tokens, then the context's state)."""
    session = tmp / "session.bin"
    session.unlink(missing_ok=True)
    run = subprocess.run([exe, "-m", path, "-p", text, "-n", str(n), "--temp", "0", "-ctv", "f16", "-no-cnv",
                          "--ignore-eos", "-c", "256", "-t", "2", "--no-warmup", "--simple-io", "--seed", "1",
                          "--prompt-cache", session, "--prompt-cache-all", *extra],
                         capture_output=True, encoding="utf-8", errors="replace", stdin=subprocess.DEVNULL, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    data = session.read_bytes()
    magic, _, count = struct.unpack_from("<III", data)
    assert magic == 0x6767736E  # "ggsn"
    return list(struct.unpack_from(f"<{count}i", data, 12))


@pytest.mark.upstream
@pytest.mark.parametrize("converter", ["ours", "upstream"])
def test_greedy_tokens_equal_upstream_llama_completion(family: str, converter: str, request: pytest.FixtureRequest,
                                                       tmp_path: Path) -> None:
    """The file from either converter, run by this runtime and by upstream's llama-completion with an F16 V cache (as
    upstream's default): the same prompt tokens (a chat turn's markers parsed, as llama-completion parses them) and the
    same greedy tokens (past the window on Gemma)."""
    exe = upstream_binary("llama-completion", "SPECEE_LLAMA_COMPLETION")
    path: Path = request.getfixturevalue(converter)
    m = specee.Model(path, n_ctx=256, n_threads=2, type_v="f16")
    for text in GREEDY_TEXTS + ([CHAT_TEXTS[family]] if family in CHAT_TEXTS else []):
        theirs = llama_completion_tokens(exe, path, text, N_GREEDY, tmp_path)
        prompt = m.tokenize(text, parse_special=True)
        assert theirs[:len(prompt)] == prompt, text
        ours = [int(t) for t in m.generate_tokens(prompt, N_GREEDY, mode="plain", temp=0, ignore_eos=True)]
        assert ours == theirs[len(prompt):], text


def test_phi3_longrope_in_short_and_long_contexts(tmp_path: Path) -> None:
    """Phi-3's LongRoPE (its 128k models): the short factors within the original context, the long ones past it, and
    the cos/sin scale; a context's factors are those of its size, as llama.cpp picks them, and transformers picks
    them by the sequence's length: a context of 32 cells on 24 tokens and one of 128 on 48 compare like for like."""
    g = np.random.default_rng(2)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": (1 + g.random(8)).tolist(), "long_factor": (1 + 4 * g.random(8)).tolist()}
    save_family("phi3", tmp_path, original_max_position_embeddings=32, max_position_embeddings=128,
                rope_parameters=rope)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    convert_hf_to_gguf(tmp_path, tmp_path / "phi3-longrope.gguf", "f32", progress=False)
    fields, tensors = read_gguf(tmp_path / "phi3-longrope.gguf")
    np.testing.assert_array_equal(tensors[C.ROPE_FACTORS_LONG], np.float32(rope["long_factor"]))
    assert fields[C.KEY_ROPE_SCALING_ATTN_FACTOR.format(arch="phi3")].value == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(32)))
    long_tokens = (TOKENS * 2)[:48]
    short_ref, long_ref = hf_logits(hf, long_tokens[:24]), hf_logits(hf, long_tokens)
    assert np.abs(short_ref - long_ref[:24]).max() > 10 * TINY_ATOL  # the factors matter
    short = specee.Model(tmp_path / "phi3-longrope.gguf", n_ctx=32, n_threads=2)
    assert_logits_close(short.eval(long_tokens[:24], output="all"), short_ref, TINY_ATOL)
    long = specee.Model(tmp_path / "phi3-longrope.gguf", n_ctx=128, n_threads=2)
    assert_logits_close(long.eval(long_tokens, output="all"), long_ref, TINY_ATOL)
    if UPSTREAM.is_file():  # upstream's converter writes the same factors and scale
        out = tmp_path / "upstream.gguf"
        r = subprocess.run([sys.executable, str(UPSTREAM), str(tmp_path), "--outfile", str(out), "--outtype", "f32"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        f_up, t_up = read_gguf(out)
        for name in (C.ROPE_FACTORS_LONG, C.ROPE_FACTORS_SHORT):
            np.testing.assert_array_equal(t_up[name], tensors[name])
        key = C.KEY_ROPE_SCALING_ATTN_FACTOR.format(arch="phi3")
        assert f_up[key].value == pytest.approx(fields[key].value)


def test_tokenizer_matches_sentencepiece(ours: Path, hf_dir: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    m = specee.Model(ours, n_ctx=64, n_threads=2)
    for text in ("Hello world", " two  spaces and\nnew lines", "digits 12345 and ünïcödé"):
        assert m.tokenize(text, add_special=True) == [sp.bos_id()] + sp.encode(text), text


# the text set every family's tokenizer is checked on: unicode (emoji, CJK, combining marks, RTL), digits of every
# length, whitespace runs of every kind before every kind of character, code and markup (tokenizer_fixtures)
FAMILY_TEXTS = tf.stress_texts(n_random=60) + tf.whitespace_texts() + ["Hello world", " lead", "x  y\n\nz"]
# a chat turn in each family's markers (where the fixture has them): Phi-3's take the whitespace after them
CHAT_TEXTS = {"phi3": "<|system|>\n Be brief.<|end|>\n<|user|>\n\tHi there <|end|>  \n<|assistant|>\n",
              "gemma2": "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"}
CHAT_TEXTS["gemma3"] = CHAT_TEXTS["gemma2"]


def sp_tokenizers(folder: Path, gemma: bool) -> Tokenizer:
    """The fixture's SentencePiece model as a `tokenizers` BPE laid out as the families' published tokenizer.json files
    are (Llama 2, Mistral, Phi-3: a space put in front and spaces as U+2581; Gemma: no space in front; byte fallback),
    with the merges transformers derives from a BPE model's scores (its own extractor needs protobuf, which this
    environment lacks); special: the control pieces (<s>, <bos>, ...) and the added tokens of tokenizer_config.json,
    with their rstrip flags."""
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    added = {t["content"]: t for t in json.loads((folder / "tokenizer_config.json").read_text())
             .get("added_tokens_decoder", {}).values()}
    vocab = {sp.IdToPiece(i): i for i in range(sp.vocab_size())}
    merges = []
    for piece, i in vocab.items():
        if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsByte(i) or piece in added:
            continue
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(sp.GetScore(i), vocab[a], vocab[b], a, b) for a, b in local]
    merges = [(a, b) for _, _, _, a, b in sorted(merges, key=lambda m: (-m[0], m[1], m[2]))]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=sp.IdToPiece(sp.unk_id()), byte_fallback=True, fuse_unk=True))
    space = [normalizers.Replace(" ", SPACE_MARK)]
    tok.normalizer = normalizers.Sequence(space if gemma else [normalizers.Prepend(SPACE_MARK)] + space)
    control = {sp.IdToPiece(i): {"lstrip": False, "rstrip": False} for i in range(sp.vocab_size()) if sp.IsControl(i)}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=a["lstrip"], rstrip=a["rstrip"])
                            for t, a in {**control, **added}.items()])
    return tok


@pytest.mark.parametrize("converter", ["ours", "upstream"])
def test_tokenizer_matches_tokenizers(family: str, converter: str, request: pytest.FixtureRequest,
                                      hf_dir: Path) -> None:
    """Every family's tokenizer, from either converter's file, tokenizes the text set as `tokenizers` does (Qwen's
    byte-level BPE: test_qwen_with_its_bpe_tokenizer_end_to_end), and a chat turn in its markers with them parsed."""
    tok = sp_tokenizers(hf_dir, family in GEMMA)
    m = specee.Model(request.getfixturevalue(converter), n_ctx=64, n_threads=2)
    assert len(FAMILY_TEXTS) > 1000
    for text in FAMILY_TEXTS:
        assert m.tokenize(text, add_special=False) == tok.encode(text, add_special_tokens=False).ids, repr(text)
    if family in CHAT_TEXTS:
        chat = CHAT_TEXTS[family]
        assert m.tokenize(chat, add_special=False, parse_special=True) == tok.encode(chat).ids


# ---- EAGLE and early exit on every family

PRED_LAYERS = [0, 1]


@pytest.fixture(scope="module")
def with_head(ours: Path, hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted model with a random EAGLE-1 head (trained by nothing) and random exit predictors on layers 0-1."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = eagle_state(cfg, seed=3)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(4)
    h, n_head, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, shape in (("q_proj", (n_head * hd, h)), ("k_proj", (n_kv * hd, h)), ("v_proj", (n_kv * hd, h)),
                        ("o_proj", (h, n_head * hd))):
        state[f"layers.0.self_attn.{name}.weight"] = 0.15 * torch.randn(*shape, generator=g)
    d = tmp_path_factory.mktemp("family_head")
    preds = {}
    for il in PRED_LAYERS:
        preds[f"blk.{il}.pred.up.weight"] = torch.randn(512, 12, generator=g) * 0.3
        preds[f"blk.{il}.pred.up.bias"] = torch.randn(512, generator=g) * 0.1
        preds[f"blk.{il}.pred.down.weight"] = torch.randn(1, 512, generator=g) * 0.1
        preds[f"blk.{il}.pred.down.bias"] = torch.randn(1, generator=g) * 0.1
    save_file(preds, d / "pred.safetensors")
    (d / "pred.json").write_text(json.dumps({"format": "specee-predictors", "exit_layers": PRED_LAYERS}))
    out = d / "with-head.gguf"
    merge_gguf(ours, out, eagle=save_published(state, cfg, d / "head"), eagle_type="f32",
               predictors=d / "pred.safetensors", progress=False)
    return out


@pytest.mark.parametrize("mode", ["eagle", "eagle2"])
def test_eagle_greedy_equals_plain(with_head: Path, mode: str) -> None:
    m = specee.Model(with_head, n_ctx=256, n_threads=2)
    drafted = 0
    for prompt in PROMPTS:
        plain = m.generate_tokens(prompt, 32, mode="plain", temp=0, ignore_eos=True)
        spec = m.generate_tokens(prompt, 32, mode=mode, temp=0, ignore_eos=True,
                                 eagle=EagleParams(topk=4) if mode == "eagle2" else EagleParams())
        assert spec == plain
        drafted += m.last_stats.n_drafted
    assert drafted > 0  # the head drafted, the model verified trees


def test_early_exit_never_exiting_equals_plain(with_head: Path) -> None:
    m = specee.Model(with_head, n_ctx=128, n_threads=2)
    for prompt in PROMPTS:
        plain = [int(t) for t in m.generate_tokens(prompt, 16, mode="plain", temp=0)]  # up to an end token
        out, layers, st = exit_decode(m, prompt, 16, threshold=1.0)  # 16 tokens, end tokens or not
        assert plain and out[:len(plain)] == plain
        assert st["n_exits"] == 0 and st["n_checks"] == 15 * len(PRED_LAYERS)


def test_early_exit_forced_exits_mask_the_skipped_layers(with_head: Path, hf_model) -> None:
    """Exits at layers 0 and 1 on a schedule: each token is the argmax at its exit layer of a forward that hides the
    exited tokens' cells in the layers they skipped (the family's biases, norms and RoPE in the K/V it wrote)."""
    m = specee.Model(with_head, n_ctx=128, n_threads=2)
    schedule = [0, -1, 1, 1, -1, 0, 0, 1]
    checked = 0
    for prompt in PROMPTS:
        out, layers, st = exit_decode(m, prompt, 16, threshold=1.0, schedule=schedule)
        assert st["n_exits"] > 0
        checked += check_against_masked_forward(hf_model, prompt, out, layers, family_forward)
    assert checked >= 15


def test_layers_on_an_rpc_device_give_the_cpus_logits(ours: Path, rpc_server: str) -> None:  # noqa: F811
    """The family's layers (biases, norms, fused matrices placed with their layer) on a second device, ggml RPC: the
    server's graph checks take the family's ops, and -ngl 0..all gives the CPU's logits and tokens."""
    check_ngl(ours, "first", "RPC", RPC_ATOL, rpc_servers=[rpc_server])


# ---- errors


def test_incomplete_family_files_are_refused(ours: Path, family: str, tmp_path: Path) -> None:
    """A file lacking one of its family's layer tensors, or with one of the wrong shape, gets an error naming it."""
    arch = FAMILIES[family][2]
    extra = [t for t in C.FAMILIES[arch].layer_tensors if t not in C.FAMILIES["llama"].layer_tensors]
    victim = (extra or [C.ATTN_K])[0] % 1
    reader = gguf.GGUFReader(ours)
    for case in ("missing", "shape"):
        w = gguf.GGUFWriter(tmp_path / f"{case}.gguf", arch)
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name == "general.architecture":
                continue
            vt = f.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
            else:
                w.add_key_value(f.name, f.contents(), vt)
        for t in reader.tensors:
            data = np.array(t.data)
            if t.name == victim and case == "missing":
                continue
            if t.name == victim:
                data = data[..., :-1].copy() if data.ndim == 1 else data[:-1].copy()
            w.add_tensor(t.name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    with pytest.raises(specee.SpecEEError, match=f"missing tensor '{victim}'"):
        specee.Model(tmp_path / "missing.gguf", n_ctx=64)
    with pytest.raises(specee.SpecEEError, match=f"tensor '{victim}' has the wrong shape"):
        specee.Model(tmp_path / "shape.gguf", n_ctx=64)


def test_unknown_architecture_names_the_known_ones(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "gemma3n.gguf", "gemma3n")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(specee.SpecEEError,
                       match="unsupported architecture 'gemma3n'.*llama, qwen2, qwen3, phi3, gemma2, gemma3"):
        specee.Model(tmp_path / "gemma3n.gguf", n_ctx=64)


def test_converter_refusals(tmp_path: Path) -> None:
    save_family("phi3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "dynamic",
                                                                                   "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3n"}))
    with pytest.raises(ValueError, match="'gemma3n' is not supported.*llama, mistral, qwen2, qwen3, phi3, gemma2, "
                                         "gemma3_text"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    # a Qwen2 checkpoint whose model_type says llama: the biases are not a llama layer's
    qwen = tmp_path / "qwen"
    save_family("qwen2", qwen)
    cfg = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias' in a llama"):
        convert_hf_to_gguf(qwen, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_a_head_made_by_autoee_fits_every_family(ours: Path, tmp_path: Path) -> None:
    """autoee reads the family's file (shapes, eps), and the head it exports, merged or as a draft head file next to
    the model, drafts losslessly."""
    cfg, _ = read_base(str(ours))
    assert (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_vocab) == (64, 4, 2, 320)
    torch.manual_seed(0)
    weights, _ = export_head(EagleHead(cfg), tmp_path / "head", {"note": "untrained"})
    merged, alone = tmp_path / "merged.gguf", tmp_path / "head.gguf"
    merge_gguf(ours, merged, eagle=weights, progress=False)
    merge_gguf(ours, alone, eagle=weights, draft_head_only=True, progress=False)  # loaded next to the base file
    for m in (specee.Model(merged, n_ctx=256, n_threads=2), specee.Model(ours, n_ctx=256, n_threads=2,
                                                                          draft_head=alone)):
        for prompt in PROMPTS[:2]:
            plain = m.generate_tokens(prompt, 24, mode="plain", temp=0, ignore_eos=True)
            assert m.generate_tokens(prompt, 24, mode="eagle2", temp=0, ignore_eos=True) == plain
            assert m.last_stats.n_drafted > 0


# ---- chat templates of the families

# microsoft/Phi-3-mini-4k-instruct's tokenizer_config.json chat_template (the July 2024 update, with system messages)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# the part of Qwen3's template that decides the rendering of plain messages (ChatML; no default system message)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == "
    "'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5-Instruct's template without tools: ChatML with a default system message
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == "
    "'system' and not loop.first) or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\n' + "
    "message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


@pytest.mark.parametrize("name,template,eos", [("phi3", PHI3_TEMPLATE, "<|endoftext|>"),
                                               ("chatml", QWEN3_TEMPLATE, "<|im_end|>"),
                                               ("qwen2.5", QWEN25_TEMPLATE, "<|im_end|>")])
def test_chat_templates_are_detected_and_match_jinja(name: str, template: str, eos: str) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from specee import _core

    assert _core.chat_template_detect(template) == name
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    conversations = [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "multi\nline ünï"}],
    ]
    for conversation in conversations:
        for add in (True, False):
            want = env.from_string(template).render(messages=conversation, add_generation_prompt=add, eos_token=eos)
            assert _core.chat_apply_template(name, conversation, add) == want


def save_qwen_bpe(family: str, path: Path, template: str) -> Tokenizer:
    """A Qwen2 or Qwen3 folder with a Qwen-style tokenizer.json (NFC, Qwen 2's split regex, which Qwen3 keeps,
    byte-level) instead of SentencePiece; returns that tokenizer."""
    from tokenizers import Regex, decoders, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specee.convert.vocab import QWEN2_SPLIT

    save_family(family, path)
    (path / "tokenizer.model").unlink()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((path / "tokenizer_config.json").read_text()), "chat_template": template}))
    return tok


QWEN_BPE = [("qwen2", QWEN25_TEMPLATE, "qwen2.5"), ("qwen3", QWEN3_TEMPLATE, "chatml")]
QWEN_CHAT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family,template,detected", QWEN_BPE)
def test_qwen_with_its_bpe_tokenizer_end_to_end(family: str, template: str, detected: str, tmp_path: Path) -> None:
    """A Qwen folder with its byte-level BPE through `convert hf`: the pre-tokenizer is written as qwen2 and the
    runtime tokenizes as `tokenizers` does, the chat specials too."""
    tok = save_qwen_bpe(family, tmp_path, template)
    out = tmp_path / f"{family}-bpe.gguf"
    convert_hf_to_gguf(tmp_path, out, "f32", progress=False)
    fields, _ = read_gguf(out)
    assert (fields["tokenizer.ggml.model"].value, fields["tokenizer.ggml.pre"].value) == ("gpt2", "qwen2")
    m = specee.Model(out, n_ctx=64, n_threads=2)
    assert m.chat_template() == detected
    texts = tf.stress_texts(n_random=100) + tf.whitespace_texts() + ["x 12345 and 678\n\nworld 1234"]
    # texts NFC leaves alone: the runtime, as llama.cpp, does not apply the tokenizer's NFC normalizer
    texts = [t for t in texts if unicodedata.normalize("NFC", t) == t]
    assert len(texts) > 100
    for text in texts:
        assert m.tokenize(text, add_special=False) == tok.encode(text).ids, repr(text)
    assert m.tokenize(QWEN_CHAT, add_special=False, parse_special=True) == tok.encode(QWEN_CHAT).ids


@pytest.mark.upstream
@pytest.mark.parametrize("family,template", [(f, t) for f, t, _ in QWEN_BPE])
def test_qwen_bpe_greedy_tokens_equal_upstream_llama_completion(family: str, template: str, tmp_path: Path) -> None:
    """The same file (`convert hf`'s: upstream's converter knows a BPE pre-tokenizer by a hash of a real model's
    tokens, which this trained one is not) in upstream's llama-completion (-ctv f16) and this runtime: the same prompt
    tokens (Qwen's pre-tokenizer: digits one by one, whitespace runs; the chat specials) and greedy tokens."""
    exe = upstream_binary("llama-completion", "SPECEE_LLAMA_COMPLETION")
    save_qwen_bpe(family, tmp_path, template)
    out = tmp_path / f"{family}-bpe.gguf"
    convert_hf_to_gguf(tmp_path, out, "f32", progress=False)
    m = specee.Model(out, n_ctx=256, n_threads=2, type_v="f16")
    for text in GREEDY_TEXTS + ["x 12345 and 678\n\n  world 1234\t\tend", QWEN_CHAT]:
        theirs = llama_completion_tokens(exe, out, text, N_GREEDY, tmp_path)
        prompt = m.tokenize(text, parse_special=True)
        assert theirs[:len(prompt)] == prompt, text
        ours = [int(t) for t in m.generate_tokens(prompt, N_GREEDY, mode="plain", temp=0, ignore_eos=True)]
        assert ours == theirs[len(prompt):], text


# ---- Gemma 2 and 3: chat template, tokenizer, sliding windows, what llama.cpp's converter leaves to assumption

# google/gemma-3-*-it's chat template
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# google/gemma-2-*-it's (no system messages)
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def test_gemma_chat_templates_match_jinja() -> None:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from specee import _core

    def raise_exception(msg: str) -> None:
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    plain = [[{"role": "user", "content": "Hello!"}],
             [{"role": "user", "content": "  2+2?\n"}, {"role": "assistant", "content": " 4 "},
              {"role": "user", "content": "multi\nline ünï"}]]
    with_system = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More?"}]]
    for template, conversations in ((GEMMA2_TEMPLATE, plain), (GEMMA3_TEMPLATE, plain + with_system)):
        assert _core.chat_template_detect(template) == "gemma"
        for conversation in conversations:
            for add in (True, False):
                want = env.from_string(template).render(messages=conversation, add_generation_prompt=add,
                                                        bos_token="<bos>")
                assert _core.chat_apply_template("gemma", conversation, add) == want
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="alternate"):
        env.from_string(GEMMA3_TEMPLATE).render(messages=bad, add_generation_prompt=True, bos_token="<bos>")
    with pytest.raises(specee.SpecEEError, match="alternate"):
        _core.chat_apply_template("gemma", bad, True)


@pytest.fixture(scope="module")
def gemma(family: str) -> str:
    if family not in GEMMA:
        pytest.skip("Gemma only")
    return family


def test_gemma_tokenizer_with_its_template(gemma: str, ours: Path, hf_dir: Path) -> None:
    """Gemma's SentencePiece as llama.cpp writes it (no space in front: tokenizer.ggml.add_space_prefix false; the
    text set: test_tokenizer_matches_tokenizers): a chat rendered by the model's own template (found in the file) is
    the same tokens as `tokenizers` gives, with one BOS."""
    tok = sp_tokenizers(hf_dir, gemma)
    fields, _ = read_gguf(ours)
    assert fields["tokenizer.ggml.add_space_prefix"].value is False
    m = specee.Model(ours, n_ctx=512, n_threads=2)
    for text in FAMILY_TEXTS[:100]:
        assert m.tokenize(text, add_special=True)[:1] == [tok.token_to_id("<bos>")]
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "And you?"}]
    assert m.chat_template() == "gemma"
    rendered = _core_apply("gemma", chat)
    assert rendered.startswith("<bos><start_of_turn>user\n")
    assert m.prompt_tokens(chat) == tok.encode(rendered, add_special_tokens=False).ids
    assert m.prompt_tokens(chat).count(2) == 1  # the template's BOS, not another


def _core_apply(name: str, chat: list[dict]) -> str:
    from specee import _core

    return _core.chat_apply_template(name, chat, True)


@pytest.fixture(scope="module")
def unwindowed(gemma: str, hf_dir: Path) -> torch.nn.Module:
    """The same weights with a window no prompt here reaches past."""
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                sliding_window=4096).eval()


def test_gemma_sliding_window_in_prompts_caches_and_several_sequences(gemma: str, ours: Path, hf_model,
                                                                      unwindowed) -> None:
    """A prompt longer than the window: the window matters (without it transformers' logits differ), and the
    runtime gives the windowed logits whether the prompt comes at once, a token at a time (the cache's cells masked
    per layer type) or beside another sequence in one batch (the server's slots)."""
    ref = hf_logits(hf_model, TOKENS)
    assert np.abs(hf_logits(unwindowed, TOKENS) - ref).max() > 10 * TINY_ATOL
    a, b = TOKENS[:23], TOKENS[5:]
    ref_a, ref_b = hf_logits(hf_model, a), hf_logits(hf_model, b)
    m = specee.Model(ours, n_ctx=256, n_threads=2)
    both = m.eval(a + b, output="all", seq_id=[1] * len(a) + [2] * len(b))
    assert_logits_close(both[:len(a)], ref_a, TINY_ATOL)
    assert_logits_close(both[len(a):], ref_b, TINY_ATOL)
    nxt = m.eval([TOKENS[23], 7], output="all", seq_id=[1, 2])  # the next token of each, in one batch
    assert_logits_close(nxt[:1], hf_logits(hf_model, TOKENS[:24])[-1:], TINY_ATOL)
    assert_logits_close(nxt[1:], hf_logits(hf_model, b + [7])[-1:], TINY_ATOL)


def test_gemma_batched_and_lookup_greedy_equal_alone(gemma: str, with_head: Path) -> None:
    """Several slots at once, and n-gram lookup's chains (verified through the same masks as EAGLE's trees), give
    the tokens plain decoding gives alone, past the window."""
    m = specee.Model(with_head, n_ctx=512, n_threads=2)
    prompts = [p * 3 for p in PROMPTS]  # repeats for lookup to find
    want = [m.generate_tokens(p, 24, mode="plain", temp=0, ignore_eos=True) for p in prompts]
    m.kv_clear()
    assert m.generate_batch(prompts, 24, temp=0, mode="plain", ignore_eos=True) == want
    for p, w in zip(prompts, want):
        assert m.generate_tokens(p, 24, mode="ngram", temp=0, ignore_eos=True) == w


def test_gemma_settings_llama_cpp_leaves_to_assumption(tmp_path: Path) -> None:
    """Gemma 3 with a query_pre_attn_scalar other than the head size, global layers' linear RoPE scaling (as Gemma
    3's 4B+ models), and sliding layers off its five-in-six pattern: `convert hf` writes attention.scale and the
    per-layer pattern, and the logits are transformers'."""
    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
    save_family("gemma3", tmp_path, num_hidden_layers=4, layer_types=types, query_pre_attn_scalar=40,
                rope_parameters=rope, final_logit_softcapping=6.0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    out = tmp_path / "gemma3.gguf"
    convert_hf_to_gguf(tmp_path, out, "f32", progress=False)
    fields, _ = read_gguf(out)
    assert fields[C.KEY_ATTENTION_SCALE.format(arch="gemma3")].value == pytest.approx(40 ** -0.5)
    assert list(fields[C.KEY_SLIDING_WINDOW_PATTERN.format(arch="gemma3")].value) == [True, False, True, True]
    assert fields[C.KEY_ROPE_SCALING_FACTOR.format(arch="gemma3")].value == pytest.approx(4.0)
    m = specee.Model(out, n_ctx=128, n_threads=2)
    assert_logits_close(m.eval(TOKENS, output="all"), hf_logits(hf, TOKENS), TINY_ATOL)
