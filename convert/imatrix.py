"""Importance matrices as llama.cpp's llama-imatrix writes them, for `quantize --imatrix` (the types that need one:
IQ1_*, IQ2_*; the others use one where it is given, as llama-quantize does).

Two formats, both read as llama-quantize reads them: the GGUF one (a tensor NAME.in_sum2 of summed squared
activations [n_mat, n_per_row] and NAME.counts [n_mat]; the weights are in_sum2 / counts, 1 where a count is 0; its
imatrix.datasets / chunk_count / chunk_size keys must be there) and the legacy binary one (n_entries, then per
entry: a name, ncall and n values; the weights are values / ncall). Every weight must be finite.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

import gguf
import numpy as np

KEYS = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")


class Imatrix(NamedTuple):
    """entries: {tensor name: float32 weights [n_mat * n_per_row]}; datasets: the texts it was computed on (names);
    chunk_count: how many chunks of them (0: not recorded)."""

    entries: dict[str, np.ndarray]
    datasets: list[str]
    chunk_count: int


def read_imatrix(path: str | os.PathLike) -> Imatrix:
    """An importance matrix file; ValueError when the file is not one (or is cut short, or holds a non-finite
    weight)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    imatrix = read_gguf(path) if magic == b"GGUF" else read_legacy(path)
    if not imatrix.entries:
        raise ValueError(f"{path}: no importance matrix entries")
    for name, w in imatrix.entries.items():
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{path}: the importance matrix of {name} holds a non-finite value")
    return imatrix


def read_gguf(path: str | os.PathLike) -> Imatrix:
    reader = gguf.GGUFReader(path)
    missing = [k for k in KEYS if k not in reader.fields]
    if missing:
        raise ValueError(f"{path}: not an importance matrix (no {', '.join(missing)}: llama-imatrix writes them)")
    datasets_field = reader.fields["imatrix.datasets"]
    datasets = [bytes(datasets_field.parts[i]).decode("utf-8", "replace") for i in datasets_field.data]
    chunk_count = int(reader.fields["imatrix.chunk_count"].parts[-1][0])
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts_t = tensors.get(base + ".counts")
        if counts_t is None or t.tensor_type != gguf.GGMLQuantizationType.F32 or \
                counts_t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {base} needs F32 tensors {base}.in_sum2 and {base}.counts")
        sums = np.asarray(t.data, dtype=np.float32).reshape(-1)
        counts = np.asarray(counts_t.data, dtype=np.float32).reshape(-1)
        if counts.size == 0 or sums.size % counts.size:
            raise ValueError(f"{path}: {base}: {sums.size} sums do not split into {counts.size} matrices")
        rows = sums.reshape(counts.size, -1)
        weights = np.where(counts[:, None] > 0, rows / np.where(counts > 0, counts, 1)[:, None], 1.0)
        out[base] = weights.astype(np.float32).reshape(-1)
    return Imatrix(out, datasets, chunk_count)


def read_legacy(path: str | os.PathLike) -> Imatrix:
    data = memoryview(open(path, "rb").read())
    at = 0

    def take(fmt: str) -> tuple:
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise ValueError(f"{path}: not an importance matrix (cut short at byte {at})")
        values = struct.unpack_from(fmt, data, at)
        at += size
        return values

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise ValueError(f"{path}: not an importance matrix ({n_entries} entries)")
    out = {}
    for _ in range(n_entries):
        (n,) = take("<i")
        if n < 0 or n > len(data):
            raise ValueError(f"{path}: not an importance matrix (a name of {n} bytes)")
        name = bytes(take(f"<{n}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise ValueError(f"{path}: {name}: {nval} values")
        values = np.asarray(take(f"<{nval}f"), dtype=np.float32)
        out[name] = values / ncall if ncall > 0 else values
    chunk_count, datasets = 0, []
    if at + 4 <= len(data):  # optional: the chunk count, then the dataset's name
        (chunk_count,) = take("<i")
        if at + 4 <= len(data):
            (n,) = take("<i")
            if 0 < n <= len(data) - at:
                datasets.append(bytes(take(f"<{n}s")[0]).decode("utf-8", "replace"))
    return Imatrix(out, datasets, chunk_count)
