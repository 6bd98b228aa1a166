"""Hugging Face checkpoint -> GGUF, readable by upstream llama.cpp: Llama and Mistral (architecture "llama"), Qwen2 /
Qwen2.5 ("qwen2"), Qwen3 ("qwen3"), Phi-3 ("phi3"), Gemma 2 ("gemma2"), Gemma 3 text ("gemma3"), the families of
specee.constants.FAMILIES. Gemma's RMS norms multiply by (1 + weight): the weights are written plus one, as
llama.cpp's converter writes them (the addition in the checkpoint's own dtype, as there).

Keys, tensor names and the Q/K row permutation (llama only: the other families use NEOX RoPE, HF's own row order)
follow llama.cpp's convert_hf_to_gguf.py; tokenizer metadata is described in vocab.py. Tensors are read and written
one at a time (safetensors and zip-format .bin files are memory-mapped), so a 7B model converts within a few GiB of
RAM.

Output types: f32, f16, bf16, q8_0, q4_0. As in llama.cpp's converter, 1-D tensors and norms stay F32,
and a matrix whose rows are not a whole number of quantization blocks falls back to F16. q4_0 is
"pure" (every matrix Q4_0, as `llama-quantize --pure`).

    python -m specee.convert hf MODEL_DIR -o OUT.gguf --outtype f16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch

from specee import constants as C
from specee.convert.checkpoint import SourceTensor, open_checkpoint, weight_files
from specee.convert.output import OutTensor, write_gguf
from specee.convert.quantize import OUTTYPES, fitting_type, quantize_array
from specee.convert.retype import Field
from specee.convert.vocab import add_vocab, load_vocab

DESCRIPTION = ("Convert a Hugging Face Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 or Gemma 3 (text) folder to a GGUF "
               "that upstream llama.cpp also loads")

Q = gguf.GGMLQuantizationType

# Hugging Face name -> GGUF name ("{bid}" / "%d": block index)
TENSOR_MAP = {
    "model.embed_tokens.weight": C.TOKEN_EMBD,
    "model.norm.weight": C.OUTPUT_NORM,
    "lm_head.weight": C.OUTPUT,
    "model.layers.{bid}.input_layernorm.weight": C.ATTN_NORM,
    "model.layers.{bid}.self_attn.q_proj.weight": C.ATTN_Q,
    "model.layers.{bid}.self_attn.k_proj.weight": C.ATTN_K,
    "model.layers.{bid}.self_attn.v_proj.weight": C.ATTN_V,
    "model.layers.{bid}.self_attn.o_proj.weight": C.ATTN_OUTPUT,
    "model.layers.{bid}.post_attention_layernorm.weight": C.FFN_NORM,
    "model.layers.{bid}.mlp.gate_proj.weight": C.FFN_GATE,
    "model.layers.{bid}.mlp.up_proj.weight": C.FFN_UP,
    "model.layers.{bid}.mlp.down_proj.weight": C.FFN_DOWN,
    "model.layers.{bid}.self_attn.q_proj.bias": C.ATTN_Q_BIAS,
    "model.layers.{bid}.self_attn.k_proj.bias": C.ATTN_K_BIAS,
    "model.layers.{bid}.self_attn.v_proj.bias": C.ATTN_V_BIAS,
    "model.layers.{bid}.self_attn.q_norm.weight": C.ATTN_Q_NORM,
    "model.layers.{bid}.self_attn.k_norm.weight": C.ATTN_K_NORM,
    "model.layers.{bid}.self_attn.qkv_proj.weight": C.ATTN_QKV,
    "model.layers.{bid}.mlp.gate_up_proj.weight": C.FFN_UP,  # phi3: gate rows, then up rows
}
# Gemma's layers: four norms, of which post_attention_layernorm is the attention output's, not the FFN input's
_GEMMA_TENSOR_MAP = {
    **TENSOR_MAP,
    "model.layers.{bid}.post_attention_layernorm.weight": C.ATTN_POST_NORM,
    "model.layers.{bid}.pre_feedforward_layernorm.weight": C.FFN_NORM,
    "model.layers.{bid}.post_feedforward_layernorm.weight": C.FFN_POST_NORM,
}
TENSOR_MAP_OF_ARCH = {"gemma2": _GEMMA_TENSOR_MAP, "gemma3": _GEMMA_TENSOR_MAP}
# config.json's model_type -> the GGUF architecture (the family) it is written as
ARCH_OF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3_text": "gemma3"}
# the families whose RMS norms scale by (1 + weight) in transformers
NORM_PLUS_ONE = ("gemma2", "gemma3")
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass
class LlamaConfig:
    """The hyperparameters of a checkpoint of any family (arch: the GGUF architecture it is written as)."""

    n_vocab: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    arch: str = "llama"
    n_ctx_orig: int | None = None  # the context RoPE was trained on before any scaling (Phi-3's config gives it)
    # gemma: the sliding window, which layers slide, the local RoPE base, the query scale, soft-capping
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_theta_swa: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None


def load_config(model_dir: str | os.PathLike) -> LlamaConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model folder)")
    hp = json.loads(path.read_text(encoding="utf-8"))
    arch = ARCH_OF_MODEL_TYPE.get(hp.get("model_type"))
    if arch is None:
        raise ValueError(f"{path}: model_type {hp.get('model_type')!r} is not supported "
                         f"(one of {', '.join(ARCH_OF_MODEL_TYPE)})")
    # transformers 5 keeps rope_theta and the scaling in rope_parameters (per layer type for Gemma 3: the global
    # layers' and the sliding ones'), older versions at the top level
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    local = rope.pop("sliding_attention", None)
    rope = dict(rope.pop("full_attention", None) or rope)
    theta_swa = (local or {}).get("rope_theta", hp.get("rope_local_base_freq"))
    kind = str(rope.get("rope_type", rope.get("type", "default"))).lower()
    if kind not in ("default", "linear", "llama3") and not (arch == "phi3" and kind in ("longrope", "su")):
        raise ValueError(f"{path}: rope type {kind!r} is not supported (linear, llama3; Phi-3: longrope)")
    if float(rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    n_head = hp["num_attention_heads"]
    return LlamaConfig(
        n_vocab=hp["vocab_size"],
        n_embd=hp["hidden_size"],
        n_ff=hp["intermediate_size"],
        n_layer=hp["num_hidden_layers"],
        n_head=n_head,
        n_head_kv=hp.get("num_key_value_heads") or n_head,
        head_dim=hp.get("head_dim") or hp["hidden_size"] // n_head,
        n_ctx_train=hp.get("max_position_embeddings", 2048),
        rope_theta=float(hp.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hp.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hp.get("tie_word_embeddings", False)),
        rope_scaling=rope,
        arch=arch,
        n_ctx_orig=rope.get("original_max_position_embeddings") or hp.get("original_max_position_embeddings"),
        **(gemma_settings(hp, theta_swa) if arch in NORM_PLUS_ONE else
           {"sliding_window": hp.get("sliding_window")} if arch == "phi3" else {}),
    )


def gemma_settings(hp: dict, theta_swa: float | None) -> dict[str, Any]:
    """A Gemma config's sliding window (its layer_types, else every other layer for Gemma 2 and five in six for
    Gemma 3), local RoPE base, query scale and soft-capping."""
    n_layer = hp["num_hidden_layers"]
    pattern = 2 if hp["model_type"] == "gemma2" else int(hp.get("sliding_window_pattern", 6))
    types = hp.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} is not one of sliding_attention / full_attention per layer")
    return dict(sliding_window=hp.get("sliding_window"), layer_types=list(types), rope_theta_swa=theta_swa,
                query_pre_attn_scalar=hp.get("query_pre_attn_scalar"),
                attn_softcap=hp.get("attn_logit_softcapping"), final_softcap=hp.get("final_logit_softcapping"))


def input_files(model_dir: str | os.PathLike) -> list[Path]:
    """What a conversion reads from the folder: the weights, the JSON files (config, tokenizer, index) and
    tokenizer.model; an output may be none of them."""
    folder = Path(model_dir)
    return [*weight_files(folder), *sorted(folder.glob("*.json")), folder / "tokenizer.model"]


def index_tensors(model_dir: str | os.PathLike, stack: ExitStack) -> list[SourceTensor]:
    """All tensors of a checkpoint (*.safetensors, single or sharded, else pytorch_model*.bin), not loaded yet."""
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights")
    return [t for f in files for t in open_checkpoint(f, stack)]


def permute(w: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """HF's rotate-half Q/K row order -> GGML's interleaved (rope pairs adjacent), as llama.cpp does."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, arch: str = C.ARCH) -> tuple[str, int | None]:
    """The GGUF name of a checkpoint tensor, and its block; a tensor the family's layers do not have is refused."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", hf_name)
    key, bid = (f"model.layers.{{bid}}.{m.group(2)}", int(m.group(1))) if m else (hf_name, None)
    names = TENSOR_MAP_OF_ARCH.get(arch, TENSOR_MAP)
    if key not in names or (bid is not None and names[key] not in C.FAMILIES[arch].layer_tensors):
        raise ValueError(f"unexpected tensor {hf_name!r} in a {arch} checkpoint")
    return (names[key] % bid if bid is not None else names[key]), bid


def llama3_rope_factors(cfg: LlamaConfig) -> np.ndarray | None:
    """rope_freqs.weight for rope_type 'llama3', computed as llama.cpp's converter does."""
    rs = cfg.rope_scaling
    if rs.get("rope_type", rs.get("type", "")).lower() != "llama3":
        return None
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, lo, hi = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def longrope(cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Phi-3's LongRoPE: the long and short frequency factors [head_dim / 2] and the cos/sin scale, computed as
    transformers does (attention_factor when the config gives it, else sqrt(1 + ln(s) / ln(n_ctx_orig)) for the
    extension s = max_position_embeddings / original_max_position_embeddings)."""
    rs = cfg.rope_scaling
    if str(rs.get("rope_type", rs.get("type", ""))).lower() not in ("longrope", "su"):
        return None
    long, short = (np.asarray(rs[k], dtype=np.float32) for k in ("long_factor", "short_factor"))
    if long.shape != (cfg.head_dim // 2,) or short.shape != long.shape:
        raise ValueError(f"LongRoPE factors of {len(long)} and {len(short)} values, expected {cfg.head_dim // 2}")
    orig = int(cfg.n_ctx_orig or cfg.n_ctx_train)
    scale = float(rs.get("factor") or cfg.n_ctx_train / orig)
    attn = rs.get("attention_factor")
    if attn is None:
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    return long, short, float(attn)


def write_hparams(writer: gguf.GGUFWriter, cfg: LlamaConfig, name: str, ftype: gguf.LlamaFileType) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(cfg.n_ctx_train)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.n_ff)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_head_kv)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_file_type(ftype)
    writer.add_vocab_size(cfg.n_vocab)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.arch == "phi3":  # as llama.cpp's converter writes it (its window too, which both runtimes ignore)
        writer.add_rope_scaling_orig_ctx_len(int(cfg.n_ctx_orig or cfg.n_ctx_train))
        writer.add_sliding_window(int(cfg.sliding_window or 0))
        if (lr := longrope(cfg)) is not None:
            writer.add_rope_scaling_attn_factors(lr[2])
    rs = cfg.rope_scaling
    if rs.get("rope_type", rs.get("type")) == "linear" and "factor" in rs:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rs["factor"])
    if cfg.arch in NORM_PLUS_ONE:
        write_gemma_hparams(writer, cfg)


def write_gemma_hparams(writer: gguf.GGUFWriter, cfg: LlamaConfig) -> None:
    """Gemma's keys, as llama.cpp's converter writes them; beyond them, what llama.cpp would otherwise assume wrongly:
    which layers slide when they are not the family's pattern, and the query scale when query_pre_attn_scalar is
    neither the head size nor (27B) n_embd / n_head."""
    if cfg.attn_softcap:
        writer.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.final_softcap:
        writer.add_final_logit_softcapping(cfg.final_softcap)
    if cfg.rope_theta_swa is not None:
        writer.add_rope_freq_base_swa(float(cfg.rope_theta_swa))
    slides = [t == "sliding_attention" for t in cfg.layer_types or []]
    if cfg.sliding_window and any(slides):
        writer.add_sliding_window(int(cfg.sliding_window))
        n = C.FAMILIES[cfg.arch].swa_pattern
        if slides != [i % n < n - 1 for i in range(cfg.n_layer)]:
            writer.add_sliding_window_pattern(slides)
    elif cfg.arch == "gemma2":  # no sliding layers: a window no position reaches past (the runtime's default is 4096)
        writer.add_sliding_window(cfg.n_ctx_train)
    scalar = cfg.query_pre_attn_scalar
    family = C.FAMILIES[cfg.arch]
    assumed = cfg.n_embd / cfg.n_head if cfg.n_layer == family.n_layer_embd_query_scale else cfg.head_dim
    if scalar is not None and float(scalar) != float(assumed):
        writer.add_attention_scale(float(scalar) ** -0.5)

def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> gguf.GGMLQuantizationType:
    """1-D tensors and norms F32; matrices the outtype, or F16 when a row is not whole blocks of it."""
    qtype = OUTTYPES[outtype][0]
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return Q.F32
    return fitting_type(qtype, shape[-1])


def tensor_loader(
    src: Callable[[], torch.Tensor], qtype: gguf.GGMLQuantizationType, heads: tuple[int, int] | None = None,
    plus_one: bool = False,
) -> Callable[[], np.ndarray]:
    """Load, permute Q/K rows when `heads` = (n_head, n_head_kv) is given, add 1 (Gemma's norms) when asked, and
    convert to `qtype`."""

    def load() -> np.ndarray:
        t = src()
        if heads is not None:
            t = permute(t, *heads)
        if plus_one:
            t = t + 1
        return quantize_array(t.to(torch.float32).numpy(), qtype)

    return load


def plan_tensors(cfg: LlamaConfig, sources: list[SourceTensor], outtype: str, model_dir: str) -> list[OutTensor]:
    """The output tensors (names, shapes, types, loaders) of a checkpoint, checked complete."""
    out = []
    for src in sources:
        if IGNORED.match(src.name) or (src.name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        name, bid = gguf_name(src.name, cfg.arch)
        if bid is not None and bid >= cfg.n_layer:
            raise ValueError(f"tensor {src.name!r} is past num_hidden_layers={cfg.n_layer}")
        heads = None  # Q/K rows permuted for GGML's normal RoPE; NEOX RoPE reads HF's order
        if C.FAMILIES[cfg.arch].rope == "normal" and bid is not None and name == C.ATTN_Q % bid:
            heads = (cfg.n_head, cfg.n_head)
        elif C.FAMILIES[cfg.arch].rope == "normal" and bid is not None and name == C.ATTN_K % bid:
            heads = (cfg.n_head, cfg.n_head_kv)
        qtype = tensor_type(name, src.shape, outtype)
        plus_one = cfg.arch in NORM_PLUS_ONE and src.name.endswith("norm.weight")
        out.append(OutTensor(name, src.shape, qtype, tensor_loader(src.load, qtype, heads, plus_one)))
    factors = llama3_rope_factors(cfg)
    if factors is not None:
        out.append(OutTensor(C.ROPE_FREQS, factors.shape, Q.F32, lambda: factors))
    if (lr := longrope(cfg)) is not None:
        long, short, _ = lr
        out.append(OutTensor(C.ROPE_FACTORS_LONG, long.shape, Q.F32, lambda: long))
        out.append(OutTensor(C.ROPE_FACTORS_SHORT, short.shape, Q.F32, lambda: short))
    layer = C.FAMILIES[cfg.arch].layer_tensors
    want = {C.TOKEN_EMBD, C.OUTPUT_NORM, *(n % b for n in layer for b in range(cfg.n_layer))}
    if not cfg.tie_word_embeddings:
        want.add(C.OUTPUT)
    if missing := sorted(want - {t.name for t in out}):
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    return out


def fields_of(writer: gguf.GGUFWriter) -> dict[str, Field]:
    """The metadata gathered in a GGUFWriter (used here only to collect keys through its add_* helpers)."""
    return {k: Field(v.value, v.type, v.sub_type) for k, v in writer.kv_data[0].items()}


def convert_hf_to_gguf(
    model_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    outtype: str = "f32",
    *,
    vocab_pre: str | None = None,
    progress: bool = True,
) -> None:
    """Write a GGUF from a Hugging Face folder (config.json, weights, tokenizer files) of a family this runtime has."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, not {outtype!r}")
    cfg = load_config(model_dir)
    meta = gguf.GGUFWriter(None, cfg.arch)
    write_hparams(meta, cfg, Path(model_dir).resolve().name, OUTTYPES[outtype][1])
    vocab = load_vocab(model_dir, cfg.n_vocab, vocab_pre)
    if vocab is not None:
        add_vocab(meta, vocab, model_dir,
                  space_prefix=False if cfg.arch in NORM_PLUS_ONE and vocab.model == "llama" else None)
    meta.add_quantization_version(gguf.GGML_QUANT_VERSION)
    with ExitStack() as stack:
        tensors = plan_tensors(cfg, index_tensors(model_dir, stack), outtype, str(model_dir))
        write_gguf(out_path, cfg.arch, fields_of(meta), tensors, desc=f"converting to {outtype}", progress=progress,
                   inputs=input_files(model_dir))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_dir", help="folder with config.json, *.safetensors or pytorch_model*.bin, tokenizer files")
    ap.add_argument("-o", "--out", required=True, help="output .gguf path")
    ap.add_argument("--outtype", type=str.lower, choices=list(OUTTYPES), default="f16",
                    help="type of the matrices (default f16)")
    ap.add_argument("--vocab-pre", help="tokenizer.ggml.pre to write for a BPE tokenizer whose pre-tokenizer "
                    "is not recognised (a name llama.cpp gives it that this runtime has: specee._core.vocab_pre_names(), "
                    "e.g. gpt-2, llama-bpe, smollm, qwen2)")


def run(args: argparse.Namespace) -> None:
    convert_hf_to_gguf(args.model_dir, args.out, args.outtype, vocab_pre=args.vocab_pre)
    print(f"wrote {args.out}")

