"""python -m specee.convert: hf (both tokenizer kinds, all output types), merge (published and own layouts of
EAGLE heads and exit predictors), import-specee, inspect, quantize, and bad inputs. Tiny models only, except
the tests marked slow (SmolLM2) and upstream (llama.cpp binaries or llama-cpp-python)."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import specee
from specee import constants as C
from specee.convert.__main__ import main as convert_main
from specee.convert.draft_head import (EAGLE_PUBLISHED, PTH_TO_SAFETENSORS, SPECEE_LLAMA2_7B_EXIT_LAYERS,
                                       default_exit_layers)
from specee.convert.hf import convert_hf_to_gguf, permute, tensor_type
from specee.convert.inspect import describe_parts, find_parts, inspect_json
from specee.convert.merge import merge_gguf
from specee.convert.output import (
    OutOfDiskError,
    OutTensor,
    copy_tensor,
    read_fields,
    string_field,
    write_gguf,
)
from specee.convert.quantize import OUTTYPES, fitting_type, llama_order, quantize_gguf
from specee.convert.retype import Field
from specee.convert.vocab import LLAMA3_SPLIT, QWEN2_SPLIT, bpe_pre_name
from specee.paths import default_draft_head_path

Q = gguf.GGMLQuantizationType
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny corpus for testing tokenizers.",
    "Numbers 123 and 4567 appear here; symbols like @#! too.",
    "  Two spaces, tabs\tand\nnew lines.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 unicode text.",
] * 20
TEXTS = [
    "Hello world, the quick brown fox.",
    "Numbers 123 and 4567; caf\u00e9 \u2014 r\u00e9sum\u00e9!",
    "  Two  spaces\tand\nnew lines ",
    "z\u00fcrich \U0001f600 emoji",  # characters outside the training text: byte fallback / byte-level
]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TOKENS = np.random.default_rng(11).integers(0, 256, 24).tolist()
# Tiny random models with F32 weights: the runtime's F16 KV cache and flash attention bound the agreement
# (measured max abs error 0.008 on these fixtures, see also tests/test_parity.py)
ATOL = 0.03


# ---- helpers


def cli(*args: object) -> int | str:
    """Run `python -m specee.convert ARGS` in this process: 0 on success, else the error message."""
    with mock.patch.object(sys, "argv", ["specee.convert", *map(str, args)]):
        try:
            convert_main()
        except SystemExit as e:
            return e.code if e.code is not None else 0
    return 0


def hf_logits(model: LlamaForCausalLM, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor([tokens])).logits[0].numpy()


def runtime_logits(path: Path, tokens: list[int]) -> np.ndarray:
    # one V cache type for every file (with an EAGLE head the default is F32, which changes logits ~1e-4)
    return specee.Model(path, n_ctx=64, n_threads=2, type_v="f16").eval(tokens, output="all")


def save_tiny_llama(path: Path, vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=160, vocab_size=vocab, tie_word_embeddings=False, initializer_range=0.15,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def meta(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensors_of(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def no_outputs(folder: Path) -> bool:
    return not list(folder.glob("*.gguf")) and not list(folder.glob("*.tmp"))


# ---- fixtures: Hugging Face folders with a tokenizer of each kind


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer.json trained by `tokenizers` (GPT-2 pre-tokenizer)."""
    path = tmp_path_factory.mktemp("bpe_hf")
    save_tiny_llama(path, 320, seed=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bpe_gguf(bpe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bpe_dir as the runtime reads it: an F32 GGUF (its BPE tokenizer and chat template with it)."""
    path = tmp_path_factory.mktemp("bpe_gguf") / "bpe-f32.gguf"
    convert_hf_to_gguf(bpe_dir, path, "f32", progress=False)
    return path


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a SentencePiece tokenizer.model (BPE with byte fallback, Llama's normalization)."""
    path = tmp_path_factory.mktemp("spm_hf")
    save_tiny_llama(path, 320, seed=2)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=320, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False,
         "chat_template": TEMPLATE}))
    return path


def reference_tokens(folder: Path, text: str) -> list[int]:
    """The tokenizer's own ids (with BOS for SentencePiece, whose config adds it)."""
    if (folder / "tokenizer.model").is_file():
        return [1] + spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode(text)
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


# ---- fixtures: EAGLE heads and exit predictors for tiny_gguf (4 layers, n_embd 64, 4/2 heads, ffn 160)


