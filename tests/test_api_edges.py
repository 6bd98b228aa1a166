"""The Python API's rough edges of issue 25: a step of generate() costs the same whatever max_tokens is; a closed
Model says so; bytes prompts are UTF-8; a lone surrogate is a UnicodeError with its position; a draft-head file's
exit threshold outside [0, 1] (NaN included) is refused at load, as the CLI refuses it. And of issue 36: Slots refuse
every use after the Model's close; one max_tokens rule for every generation call (-1: no limit but the context);
an empty stop string, a chat role outside the known set, a content that is not text are clear errors; a huge
n_threads is clamped to the CPUs the process may use. Each case checks that the model (or a new one) still works."""

from __future__ import annotations

import functools
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import specee


@pytest.fixture(scope="module")
def model(bpe_f32_gguf: Path):
    with specee.Model(bpe_f32_gguf, n_ctx=64, n_threads=1) as m:
        yield m


# a generation in a process of its own: its peak resident memory in KiB
PEAK_RSS = """import resource, sys
import specee
with specee.Model(sys.argv[1], n_ctx=64, n_threads=1) as m:
    m.generate("Hello", max_tokens=int(sys.argv[2]), mode="plain", ignore_eos=True)
    assert m.last_stats.stop_reason == "context", m.last_stats.stop_reason
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_step_costs_the_same_whatever_max_tokens_is(bpe_f32_gguf: Path) -> None:
    """Both runs end when the 64-cell context is full; 10^9 once allocated two vectors of 10^9 int32 per step (8 GB):
    its peak memory is the small run's (the allocation, not the time it takes, which depends on the machine's load)."""
    def peak_kib(n: int) -> int:
        r = subprocess.run([sys.executable, "-c", PEAK_RSS, str(bpe_f32_gguf), str(n)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split()[-1])

    small = peak_kib(1000)
    assert peak_kib(10**9) < small + (64 << 10), small  # KiB


def test_a_closed_model_says_so(bpe_f32_gguf: Path) -> None:
    m = specee.Model(bpe_f32_gguf, n_ctx=64, n_threads=1)
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


def test_slots_refuse_every_use_after_the_models_close(bpe_f32_gguf: Path) -> None:
    """A Slots object kept decoding and taking requests after Model.close(); now it says "Model is closed", as every
    handle of the model does, and the native slots are freed with the model."""
    m = specee.Model(bpe_f32_gguf, n_ctx=64, n_threads=1)
    slots = m.slots(2)
    slot = slots.submit([5, 6, 7], 4, mode="plain", temp=0.0, ignore_eos=True)
    assert slot is not None and slots.step() == 1
    m.close()
    assert slots.closed
    for call in (slots.step, lambda: slots.submit([5, 6], 2), lambda: slots.read(slot), lambda: slots.release(slot),
                 lambda: slots.n_slots, lambda: slots.n_busy, lambda: slots.mode(slot), lambda: slots.stats(slot),
                 slots.totals, lambda: slots.embed([5, 6]), lambda: m.slots(1), lambda: m.generate_batch([[5, 6]])):
        with pytest.raises(ValueError, match="Model is closed"):
            call()
    with specee.Model(bpe_f32_gguf, n_ctx=64, n_threads=1) as again:  # the process goes on: a new model works
        with again.slots(1) as own:
            assert own.submit([5, 6, 7], 2, mode="plain", temp=0.0, ignore_eos=True) == 0
        with pytest.raises(ValueError, match="Slots are closed"):  # closed on their own
            own.step()
        assert len(again.generate_batch([[5, 6, 7]], max_tokens=2, mode="plain", temp=0.0, ignore_eos=True)[0]) == 2


def test_one_max_tokens_rule_for_every_generation_call(model: specee.Model) -> None:
    """generate(max_tokens=-1) returned '' while generate_batch(max_tokens=-3) ran to the end of the context: now -1
    is no limit but the end of text or the context for every call (OpenAI's and llama.cpp's meaning), the calls agree,
    and any other negative is a ValueError, a non-integer a TypeError."""
    greedy = dict(mode="plain", temp=0.0, ignore_eos=True)
    prompt = model.tokenize("Hello")
    model.kv_clear()
    alone = model.generate_tokens(prompt, max_tokens=-1, **greedy)
    assert model.last_stats.stop_reason == "context" and len(alone) >= 64 - len(prompt) - 1
    model.kv_clear()
    assert model.generate_batch([prompt], max_tokens=-1, **greedy) == [alone]  # the slot: the whole 64-cell context
    model.kv_clear()
    text = model.generate("Hello", max_tokens=-1, **greedy)
    assert model.last_stats.tokens == alone and text == model.detokenize(alone)
    model.kv_clear()
    calls = {"generate": lambda n: model.generate("Hello", max_tokens=n),
             "stream": lambda n: model.stream("Hello", max_tokens=n),
             "generate_tokens": lambda n: model.generate_tokens(prompt, max_tokens=n),
             "generate_batch": lambda n: model.generate_batch([prompt], max_tokens=n),
             "Slots.submit": lambda n: model.slots(1).submit(prompt, n)}
    for name, call in calls.items():
        for bad in (-2, -3, -(2**40)):
            with pytest.raises(ValueError, match=r"max_tokens must be -1 \(until the end of text or a full context\) "
                                                 r"or >= 0"):
                call(bad)
        for bad in (1.5, "3", True, None):
            with pytest.raises(TypeError):
                call(bad)
    assert model.generate_tokens(prompt, max_tokens=0, **greedy) == []
    assert len(model.generate_tokens(prompt, max_tokens=3, **greedy)) == 3  # the model still generates


def test_an_empty_stop_string_is_refused(model: specee.Model) -> None:
    """stop=[''] silently returned '' (the empty string is found before the first token): now a ValueError, as is a
    stop list holding something else than text."""
    for stop in ([""], ["ok", ""], [5], [b"x"], [None]):
        with pytest.raises(ValueError, match="stop strings must be non-empty str"):
            model.generate("Hello", max_tokens=4, stop=stop)
        with pytest.raises(ValueError, match="stop strings must be non-empty str"):
            specee.GenerateOptions(stop=stop)
    for stop in (5, b"x"):
        with pytest.raises(TypeError, match="stop must be a string or a list of strings"):
            model.stream("Hello", max_tokens=4, stop=stop)
    greedy = dict(max_tokens=8, mode="plain", temp=0.0, ignore_eos=True)
    full = model.generate("Hello", **greedy)
    assert full and model.generate("Hello", stop=full[2:4], **greedy) == full[:full.index(full[2:4])]


def test_options_given_as_text_are_stored_as_numbers_and_groups_must_be_their_classes() -> None:
    """The runtime reads "0.5" as 0.5; the options then hold the number (a caller comparing or doing arithmetic on them
    must not find a string), and eagle=None is a TypeError that names the class, not an AttributeError from inside."""
    from specee.generate import EagleParams, ExitParams, GenerateOptions, NgramParams
    o = GenerateOptions(temp="0.5", top_k="3", seed="7", eagle=EagleParams(total_tokens="10"),
                        exit=ExitParams(threshold="0.25"), ngram=NgramParams(draft_max="6"))
    assert (o.temp, o.top_k, o.seed) == (0.5, 3, 7) and type(o.temp) is float and type(o.top_k) is int
    assert (o.eagle.total_tokens, o.exit.threshold, o.ngram.draft_max) == (10, 0.25, 6)
    for group in ("eagle", "exit", "ngram"):
        with pytest.raises(TypeError, match=f"{group} must be"):
            GenerateOptions(**{group: None})
    with pytest.raises(ValueError, match="temp"):
        GenerateOptions(temp="warm")


def test_chat_roles_and_contents_are_checked(model: specee.Model) -> None:
    """A message's role is one of the known set (a role 5 was accepted as "5"), its content text (5 became "5"),
    each message a mapping; the errors name what is allowed. Rendering then tokenizing (GIL released) gives
    specee_chat_tokenize's tokens."""
    roles = "system, developer, user, assistant, tool"
    for role in (5, "wizard", "", "User", None, ["user"]):
        with pytest.raises(ValueError, match=f"message 0: the role must be one of {roles}"):
            model.prompt_tokens([{"role": role, "content": "hi"}])
    with pytest.raises(ValueError, match=f"message 1: the role must be one of {roles}, not 'bot'"):
        model.generate([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hi"}], max_tokens=2)
    for content in (5, None, ["hi"], {"text": "hi"}):
        with pytest.raises(TypeError, match="message 0: the content must be str or bytes"):
            model.prompt_tokens([{"role": "user", "content": content}])
    for messages in (["hi"], [{"role": "user"}], [("user", "hi")]):
        with pytest.raises(TypeError, match="message 0 must be a mapping with a 'role' and a 'content'"):
            model.prompt_tokens(messages)
    with pytest.raises(TypeError, match="the prompt must be str, bytes or a list of chat messages"):
        model.prompt_tokens({"role": "user", "content": "hi"})
    chat = [{"role": r, "content": f"{r} says <|im_end|> hi"} for r in ("system", "developer", "user", "assistant",
                                                                         "tool", "user")]
    assert model.prompt_tokens(chat) == specee._core.chat_tokenize(model._model, None, chat, True)
    assert model.prompt_tokens([{"role": b"user", "content": b"hi"}]) == model.prompt_tokens(
        [{"role": "user", "content": "hi"}])
    short = [{"role": "tool", "content": "1"}, {"role": "user", "content": "hi"}]
    assert model.generate(short, max_tokens=2, mode="plain", temp=0.0, ignore_eos=True)  # still answers


def test_a_huge_thread_count_is_clamped_to_the_cpus_the_process_may_use(bpe_f32_gguf: Path) -> None:
    """n_threads=10000 was clamped to 8 on 2 cores (2 tokens took 118 s): now to the CPUs of the process's affinity
    mask, with a warning; forced to one CPU in a child process here, so the check does not depend on the machine."""
    one_cpu = functools.partial(os.sched_setaffinity, 0, {min(os.sched_getaffinity(0))})
    code = ("import warnings, specee\nwith warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    m = specee.Model({str(bpe_f32_gguf)!r}, n_ctx=64, n_threads=10000, n_threads_batch=2**31 - 1)\n"
            "out = m.generate_tokens([5, 6, 7], max_tokens=2, mode='plain', temp=0.0, ignore_eos=True)\n"
            "print(m.n_threads, len(out), '|'.join(str(x.message) for x in w))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=one_cpu, timeout=120)
    assert res.returncode == 0, res.stderr
    n_threads, n_out, warned = res.stdout.strip().split(" ", 2)
    assert (n_threads, n_out) == ("1", "2"), res.stdout
    assert "10000 threads are more than the 1 CPU(s) this process may use: using 1" in warned
    assert "2147483647 threads are more than the 1 CPU(s)" in warned
    with pytest.raises(ValueError, match="n_threads"):  # beyond the option's integer range: refused, not wrapped
        specee.Model(bpe_f32_gguf, n_ctx=64, n_threads=2**31)


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
