"""Rewrite SpecEE's own merged GGUF (architecture "eauto") as a llama GGUF with specee.* metadata.

SpecEE's llama.cpp fork stores the base model under the `eauto` architecture with the llama keys
renamed `eauto.*`, every layer's predictor (blk.N.pred.up/down.weight/bias) and the EAGLE head
(eagle.*, q/k rows permuted like the base model's). The rewrite is lossless: every tensor keeps its
name, type and bytes; the keys `eauto.*` become `llama.*`; specee.* keys are added. The exit layer set
is not stored in SpecEE's files (its fork hard-codes {15,16,17,19,21,24,26,28} for Llama-2-7B): that set
is used for a 32-layer model, else every predictor layer but the last; --exit-layers overrides it.

    python -m specee.convert import-specee SpecEE-7b-chat-hf.gguf -o specee-7b.gguf
"""

from __future__ import annotations

import argparse
import os

import gguf

from specee import constants as C
from specee.convert.draft_head import DEFAULT_N_CANDIDATES, DEFAULT_THRESHOLD, check_exit_layers, default_exit_layers
from specee.convert.merge import array_field, parse_layers
from specee.convert.output import copy_tensor, field_value, read_fields, string_field, uint32_field, write_gguf
from specee.convert.retype import Field

DESCRIPTION = "Rewrite SpecEE's eauto GGUF losslessly as llama + specee.* (tensor bytes unchanged)"


def import_specee(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    exit_layers: list[int] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    progress: bool = True,
) -> None:
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: no such file")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"the exit threshold must lie in [0, 1], not {threshold}")
    reader = gguf.GGUFReader(src)
    fields = read_fields(reader)
    arch = str(field_value(fields[gguf.Keys.General.ARCHITECTURE]))
    if arch != C.EAUTO_ARCH:
        raise ValueError(f"{src}: architecture is {arch!r}, not SpecEE's {C.EAUTO_ARCH!r}")
    prefix = C.EAUTO_ARCH + "."
    out: dict[str, Field] = {}
    for key, f in fields.items():
        if key == gguf.Keys.General.ARCHITECTURE:
            out[key] = string_field(C.ARCH)
        else:
            out[C.ARCH + "." + key[len(prefix):] if key.startswith(prefix) else key] = f
    names = {t.name for t in reader.tensors}
    n_layer = int(out[C.KEY_BLOCK_COUNT.format(arch=C.ARCH)].value)
    pred_layers = [i for i in range(n_layer) if all(fmt % i in names for fmt in C.PRED_TENSOR_NAMES)]
    eagle = [n for n in C.EAGLE_TENSOR_NAMES if n not in C.EAGLE_OPTIONAL]
    if all(n in names for n in eagle):
        gate = next(t for t in reader.tensors if t.name == C.EAGLE_FFN_GATE)
        out[C.KEY_EAGLE_VERSION] = uint32_field(1)
        out[C.KEY_EAGLE_FEED_FORWARD_LENGTH] = uint32_field(int(gate.shape[1]))
    elif any(n.startswith("eagle.") for n in names):
        raise ValueError(f"{src}: incomplete EAGLE head, lacks {[n for n in eagle if n not in names]}")
    if pred_layers:
        layers = check_exit_layers(exit_layers or default_exit_layers(pred_layers, n_layer), pred_layers, n_layer)
        out[C.KEY_EXIT_LAYERS] = array_field(layers)
        out[C.KEY_EXIT_THRESHOLD] = Field(float(threshold), gguf.GGUFValueType.FLOAT32)
        out[C.KEY_EXIT_N_CANDIDATES] = uint32_field(DEFAULT_N_CANDIDATES)
    elif exit_layers:
        raise ValueError(f"{src}: --exit-layers given but the file has no predictors")
    tensors = [copy_tensor(t) for t in reader.tensors]
    write_gguf(dst, C.ARCH, out, tensors, desc="rewriting", progress=progress, inputs=[src])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("src", help="SpecEE's merged .gguf (general.architecture eauto)")
    ap.add_argument("-o", "--out", required=True, help="output .gguf path")
    ap.add_argument("--exit-layers", type=parse_layers, help="static exit layer set, e.g. 15,16,17,19")
    ap.add_argument("--exit-threshold", type=float, default=DEFAULT_THRESHOLD,
                    help=f"predictor threshold (default {DEFAULT_THRESHOLD}, as SpecEE)")


def run(args: argparse.Namespace) -> None:
    import_specee(args.src, args.out, exit_layers=args.exit_layers, threshold=args.exit_threshold)
    print(f"wrote {args.out}")

