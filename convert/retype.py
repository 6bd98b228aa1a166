"""Rewrite a GGUF file: copy its metadata and tensors, dequantizing tensors to F32 (or F16).

    python -m specee.convert.retype IN.gguf -o OUT.gguf --outtype f32

`read_gguf` and `write_gguf` are the two halves, reusable for edited copies (another architecture
name, a tensor dropped or replaced).
"""

from __future__ import annotations

import argparse
import os
from typing import Iterable, Sequence

import gguf
import numpy as np

from specee.convert.output import Field, PathLike, temp_output

OUTTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Field], dict[str, np.ndarray]]:
    """Metadata (without the GGUF.* header fields) and tensors dequantized to float32 numpy arrays
    (numpy shape order: the reverse of GGML's ne)."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        fields[f.name] = Field(f.contents(), f.types[0], sub)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(data, dtype=np.float32).reshape(shape)
    return fields, tensors


def write_gguf(path: PathLike, fields: dict[str, Field], tensors: Iterable[tuple[str, np.ndarray]],
               inputs: Sequence[PathLike] = ()) -> None:
    """Write metadata and tensors as given (general.architecture is taken from `fields`); `path` may be none of
    `inputs`."""
    arch = fields["general.architecture"].value
    with temp_output(path, 0, inputs) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, f in fields.items():
            if key != "general.architecture":
                writer.add_key_value(key, f.value, f.type, sub_type=f.sub_type)
        for name, data in tensors:
            writer.add_tensor(name, data)
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def retype_gguf(src: str | os.PathLike, dst: str | os.PathLike, outtype: str = "f32") -> None:
    """Copy `src` to `dst` with every tensor in F32 (outtype f32) or 2-D+ tensors in F16 (f16)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, not {outtype!r}")
    fields, tensors = read_gguf(src)
    fields["general.file_type"] = Field(int(OUTTYPES[outtype]), gguf.GGUFValueType.UINT32)
    fields.pop("general.quantization_version", None)

    def cast(data: np.ndarray) -> np.ndarray:
        return data.astype(np.float16) if outtype == "f16" and data.ndim > 1 else data

    write_gguf(dst, fields, ((name, cast(data)) for name, data in tensors.items()), inputs=[src])


def main() -> None:
    ap = argparse.ArgumentParser(description="Copy a GGUF with its tensors dequantized to F32 or F16")
    ap.add_argument("src", help="input .gguf")
    ap.add_argument("-o", "--out", required=True, help="output .gguf path")
    ap.add_argument("--outtype", choices=sorted(OUTTYPES), default="f32")
    args = ap.parse_args()
    try:
        retype_gguf(args.src, args.out, args.outtype)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
