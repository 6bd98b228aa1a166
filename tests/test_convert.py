"""specee.convert.hf: Hugging Face Llama -> GGUF, checked against transformers and upstream conventions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import specee
from specee.convert.hf import convert_hf_to_gguf
from specee.convert.retype import read_gguf

TOKENS = np.random.default_rng(5).integers(0, 256, 16).tolist()


def test_metadata_and_tensor_names(tiny_gguf: Path) -> None:
    fields, tensors = read_gguf(tiny_gguf)
    meta = {k: f.value for k, f in fields.items()}
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 4 and meta["llama.embedding_length"] == 64
    assert meta["llama.feed_forward_length"] == 160 and meta["llama.context_length"] == 512
    assert meta["llama.attention.head_count"] == 4 and meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.rope.dimension_count"] == 16 and meta["llama.vocab_size"] == 256
    assert meta["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert tensors["blk.0.attn_k.weight"].shape == (32, 64)  # n_head_kv * head_dim rows
    assert "output.weight" in tensors and len(tensors) == 3 + 4 * 9


def test_transformers_reads_the_file_back(tiny_gguf: Path, tiny_hf, hf_forward) -> None:
    """transformers' GGUF loader undoes llama.cpp's Q/K permutation: same logits as the source model."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    back = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    np.testing.assert_allclose(hf_forward(back.eval(), TOKENS), hf_forward(tiny_hf, TOKENS), atol=1e-5)


def test_weight_formats_give_the_same_tensors(tiny_hf_dir: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    """Sharded safetensors and pytorch_model.bin convert to the same tensors as one safetensors file."""
    model = LlamaForCausalLM.from_pretrained(tiny_hf_dir)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    pt = tmp_path / "pt"
    pt.mkdir()
    shutil.copy(tiny_hf_dir / "config.json", pt)
    torch.save(model.state_dict(), pt / "pytorch_model.bin")
    _, want = read_gguf(tiny_gguf)
    for folder in (sharded, pt):
        convert_hf_to_gguf(folder, tmp_path / "out.gguf", "f32")
        _, got = read_gguf(tmp_path / "out.gguf")
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_tied_embeddings_f16(tmp_path: Path, hf_forward) -> None:
    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=128, vocab_size=256, tie_word_embeddings=True, initializer_range=0.15)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "tied-f16.gguf"
    convert_hf_to_gguf(tmp_path / "hf", out, "f16")
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in types
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32  # 1-D tensors stay F32
    m = specee.Model(out, n_ctx=64, n_threads=2)
    got = m.eval(TOKENS, output="all")
    # F16 weights on top of the F16 KV cache: measured max abs error 0.0092
    np.testing.assert_allclose(got, hf_forward(hf, TOKENS), atol=0.03)


def test_clear_errors(tiny_hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="outtype"):
        convert_hf_to_gguf(tiny_hf_dir, tmp_path / "x.gguf", "iq2_xxs")  # needs an importance matrix: not offered
    assert not list(tmp_path.glob("*.gguf*"))  # nothing left behind
