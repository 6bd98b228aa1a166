"""Shared fixtures: a tiny random Llama (Hugging Face folder, model and GGUF), the SmolLM2 GGUF, and an
explicit PyTorch Llama forward with per-layer attention masks (the reference for masks and KV validity)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Sequence

# tests never download: the Hugging Face Hub is offline for huggingface_hub and datasets (both read these when
# imported), so an evaluation set by Hub id comes from the cache or fails with its message (tests/test_eval.py)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import specee  # noqa: E402
from specee.convert.hf import convert_hf_to_gguf  # noqa: E402
from specee.convert.retype import retype_gguf  # noqa: E402

TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=160,
    vocab_size=256,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # larger than HF's 0.02 so that attention is far from uniform and masks/positions matter
    initializer_range=0.15,
)
SEED = 1234

# Pass costs forced on a context for tests of the rules that read them (n-gram lookup's chain length, the hybrid's
# confident steps, `auto`'s EAGLE-2 estimate, the slots' marginal cost), so the decision a test checks does not depend
# on this machine or its load: a pass of n tokens in single passes, linear between the points. CHEAP: what batched
# kernels aim at (issue 45's targets); SERIAL: no batching at all, every row costs a pass of its own.
CHEAP_PASSES = ([1, 2, 4, 8, 16, 64], [1.0, 1.1, 1.3, 1.8, 3.0, 11.0])
SERIAL_PASSES = ([1, 64], [1.0, 64.0])


def force_pass_costs(model: specee.Model, curve: tuple[list[int], list[float]], n_max: int = 64) -> None:
    """Every pass of 2..n_max tokens on the model's context costs what `curve` says (held for the context's life)."""
    for n in range(2, min(n_max, model.n_batch) + 1):
        model._ctx.set_pass_cost(n, float(np.interp(n, *curve)))


def load_hf(model_dir: str | Path) -> LlamaForCausalLM:
    """An HF Llama in float32 with eager attention (the numerical reference)."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    with torch.no_grad():  # HF sets norm weights to 1: make them random so a missing norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tiny_hf_dir: Path) -> LlamaForCausalLM:
    return load_hf(tiny_hf_dir)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny-f32.gguf"
    convert_hf_to_gguf(tiny_hf_dir, path, "f32")
    return path


@pytest.fixture(scope="session")
def bpe_f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with a byte-level BPE vocabulary and random F32 weights (the GGUF fuzzer's seed), for the runs
    that tokenize."""
    import gguf

    from fuzz_gguf import write_seed

    path = tmp_path_factory.mktemp("vocab") / "bpe.gguf"
    write_seed(path, "bpe", gguf.GGMLQuantizationType.F32, parts=False, seed=1)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return Path(specee.default_model_path())
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 model not installed: {e}")


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with every tensor dequantized to F32 (cached for the session)."""
    path = tmp_path_factory.mktemp("smollm2") / "smollm2-f32.gguf"
    retype_gguf(smollm2_path, path, "f32")
    return path


# ---- explicit PyTorch Llama forward


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (HF's row order) of x [n_head, n, head_dim] at positions pos [n]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def llama_forward_masked(
    model: LlamaForCausalLM,
    tokens: Sequence[int],
    pos: Sequence[int] | None = None,
    masks: Sequence[np.ndarray] | np.ndarray | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Whole-sequence Llama forward with HF's weights and explicit attention masks.

    masks: [n, n] bool (query i sees key j), one for all layers or one per layer; default causal.
    Returns logits [n, n_vocab] and the hidden state after each layer (before the final norm).
    """
    cfg = model.config
    n = len(tokens)
    n_head, n_head_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // n_head if getattr(cfg, "head_dim", None) is None else cfg.head_dim
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    eps = cfg.rms_norm_eps
    p = torch.arange(n) if pos is None else torch.as_tensor(pos)
    if masks is None:
        masks = np.tril(np.ones((n, n), dtype=bool))
    if isinstance(masks, np.ndarray):
        masks = [masks] * cfg.num_hidden_layers
    hiddens = []
    with torch.no_grad():
        x = model.model.embed_tokens.weight[torch.as_tensor(tokens)]
        for layer, mask in zip(model.model.layers, masks):
            att = layer.self_attn
            h = rms_norm(x, layer.input_layernorm.weight, eps)
            q = rope((h @ att.q_proj.weight.T).view(n, n_head, hd).transpose(0, 1), p, theta)
            k = rope((h @ att.k_proj.weight.T).view(n, n_head_kv, hd).transpose(0, 1), p, theta)
            v = (h @ att.v_proj.weight.T).view(n, n_head_kv, hd).transpose(0, 1)
            k = k.repeat_interleave(n_head // n_head_kv, 0)
            v = v.repeat_interleave(n_head // n_head_kv, 0)
            scores = q @ k.transpose(1, 2) / math.sqrt(hd)
            scores = scores.masked_fill(~torch.as_tensor(mask)[None], float("-inf"))
            o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, n_head * hd)
            x = x + o @ att.o_proj.weight.T
            h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
            mlp = layer.mlp
            ffn = torch.nn.functional.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)
            x = x + ffn @ mlp.down_proj.weight.T
            hiddens.append(x.numpy().copy())
        logits = rms_norm(x, model.model.norm.weight, eps) @ model.lm_head.weight.T
    return logits.numpy(), hiddens


@pytest.fixture(scope="session")
def llama_forward() -> Callable[..., tuple[np.ndarray, list[np.ndarray]]]:
    """The explicit masked forward, as a fixture so the tests need not import conftest."""
    return llama_forward_masked


def hf_logits(model: LlamaForCausalLM, tokens: Sequence[int]) -> np.ndarray:
    """Logits [n, n_vocab] of a plain causal HF forward."""
    with torch.no_grad():
        return model(torch.as_tensor([list(tokens)])).logits[0].float().numpy()


@pytest.fixture(scope="session")
def hf_forward() -> Callable[[LlamaForCausalLM, Sequence[int]], np.ndarray]:
    return hf_logits
