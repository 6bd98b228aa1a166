"""Reading PyTorch checkpoints safely and lazily: safetensors files and `torch.save` files.

A `.bin`/`.pth` file is opened only with `torch.load(weights_only=True)`, which refuses pickles that
hold anything but tensors and plain containers, so no code from a model file ever runs. Tensors are
listed with their shapes first and loaded one at a time (safetensors and zip-format torch files are
memory-mapped).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open


class RefusedPickleError(ValueError):
    """A torch.save file that holds more than tensors (loading it could run code)."""


@dataclass
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


def open_safetensors(path: str | os.PathLike, stack: ExitStack) -> list[SourceTensor]:
    """The tensors of a safetensors file, kept open (memory-mapped) until `stack` closes."""
    try:
        st = stack.enter_context(safe_open(str(path), framework="pt"))
        names = list(st.keys())
        shapes = [tuple(st.get_slice(n).get_shape()) for n in names]
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}); is it truncated or damaged?") from e
    return [SourceTensor(n, s, lambda n=n: st.get_tensor(n)) for n, s in zip(names, shapes)]


def open_torch_file(path: str | os.PathLike) -> list[SourceTensor]:
    """The tensors of a `torch.save` file (a dict of tensors), read with weights_only=True."""
    try:
        # zip-format files can be memory-mapped; the legacy format is read whole
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RefusedPickleError(
            f"{path}: refused to load: the file holds objects other than tensors, and loading them could "
            f"run code (torch.load weights_only=True said: {reason})"
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({e}); is it truncated or damaged?") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a dict of tensors (a state_dict), got {type(state).__name__}")
    return [SourceTensor(str(n), tuple(t.shape), lambda t=t: t) for n, t in state.items()]


def open_checkpoint(path: str | os.PathLike, stack: ExitStack) -> list[SourceTensor]:
    """One checkpoint file: *.safetensors, or a torch.save file (.bin, .pt, .pth)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        return open_safetensors(path, stack)
    return open_torch_file(path)


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """A Hugging Face folder's weight files: *.safetensors (one or sharded), else pytorch_model*.bin."""
    folder = Path(folder)
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
