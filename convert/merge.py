"""Merge an EAGLE-1 or EAGLE-3 draft head and exit predictors into a base GGUF (one file for the SpecEE runtime), or write
them as a draft head file.

The base model's metadata and tensors are copied unchanged (any type, quantized included); the EAGLE
tensors are added as F16 (matrices; --eagle-type f32 keeps F32) and F32 (vectors), the predictors as
F32, and the settings as specee.* keys (see docs/gguf.md and specee.constants). A draft head or
predictors the base file carries already are replaced when new ones are given and kept otherwise. Layouts of
the inputs: see draft_head.py. With --draft-head-only the output is a draft head file: only the draft head
(eagle.* tensors and specee.eagle.* keys, checked against the base model) and the predictors if given
(blk.N.pred.*, specee.exit.*), to be loaded next to an unmodified base file (--draft-head, Model(draft_head=...)).

    python -m specee.convert merge BASE.gguf -o OUT.gguf --eagle EAGLE_DIR --predictors preds.safetensors
    python -m specee.convert merge BASE.gguf -o DRAFT_HEAD.gguf --eagle HEAD.safetensors --draft-head-only
    python -m specee.convert merge BASE.gguf -o DRAFT_HEAD.gguf --eagle HEAD.safetensors --predictors P.safetensors \\
        --draft-head-only
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import gguf
import numpy as np

from specee import constants as C
from specee.convert.draft_head import (
    DEFAULT_THRESHOLD,
    EagleHead,
    Predictors,
    base_model,
    check_exit_layers,
    default_exit_layers,
    load_eagle,
    load_predictors,
)
from specee.convert.output import OutTensor, copy_tensor, read_fields, uint32_field, write_gguf
from specee.convert.retype import Field

DESCRIPTION = ("Merge an EAGLE-1 or EAGLE-3 draft head and exit predictors into a base GGUF (one file with specee.* metadata), "
               "or write them as a draft head file")

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
EAGLE_TYPES = {"f16": Q.F16, "f32": Q.F32}
PRED_RE = re.compile(r"blk\.\d+\.pred\.")


def array_field(values: list[int]) -> Field:
    return Field([int(v) for v in values], V.ARRAY, V.INT32)


def input_files(*paths: str | os.PathLike | None) -> list[Path]:
    """The files a merge may read: each given file with the NAME.json and config.json beside it, and every file
    of a given folder (a published EAGLE head); an output may be none of them."""
    files = []
    for path in (Path(p) for p in paths if p is not None):
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.is_file())
        else:
            files += [path, path.with_suffix(".json"), path.parent / "config.json"]
    return files


def eagle_tensors(head: EagleHead, qtype: Q, embd: bool) -> list[OutTensor]:
    out = []
    for name in C.EAGLE_TENSOR_NAMES:
        if name not in head.tensors or (name == C.EAGLE_TOKEN_EMBD and not embd):
            continue
        data = head.tensors[name]
        t = Q.F32 if data.ndim == 1 else qtype
        out.append(OutTensor(name, data.shape, t, lambda d=data, t=t: gguf.quants.quantize(d, t)))
    return out


def predictor_tensors(preds: Predictors) -> list[OutTensor]:
    out = []
    for layer in preds.layers:
        for fmt in C.PRED_TENSOR_NAMES:
            data = preds.tensors[fmt % layer].astype(np.float32)
            out.append(OutTensor(fmt % layer, data.shape, Q.F32, lambda d=data: d))
    return out


def resolve_exit_settings(
    preds: Predictors, n_layer: int, exit_layers: list[int] | None, threshold: float | None
) -> tuple[list[int], float]:
    """Command line first, then the predictors' settings file, then the defaults."""
    layers = exit_layers or preds.exit_layers or default_exit_layers(preds.layers, n_layer)
    layers = check_exit_layers(layers, preds.layers, n_layer)
    if not layers:
        raise ValueError(f"no exit layers: predictors exist only for layers {preds.layers} of {n_layer}")
    thr = threshold if threshold is not None else preds.threshold if preds.threshold is not None else DEFAULT_THRESHOLD
    if not 0.0 <= thr <= 1.0:
        raise ValueError(f"the exit threshold must lie in [0, 1], not {thr}")
    return layers, float(thr)


