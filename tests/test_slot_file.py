"""A slot's cache saved to a file, restored into a slot and erased (csrc/serve/specee-slot-cache.cpp, specee.h), a
request on a chosen slot, the prompt's progress, and the cache shared whole (unified): a restored cache is a prefix
the next request reuses and gives the same tokens as the slot it came from; a bad file changes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specee

N_CTX = 256
PROMPT = np.random.default_rng(7).integers(0, 256, 24).tolist()


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> specee.Model:
    return specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)


def run(slots: specee.Slots, slot: int) -> specee.SlotOutput:
    """The slot's request to its end (bounded), read whole."""
    tokens: list[int] = []
    for _ in range(2 * N_CTX):
        busy = slots.step()
        tokens += slots.read(slot).tokens
        if busy == 0:
            break
    out = slots.read(slot)
    out.tokens = tokens + out.tokens
    return out


def test_a_saved_cache_restored_into_another_slot_is_reused(tiny: specee.Model, tmp_path: Path) -> None:
    tiny.kv_clear()
    slots = tiny.slots(2)
    a = slots.submit(PROMPT, 6, temp=0, mode="plain", slot=1)
    assert a == 1  # the slot asked for, not the least recently used one
    first = run(slots, a)
    slots.release(a)
    n = slots.save(1, str(tmp_path / "one.bin"))
    assert n == len(PROMPT) + len(first.tokens) - 1  # the last token was never evaluated
    assert slots.erase(0) == 0
    assert slots.restore(0, str(tmp_path / "one.bin")) == n
    # the same prompt on slot 0: its restored cache is the prefix (all but the last two tokens are reused)
    b = slots.submit(PROMPT, 6, temp=0, mode="plain", slot=0)
    assert b == 0 and slots.n_past(b) == len(PROMPT) - 2
    second = run(slots, b)
    assert second.tokens == first.tokens
    assert slots.stats(b)["n_reused"] == len(PROMPT) - 2
    slots.release(b)
    # slot 1 kept its own cache; erase drops it
    assert slots.erase(1) == n and slots.erase(1) == 0


def test_a_busy_slot_and_bad_files_are_refused_without_a_change(tiny: specee.Model, tmp_path: Path) -> None:
    tiny.kv_clear()
    slots = tiny.slots(2)
    s = slots.submit(PROMPT, 4, temp=0, mode="plain", slot=0)
    assert slots.submit(PROMPT, 4, temp=0, mode="plain", slot=0) is None  # busy
    with pytest.raises(specee.SpecEEError, match="holds a request"):
        slots.save(0, str(tmp_path / "busy.bin"))
    run(slots, s)
    slots.release(s)
    good = tmp_path / "good.bin"
    n = slots.save(0, str(good))
    data = good.read_bytes()
    bad = tmp_path / "bad.bin"
    for broken, why in ((b"", "ends early"), (b"XXXX" + data[4:], "not a slot file"), (data[:-5], "ends early")):
        bad.write_bytes(broken)
        with pytest.raises(specee.SpecEEError, match=why):
            slots.restore(0, str(bad))
    with pytest.raises(specee.SpecEEError, match="No such file"):
        slots.restore(0, str(tmp_path / "missing.bin"))
    with pytest.raises(specee.SpecEEError, match="out of range"):
        slots.restore(2, str(good))
    assert slots.erase(0) == n  # every refusal above left the slot's cache as it was


def test_a_file_of_another_context_is_refused(tiny: specee.Model, tiny_gguf: Path, tmp_path: Path) -> None:
    tiny.kv_clear()
    slots = tiny.slots(2)
    run(slots, slots.submit(PROMPT, 2, temp=0, mode="plain", slot=0))
    slots.release(0)
    slots.save(0, str(tmp_path / "f32v.bin"))
    other = specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1, type_v="f16")  # V rows of another type
    with pytest.raises(specee.SpecEEError, match="differ from this context"):
        other.slots(2).restore(0, str(tmp_path / "f32v.bin"))
    small = specee.Model(tiny_gguf, n_ctx=32, n_threads=1)  # 16 cells a slot: the file's 25 do not fit
    with pytest.raises(specee.SpecEEError, match="more than a slot may use"):
        small.slots(2).restore(0, str(tmp_path / "f32v.bin"))


def test_progress_and_the_unified_cache(tiny: specee.Model) -> None:
    tiny.kv_clear()
    slots = tiny.slots(2, n_chunk=8)
    s = slots.submit(PROMPT, 2, temp=0, mode="plain")
    seen = [slots.n_past(s)]
    for _ in range(10):
        slots.step()
        seen.append(slots.n_past(s))
        if seen[-1] == len(PROMPT):
            break
    assert seen == [0, 8, 16, 24]  # a chunk of 8 a pass
    run(slots, s)
    slots.release(s)
    assert slots.n_ctx_slot == N_CTX // 2
    slots.set_unified(True)
    assert slots.n_ctx_slot == N_CTX  # one request may use the whole cache now
    a = slots.submit(PROMPT, N_CTX - len(PROMPT) - 1, temp=0, mode="plain", ignore_eos=True)
    assert len(run(slots, a).tokens) == N_CTX - len(PROMPT) - 1
    slots.release(a)
    # two requests that each fit but together overflow the shared cache: the pass fails, as llama.cpp's does
    b = slots.submit(PROMPT, 200, temp=0, mode="plain", ignore_eos=True)
    c = slots.submit(PROMPT[:-1], 200, temp=0, mode="plain", ignore_eos=True)
    assert {b, c} == {0, 1}
    with pytest.raises(specee.SpecEEError, match="context overflow"):
        for _ in range(400):
            slots.step()
    with pytest.raises(specee.SpecEEError, match="hold requests"):
        slots.set_unified(False)
