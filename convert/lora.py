"""A Hugging Face PEFT LoRA adapter folder -> a GGUF LoRA adapter (csrc/context/specee-lora.h), in the layout and keys
upstream llama.cpp's convert_lora_to_gguf.py writes, so either runtime loads it:

    python -m specee.convert lora PEFT_DIR --base GGUF_OR_HF_DIR -o OUT.gguf [--outtype f32|f16|bf16|q8_0]

The folder holds adapter_config.json (r, lora_alpha) and adapter_model.safetensors (or adapter_model.bin) with, for
each adapted matrix W [out, in] of the base model, lora_A [r, in] and lora_B [out, r], so that the adapted matrix is
W + lora_alpha / r * lora_B @ lora_A. Each pair is written under W's GGUF name (as `python -m specee.convert hf` names
the family's tensors) plus ".lora_a" / ".lora_b", unchanged except that llama's Q/K rows are permuted in lora_B as in
W; the metadata: general.type "adapter", adapter.type "lora", adapter.lora.alpha, general.architecture the base's.
The base (a GGUF of the model, or its Hugging Face folder: only config.json is read) gives the architecture and the
head counts of the permutation.

Refused, with the reason: rsLoRA (use_rslora: scale alpha / sqrt(r)) and per-module alpha_pattern (one alpha per
file here, as upstream), token-embedding adapters (lora_embedding_A/B) and modules_to_save (whole matrices, not
pairs). Output types: f32 (default, as upstream), f16, bf16, q8_0 (a matrix whose rows are not whole Q8_0 blocks,
e.g. lora_b of rank 8, is F16). The file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from specee import constants as C
from specee.convert.checkpoint import SourceTensor, open_checkpoint
from specee.convert.hf import gguf_name, load_config, permute, tensor_type
from specee.convert.output import Field, OutTensor, string_field, write_gguf
from specee.convert.quantize import quantize_array

DESCRIPTION = "Convert a Hugging Face PEFT LoRA adapter to a GGUF LoRA adapter (llama.cpp's --lora)"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # upstream convert_lora_to_gguf.py's (less "auto")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PAIR = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")


@dataclass
class Base:
    """What the conversion needs of the base model: its architecture and head counts."""

    arch: str
    n_head: int
    n_head_kv: int


def load_base(path: str | Path) -> Base:
    """The base model from its GGUF file or its Hugging Face folder (config.json)."""
    path = Path(path)
    if path.is_dir():
        cfg = load_config(path)
        return Base(cfg.arch, cfg.n_head, cfg.n_head_kv)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such base model (a GGUF file or a Hugging Face folder)")
    reader = gguf.GGUFReader(path)
    fields = reader.fields

    def value(key: str):
        if key not in fields:
            raise ValueError(f"{path}: the base GGUF has no {key}")
        return fields[key].contents()

    arch = str(value("general.architecture"))
    if arch not in C.FAMILIES:
        raise ValueError(f"{path}: architecture {arch!r} is not one of {', '.join(C.FAMILIES)}")
    n_head = int(value(f"{arch}.attention.head_count"))
    kv_key = f"{arch}.attention.head_count_kv"
    return Base(arch, n_head, int(value(kv_key)) if kv_key in fields else n_head)


def load_adapter_config(peft_dir: Path) -> tuple[float, int]:
    """lora_alpha and r of adapter_config.json, refused where this format cannot hold the adapter."""
    path = peft_dir / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{peft_dir}: no adapter_config.json (not a PEFT adapter folder)")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_rslora"):
        raise ValueError(f"{path}: use_rslora (scale alpha / sqrt(r)) is not supported: the GGUF format scales by "
                         "alpha / r")
    if cfg.get("alpha_pattern"):
        raise ValueError(f"{path}: alpha_pattern (an alpha per module) is not supported: one alpha per adapter")
    try:
        alpha, rank = float(cfg["lora_alpha"]), int(cfg["r"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: needs numbers lora_alpha and r ({e})") from e
    if rank < 1 or not alpha >= 0:
        raise ValueError(f"{path}: r must be >= 1 and lora_alpha >= 0 (r={rank}, lora_alpha={alpha})")
    return alpha, rank


def adapter_file(peft_dir: Path) -> Path:
    for name in ADAPTER_FILES:
        if (peft_dir / name).is_file():
            return peft_dir / name
    raise FileNotFoundError(f"{peft_dir}: no {' or '.join(ADAPTER_FILES)}")


def pair_tensors(sources: list[SourceTensor], base: Base, outtype: str) -> list[OutTensor]:
    """Every lora_A / lora_B of the adapter as the GGUF's .lora_a / .lora_b of the matrix it adapts."""
    normal_rope = C.FAMILIES[base.arch].rope == "normal"
    out, seen = [], {}
    for src in sources:
        if "lora_embedding_" in src.name:
            raise ValueError(f"{src.name}: token-embedding adapters are not supported")
        m = _PAIR.match(src.name)
        if not m:
            raise ValueError(f"{src.name}: not a lora_A / lora_B weight (modules_to_save and biases are not "
                             "supported)")
        name, bid = gguf_name(m.group(1) + ".weight", base.arch)
        if len(src.shape) != 2:
            raise ValueError(f"{src.name}: a LoRA matrix must be 2-D, not {list(src.shape)}")
        heads = None
        if m.group(2) == "B" and normal_rope and bid is not None and name == C.ATTN_Q % bid:
            heads = (base.n_head, base.n_head)
        elif m.group(2) == "B" and normal_rope and bid is not None and name == C.ATTN_K % bid:
            heads = (base.n_head, base.n_head_kv)
        dest = f"{name}.lora_{m.group(2).lower()}"
        ttype = tensor_type(dest, src.shape, outtype)
        out.append(OutTensor(dest, src.shape, ttype, loader(src, ttype, heads)))
        seen.setdefault(name, {})[m.group(2)] = src.shape
    for name, ab in seen.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{name}: the adapter has lora_{''.join(ab)} but not its pair")
        if ab["A"][0] != ab["B"][1]:
            raise ValueError(f"{name}: lora_A has rank {ab['A'][0]} but lora_B {ab['B'][1]}")
    if not out:
        raise ValueError("the adapter has no lora_A / lora_B weights")
    return out