def merge_gguf(
    base_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    eagle: str | os.PathLike | None = None,
    predictors: str | os.PathLike | None = None,
    exit_layers: list[int] | None = None,
    threshold: float | None = None,
    eagle_type: str = "f16",
    eagle_embd: bool = True,
    draft_head_only: bool = False,
    feature_layers: list[int] | None = None,
    progress: bool = True,
) -> None:
    if eagle is None and predictors is None:
        raise ValueError("nothing to merge: give a draft head (--eagle), predictors (--predictors) or both")
    if draft_head_only and eagle is None:
        raise ValueError("--draft-head-only writes a draft head file (the draft head, and predictors if given) "
                         "without the base model: give --eagle")
    if eagle_type not in EAGLE_TYPES:
        raise ValueError(f"eagle_type must be one of {list(EAGLE_TYPES)}, not {eagle_type!r}")
    if not os.path.isfile(base_path):
        raise FileNotFoundError(f"{base_path}: no such base model file")
    reader = gguf.GGUFReader(base_path)
    fields = read_fields(reader)
    base = base_model(fields, reader, base_path)
    if base.arch == C.EAUTO_ARCH:
        raise ValueError(f"{base_path} is a SpecEE eauto file: rewrite it with `import-specee` first")
    if base.arch not in C.FAMILIES:
        raise ValueError(f"{base_path}: architecture {base.arch!r} is not supported (one of {', '.join(C.FAMILIES)})")
    if feature_layers and eagle is None:
        raise ValueError("--eagle-feature-layers sets an EAGLE-3 head's feature layers: give the head (--eagle)")
    head = load_eagle(eagle, base, feature_layers) if eagle is not None else None
    preds = load_predictors(predictors, base) if predictors is not None else None

    def replaced(name: str) -> bool:
        return (head is not None and name.startswith("eagle.")) or (preds is not None and bool(PRED_RE.match(name)))

    tensors = [copy_tensor(t) for t in reader.tensors if not replaced(t.name)]
    if draft_head_only:
        fields = {k: f for k, f in fields.items() if k.startswith("specee.eagle.")}
        tensors = []
    if head is not None:
        for key in [k for k in fields if k.startswith("specee.eagle.")]:
            del fields[key]
        fields[C.KEY_EAGLE_VERSION] = uint32_field(head.version)
        fields[C.KEY_EAGLE_FEED_FORWARD_LENGTH] = uint32_field(head.n_ff)
        if head.draft_vocab is not None:
            fields[C.KEY_EAGLE_DRAFT_VOCAB] = array_field(head.draft_vocab)
        if head.acceptance is not None:
            fields[C.KEY_EAGLE_ACCEPTANCE] = Field(head.acceptance, V.FLOAT32)
        if head.feature_layers is not None:
            fields[C.KEY_EAGLE_FEATURE_LAYERS] = array_field(head.feature_layers)
        tensors += eagle_tensors(head, EAGLE_TYPES[eagle_type], eagle_embd)
    if preds is not None:
        layers, thr = resolve_exit_settings(preds, base.n_layer, exit_layers, threshold)
        for key in [k for k in fields if k.startswith("specee.exit.")]:
            del fields[key]
        fields[C.KEY_EXIT_LAYERS] = array_field(layers)
        fields[C.KEY_EXIT_THRESHOLD] = Field(thr, V.FLOAT32)
        fields[C.KEY_EXIT_N_CANDIDATES] = uint32_field(preds.n_candidates)
        if preds.speedup is not None and layers == preds.exit_layers and thr == preds.threshold:
            fields[C.KEY_EXIT_SPEEDUP] = Field(preds.speedup, V.FLOAT32)  # simulated for exactly these settings
        tensors += predictor_tensors(preds)
    write_gguf(out_path, base.arch, fields, tensors, desc="merging", progress=progress,
               inputs=input_files(base_path, eagle, predictors))


def parse_layers(text: str) -> list[int]:
    """"15,16,17" or "15-17,19" -> [15, 16, 17(, 19)]."""
    layers = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        layers += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return layers


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("base", help="base model .gguf (a family of specee.constants.FAMILIES: llama, qwen2, ...; any tensor types)")
    ap.add_argument("-o", "--out", required=True, help="output .gguf path")
    ap.add_argument("--eagle", help="EAGLE-1 or EAGLE-3 draft head: a published folder (config.json + "
                    "pytorch_model.bin or model.safetensors), NAME.safetensors with NAME.json (this project's layout), or a draft head file "
                    "NAME.gguf (merge --draft-head-only, train-eagle --head-gguf)")
    ap.add_argument("--predictors", help="exit predictors: a safetensors file (SpecEE's model.layers.N.pred.* or "
                    "this project's blk.N.pred.* names, optional NAME.json with settings)")
    ap.add_argument("--exit-layers", type=parse_layers,
                    help="static exit layer set, e.g. 15,16,17 or 15-17,19 (default: the predictors' settings, "
                    "else SpecEE's set for a 32-layer model, else every predictor layer but the last layer)")
    ap.add_argument("--exit-threshold", type=float, help=f"predictor threshold (default {DEFAULT_THRESHOLD})")
    ap.add_argument("--eagle-type", choices=list(EAGLE_TYPES), default="f16", help="type of the EAGLE matrices")
    ap.add_argument("--no-eagle-embd", action="store_true",
                    help="leave out the head's own token embedding (the runtime then uses the base model's)")
    ap.add_argument("--eagle-feature-layers", type=parse_layers,
                    help="EAGLE-3: the 3 target layers whose outputs (0-based) form the head's feature, e.g. 1,14,26 "
                    "(default: the checkpoint's eagle_aux_hidden_state_layer_ids, which name layer inputs, else "
                    "EAGLE's inputs of layers 2, L//2, L-3 = outputs of 1, L//2-1, L-4)")
    ap.add_argument("--draft-head-only", action="store_true",
                    help="write a draft head file: only the draft head (eagle.* tensors, specee.eagle.* keys; shapes "
                    "checked against the base model) and the predictors if given, for loading next to the "
                    "unmodified base file (--draft-head)")


def run(args: argparse.Namespace) -> None:
    merge_gguf(args.base, args.out, eagle=args.eagle, predictors=args.predictors, exit_layers=args.exit_layers,
               threshold=args.exit_threshold, eagle_type=args.eagle_type, eagle_embd=not args.no_eagle_embd,
               draft_head_only=args.draft_head_only, feature_layers=args.eagle_feature_layers)
    print(f"wrote {args.out}")

