"""Retype the tensors of a GGUF: dequantize (Q4_1 -> F16) or quantize (F16 -> Q8_0, Q4_K, IQ4_NL, ...: every type
ggml makes without an importance matrix).

Follows `llama-quantize` so that its output can be compared byte for byte (the F16 output for
SmolLM2 Q4_1 is identical; see tests/test_convert_cli.py):
- a tensor is converted when it has 2 or more dimensions (trailing 1s not counted), its name ends in
  "weight" and it is not a norm; every other tensor is copied unchanged;
- tensors are written in llama.cpp's order (by block number, then name; non-block tensors first);
- the metadata is copied in order, then general.quantization_version and general.file_type are set
  (moved to the end), and the split.* keys are dropped;
- converting an already quantized tensor needs allow_requantize (--allow-requantize), also when the
  target is a float type;
- a matrix whose rows are not a whole number of blocks of the target type gets a fallback type whose blocks fit
  (Q4_K -> Q5_0, Q6_K -> Q8_0, ...; FALLBACK), else F16;
- the quantized types are made by ggml's own quantizers, the ones llama-quantize calls.
Differences, on purpose: the quantized targets are "pure" (every matrix gets the target type, as
`llama-quantize --pure`: llama-quantize's K-quant mixtures give some matrices other types; the _S/_M/_L names
differ in general.file_type only),
draft head matrices (eagle.*) stay float (the target when it is a float type, else F16) and the exit
predictors stay F32.

    python -m specee.convert quantize IN.gguf OUT.gguf f16 --allow-requantize
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Callable

import gguf
import numpy as np

from specee.convert.imatrix import read_imatrix
from specee.convert.output import (OutTensor, copy_tensor, field_value, read_fields, string_field, uint32_field,
                                   write_gguf)

DESCRIPTION = "Retype a GGUF's tensors (dequantize or quantize), as llama-quantize does"

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType
# outtype -> (tensor type of the matrices, general.file_type); hf.py's --outtype too. llama-quantize's names; every
# matrix gets the one type ("pure", as llama-quantize --pure: the _S/_M/_L names differ in general.file_type only).
# Made by ggml's own quantizers (specee._core.quantize), except the float types; types that need an importance matrix
# (IQ1_S, IQ1_M, IQ2_*) are not offered.
OUTTYPES = {
    "f32": (Q.F32, FT.ALL_F32),
    "f16": (Q.F16, FT.MOSTLY_F16),
    "bf16": (Q.BF16, FT.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, FT.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, FT.MOSTLY_Q4_0),
    "q4_1": (Q.Q4_1, FT.MOSTLY_Q4_1),
    "q5_0": (Q.Q5_0, FT.MOSTLY_Q5_0),
    "q5_1": (Q.Q5_1, FT.MOSTLY_Q5_1),
    "q2_k": (Q.Q2_K, FT.MOSTLY_Q2_K),
    "q3_k_s": (Q.Q3_K, FT.MOSTLY_Q3_K_S),
    "q3_k_m": (Q.Q3_K, FT.MOSTLY_Q3_K_M),
    "q3_k_l": (Q.Q3_K, FT.MOSTLY_Q3_K_L),
    "q4_k_s": (Q.Q4_K, FT.MOSTLY_Q4_K_S),
    "q4_k_m": (Q.Q4_K, FT.MOSTLY_Q4_K_M),
    "q5_k_s": (Q.Q5_K, FT.MOSTLY_Q5_K_S),
    "q5_k_m": (Q.Q5_K, FT.MOSTLY_Q5_K_M),
    "q6_k": (Q.Q6_K, FT.MOSTLY_Q6_K),
    "iq3_xxs": (Q.IQ3_XXS, FT.MOSTLY_IQ3_XXS),
    "iq3_s": (Q.IQ3_S, FT.MOSTLY_IQ3_S),
    "iq4_nl": (Q.IQ4_NL, FT.MOSTLY_IQ4_NL),
    "iq4_xs": (Q.IQ4_XS, FT.MOSTLY_IQ4_XS),
    "tq1_0": (Q.TQ1_0, FT.MOSTLY_TQ1_0),
    "tq2_0": (Q.TQ2_0, FT.MOSTLY_TQ2_0),
    "mxfp4": (Q.MXFP4, FT.MOSTLY_MXFP4_MOE),
}
# the types ggml makes only with an importance matrix (quantize --imatrix FILE; not offered by `hf --outtype`)
IMATRIX_OUTTYPES = {
    "iq2_xxs": (Q.IQ2_XXS, FT.MOSTLY_IQ2_XXS),
    "iq2_xs": (Q.IQ2_XS, FT.MOSTLY_IQ2_XS),
    "iq2_s": (Q.IQ2_S, FT.MOSTLY_IQ2_S),
    "iq1_s": (Q.IQ1_S, FT.MOSTLY_IQ1_S),
    "iq1_m": (Q.IQ1_M, FT.MOSTLY_IQ1_M),
}
IMATRIX_TYPES = {q for q, _ in IMATRIX_OUTTYPES.values()}
# a matrix whose rows are not whole blocks of the type gets the next of these whose blocks fit (llama-quantize's
# fallbacks for the 256-value super-blocks), else F16
FALLBACK = {Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL, Q.IQ2_S: Q.IQ4_NL, Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL,
            Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL,
            Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.TQ1_0: Q.Q4_0, Q.TQ2_0: Q.Q4_0}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
KEY_QUANT_VERSION = gguf.Keys.General.QUANTIZATION_VERSION
KEY_FILE_TYPE = gguf.Keys.General.FILE_TYPE
SPLIT_KEYS = (gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
              gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
PRED_RE = re.compile(r"blk\.\d+\.pred\.")


def llama_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order: block number (-1 outside blocks), then name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def n_dims(ne: np.ndarray) -> int:
    """Dimensions up to the last one larger than 1 (ggml_n_dims)."""
    sizes = [int(n) for n in ne]
    while len(sizes) > 1 and sizes[-1] == 1:
        sizes.pop()
    return len(sizes)


def target_type(name: str, ne: np.ndarray, current: Q, qtype: Q) -> Q:
    """The type `name` (GGML shape `ne`, now `current`) gets when the file is retyped to `qtype`."""
    if PRED_RE.match(name):
        return Q.F32
    if n_dims(ne) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return current
    if name.startswith("eagle.") and qtype not in FLOAT_TYPES:
        qtype = Q.F16
    return fitting_type(qtype, int(ne[0]))


def fitting_type(qtype: Q, row: int) -> Q:
    """qtype, or its fallback, or F16: the first whose blocks divide a row of `row` values."""
    while qtype is not None and row % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype)
    return Q.F16 if qtype is None else qtype


def quantize_array(data: np.ndarray, qtype: Q, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Floats [..., row] as `qtype`: the float types by the gguf package, the others by ggml's quantizers (what
    llama-quantize runs), as rows of bytes [..., row bytes]. imatrix: importance weights, one row of them per matrix
    of a 3-D tensor (the quantized types that take one use it)."""
    if qtype in FLOAT_TYPES:
        return gguf.quants.quantize(np.asarray(data, dtype=np.float32), qtype)
    from specee import _core

    n_per_row = data.shape[-1]
    if imatrix is None:
        rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, n_per_row)
        return _core.quantize(int(qtype), rows).reshape(*data.shape[:-1], -1)
    mats = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-2], n_per_row)
    weights = np.asarray(imatrix, dtype=np.float32).reshape(len(mats), n_per_row)
    return np.stack([_core.quantize(int(qtype), m, w) for m, w in zip(mats, weights)]).reshape(*data.shape[:-1], -1)


