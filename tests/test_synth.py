"""python -m specee.convert synth: the synthetic Llama-2-7B-shaped file for cost benchmarks. Small shapes are
written (2 layers, hidden sizes as flags); the 7B shape is checked as a plan without writing it. Tests
marked upstream run llama.cpp's llama-quantize and llama-completion on the small files."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

import specee
from specee import constants as C
from specee.convert.synth import KEY_SYNTHETIC, NAME, N_FIXED, STD, llama2_7b, plan_tensors, synthetic_vocab
from specee.convert.vocab import SPACE_MARK
from test_convert_cli import cli, no_outputs, upstream_binary

Q = gguf.GGMLQuantizationType
SMALL = ["--layers", "2", "--embd", "256", "--ff", "512", "--heads", "4", "--vocab", "1000"]
MATRIX_NAMES = [C.ATTN_Q, C.ATTN_K, C.ATTN_V, C.ATTN_OUTPUT, C.FFN_GATE, C.FFN_UP, C.FFN_DOWN]
NORM_NAMES = [C.ATTN_NORM, C.FFN_NORM]
LLAMA2_7B_PARAMS = 6_738_415_616  # Meta's published parameter count of Llama-2-7B


def write_small(folder: Path, outtype: str, *extra: str) -> Path:
    out = folder / f"synth-{outtype}.gguf"
    assert cli("synth", "-o", out, "--type", outtype, *SMALL, *extra) == 0
    return out


@pytest.fixture(scope="module")
def small_q4_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small(tmp_path_factory.mktemp("synth"), "q4_0")


@pytest.fixture(scope="module")
def small_f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small(tmp_path_factory.mktemp("synth"), "f16")


def contents(path: Path) -> tuple[dict, dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def expected_types(matrix: Q, output: Q) -> dict[str, Q]:
    types = {C.TOKEN_EMBD: matrix, C.OUTPUT_NORM: Q.F32, C.OUTPUT: output}
    for il in range(2):
        types |= {fmt % il: matrix for fmt in MATRIX_NAMES} | {fmt % il: Q.F32 for fmt in NORM_NAMES}
    return types


# ---- the small files


@pytest.mark.parametrize("outtype, matrix, output, file_type", [
    ("q4_0", Q.Q4_0, Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q4_0),
    ("f16", Q.F16, Q.F16, gguf.LlamaFileType.MOSTLY_F16),
])
def test_synth_metadata_shapes_and_types(outtype: str, matrix: Q, output: Q, file_type: int,
                                         request: pytest.FixtureRequest) -> None:
    fields, tensors = contents(request.getfixturevalue(f"small_{outtype}"))
    assert fields["general.architecture"] == "llama" and fields["general.name"] == NAME
    assert fields[KEY_SYNTHETIC] is True and fields["general.file_type"] == file_type
    want = {"llama.block_count": 2, "llama.embedding_length": 256, "llama.feed_forward_length": 512,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 4, "llama.context_length": 4096,
            "llama.rope.dimension_count": 64, "llama.vocab_size": 1000, "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    assert {k: fields[k] for k in want} == want
    assert fields["llama.rope.freq_base"] == 10000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert {name: t.tensor_type for name, t in tensors.items()} == expected_types(matrix, output)
    ne = {name: [int(n) for n in t.shape] for name, t in tensors.items()}
    assert ne[C.TOKEN_EMBD] == ne[C.OUTPUT] == [256, 1000]  # GGML order: [n_embd, n_vocab]
    assert ne[C.ATTN_K % 1] == [256, 256] and ne[C.FFN_GATE % 1] == [256, 512] and ne[C.FFN_DOWN % 1] == [512, 256]
    assert ne[C.ATTN_NORM % 0] == ne[C.OUTPUT_NORM] == [256]


@pytest.mark.parametrize("outtype", ["q4_0", "f16"])
def test_synth_weights_have_the_intended_spread(outtype: str, request: pytest.FixtureRequest) -> None:
    _, tensors = contents(request.getfixturevalue(f"small_{outtype}"))
    for name, t in tensors.items():
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), name
        center = 1.0 if t.tensor_type == Q.F32 else 0.0  # norms about 1, matrices about 0
        rms = float(np.sqrt(np.mean((values - center) ** 2)))
        assert rms == pytest.approx(STD, rel=0.1), name


@pytest.mark.parametrize("outtype", ["q4_0", "f16"])
def test_synth_loads_and_generates(outtype: str, request: pytest.FixtureRequest) -> None:
    model = specee.Model(request.getfixturevalue(f"small_{outtype}"), n_ctx=128, n_threads=2)
    assert (model.n_layer, model.n_embd, model.n_ff, model.bos, model.eos) == (2, 256, 512, 1, 2)
    prompt = model.tokenize("The quick brown fox")
    assert prompt[0] == 1 and all(0 <= t < 1000 for t in prompt)
    logits = model.eval(prompt, output="all")
    assert logits.shape == (len(prompt), 1000) and np.isfinite(logits).all()
    out = model.generate_tokens(prompt, 8, temp=0, ignore_eos=True)
    assert len(out) == 8 and all(0 <= t < 1000 for t in out)


@pytest.mark.parametrize("outtype", ["q4_0", "f16"])
def test_synth_draft_head_runs_eagle_and_early_exit(outtype: str, request: pytest.FixtureRequest,
                                                    tmp_path: Path) -> None:
    """--draft-head: a random draft head (draft vocabulary, matrices in --type) and predictors for layers 0..n-2, loaded
    as --draft-head: EAGLE-2 stays lossless on it, and a replayed exit schedule runs with its checks and head."""
    draft_head = tmp_path / "draft-head.gguf"
    assert cli("synth", "-o", draft_head, "--type", outtype, "--draft-head", "--draft-vocab", "300", *SMALL) == 0
    fields, tensors = contents(draft_head)
    assert fields[KEY_SYNTHETIC] is True and fields[C.KEY_EAGLE_DRAFT_VOCAB] == list(range(300))
    assert tensors[C.EAGLE_OUTPUT].tensor_type == (Q.Q4_0 if outtype == "q4_0" else Q.F16)
    assert {C.PRED_UP % 0} <= set(tensors) and C.PRED_UP % 1 not in tensors
    model = specee.Model(request.getfixturevalue(f"small_{outtype}"), n_ctx=128, n_threads=2, draft_head=draft_head)
    assert model.has_eagle and model._model.eagle_n_vocab == 300 and model._model.exit_n_pred == 1
    prompt = model.tokenize("The quick brown fox")
    plain = model.generate_tokens(prompt, 12, mode="plain", temp=0, ignore_eos=True)
    assert model.generate_tokens(prompt, 12, mode="eagle2", temp=0, ignore_eos=True) == plain
    out = model.generate_tokens(prompt, 12, mode="early-exit", temp=0, ignore_eos=True,
                                exit=specee.ExitParams(replay=[0, 1]))
    assert len(out) == 12 and model.last_stats.layers_run == [1, 2] * 5 + [1]


def test_synth_vocab_round_trips_any_text(small_q4_0: Path) -> None:
    model = specee.Model(small_q4_0, n_ctx=64, n_threads=2)
    for text in ["Hello world, the quick brown fox.", "z\u00fcrich \U0001f600 emoji\n\ttabs  two spaces"]:
        tokens = model.tokenize(text)
        assert model.detokenize(tokens, remove_special=True) == text


def test_synth_vocab_is_sentencepiece_shaped() -> None:
    tokens, scores, types = synthetic_vocab(2000, np.random.default_rng(0))
    assert len(tokens) == len(scores) == len(types) == 2000 and len(set(tokens)) == 2000
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>" and tokens[258] == "<0xFF>"
    T = gguf.TokenType
    assert types[:4] == [T.UNKNOWN, T.CONTROL, T.CONTROL, T.BYTE] and set(types[259:]) == {T.NORMAL}
    pieces = tokens[259:]
    assert all(SPACE_MARK not in p[1:] for p in pieces)
    assert scores[259:] == sorted(scores[259:], reverse=True)
    for i, p in enumerate(pieces):  # every longer piece is two earlier ones joined, so merges can reach it
        earlier = set(pieces[:i])
        assert len(p) == 1 or any(p[:k] in earlier and p[k:] in earlier for k in range(1, len(p))), p


def test_synth_seed_decides_the_bytes(tmp_path: Path) -> None:
    files = []
    for folder, seed in [("a", "3"), ("b", "3"), ("c", "4")]:
        (tmp_path / folder).mkdir()
        files.append(write_small(tmp_path / folder, "q4_0", "--seed", seed).read_bytes())
    assert files[0] == files[1] != files[2]


@pytest.mark.parametrize("flags, message", [
    (["--embd", "300"], "--embd must be a positive multiple of 256"),
    (["--ff", "100"], "--ff must be a positive multiple of 32"),
    (["--heads", "3"], "--heads must divide --embd"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--vocab", "100"], f"--vocab must be at least {N_FIXED}"),
    (["--seed", "-1"], "--seed must be 0 or more"),
])
def test_synth_bad_sizes_are_one_line_errors(flags: list[str], message: str, tmp_path: Path) -> None:
    err = cli("synth", "-o", tmp_path / "x.gguf", *SMALL, *flags)
    assert isinstance(err, str) and err.startswith("error: ") and message in err and "\n" not in err
    assert no_outputs(tmp_path)


# ---- the 7B shape, planned without writing


@pytest.mark.parametrize("outtype, gib", [("q4_0", 3.56), ("f16", 12.55)])
def test_synth_7b_plan_is_llama2_7b(outtype: str, gib: float) -> None:
    plan = {t.name: t for t in plan_tensors(llama2_7b(), outtype, seed=0)}
    assert len(plan) == 2 + 32 * 9 + 1
    assert sum(int(np.prod(t.shape)) for t in plan.values()) == LLAMA2_7B_PARAMS
    assert plan[C.TOKEN_EMBD].shape == plan[C.OUTPUT].shape == (32000, 4096)
    assert plan[C.FFN_UP % 31].shape == (11008, 4096) and plan[C.FFN_DOWN % 31].shape == (4096, 11008)
    # upstream's llama-bench reports its Llama 7B Q4_0 as 3.56 GiB (output Q6_K) and F16 as 12.55 GiB
    assert sum(t.nbytes for t in plan.values()) / 2**30 == pytest.approx(gib, abs=0.005)


# ---- upstream llama.cpp on the same files


@pytest.mark.upstream
def test_upstream_llama_quantize_types_q4_0_as_synth(small_f16: Path, small_q4_0: Path, tmp_path: Path) -> None:
    exe = upstream_binary("llama-quantize", "SPECEE_LLAMA_QUANTIZE")
    theirs = tmp_path / "upstream-q4_0.gguf"
    run = subprocess.run([exe, small_f16, theirs, "Q4_0"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    their_fields, their_tensors = contents(theirs)
    fields, tensors = contents(small_q4_0)
    assert {n: t.tensor_type for n, t in their_tensors.items()} == {n: t.tensor_type for n, t in tensors.items()}
    assert their_fields["general.file_type"] == fields["general.file_type"]


@pytest.mark.upstream
def test_upstream_llama_completion_runs_synth(small_q4_0: Path) -> None:
    exe = upstream_binary("llama-completion", "SPECEE_LLAMA_COMPLETION")
    text = "The quick brown fox, z\u00fcrich \U0001f600 123"  # characters outside the pieces: byte tokens
    run = subprocess.run([exe, "-m", small_q4_0, "-p", text, "-n", "8", "--temp", "0", "-no-cnv", "--verbose-prompt",
                          "-t", "2", "-c", "128", "--no-warmup", "--simple-io", "--ignore-eos"],
                         capture_output=True, encoding="utf-8", errors="replace", stdin=subprocess.DEVNULL, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    ids = [int(i) for i in re.findall(r"^\S+ I\s+(\d+) -> '", run.stdout + run.stderr, re.M)]
    assert ids == specee.Model(small_q4_0, n_ctx=64, n_threads=2).tokenize(text)
