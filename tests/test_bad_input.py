"""Bad files and bad calls raise SpecEEError (FileNotFoundError for a missing file) naming the problem."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import specee
from specee.convert.retype import Field, read_gguf, write_gguf


def load(path: Path) -> specee.Model:
    return specee.Model(path, n_ctx=64, n_threads=2)


# ---- files


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_tensor_data(tiny_gguf: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(specee.SpecEEError, match="truncated"):
        load(path)


@pytest.mark.parametrize("size", [0, 3, 40, 300])
def test_truncated_header(tiny_gguf: Path, tmp_path: Path, size: int) -> None:
    path = tmp_path / "cut.bin"  # no "gguf" in the name: the message itself must say what is wrong
    path.write_bytes(tiny_gguf.read_bytes()[:size])
    with pytest.raises(specee.SpecEEError, match=r"truncated|not a GGUF"):
        load(path)


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(specee.SpecEEError, match=r"not a GGUF|magic"):
        load(path)


def test_bad_magic(tiny_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "magic.bin"
    path.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(specee.SpecEEError, match=r"not a GGUF|magic"):
        load(path)


def edited_copy(src: Path, dst: Path, *, arch: str | None = None, drop: str | None = None,
                replace: dict[str, np.ndarray] | None = None, fields: dict[str, Field] | None = None) -> Path:
    """A copy of src with its architecture, a tensor dropped, tensors replaced or metadata fields set."""
    meta, tensors = read_gguf(src)
    if arch is not None:
        meta["general.architecture"] = Field(arch, gguf.GGUFValueType.STRING)
    meta.update(fields or {})
    tensors.pop(drop, None)
    tensors.update(replace or {})
    write_gguf(dst, meta, tensors.items())
    return dst


def test_edited_copy_still_loads(tiny_gguf: Path, tmp_path: Path) -> None:
    """The unedited copy loads, so the failures below come from the edits."""
    m = load(edited_copy(tiny_gguf, tmp_path / "same.gguf"))
    assert m.n_layer == 4


def test_wrong_architecture(tiny_gguf: Path, tmp_path: Path) -> None:
    path = edited_copy(tiny_gguf, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(specee.SpecEEError, match="architecture") as err:
        load(path)
    assert "gpt2" in str(err.value)


def test_specee_eauto_file_names_the_import(tiny_gguf: Path, tmp_path: Path) -> None:
    """SpecEE's own GGUF (architecture eauto): the error names the command that rewrites it for this runtime."""
    path = edited_copy(tiny_gguf, tmp_path / "SpecEE-7b.gguf", arch="eauto")
    with pytest.raises(specee.SpecEEError, match="unsupported architecture 'eauto'") as err:
        load(path)
    assert f"python -m specee.convert import-specee {path} -o OUT.gguf" in str(err.value)


def test_missing_tensor(tiny_gguf: Path, tmp_path: Path) -> None:
    path = edited_copy(tiny_gguf, tmp_path / "missing.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(specee.SpecEEError, match="missing tensor") as err:
        load(path)
    assert "blk.1.ffn_up.weight" in str(err.value)


def test_wrong_tensor_shape(tiny_gguf: Path, tmp_path: Path) -> None:
    bad = {"blk.2.attn_q.weight": np.zeros((64, 48), dtype=np.float32)}  # input width 48, not n_embd 64
    path = edited_copy(tiny_gguf, tmp_path / "shape.gguf", replace=bad)
    with pytest.raises(specee.SpecEEError, match="shape") as err:
        load(path)
    assert "blk.2.attn_q.weight" in str(err.value)


# ---- calls


@pytest.fixture
def tiny(tiny_gguf: Path) -> specee.Model:
    return load(tiny_gguf)


def test_context_overflow_in_one_batch(tiny: specee.Model) -> None:
    with pytest.raises(specee.SpecEEError, match="context"):
        tiny.eval(list(range(tiny.n_ctx + 8)))
    assert tiny.kv_n_used == 0


def test_context_overflow_across_batches_leaves_cache(tiny: specee.Model) -> None:
    n_ctx = tiny.n_ctx
    tokens = np.random.default_rng(2).integers(0, 256, n_ctx).tolist()
    first = n_ctx - 12
    tiny.eval(tokens[:first])
    with pytest.raises(specee.SpecEEError, match="context"):
        tiny.eval(tokens[first:] + [1, 2, 3, 4, 5, 6, 7, 8])
    assert tiny.kv_n_used == first and tiny.kv_pos_max == first - 1
    got = tiny.eval(tokens[first:])  # exactly fills the cache
    tiny.kv_clear()
    # one batch of 64 takes ggml's tiled flash-attention path, 52 + 12 the F16-accumulating one: measured 0.007
    np.testing.assert_allclose(got, tiny.eval(tokens), atol=0.02)


def test_empty_batch(tiny: specee.Model) -> None:
    with pytest.raises(specee.SpecEEError, match="empty"):
        tiny.eval([])


@pytest.mark.parametrize("bad", [256, 100000, -1])
def test_token_id_out_of_range(tiny: specee.Model, bad: int) -> None:
    tiny.eval([1, 2, 3])
    with pytest.raises(specee.SpecEEError, match="token id"):
        tiny.eval([5, bad, 6])
    assert tiny.kv_n_used == 3


@pytest.mark.parametrize("layers", [(0, 5), (3, 2), (-1, 2), (2, 2), (0, 0)])
def test_invalid_layer_range(tiny: specee.Model, layers: tuple[int, int]) -> None:
    with pytest.raises(specee.SpecEEError, match="layer"):
        tiny.eval([1, 2, 3], layers=layers)
    assert tiny.kv_n_used == 0


def test_continue_without_a_started_batch(tiny: specee.Model) -> None:
    with pytest.raises(specee.SpecEEError, match="layer"):
        tiny.eval([1, 2, 3], layers=(2, 4))