def eagle_state(cfg: dict, seed: int = 0, hidden: int | None = None) -> dict[str, torch.Tensor]:
    """A random EAGLE-1 head in the published key layout."""
    h = hidden or cfg["hidden_size"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ff, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // n_head
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return 0.15 * torch.randn(*shape, generator=g)

    return {
        "embed_tokens.weight": r(vocab, h), "fc.weight": r(h, 2 * h), "fc.bias": r(h),
        "layers.0.self_attn.q_proj.weight": r(n_head * hd, h), "layers.0.self_attn.k_proj.weight": r(n_kv * hd, h),
        "layers.0.self_attn.v_proj.weight": r(n_kv * hd, h), "layers.0.self_attn.o_proj.weight": r(h, n_head * hd),
        "layers.0.post_attention_layernorm.weight": 1 + r(h), "layers.0.mlp.gate_proj.weight": r(ff, h),
        "layers.0.mlp.up_proj.weight": r(ff, h), "layers.0.mlp.down_proj.weight": r(h, ff),
    }


def predictor_state(layers: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random predictors in SpecEE's layout (F16, as its add_predictor script saves them)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in layers:
        for part, shape in (("up.weight", (512, 12)), ("up.bias", (512,)), ("down.weight", (1, 512)),
                            ("down.bias", (1,))):
            out[f"model.layers.{i}.pred.{part}"] = (0.1 * torch.randn(*shape, generator=g)).half()
    return out


@pytest.fixture(scope="module")
def tiny_config(tiny_hf_dir: Path) -> dict:
    return json.loads((tiny_hf_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def eagle_dir(tiny_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A published-layout EAGLE head (config.json + pytorch_model.bin) for the tiny model."""
    path = tmp_path_factory.mktemp("eagle")
    (path / "config.json").write_text(json.dumps(tiny_config))
    torch.save(eagle_state(tiny_config), path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def predictors_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SpecEE-layout predictors for layers 1..3 of the 4-layer tiny model."""
    path = tmp_path_factory.mktemp("preds") / "model-predictor.safetensors"
    save_file(predictor_state([1, 2, 3]), path)
    return path


@pytest.fixture(scope="module")
def merged(tiny_gguf: Path, eagle_dir: Path, predictors_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("merged") / "tiny-specee.gguf"
    assert cli("merge", tiny_gguf, "-o", out, "--eagle", eagle_dir, "--predictors", predictors_file) == 0
    return out


# ---- command line


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture) -> None:
    for command in ("hf", "lora", "merge", "import-specee", "inspect", "quantize", "synth"):
        assert cli(command, "--help") == 0
        assert f"python -m specee.convert {command}" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "specee.convert", "--help"], capture_output=True, text=True, check=True)
    assert "hf,lora,merge,import-specee,inspect,quantize,synth" in out.stdout


# ---- hf: round trips with both tokenizer kinds


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_round_trip_with_tokenizer(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    folder: Path = request.getfixturevalue(f"{kind}_dir")
    out = tmp_path / f"{kind}.gguf"
    assert cli("hf", folder, "-o", out, "--outtype", "f32") == 0
    m = meta(out)
    assert m["tokenizer.ggml.model"] == ("gpt2" if kind == "bpe" else "llama")
    assert m["tokenizer.ggml.pre"] == ("gpt-2" if kind == "bpe" else "default")
    assert len(m["tokenizer.ggml.tokens"]) == len(m["tokenizer.ggml.token_type"]) == 320
    assert m["tokenizer.chat_template"] == TEMPLATE
    if kind == "bpe":
        assert m["tokenizer.ggml.merges"] and m["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # control tokens
        assert (m["tokenizer.ggml.bos_token_id"], m["tokenizer.ggml.eos_token_id"]) == (1, 2)
    else:
        assert len(m["tokenizer.ggml.scores"]) == 320 and m["tokenizer.ggml.add_bos_token"] is True
        assert m["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6]  # unknown, control x2, byte
    assert m["general.file_type"] == 0 and m["general.quantization_version"] == 2

    model = specee.Model(out, n_ctx=64, n_threads=2)
    for text in TEXTS:
        assert model.tokenize(text, add_special=True) == reference_tokens(folder, text), text
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = np.random.default_rng(5).integers(0, 320, 24).tolist()
    np.testing.assert_allclose(model.eval(tokens, output="all"), hf_logits(hf, tokens), atol=ATOL)


def test_bpe_pre_tokenizer_names(bpe_dir: Path, tmp_path: Path) -> None:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert bpe_pre_name({"pre_tokenizer": byte_level}) == "gpt-2"
    digits = {"type": "Digits", "individual_digits": True}
    assert bpe_pre_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [digits, byte_level]}}) == "smollm"
    split = {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}
    llama3 = {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
    assert bpe_pre_name({"pre_tokenizer": llama3}) == "llama-bpe"
    qwen2 = {"type": "Sequence",
             "pretokenizers": [{**split, "pattern": {"Regex": QWEN2_SPLIT}}, llama3["pretokenizers"][1]]}
    assert bpe_pre_name({"pre_tokenizer": qwen2, "normalizer": {"type": "NFC"}}) == "qwen2"
    # an unknown pre-tokenizer is refused, and --vocab-pre names it
    folder = tmp_path / "odd"
    shutil.copytree(bpe_dir, folder)
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Punctuation", "behavior": "Isolated"},
                                                                  byte_level]}
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    assert "--vocab-pre" in cli("hf", folder, "-o", tmp_path / "x.gguf")
    # a name the runtime has no rules for would write a file that does not load: refused, naming the known ones
    assert "known: default, gpt-2" in cli("hf", folder, "-o", tmp_path / "x.gguf", "--vocab-pre", "tekken")
    assert not (tmp_path / "x.gguf").exists()
    assert cli("hf", folder, "-o", tmp_path / "x.gguf", "--vocab-pre", "gpt-2") == 0
    assert meta(tmp_path / "x.gguf")["tokenizer.ggml.pre"] == "gpt-2"


# The reference is transformers' own reading of the file (dequantized weights, Q/K permutation undone), so the
# check is about the file, not about quantization error. The runtime also rounds activations (to BF16 for BF16
# matrices, to Q8_0 blocks for Q8_0/Q4_0 ones). Measured max abs error on these tokens: bf16 0.041, q8_0 0.21,
# q4_0 0.16 (against the original F32 model q4_0 is off by 3.7, q8_0 by 0.25).
@pytest.mark.parametrize("outtype,qtype,atol", [("bf16", Q.BF16, 0.1), ("q8_0", Q.Q8_0, 0.4), ("q4_0", Q.Q4_0, 0.4)])
def test_output_types(outtype: str, qtype: Q, atol: float, tiny_hf_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    out = tmp_path / f"tiny-{outtype}.gguf"
    convert_hf_to_gguf(tiny_hf_dir, out, outtype, progress=False)
    types = {name: t.tensor_type for name, t in tensors_of(out).items()}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == types["output.weight"] == qtype
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == Q.F32
    assert meta(out)["general.file_type"] == {"bf16": 32, "q8_0": 7, "q4_0": 2}[outtype]
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    err = np.abs(runtime_logits(out, TOKENS) - hf_logits(back, TOKENS)).max()
    assert err < atol, f"max abs error {err:.3g}"


def test_row_not_whole_blocks_falls_back_to_f16() -> None:
    assert tensor_type("blk.0.ffn_down.weight", (64, 48), "q8_0") == Q.F16
    assert tensor_type("blk.0.ffn_down.weight", (64, 64), "q8_0") == Q.Q8_0
    assert tensor_type("blk.0.ffn_norm.weight", (64,), "q8_0") == Q.F32


# ---- hf: the same files in upstream llama.cpp


@pytest.mark.upstream
@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_upstream_llama_cpp_python_loads_the_file(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (upstream llama.cpp) is not installed")
    folder: Path = request.getfixturevalue(f"{kind}_dir")
    out = tmp_path / f"{kind}.gguf"
    convert_hf_to_gguf(folder, out, "f32", progress=False)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=kind == "spm") == reference_tokens(folder, text), text
    tokens = np.random.default_rng(5).integers(0, 320, 24).tolist()
    llm.eval(tokens)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    np.testing.assert_allclose(np.asarray(llm.scores[: len(tokens)]), hf_logits(hf, tokens), atol=ATOL)


def upstream_binary(name: str, env: str) -> str:
    """Upstream llama.cpp's program: $env, else the one in the folder $SPECEE_UPSTREAM_BIN names, else on PATH."""
    folder = os.environ.get("SPECEE_UPSTREAM_BIN")
    path = os.environ.get(env) or (folder and shutil.which(name, path=folder)) or shutil.which(name)
    if not path:
        pytest.skip(f"upstream {name} not found (set SPECEE_UPSTREAM_BIN to its folder, or {env}, or put it on PATH)")
    return path


@pytest.mark.upstream
@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_upstream_llama_completion_tokenizes_like_the_reference(kind: str, request: pytest.FixtureRequest,
                                                                tmp_path: Path) -> None:
    exe = upstream_binary("llama-completion", "SPECEE_LLAMA_COMPLETION")
    folder: Path = request.getfixturevalue(f"{kind}_dir")
    out = tmp_path / f"{kind}.gguf"
    convert_hf_to_gguf(folder, out, "f32", progress=False)
    text = TEXTS[0]
    for _ in range(3):  # upstream's log thread now and then drops the lines before its exit (1 run in ~20 here)
        run = subprocess.run([exe, "-m", out, "-p", text, "-n", "4", "--temp", "0", "-no-cnv", "--verbose-prompt",
                              "-t", "2", "-c", "128", "--no-warmup", "--simple-io"], capture_output=True,
                             encoding="utf-8", errors="replace", stdin=subprocess.DEVNULL, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        ids = [int(i) for i in re.findall(r"^\S+ I\s+(\d+) -> '", run.stdout + run.stderr, re.M)]
        if ids:  # the prompt's tokens were printed: what they say is checked
            break
    assert ids == reference_tokens(folder, text)


# ---- merge


def test_merge_published_layout(merged: Path, tiny_gguf: Path, eagle_dir: Path, predictors_file: Path) -> None:
    parts = inspect_json(merged)["parts"]
    assert parts["base_model"] and parts["eagle_head"] and parts["eagle_token_embd"]
    assert parts["predictor_layers"] == [1, 2, 3]
    assert parts["exit_layers"] == [1, 2]  # default: every predictor layer but the last layer (3)
    assert parts["exit_threshold"] == 0.5 and parts["exit_n_candidates"] == 4 and parts["eagle_version"] == 1
    m = meta(merged)
    assert m[C.KEY_EAGLE_FEED_FORWARD_LENGTH] == 160 and m["general.architecture"] == "llama"

    got, base = tensors_of(merged), tensors_of(tiny_gguf)
    for name, t in base.items():  # the base model is copied byte for byte
        assert got[name].tensor_type == t.tensor_type and np.array_equal(got[name].data, t.data), name
    state = torch.load(eagle_dir / "pytorch_model.bin", weights_only=True)
    q = permute(state["layers.0.self_attn.q_proj.weight"], 4, 4).numpy()
    k = permute(state["layers.0.self_attn.k_proj.weight"], 4, 2).numpy()
    assert got[C.EAGLE_ATTN_Q].tensor_type == Q.F16 and got[C.EAGLE_FC_BIAS].tensor_type == Q.F32
    np.testing.assert_array_equal(got[C.EAGLE_ATTN_Q].data, q.astype(np.float16))
    np.testing.assert_array_equal(got[C.EAGLE_ATTN_K].data, k.astype(np.float16))
    np.testing.assert_array_equal(got[C.EAGLE_FC].data, state["fc.weight"].numpy().astype(np.float16))
    np.testing.assert_array_equal(got[C.EAGLE_TOKEN_EMBD].data, state["embed_tokens.weight"].numpy().astype(np.float16))
    preds = load_file(predictors_file)
    assert got["blk.2.pred.up.weight"].tensor_type == Q.F32
    for name in ("blk.2.pred.up.weight", "blk.3.pred.down.bias"):
        source = preds["model.layers." + name[len("blk."):]].float().numpy()
        np.testing.assert_array_equal(got[name].data, source)
    # the runtime reads the merged file as the base model
    np.testing.assert_allclose(runtime_logits(merged, TOKENS), runtime_logits(tiny_gguf, TOKENS), atol=1e-6)


def test_merge_other_layouts_give_the_same_file_contents(merged: Path, tiny_gguf: Path, eagle_dir: Path,
                                                         predictors_file: Path, tmp_path: Path) -> None:
    state = torch.load(eagle_dir / "pytorch_model.bin", weights_only=True)
    # published layout with model.safetensors
    st_dir = tmp_path / "eagle_st"
    st_dir.mkdir()
    shutil.copy(eagle_dir / "config.json", st_dir)
    save_file(state, st_dir / "model.safetensors")
    # own layouts: GGUF names (q/k in Hugging Face order) + settings json
    save_file({EAGLE_PUBLISHED[k]: v for k, v in state.items()}, tmp_path / "head.safetensors")
    (tmp_path / "head.json").write_text(json.dumps({"format": "specee-eagle", "eagle_version": 1}))
    preds = {re.sub(r"model\.layers\.(\d+)\.", r"blk.\1.", k): v for k, v in load_file(predictors_file).items()}
    save_file(preds, tmp_path / "preds.safetensors")
    (tmp_path / "preds.json").write_text(json.dumps({"format": "specee-predictors", "exit_layers": [2],
                                                     "threshold": 0.75, "n_candidates": 4}))
    want = tensors_of(merged)
    own = (tmp_path / "head.safetensors", tmp_path / "preds.safetensors")
    for eagle, predictors in ((st_dir, predictors_file), own):
        out = tmp_path / "out.gguf"
        assert cli("merge", tiny_gguf, "-o", out, "--eagle", eagle, "--predictors", predictors) == 0
        got = tensors_of(out)
        assert list(got) == list(want)
        for name, t in want.items():
            assert np.array_equal(got[name].data, t.data), name
    assert (meta(out)[C.KEY_EXIT_LAYERS], meta(out)[C.KEY_EXIT_THRESHOLD]) == ([2], 0.75)  # from preds.json
    # the command line wins over the settings file; the head's own embedding can be left out
    assert cli("merge", tiny_gguf, "-o", out, "--eagle", own[0], "--predictors", own[1], "--exit-layers", "1-2",
               "--exit-threshold", "0.9", "--no-eagle-embd") == 0
    m = meta(out)
    assert m[C.KEY_EXIT_LAYERS] == [1, 2] and abs(m[C.KEY_EXIT_THRESHOLD] - 0.9) < 1e-6
    assert C.EAGLE_TOKEN_EMBD not in tensors_of(out)
    # merging predictors into a merged file keeps its EAGLE head and replaces the predictors
    assert cli("merge", merged, "-o", out, "--predictors", own[1]) == 0
    parts = inspect_json(out)["parts"]
    assert parts["eagle_head"] and parts["exit_layers"] == [2] and parts["predictor_layers"] == [1, 2, 3]


def test_merge_eagle_takes_a_draft_head_file(merged: Path, tiny_gguf: Path, eagle_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """--eagle takes a draft head file (what --draft-head-only writes) as well as the two weight layouts, and its
    help names all three."""
    assert cli("merge", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a published folder" in text and "NAME.safetensors with NAME.json" in text
    assert "or a draft head file NAME.gguf" in text
    draft_head, out = tmp_path / "draft-head.gguf", tmp_path / "out.gguf"
    assert cli("merge", tiny_gguf, "-o", draft_head, "--eagle", eagle_dir, "--draft-head-only") == 0
    assert cli("merge", tiny_gguf, "-o", out, "--eagle", draft_head) == 0
    want, got = tensors_of(merged), tensors_of(out)
    assert [n for n in got if n.startswith("eagle.")] == [n for n in want if n.startswith("eagle.")]
    for name, t in got.items():
        if name.startswith("eagle."):
            assert t.tensor_type == want[name].tensor_type and np.array_equal(t.data, want[name].data), name


def test_merge_keeps_a_quantized_base_unchanged(tiny_gguf: Path, eagle_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "tiny-q8_0.gguf"
    quantize_gguf(tiny_gguf, base, "q8_0", progress=False)
    out = tmp_path / "merged-q8_0.gguf"
    merge_gguf(base, out, eagle=eagle_dir, progress=False)
    got = tensors_of(out)
    for name, t in tensors_of(base).items():
        assert got[name].tensor_type == t.tensor_type and np.array_equal(got[name].data, t.data), name
    assert got["blk.0.attn_q.weight"].tensor_type == Q.Q8_0
    assert meta(out)["general.file_type"] == 7
    parts = inspect_json(out)["parts"]
    assert parts["eagle_head"] and not parts["predictor_layers"]


def test_eagle_qk_rows_are_in_the_runtime_rope_order(tiny_gguf: Path, eagle_dir: Path, tiny_config: dict,
                                                     tmp_path: Path) -> None:
    """The EAGLE layer from a merged file, run by this runtime (as layer 0 of a one-layer model whose token
    embeddings are the layer inputs), gives the logits of PyTorch's EAGLE layer (HF decoder layer without input
    norm, rotate-half RoPE) on the same weights; with q/k left in Hugging Face's row order it would not.
    Measured max abs error 0.0054 (logit std 2.4); with unpermuted q/k 4.8."""
    merged32 = tmp_path / "merged-f32.gguf"
    merge_gguf(tiny_gguf, merged32, eagle=eagle_dir, eagle_type="f32", progress=False)
    state = torch.load(eagle_dir / "pytorch_model.bin", weights_only=True)
    h, n, n_out = tiny_config["hidden_size"], 16, 48
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n_out, h, generator=g)  # the inputs of the layer, one "token embedding" each
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1: the runtime's input norm (weight 1) is ~identity
    norm_w, lm_head = 1 + 0.2 * torch.randn(h, generator=g), 0.3 * torch.randn(n_out, h, generator=g)

    cfg = LlamaConfig(**{**tiny_config, "num_hidden_layers": 1, "vocab_size": n_out})
    ref = LlamaForCausalLM(cfg).eval()
    layer = ref.model.layers[0]
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's layer 0 has no input norm
    with torch.no_grad():
        for hf_name, value in state.items():
            if hf_name.startswith("layers.0."):
                layer.get_parameter(hf_name[len("layers.0."):]).copy_(value)
        ref.model.norm.weight.copy_(norm_w)
        ref.lm_head.weight.copy_(lm_head)
        want = ref(inputs_embeds=x[None, :n]).logits[0].numpy()

    src = gguf.GGUFReader(merged32)
    fields = read_fields(src)
    fields["llama.block_count"].value = 1
    fields["llama.vocab_size"].value = n_out
    eagle = {t.name: t for t in src.tensors}

    def one_layer_model(path: Path, qk: dict[str, np.ndarray]) -> Path:
        def tensor(name: str, data: np.ndarray) -> OutTensor:
            data = np.ascontiguousarray(data, dtype=np.float32)
            return OutTensor(name, data.shape, Q.F32, lambda: data)

        tensors = [tensor(C.TOKEN_EMBD, x.numpy()), tensor(C.OUTPUT_NORM, norm_w.numpy()),
                   tensor(C.OUTPUT, lm_head.numpy()), tensor(C.ATTN_NORM % 0, np.ones(h))]
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"):
            data = qk.get(name, eagle[f"eagle.{name}.weight"].data)
            tensors.append(tensor(f"blk.0.{name}.weight", data))
        write_gguf(path, "llama", fields, tensors, progress=False)
        return path

    got = runtime_logits(one_layer_model(tmp_path / "eagle-layer.gguf", {}), list(range(n)))
    err = np.abs(got - want).max()
    assert err < ATOL, f"max abs error {err:.3g}"
    unpermuted = {"attn_q": state["layers.0.self_attn.q_proj.weight"].numpy(),
                  "attn_k": state["layers.0.self_attn.k_proj.weight"].numpy()}
    bad = runtime_logits(one_layer_model(tmp_path / "unpermuted.gguf", unpermuted), list(range(n)))
    assert np.abs(bad - want).max() > 10 * ATOL  # the check can tell the two row orders apart


def test_default_exit_layers() -> None:
    assert default_exit_layers(list(range(32)), 32) == list(SPECEE_LLAMA2_7B_EXIT_LAYERS)
    assert default_exit_layers([5, 10, 29], 30) == [5, 10]
    assert default_exit_layers([0, 1, 2, 3], 4) == [0, 1, 2]


# ---- import-specee


def make_eauto(merged: Path, out: Path) -> Path:
    """A SpecEE-style file: architecture eauto, llama keys as eauto.*, no specee.* keys, F16 predictor matrices."""
    reader = gguf.GGUFReader(merged)
    fields = {}
    for key, f in read_fields(reader).items():
        if key == "general.architecture":
            fields[key] = string_field("eauto")
        elif key.startswith("llama."):
            fields["eauto." + key[len("llama."):]] = f
        elif not key.startswith("specee."):
            fields[key] = f
    tensors = []
    for t in reader.tensors:
        if ".pred." in t.name and t.name.endswith(".weight"):
            data = t.data.astype(np.float16)
            tensors.append(OutTensor(t.name, data.shape, Q.F16, lambda d=data: d))
        else:
            tensors.append(copy_tensor(t))
    write_gguf(out, "eauto", fields, tensors, progress=False)
    return out


def test_import_specee_is_lossless(merged: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = make_eauto(merged, tmp_path / "eauto.gguf")
    out = tmp_path / "imported.gguf"
    assert cli("import-specee", src, "-o", out) == 0
    m_src, m_out = meta(src), meta(out)
    assert m_out["general.architecture"] == "llama"
    for key, value in m_src.items():
        if key.startswith("eauto."):
            assert m_out["llama." + key[len("eauto."):]] == value, key
        elif key != "general.architecture":
            assert m_out[key] == value, key
    assert m_out[C.KEY_EXIT_LAYERS] == [1, 2] and m_out[C.KEY_EAGLE_VERSION] == 1
    got, want = gguf.GGUFReader(out).tensors, gguf.GGUFReader(src).tensors
    assert [t.name for t in got] == [t.name for t in want]
    for a, b in zip(got, want):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name
    # inspect reports the three parts
    assert cli("inspect", out, "--no-tensors") == 0
    text = capsys.readouterr().out
    assert "base model       yes: llama, 4 layers" in text
    assert "draft head       yes: EAGLE-1, own token embedding" in text
    assert "exit predictors  yes: 3 layers [1, 2, 3]; static exit layers [1, 2], threshold 0.5, 4 candidates" in text
    # the runtime loads it; --exit-layers chooses another set; a llama file is not an eauto file
    assert specee.Model(out, n_ctx=32, n_threads=2).n_layer == 4
    assert cli("import-specee", src, "-o", out, "--exit-layers", "2") == 0 and meta(out)[C.KEY_EXIT_LAYERS] == [2]
    assert "eauto" in cli("import-specee", merged, "-o", tmp_path / "x.gguf")
    assert "import-specee" in cli("merge", src, "-o", tmp_path / "x.gguf", "--predictors", tmp_path / "none")


def test_inspect(tiny_gguf: Path, merged: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli("inspect", tiny_gguf) == 0
    text = capsys.readouterr().out
    assert "blk.0.attn_k.weight" in text and "F32" in text and "llama.block_count" in text
    assert "draft head       no" in text and "exit predictors  no" in text
    assert cli("inspect", merged, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert {"name": "eagle.fc.weight", "type": "F16", "shape": [128, 64]} in info["tensors"]
    assert info["metadata"][C.KEY_EXIT_LAYERS] == [1, 2]


def test_inspect_shipped_draft_head(capsys: pytest.CaptureFixture) -> None:
    """The shipped draft head file has no base model and so no block count: its predictors are found by
    their tensor names, and its draft head is described all the same."""
    path = default_draft_head_path()
    parts = inspect_json(path)["parts"]
    m, t = meta(Path(path)), tensors_of(Path(path))
    assert parts["n_layer"] == 0 and not parts["base_model"]
    assert parts["predictor_layers"] == list(range(29)) and parts["predictor_incomplete"] == []  # SmolLM2's 30 but the last
    assert parts["eagle_head"] and parts["eagle_version"] == m[C.KEY_EAGLE_VERSION] == 1
    assert parts["eagle_draft_vocab"] == len(m[C.KEY_EAGLE_DRAFT_VOCAB]) == int(t[C.EAGLE_OUTPUT].shape[1])
    assert parts["eagle_n_ff"] == m[C.KEY_EAGLE_FEED_FORWARD_LENGTH] == int(t[C.EAGLE_FFN_GATE].shape[1])
    assert parts["exit_layers"] == m[C.KEY_EXIT_LAYERS]
    assert cli("inspect", path, "--no-tensors") == 0
    text = capsys.readouterr().out
    assert "base model       no: no llama.block_count" in text
    assert (f"draft head       yes: EAGLE-1, uses the base model's token embedding, draft vocabulary of "
            f"{parts['eagle_draft_vocab']}, feed-forward length {parts['eagle_n_ff']}") in text
    assert f"exit predictors  yes: 29 layers {list(range(29))}; static exit layers {m[C.KEY_EXIT_LAYERS]}" in text


def test_inspect_parts_from_tensor_names() -> None:
    """Predictor layers come from the names (any layer, with or without a block count); a layer with only
    some of its predictor tensors is reported as incomplete; without specee.eagle.feed_forward_length the
    head's feed-forward length is read off eagle.ffn_gate, as the runtime reads it."""
    shapes = {n: [64, 160] for n in C.EAGLE_TENSOR_NAMES}
    shapes.update({n % 7: [12, 512] for n in C.PRED_TENSOR_NAMES})
    shapes[C.PRED_UP % 40] = [12, 512]
    fields = {gguf.Keys.General.ARCHITECTURE: Field("llama", gguf.GGUFValueType.STRING)}
    parts = find_parts(fields, shapes)
    assert parts.predictor_layers == [7] and parts.predictor_incomplete == [40]
    assert parts.eagle_head and parts.eagle_n_ff == 160 and parts.eagle_version is None
    lines = describe_parts(parts)
    assert lines[-2] == "exit predictors  yes: 1 layers [7]"
    assert lines[-1].startswith("exit predictors  incomplete in layers [40] (each needs blk.N.pred.up.weight")
    fields[C.KEY_EAGLE_FEED_FORWARD_LENGTH] = Field(96, gguf.GGUFValueType.UINT32)
    assert find_parts(fields, shapes).eagle_n_ff == 96


# ---- bad inputs: refused with a clear message, no output file


def test_head_for_another_model_is_refused(tiny_gguf: Path, tiny_config: dict, tmp_path: Path) -> None:
    big = {**tiny_config, "hidden_size": 128}
    head = tmp_path / "eagle128"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(big))
    torch.save(eagle_state(big), head / "pytorch_model.bin")
    msg = cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--eagle", head)
    assert "hidden_size is 128" in msg and "embedding_length is 64" in msg
    # the same head without a matching config.json: the tensor shapes give it away
    (head / "config.json").write_text(json.dumps(tiny_config))
    msg = cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--eagle", head)
    assert "hidden size is 128" in msg and "embedding_length is 64" in msg
    # a head for a model with another vocabulary
    (head / "config.json").write_text(json.dumps({**tiny_config, "vocab_size": 512}))
    assert "vocab_size is 512" in cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--eagle", head)
    # predictors for layers the model does not have, or of the wrong shape
    preds = tmp_path / "p.safetensors"
    save_file(predictor_state([2, 7]), preds)
    assert "layers [7]" in cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--predictors", preds)
    bad = predictor_state([1])
    bad["model.layers.1.pred.down.weight"] = torch.zeros(2, 512)
    save_file(bad, preds)
    assert "shape" in cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--predictors", preds)
    assert no_outputs(tmp_path)


def test_truncated_safetensors_is_refused(tiny_gguf: Path, eagle_dir: Path, predictors_file: Path,
                                          tmp_path: Path) -> None:
    head = tmp_path / "eagle"
    head.mkdir()
    shutil.copy(eagle_dir / "config.json", head)
    save_file(torch.load(eagle_dir / "pytorch_model.bin", weights_only=True), head / "model.safetensors")
    data = (head / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(data[: len(data) - 1000])
    msg = cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--eagle", head)
    assert "model.safetensors" in msg and "truncated" in msg
    preds = tmp_path / "p.safetensors"
    preds.write_bytes(predictors_file.read_bytes()[:5000])
    assert "truncated" in cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--predictors", preds)
    assert no_outputs(tmp_path)


class RunsCode:
    """A pickle payload that would run a shell command when unpickled without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused(tiny_gguf: Path, tiny_config: dict, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    head = tmp_path / "eagle"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(tiny_config))
    torch.save({**eagle_state(tiny_config), "fc.bias": RunsCode(marker)}, head / "pytorch_model.bin")
    msg = cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--eagle", head)
    assert "refused" in msg and "pytorch_model.bin" in msg
    assert not marker.exists()
    # the same for a model folder converted with hf
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config))
    torch.save({"model.embed_tokens.weight": RunsCode(marker)}, model / "pytorch_model.bin")
    assert "refused" in cli("hf", model, "-o", tmp_path / "out.gguf")
    assert not marker.exists() and no_outputs(tmp_path)


# SpecEE's training script: one predictor per layer, `torch.save` of the whole module (class MLP of __main__)
SPECEE_PTH_WRITER = """
import sys, torch
from safetensors.torch import save_file
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.relu = torch.nn.Linear(12, 512), torch.nn.ReLU()
        self.fc2, self.sigmoid = torch.nn.Linear(512, 1), torch.nn.Sigmoid()
torch.manual_seed(0)
want = {}
for i in (1, 2):
    model = MLP()
    torch.save(model, f"model{i}.pth")
    for k, v in model.state_dict().items():
        want[f"model.layers.{i}.pred." + k.replace("fc1", "up").replace("fc2", "down")] = v
save_file(want, "want.safetensors")
"""


def test_specee_pth_predictors_are_refused_saying_what_to_use(tiny_gguf: Path, tmp_path: Path) -> None:
    """SpecEE's model{i}.pth predictor files are pickles, refused as any; the message names the safetensors to
    give instead and a command that converts them, which works (it is run here on stand-ins)."""
    subprocess.run([sys.executable, "-c", SPECEE_PTH_WRITER], cwd=tmp_path, check=True)
    msg = cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--predictors", tmp_path / "model1.pth")
    assert "model1.pth: refused to load" in msg
    assert "Give --predictors a safetensors file instead: SpecEE's published one" in msg
    assert PTH_TO_SAFETENSORS in msg and no_outputs(tmp_path)
    command = PTH_TO_SAFETENSORS.replace("python", shlex.quote(sys.executable), 1)
    subprocess.run(command, shell=True, cwd=tmp_path, check=True)
    got, want = load_file(tmp_path / "preds.safetensors"), load_file(tmp_path / "want.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert cli("merge", tiny_gguf, "-o", tmp_path / "out.gguf", "--predictors", tmp_path / "preds.safetensors") == 0
    assert inspect_json(tmp_path / "out.gguf")["parts"]["predictor_layers"] == [1, 2]


# ---- writing: never a half-written file under the final name


def test_out_of_disk_is_refused_up_front(tiny_hf_dir: Path, tmp_path: Path) -> None:
    usage = shutil.disk_usage(tmp_path)._replace(free=10_000)
    with mock.patch("specee.convert.output.shutil.disk_usage", return_value=usage):
        msg = cli("hf", tiny_hf_dir, "-o", tmp_path / "out.gguf")
    assert msg.startswith("error:") and "out of disk" in msg and "9.8 KiB free" in msg
    assert no_outputs(tmp_path)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("boom")])
def test_failure_while_writing_leaves_no_file(error: BaseException, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    out.write_bytes(b"an older file")

    def fail() -> np.ndarray:
        raise error

    ok = np.zeros((4, 32), np.float32)
    tensors = [OutTensor("a.weight", ok.shape, Q.F32, lambda: ok), OutTensor("b.weight", (4, 32), Q.F32, fail)]
    fields = {"general.architecture": string_field("llama")}
    expected = OutOfDiskError if isinstance(error, OSError) else type(error)
    with pytest.raises(expected):
        write_gguf(out, "llama", fields, tensors, progress=False)
    assert out.read_bytes() == b"an older file" and not list(tmp_path.glob("*.tmp"))


# ---- quantize


def test_quantize_types(tiny_gguf: Path, merged: Path, tmp_path: Path) -> None:
    q8 = tmp_path / "q8_0.gguf"
    assert cli("quantize", tiny_gguf, q8, "Q8_0") == 0
    types = {n: t.tensor_type for n, t in tensors_of(q8).items()}
    assert types["blk.0.ffn_up.weight"] == types["token_embd.weight"] == types["output.weight"] == Q.Q8_0
    assert types["blk.0.ffn_norm.weight"] == Q.F32
    assert list(types) == sorted(types, key=llama_order)
    m = meta(q8)
    assert list(m)[-2:] == ["general.quantization_version", "general.file_type"] and m["general.file_type"] == 7
    # requantizing needs --allow-requantize, as in llama-quantize (also to dequantize)
    assert "--allow-requantize" in cli("quantize", q8, tmp_path / "f16.gguf", "f16")
    assert not (tmp_path / "f16.gguf").exists()
    assert cli("quantize", q8, tmp_path / "f16.gguf", "f16", "--allow-requantize") == 0
    f16 = tensors_of(tmp_path / "f16.gguf")
    src = tensors_of(q8)["blk.1.attn_v.weight"]
    np.testing.assert_array_equal(f16["blk.1.attn_v.weight"].data,
                                  gguf.quants.dequantize(src.data, src.tensor_type).astype(np.float16))
    # a merged file: the EAGLE matrices stay F16, the predictors F32
    q4 = tmp_path / "merged-q4_0.gguf"
    quantize_gguf(merged, q4, "q4_0", progress=False)
    types = {n: t.tensor_type for n, t in tensors_of(q4).items()}
    assert types["blk.0.attn_q.weight"] == Q.Q4_0 and types[C.EAGLE_ATTN_Q] == Q.F16
    assert types["blk.1.pred.up.weight"] == types["blk.1.pred.down.weight"] == Q.F32
    assert inspect_json(q4)["parts"]["exit_layers"] == [1, 2]


@pytest.mark.parametrize("outtype", [t for t in OUTTYPES if t not in ("f32", "f16", "bf16")])
def test_quantize_tiny_to_every_type(outtype: str, tiny_gguf: Path, tmp_path: Path) -> None:
    """Every type ggml makes without an importance matrix: each matrix the type, or the fallback whose blocks fit
    its rows; the file loads and its logits are finite."""
    out = tmp_path / f"tiny-{outtype}.gguf"
    quantize_gguf(tiny_gguf, out, outtype, progress=False)
    qtype, ftype = OUTTYPES[outtype]
    for name, t in tensors_of(out).items():
        if name.endswith("_proj.weight") or (len(t.shape) > 1 and "norm" not in name):
            assert t.tensor_type == fitting_type(qtype, int(t.shape[0])), name
    assert meta(out)["general.file_type"] == int(ftype)
    m = specee.Model(out, n_ctx=64, n_threads=1)
    assert np.isfinite(m.eval([1, 2, 3])).all()


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["q4_k_m", "q6_k", "iq4_xs", "tq2_0"])
def test_quantize_smollm2_to_k_iq_and_ternary_types(outtype: str, smollm2_path: Path, tmp_path: Path) -> None:
    """Where rows are whole 256-value blocks (SmolLM2's ffn_down: rows of n_ff = 1536) the matrix gets the type
    itself, elsewhere (rows of 576) the fallback; the file loads and decodes. (Quality is the file-type
    benchmark's: python -m specee.bench.filetype.)"""
    out = tmp_path / f"smollm2-{outtype}.gguf"
    quantize_gguf(smollm2_path, out, outtype, allow_requantize=True, progress=False)
    qtype, ftype = OUTTYPES[outtype]
    types = {n: t.tensor_type for n, t in tensors_of(out).items()}
    assert types["blk.0.ffn_down.weight"] == fitting_type(qtype, 1536) == qtype  # rows of n_ff = 6 x 256
    assert types["blk.0.attn_q.weight"] == fitting_type(qtype, 576)
    assert types["blk.0.attn_norm.weight"] == Q.F32 and meta(out)["general.file_type"] == int(ftype)
    m = specee.Model(out, n_ctx=64, n_threads=1)
    logits = m.eval(m.tokenize("The capital of France is"))
    assert np.isfinite(logits).all() and len(m.generate("Hello", max_tokens=4, mode="plain")) > 0


def write_imatrix(path: Path, model: Path, seed: int = 0, legacy: bool = False) -> None:
    """An importance matrix for `model`'s matrices (but token_embd, which llama-imatrix never records)
    in llama-imatrix's GGUF layout (NAME.in_sum2 [n_mat, n_per_row], NAME.counts [n_mat]) or its legacy binary one:
    random positive sums over 7 calls."""
    rng = np.random.default_rng(seed)
    names = {n: int(t.shape[0]) for n, t in tensors_of(model).items()
             if len(t.shape) > 1 and n.endswith("weight") and "norm" not in n and n != "token_embd.weight"}
    sums = {n: (rng.random(k) * 7).astype(np.float32) for n, k in names.items()}
    if legacy:
        out = struct.pack("<i", len(sums))
        for n, v in sums.items():
            out += struct.pack("<i", len(n)) + n.encode() + struct.pack("<ii", 7, v.size) + v.tobytes()
        path.write_bytes(out + struct.pack("<ii", 3, 4) + b"wiki")
        return
    w = gguf.GGUFWriter(str(path), "imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["wiki"])
    w.add_uint32("imatrix.chunk_count", 3)
    w.add_uint32("imatrix.chunk_size", 512)
    for n, v in sums.items():
        w.add_tensor(n + ".in_sum2", v.reshape(1, -1))
        w.add_tensor(n + ".counts", np.full((1, 1), 7, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_quantize_with_an_importance_matrix(tiny_gguf: Path, tmp_path: Path) -> None:
    """--imatrix FILE (llama-imatrix's GGUF or legacy format, read alike): the types that take weights use them (the
    bytes change), llama-quantize's quantize.imatrix.* keys are written; the iq2/iq1 types need one, and a matrix
    it lacks or an entry of the wrong size is an error naming the tensor."""
    from specee.convert.imatrix import read_imatrix
    imat, legacy = tmp_path / "imatrix.gguf", tmp_path / "imatrix.dat"
    write_imatrix(imat, tiny_gguf)
    write_imatrix(legacy, tiny_gguf, legacy=True)
    a, b = read_imatrix(imat), read_imatrix(legacy)
    assert a.entries.keys() == b.entries.keys() and (a.datasets, a.chunk_count) == (b.datasets, 3) == (["wiki"], 3)
    for n in a.entries:
        np.testing.assert_allclose(a.entries[n], b.entries[n], rtol=1e-6)
    plain, weighted = tmp_path / "plain.gguf", tmp_path / "weighted.gguf"
    quantize_gguf(tiny_gguf, plain, "iq4_nl", progress=False)
    assert cli("quantize", "--imatrix", imat, tiny_gguf, weighted, "iq4_nl") == 0
    p, w = tensors_of(plain), tensors_of(weighted)
    assert not np.array_equal(p["blk.0.ffn_up.weight"].data, w["blk.0.ffn_up.weight"].data)
    assert np.array_equal(p["token_embd.weight"].data, w["token_embd.weight"].data)  # no entry: no weights
    assert meta(weighted)["quantize.imatrix.entries_count"] == len(a.entries)
    assert meta(weighted)["quantize.imatrix.chunks_count"] == 3
    assert np.isfinite(specee.Model(weighted, n_ctx=64, n_threads=1).eval([1, 2, 3])).all()
    assert "iq2_xxs needs an importance matrix: --imatrix FILE" in str(cli("quantize", tiny_gguf, tmp_path / "x.gguf",
                                                                            "iq2_xxs"))
    # the tiny model's rows (64, 160) take iq2_xxs's fallback (iq4_nl, which needs no weights): a 256-wide matrix
    from specee.convert.quantize import imatrix_of
    with pytest.raises(ValueError, match="no importance matrix entry for blk.1.attn_q.weight, which IQ2_XXS needs"):
        imatrix_of("blk.1.attn_q.weight", np.array([256, 8]), Q.IQ2_XXS, {}, "imatrix.gguf")
    with pytest.raises(ValueError, match="the importance matrix of blk.1.attn_q.weight has 64 weights, the tensor 256"):
        imatrix_of("blk.1.attn_q.weight", np.array([256, 8]), Q.IQ4_NL, a.entries, "imatrix.gguf")
    assert imatrix_of("token_embd.weight", np.array([256, 8]), Q.IQ4_NL, a.entries, "imatrix.gguf") is None
    with pytest.raises(ValueError, match="one weight per column"):
        specee._core.quantize(int(Q.IQ4_NL), np.zeros((1, 64), np.float32), np.ones(32, np.float32))
    (tmp_path / "junk.gguf").write_bytes(b"\x02\x00\x00\x00\x05\x00")
    with pytest.raises(ValueError, match="cut short"):
        read_imatrix(tmp_path / "junk.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_quantize_refuses_types_that_need_an_importance_matrix() -> None:
    with pytest.raises(specee.SpecEEError, match="iq2_xxs needs an importance matrix"):
        specee._core.quantize(int(Q.IQ2_XXS), np.zeros((1, 256), np.float32))
    with pytest.raises(specee.SpecEEError, match="rows of 100 values cannot be q4_K"):
        specee._core.quantize(int(Q.Q4_K), np.zeros((1, 100), np.float32))
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    for q in (Q.Q4_0, Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # the gguf package's own quantizers agree to the byte
        np.testing.assert_array_equal(specee._core.quantize(int(q), x), gguf.quants.quantize(x, q))
    np.testing.assert_allclose(gguf.quants.dequantize(specee._core.quantize(int(Q.Q6_K), x), Q.Q6_K), x, atol=0.1)


@pytest.mark.slow
def test_quantize_smollm2_q4_1_to_f16_follows_llama_quantize(smollm2_path: Path, tmp_path: Path) -> None:
    """Each F16 tensor is gguf's dequantization of the Q4_1 tensor rounded to F16; 1-D tensors are copied; the
    metadata and tensor order follow llama-quantize (the bytes are compared in the upstream test below)."""
    out = tmp_path / "smollm2-f16.gguf"
    quantize_gguf(smollm2_path, out, "f16", allow_requantize=True, progress=False)
    src, dst = gguf.GGUFReader(smollm2_path), gguf.GGUFReader(out)
    assert [t.name for t in dst.tensors] == sorted((t.name for t in src.tensors), key=llama_order)
    by_name = {t.name: t for t in src.tensors}
    for t in dst.tensors:
        s = by_name[t.name]
        if len(s.shape) == 1:
            assert t.tensor_type == s.tensor_type and np.array_equal(t.data, s.data), t.name
        else:
            assert t.tensor_type == Q.F16
            np.testing.assert_array_equal(t.data, gguf.quants.dequantize(s.data, s.tensor_type).astype(np.float16))
    src_fields, dst_fields = read_fields(src), read_fields(dst)
    moved = ["general.quantization_version", "general.file_type"]
    assert list(dst_fields) == [k for k in src_fields if k not in moved] + moved
    assert dst_fields["general.file_type"].value == 1 and dst_fields["general.quantization_version"].value == 2
    for key, f in src_fields.items():
        if key not in moved:
            assert dst_fields[key] == f, key


@pytest.mark.slow
@pytest.mark.upstream
def test_quantize_smollm2_bytes_equal_llama_quantize(smollm2_path: Path, tmp_path: Path) -> None:
    exe = upstream_binary("llama-quantize", "SPECEE_LLAMA_QUANTIZE")
    theirs = tmp_path / "upstream-f16.gguf"
    run = subprocess.run([exe, "--allow-requantize", smollm2_path, theirs, "F16"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = tmp_path / "ours-f16.gguf"
    quantize_gguf(smollm2_path, ours, "f16", allow_requantize=True, progress=False)
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.upstream
@pytest.mark.parametrize("outtype", ["IQ4_NL", "Q4_K_M", "IQ2_XXS", "Q8_0"])
def test_quantize_with_an_importance_matrix_bytes_equal_llama_quantize(outtype: str, tiny_gguf: Path,
                                                                       tmp_path: Path) -> None:
    exe = upstream_binary("llama-quantize", "SPECEE_LLAMA_QUANTIZE")
    imat = tmp_path / "imatrix.gguf"
    write_imatrix(imat, tiny_gguf)
    theirs, ours = tmp_path / "upstream.gguf", tmp_path / "ours.gguf"
    run = subprocess.run([exe, "--pure", "--imatrix", imat, tiny_gguf, theirs, outtype], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    quantize_gguf(tiny_gguf, ours, outtype.lower(), imatrix=imat, progress=False)
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.slow
@pytest.mark.upstream
def test_quantize_smollm2_iq2_xxs_bytes_equal_llama_quantize(smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2's ffn_down rows (1536) take IQ2_XXS itself, with the importance weights."""
    exe = upstream_binary("llama-quantize", "SPECEE_LLAMA_QUANTIZE")
    imat = tmp_path / "imatrix.gguf"
    write_imatrix(imat, smollm2_path)
    theirs, ours = tmp_path / "upstream.gguf", tmp_path / "ours.gguf"
    run = subprocess.run([exe, "--pure", "--allow-requantize", "--imatrix", imat, smollm2_path, theirs, "IQ2_XXS"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    quantize_gguf(smollm2_path, ours, "iq2_xxs", imatrix=imat, allow_requantize=True, progress=False)
    assert tensors_of(ours)["blk.0.ffn_down.weight"].tensor_type == Q.IQ2_XXS
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.upstream
@pytest.mark.parametrize("outtype", [t.upper() for t in OUTTYPES if t != "f32"])
def test_quantize_tiny_bytes_equal_llama_quantize_pure(outtype: str, tiny_gguf: Path, tmp_path: Path) -> None:
    exe = upstream_binary("llama-quantize", "SPECEE_LLAMA_QUANTIZE")
    theirs = tmp_path / "upstream.gguf"
    upstream_name = {"MXFP4": "MXFP4_MOE"}.get(outtype, outtype)  # llama-quantize's name of the file type
    run = subprocess.run([exe, "--pure", tiny_gguf, theirs, upstream_name], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = tmp_path / "ours.gguf"
    quantize_gguf(tiny_gguf, ours, outtype.lower(), progress=False)
    assert ours.read_bytes() == theirs.read_bytes()
