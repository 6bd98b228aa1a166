"""The Python API's rough edges of issue 25: a step of generate() costs the same whatever max_tokens is; a closed
Model says so; bytes prompts are UTF-8; a lone surrogate is a UnicodeError with its position; a draft-head file's
exit threshold outside [0, 1] (NaN included) is refused at load, as the CLI refuses it."""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import pytest

import specee


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with a byte-level BPE vocabulary (the GGUF fuzzer's seed), for the runs that tokenize."""
    import gguf

    from fuzz_gguf import write_seed

    path = tmp_path_factory.mktemp("vocab") / "bpe.gguf"
    write_seed(path, "bpe", gguf.GGMLQuantizationType.F32, parts=False, seed=1)
    return path


@pytest.fixture(scope="module")
def model(vocab_gguf: Path):
    with specee.Model(vocab_gguf, n_ctx=64, n_threads=1) as m:
        yield m


def test_a_step_costs_the_same_whatever_max_tokens_is(model: specee.Model) -> None:
    """Both runs end when the 64-cell context is full; 10^9 once allocated two vectors of 10^9 int32 per step."""
    def timed(n: int) -> float:
        t0 = time.perf_counter()
        model.generate("Hello", max_tokens=n, mode="plain", ignore_eos=True)
        assert model.last_stats.stop_reason == "context"
        return time.perf_counter() - t0

    small = timed(1000)
    assert timed(10**9) < 3 * small + 1.0


def test_a_closed_model_says_so(vocab_gguf: Path) -> None:
    m = specee.Model(vocab_gguf, n_ctx=64, n_threads=1)
    stream = m.stream("Hello", max_tokens=20, mode="plain", ignore_eos=True)
    next(stream)
    m.close()
    assert m.closed
    for call in (lambda: m.generate("Hello"), lambda: m.tokenize("x"), lambda: m.n_layer, lambda: m.eval([1, 2]),
                 lambda: m.generate_tokens([1, 2]), lambda: m.chat_template(), lambda: next(stream),
                 lambda: m.prompt_tokens([{"role": "user", "content": "hi"}])):
        with pytest.raises(ValueError, match="Model is closed"):
            call()
    m.close()  # twice is fine


def test_bytes_prompts_are_utf8(model: specee.Model) -> None:
    text = "Grüße, world"
    assert model.tokenize(text.encode()) == model.tokenize(text)
    greedy = dict(max_tokens=4, mode="plain", temp=0.0, ignore_eos=True)
    assert model.generate(text.encode(), **greedy) == model.generate(text, **greedy)
    with pytest.raises(UnicodeDecodeError):
        model.generate(b"ab\xff", max_tokens=2)
    with pytest.raises(TypeError, match="must be str, bytes or chat messages"):
        model.tokenize(123)  # type: ignore[arg-type]


def test_a_lone_surrogate_is_a_unicode_error_at_its_position(model: specee.Model) -> None:
    for call in (lambda t: model.tokenize(t), lambda t: model.generate(t, max_tokens=2),
                 lambda t: model.prompt_tokens([{"role": "user", "content": t}]),
                 lambda t: model.prompt_tokens([{"role": "user", "content": "hi"}], chat_template=t)):
        with pytest.raises(UnicodeEncodeError) as e:
            call("ab\udc80cd")
        assert e.value.start == 2


def _with_threshold(src: Path, dst: Path, value: float) -> Path:
    """A copy of a GGUF with its float32 specee.exit.threshold set to `value` (patched in place: key, type, value)."""
    data = bytearray(src.read_bytes())
    key = b"specee.exit.threshold"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 6  # GGUF_TYPE_FLOAT32
    struct.pack_into("<f", data, at + 4, value)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("value", [math.nan, -0.5, 1.5, math.inf])
def test_a_file_threshold_outside_0_1_is_refused_at_load(tiny_gguf: Path, tiny_hf_dir: Path, tmp_path: Path,
                                                         value: float) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    from specee.convert.merge import merge_gguf

    n_layer = json.loads((tiny_hf_dir / "config.json").read_text())["num_hidden_layers"]
    preds = {}
    for il in range(n_layer - 1):
        preds[f"model.layers.{il}.pred.up.weight"] = torch.zeros(512, 12)
        preds[f"model.layers.{il}.pred.up.bias"] = torch.zeros(512)
        preds[f"model.layers.{il}.pred.down.weight"] = torch.zeros(1, 512)
        preds[f"model.layers.{il}.pred.down.bias"] = torch.zeros(1)
    save_file(preds, tmp_path / "pred.safetensors")
    merged = tmp_path / "exit.gguf"
    merge_gguf(tiny_gguf, merged, predictors=tmp_path / "pred.safetensors", progress=False)
    specee.Model(merged, n_ctx=32, n_threads=1).close()  # the file as written loads
    bad = _with_threshold(merged, tmp_path / "bad.gguf", value)
    with pytest.raises(specee.SpecEEError, match=r"specee\.exit\.threshold = .* expected a number in \[0, 1\]"):
        specee.Model(bad, n_ctx=32, n_threads=1)
