"""Print a GGUF's metadata and tensor table, and which SpecEE parts it carries (base model, draft head,
exit predictors with their layers).

    python -m specee.convert inspect MODEL.gguf [--no-tensors] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass, field

import gguf

from specee import constants as C
from specee.convert.output import field_value, format_bytes, read_fields
from specee.convert.retype import Field

DESCRIPTION = "Show a GGUF's metadata, tensors and SpecEE parts (base model / draft head / exit predictors)"

SHOWN_ITEMS = 8  # array items printed


@dataclass
class Parts:
    arch: str
    n_layer: int
    base_model: bool
    base_missing: list[str] = field(default_factory=list)
    eagle_head: bool = False
    eagle_missing: list[str] = field(default_factory=list)
    eagle_version: int | None = None
    eagle_token_embd: bool = False
    eagle_draft_vocab: int | None = None  # rows of eagle.output, when the head has a reduced vocabulary
    eagle_n_ff: int | None = None  # specee.eagle.feed_forward_length, else the rows of eagle.ffn_gate
    eagle_feature_layers: list[int] | None = None  # EAGLE-3: specee.eagle.feature_layers
    predictor_layers: list[int] = field(default_factory=list)
    predictor_incomplete: list[int] = field(default_factory=list)  # layers with some of their pred tensors
    exit_layers: list[int] | None = None
    exit_threshold: float | None = None
    exit_n_candidates: int | None = None


# "blk.%d.pred.up.weight" -> a pattern giving the layer number
PRED_PATTERNS = [re.compile(re.escape(n).replace("%d", r"(\d+)")) for n in C.PRED_TENSOR_NAMES]


def find_predictor_layers(names: set[str]) -> tuple[list[int], list[int]]:
    """(layers with all their predictor tensors, layers with only some), read off the tensor names, so a
    draft head file (no block count) lists them too."""
    layers = sorted({int(m[1]) for n in names for pat in PRED_PATTERNS if (m := pat.fullmatch(n))})
    complete = [i for i in layers if all(f % i in names for f in C.PRED_TENSOR_NAMES)]
    return complete, [i for i in layers if i not in complete]


def find_parts(fields: dict[str, Field], shapes: dict[str, list[int]]) -> Parts:
    """The SpecEE parts in a file of these metadata fields and tensors (name -> shape as GGML's ne)."""
    names = set(shapes)
    arch = str(field_value(fields.get(gguf.Keys.General.ARCHITECTURE, Field("", gguf.GGUFValueType.STRING))))
    n_layer_f = fields.get(C.KEY_BLOCK_COUNT.format(arch=arch))
    n_layer = int(n_layer_f.value) if n_layer_f is not None else 0
    family = C.FAMILIES.get(arch, C.FAMILIES[C.ARCH])
    want = [C.TOKEN_EMBD, C.OUTPUT_NORM] + [n % i for i in range(n_layer) for n in family.layer_tensors]
    base_missing = [n for n in want if n not in names]
    parts = Parts(arch, n_layer, base_model=n_layer > 0 and not base_missing, base_missing=base_missing)
    eagle = [n for n in names if n.startswith("eagle.")]
    if eagle:
        version = fields.get(C.KEY_EAGLE_VERSION)
        parts.eagle_version = int(version.value) if version is not None else None
        optional = C.EAGLE3_OPTIONAL if parts.eagle_version == 3 else C.EAGLE_OPTIONAL
        required = [n for n in C.EAGLE_TENSOR_NAMES if n not in optional]
        parts.eagle_missing = [n for n in required if n not in names]
        parts.eagle_head = not parts.eagle_missing
        parts.eagle_token_embd = C.EAGLE_TOKEN_EMBD in names
        layers = fields.get(C.KEY_EAGLE_FEATURE_LAYERS)
        parts.eagle_feature_layers = [int(i) for i in field_value(layers)] if layers is not None else None
        draft = fields.get(C.KEY_EAGLE_DRAFT_VOCAB)
        parts.eagle_draft_vocab = len(draft.value) if draft is not None else None
        n_ff = fields.get(C.KEY_EAGLE_FEED_FORWARD_LENGTH)
        gate = shapes.get(C.EAGLE_FFN_GATE)
        parts.eagle_n_ff = int(n_ff.value) if n_ff is not None else int(gate[1]) if gate else None
    parts.predictor_layers, parts.predictor_incomplete = find_predictor_layers(names)
    if C.KEY_EXIT_LAYERS in fields:
        parts.exit_layers = [int(i) for i in fields[C.KEY_EXIT_LAYERS].value]
    if C.KEY_EXIT_THRESHOLD in fields:
        parts.exit_threshold = round(float(fields[C.KEY_EXIT_THRESHOLD].value), 6)
    if C.KEY_EXIT_N_CANDIDATES in fields:
        parts.exit_n_candidates = int(fields[C.KEY_EXIT_N_CANDIDATES].value)
    return parts


def describe_parts(p: Parts) -> list[str]:
    lines = []
    if p.base_model:
        lines.append(f"base model       yes: {p.arch}, {p.n_layer} layers")
    elif p.n_layer == 0:
        lines.append(f"base model       no: no {C.KEY_BLOCK_COUNT.format(arch=p.arch)} (a draft head file)")
    else:
        lines.append(f"base model       no: lacks {len(p.base_missing)} tensors, e.g. {p.base_missing[:3]}")
    if p.eagle_head:
        version = f"EAGLE-{p.eagle_version}" if p.eagle_version else "EAGLE (no specee.eagle.version key)"
        embd = "own token embedding" if p.eagle_token_embd else "uses the base model's token embedding"
        draft = f", draft vocabulary of {p.eagle_draft_vocab}" if p.eagle_draft_vocab else ""
        n_ff = f", feed-forward length {p.eagle_n_ff}" if p.eagle_n_ff else ""
        layers = f", features: outputs of layers {p.eagle_feature_layers}" if p.eagle_feature_layers else ""
        version = "EAGLE-3 head" if p.eagle_version == 3 else version
        lines.append(f"draft head       yes: {version}, {embd}{draft}{n_ff}{layers}")
    elif p.eagle_missing:
        lines.append(f"draft head       incomplete: lacks {p.eagle_missing}")
    else:
        lines.append("draft head       no")
    if p.predictor_layers:
        text = f"exit predictors  yes: {len(p.predictor_layers)} layers {p.predictor_layers}"
        if p.exit_layers is not None:
            text += f"; static exit layers {p.exit_layers}"
        if p.exit_threshold is not None:
            text += f", threshold {p.exit_threshold:g}"
        if p.exit_n_candidates is not None:
            text += f", {p.exit_n_candidates} candidates"
        lines.append(text)
    elif not p.predictor_incomplete:
        lines.append("exit predictors  no")
    if p.predictor_incomplete:
        each = ", ".join(n.replace("%d", "N") for n in C.PRED_TENSOR_NAMES)
        lines.append(f"exit predictors  incomplete in layers {p.predictor_incomplete} (each needs {each})")
    return lines


def show_value(f: Field, full: bool = False) -> str:
    value = field_value(f)
    if isinstance(value, list):
        sub = f.sub_type.name if f.sub_type is not None else "?"
        items = value if full else value[:SHOWN_ITEMS]
        more = "" if len(items) == len(value) else ", ..."
        return f"[{len(value)} x {sub}] [{', '.join(repr(v) for v in items)}{more}]"
    if isinstance(value, str):
        return repr(value if full or len(value) <= 80 else value[:77] + "...")
    return str(value)


def tensor_shapes(reader: gguf.GGUFReader) -> dict[str, list[int]]:
    return {t.name: [int(n) for n in t.shape] for t in reader.tensors}


def inspect_gguf(path: str | os.PathLike, *, tensors: bool = True, full: bool = False) -> str:
    reader = gguf.GGUFReader(path)
    fields = read_fields(reader)
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    lines = [f"{path}: GGUF v{version}, {format_bytes(os.path.getsize(path))}, {len(fields)} metadata keys, "
             f"{len(reader.tensors)} tensors, alignment {reader.alignment}", "", "metadata:"]
    width = max((len(k) for k in fields), default=0)
    lines += [f"  {k:<{width}}  {show_value(f, full)}" for k, f in fields.items()]
    if tensors:
        lines += ["", "tensors (shape as GGML's ne, innermost first):"]
        width = max((len(t.name) for t in reader.tensors), default=0)
        for t in reader.tensors:
            shape = ", ".join(str(int(n)) for n in t.shape)
            lines.append(f"  {t.name:<{width}}  {t.tensor_type.name:<5}  [{shape}]")
    parts = find_parts(fields, tensor_shapes(reader))
    lines += ["", "SpecEE parts:"] + ["  " + line for line in describe_parts(parts)]
    return "\n".join(lines)


def inspect_json(path: str | os.PathLike) -> dict:
    reader = gguf.GGUFReader(path)
    fields = read_fields(reader)
    meta = {}
    for k, f in fields.items():
        value = field_value(f)
        meta[k] = value if not isinstance(value, list) or len(value) <= SHOWN_ITEMS else f"[{len(value)} items]"
    return {
        "metadata": meta,
        "tensors": [{"name": t.name, "type": t.tensor_type.name, "shape": [int(n) for n in t.shape]}
                    for t in reader.tensors],
        "parts": asdict(find_parts(fields, tensor_shapes(reader))),
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("path", help="a .gguf file")
    ap.add_argument("--no-tensors", action="store_true", help="leave out the tensor table")
    ap.add_argument("--full", action="store_true", help="print whole arrays and strings")
    ap.add_argument("--json", action="store_true",
                    help="print metadata (long arrays summarized), tensors and parts as JSON")


def run(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.path):
        raise FileNotFoundError(f"{args.path}: no such file")
    if args.json:
        print(json.dumps(inspect_json(args.path), indent=1))
    else:
        print(inspect_gguf(args.path, tensors=not args.no_tensors, full=args.full))