def loader(src: SourceTensor, qtype: gguf.GGMLQuantizationType, heads: tuple[int, int] | None):
    def load():
        t = src.load()
        if heads is not None:
            t = permute(t, *heads)
        return quantize_array(t.to(torch.float32).numpy(), qtype)

    return load


def convert_lora(peft_dir: str | Path, base_path: str | Path, out: str | Path, outtype: str = "f32",
                 progress: bool = True) -> None:
    """Write the GGUF adapter of a PEFT folder for the base model at base_path (GGUF or Hugging Face folder)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    peft_dir = Path(peft_dir)
    alpha, _ = load_adapter_config(peft_dir)
    base = load_base(base_path)
    fields = {"general.type": string_field("adapter"), "adapter.type": string_field("lora"),
              "adapter.lora.alpha": Field(alpha, gguf.GGUFValueType.FLOAT32)}
    with ExitStack() as stack:
        src = adapter_file(peft_dir)
        tensors = pair_tensors(open_checkpoint(src, stack), base, outtype)
        write_gguf(out, base.arch, fields, tensors, desc=f"converting to {outtype}", progress=progress,
                   inputs=[src, peft_dir / "adapter_config.json", Path(base_path)])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("peft_dir", help="folder with adapter_config.json and adapter_model.safetensors (or .bin)")
    ap.add_argument("--base", required=True, help="the base model: its GGUF file or its Hugging Face folder")
    ap.add_argument("-o", "--out", required=True, help="output .gguf path")
    ap.add_argument("--outtype", type=str.lower, choices=OUTTYPES, default="f32",
                    help="type of the LoRA matrices (default f32, as upstream's converter)")


def run(args: argparse.Namespace) -> None:
    convert_lora(args.peft_dir, args.base, args.out, args.outtype)
    print(f"wrote {args.out}")