def converter(t: gguf.ReaderTensor, qtype: Q, imatrix: np.ndarray | None = None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return quantize_array(np.asarray(data, dtype=np.float32), qtype, imatrix)

    return load


def imatrix_of(name: str, ne: np.ndarray, qtype: Q, entries: dict[str, np.ndarray], path: str) -> np.ndarray | None:
    """The importance weights of matrix `name` (GGML shape `ne`) when quantized to `qtype`, as llama-quantize picks
    them: the entry of that name if its size is the matrix's (rows x matrices; token_embd, which llama-imatrix never
    sees, is let off a mismatch); ValueError where the type needs weights and there are none."""
    w = entries.get(name)
    n_mat = int(np.prod([int(n) for n in ne[2:]])) if len(ne) > 2 else 1
    if w is not None and w.size != int(ne[0]) * n_mat:
        if name != "token_embd.weight":
            raise ValueError(f"{path}: the importance matrix of {name} has {w.size} weights, the tensor "
                             f"{int(ne[0]) * n_mat} columns")
        w = None
    if w is None and qtype in IMATRIX_TYPES:
        raise ValueError(f"{path}: no importance matrix entry for {name}, which {qtype.name} needs (llama-imatrix "
                         "records the matrices a model multiplies by)")
    return w


def quantize_gguf(
    src: str | os.PathLike, dst: str | os.PathLike, outtype: str, *, allow_requantize: bool = False,
    progress: bool = True, imatrix: str | os.PathLike | None = None,
) -> None:
    """Retype `src` into `dst` (see the module's text); imatrix: an importance matrix file (llama-imatrix's), needed
    by the IMATRIX_OUTTYPES and used by every quantized type that takes one, as llama-quantize --imatrix."""
    types = {**OUTTYPES, **IMATRIX_OUTTYPES}
    if outtype not in types:
        raise ValueError(f"outtype must be one of {list(types)}, not {outtype!r}")
    if outtype in IMATRIX_OUTTYPES and imatrix is None:
        raise ValueError(f"{outtype} needs an importance matrix: --imatrix FILE (llama-imatrix's output)")
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: no such file")
    imat = None if imatrix is None else read_imatrix(imatrix)
    entries = {} if imat is None else imat.entries
    qtype, ftype = types[outtype]
    reader = gguf.GGUFReader(src)
    fields = read_fields(reader)
    for key in (KEY_QUANT_VERSION, KEY_FILE_TYPE, *SPLIT_KEYS):
        fields.pop(key, None)
    fields[KEY_QUANT_VERSION] = uint32_field(gguf.GGML_QUANT_VERSION)
    fields[KEY_FILE_TYPE] = uint32_field(int(ftype))
    if imat is not None:  # what llama-quantize records of it, in its order (a text of at most 127 bytes)
        fields["quantize.imatrix.file"] = string_field(os.fsencode(imatrix)[:127].decode("utf-8", "replace"))
        if imat.datasets:
            fields["quantize.imatrix.dataset"] = string_field(imat.datasets[0].encode()[:127].decode("utf-8",
                                                                                                    "replace"))
        fields["quantize.imatrix.entries_count"] = uint32_field(len(imat.entries))
        if imat.chunk_count > 0:
            fields["quantize.imatrix.chunks_count"] = uint32_field(imat.chunk_count)
    tensors = []
    for t in sorted(reader.tensors, key=lambda t: llama_order(t.name)):
        new = target_type(t.name, t.shape, t.tensor_type, qtype)
        if new == t.tensor_type:
            tensors.append(copy_tensor(t))
            continue
        if t.tensor_type not in FLOAT_TYPES and not allow_requantize:
            raise ValueError(
                f"{src}: tensor {t.name} is {t.tensor_type.name} already; converting quantized tensors is "
                "disabled unless --allow-requantize is given (quantizing them again loses quality)"
            )
        weights = None if new in FLOAT_TYPES or imatrix is None else imatrix_of(t.name, t.shape, new, entries,
                                                                                 str(imatrix))
        tensors.append(OutTensor(t.name, tuple(int(n) for n in reversed(t.shape)), new, converter(t, new, weights)))
    arch = field_value(fields[gguf.Keys.General.ARCHITECTURE])
    write_gguf(dst, str(arch), fields, tensors, desc=f"quantizing to {outtype}", progress=progress, inputs=[src])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("src", help="input .gguf")
    ap.add_argument("dst", help="output .gguf")
    ap.add_argument("outtype", type=str.lower, choices=[*OUTTYPES, *IMATRIX_OUTTYPES],
                    help=f"target type of the matrices ({', '.join(IMATRIX_OUTTYPES)}: with --imatrix only)")
    ap.add_argument("--allow-requantize", action="store_true",
                    help="allow converting tensors that are quantized already (as llama-quantize)")
    ap.add_argument("--imatrix", metavar="FILE",
                    help="an importance matrix (llama-imatrix's output, GGUF or legacy .dat), as llama-quantize "
                    "--imatrix: needed by iq2_*/iq1_*, used by every type that takes one")


def run(args: argparse.Namespace) -> None:
    quantize_gguf(args.src, args.dst, args.outtype, allow_requantize=args.allow_requantize, imatrix=args.imatrix)
    print(f"wrote {args.dst}")

