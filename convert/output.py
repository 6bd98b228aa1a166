"""Writing GGUF files safely, shared by every subcommand (and by the safetensors exports of specee.autoee).

An output that is one of the command's inputs (the same file, also through a link) is refused: writing it
would destroy what is being read. The file is written to a new temporary file `.OUT.<random>.tmp` in the
output's folder (a name of its own, never an input's or a leftover's) and renamed to `OUT` only when
complete; the temporary file is removed on any error and on SIGINT, SIGTERM and SIGHUP, so a half-written
file never carries the final name. SIGKILL cannot be caught: it leaves the `.OUT.<random>.tmp` file behind,
which nothing else uses and which can be deleted. Free disk space is checked before the first byte is
written. Tensors are written one at a time (each `OutTensor.load` is called once, just before its bytes go
out), so memory stays at about one tensor.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import gguf
import numpy as np
from tqdm import tqdm

QType = gguf.GGMLQuantizationType
KEY_ALIGNMENT = "general.alignment"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PathLike = str | os.PathLike


class OutOfDiskError(OSError):
    pass


@dataclass
class Field:
    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


@dataclass
class OutTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): the reverse of GGML's ne
    type: QType
    load: Callable[[], np.ndarray]  # the data: float arrays for F32/F16, raw uint8 blocks for other types

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.type)


def tensor_nbytes(shape: Sequence[int], qtype: QType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block:
        raise ValueError(f"a row of {shape[-1]} values is not a whole number of {qtype.name} blocks ({block})")
    return n // block * size


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def check_free_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OutOfDiskError(errno.ENOSPC, f"out of disk: the output needs {format_bytes(need)} but {folder} "
                             f"has {format_bytes(free)} free")


def check_not_input(out: Path, inputs: Sequence[PathLike]) -> None:
    """Refuse an output that is a folder or one of the inputs (the same path, or the same file through a link)."""
    if out.is_dir():
        raise IsADirectoryError(f"the output {out} is a folder")
    for path in map(Path, inputs):
        if out.resolve() == path.resolve() or (out.exists() and path.exists() and os.path.samefile(out, path)):
            raise ValueError(f"the output {out} is the input {path}: writing it would destroy the input; "
                             "choose another output path")


@contextmanager
def removed_on_signal(path: Path) -> Iterator[None]:
    """Remove `path` when SIGINT, SIGTERM or SIGHUP arrives, then let the signal act as it did before (SIGINT:
    KeyboardInterrupt; SIGTERM, SIGHUP: the process ends, killed by it). Signals left ignored stay ignored;
    outside the main thread (where Python cannot handle signals) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum: int, frame) -> None:
        path.unlink(missing_ok=True)
        before = previous[signum]
        if callable(before):
            before(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, signal.SIG_DFL if before is None else before)


@contextmanager
def temp_output(out: PathLike, need: int, inputs: Sequence[PathLike] = ()) -> Iterator[Path]:
    """Yield a new empty file `.OUT.<random>.tmp` in the output's folder to write to; rename it to `out` when the
    block ends normally, remove it on an error or a stop signal. `out` may be none of `inputs` (the paths the
    command reads)."""
    out = Path(out)
    check_not_input(out, inputs)
    folder = out.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"output folder {folder} does not exist")
    check_free_space(folder, need)
    tmp = folder / f".{out.name}.{secrets.token_hex(6)}.tmp"
    with removed_on_signal(tmp):
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        try:
            yield tmp
            os.replace(tmp, out)
        except OSError as e:
            if e.errno == errno.ENOSPC and not isinstance(e, OutOfDiskError):
                raise OutOfDiskError(errno.ENOSPC, f"out of disk while writing {out}") from e
            raise
        finally:
            tmp.unlink(missing_ok=True)


def metadata_bytes(fields: Mapping[str, Field], tensors: Sequence[OutTensor]) -> int:
    """An upper bound of the header, key-value and tensor-info bytes (for the free-space check)."""
    n = 64
    for key, f in fields.items():
        values = f.value if f.type == gguf.GGUFValueType.ARRAY else [f.value]
        n += len(key) + 32 + sum(len(v) + 8 if isinstance(v, (str, bytes)) else 8 for v in values)
    return n + sum(len(t.name) + 64 for t in tensors)


def write_gguf(
    out: PathLike,
    arch: str,
    fields: Mapping[str, Field],
    tensors: Sequence[OutTensor],
    desc: str = "writing",
    progress: bool = True,
    inputs: Sequence[PathLike] = (),
) -> None:
    """Write a GGUF: `fields` in their order (general.architecture first, from `arch`), then `tensors`;
    `out` may be none of `inputs`."""
    align = int(fields[KEY_ALIGNMENT].value) if KEY_ALIGNMENT in fields else gguf.GGUF_DEFAULT_ALIGNMENT
    need = metadata_bytes(fields, tensors) + sum(gguf.GGUFWriter.ggml_pad(t.nbytes, align) for t in tensors) + align
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names: {sorted({n for n in names if names.count(n) > 1})}")
    with temp_output(out, need, inputs) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.data_alignment = align
        try:
            for key, f in fields.items():
                if key != gguf.Keys.General.ARCHITECTURE:
                    writer.add_key_value(key, f.value, f.type, sub_type=f.sub_type)
            for t in tensors:
                # the float32 dtype is a placeholder: with raw_dtype the shape is taken as given, in elements
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in tqdm(tensors, desc=desc, unit="tensor", disable=not progress, leave=False):
                data = np.ascontiguousarray(t.load())
                if data.nbytes != t.nbytes:
                    raise ValueError(f"tensor {t.name}: {data.nbytes} bytes of data for {t.nbytes} expected")
                writer.write_tensor_data(data)
        finally:
            writer.close()


# ---- reading


def read_fields(reader: gguf.GGUFReader) -> dict[str, Field]:
    """A GGUF's metadata without the GGUF.* header entries, exactly as stored: strings stay bytes, so
    that copying them is lossless even where they are not valid UTF-8."""
    fields = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.STRING:
            fields[f.name] = Field(bytes(f.parts[f.data[0]]), vtype)
        elif vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[1] if len(f.types) > 1 else gguf.GGUFValueType.UINT8
            if sub == gguf.GGUFValueType.ARRAY:
                raise ValueError(f"metadata key {f.name}: nested arrays are not supported")
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(f.parts[i]) for i in f.data]
            else:
                value = [f.parts[i][0].item() for i in f.data]
            fields[f.name] = Field(value, vtype, sub)
        else:
            fields[f.name] = Field(f.parts[f.data[0]][0].item(), vtype)
    return fields


def field_value(f: Field) -> object:
    """The value with strings decoded (for display and comparisons)."""
    if isinstance(f.value, bytes):
        return f.value.decode("utf-8", errors="replace")
    if isinstance(f.value, list):
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in f.value]
    return f.value


def copy_tensor(t: gguf.ReaderTensor) -> OutTensor:
    """A tensor of an open GGUF, written back with its bytes unchanged."""
    return OutTensor(t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type, lambda: t.data)


def string_field(s: str) -> Field:
    return Field(s, gguf.GGUFValueType.STRING)


def uint32_field(n: int) -> Field:
    return Field(int(n), gguf.GGUFValueType.UINT32)
