"""llama.cpp's host-memory prompt cache (--cache-ram, server/prompt_cache.py, Slots.save_mem / restore_mem in
csrc/serve/specee-slot-cache.cpp): a slot's cells kept as bytes (the slot file's bytes) and restored give the tokens the
slot gave without the cache; the cache keeps to its budget, dropping the oldest entries first; 0 turns it off; the
server restores a kept prompt for a later request and says so in its log with llama-server's test tags. Servers bind
127.0.0.1 and are stopped here; every loop is bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import specee
from specee.server.prompt_cache import MIB, PromptCache
from test_convert_cli import bpe_dir, bpe_gguf  # noqa: F401 (fixtures of chat_gguf: a tiny BPE Llama, its GGUF)
from test_server import Server, call, chat_gguf  # noqa: F401 (chat_gguf: a fixture)
from test_slot_file import N_CTX, PROMPT, run

# ---- the library: a slot's cells as bytes in memory


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> specee.Model:
    return specee.Model(tiny_gguf, n_ctx=N_CTX, n_threads=1)


def test_bytes_in_memory_are_the_file_and_restore_the_same_tokens(tiny: specee.Model, tmp_path: Path) -> None:
    tiny.kv_clear()
    slots = tiny.slots(2)
    first = run(slots, slots.submit(PROMPT, 6, temp=0, mode="plain", slot=0))
    slots.release(0)
    data = slots.save_mem(0)
    n = slots.save(0, str(tmp_path / "zero.bin"))
    assert data == (tmp_path / "zero.bin").read_bytes()  # one layout, in a file or in memory
    assert slots.cache_tokens(0)[: len(PROMPT)] == PROMPT and len(slots.cache_tokens(0)) == n
    assert slots.choose(PROMPT) == (0, len(PROMPT))  # the slot holding the prompt, and how much of it
    assert slots.erase(0) == n and slots.cache_tokens(0) == []
    assert slots.restore_mem(1, data) == n
    second = run(slots, slots.submit(PROMPT, 6, temp=0, mode="plain", slot=1))
    assert slots.stats(1)["n_reused"] == len(PROMPT) - 2  # the restored cells were reused
    assert second.tokens == first.tokens
    slots.release(1)
    for broken, why in ((b"", "ends early"), (b"XXXX" + data[4:], "not a slot file"), (data[:-5], "ends early"),
                        (data + b"x", "after its cells")):
        with pytest.raises(specee.SpecEEError, match=why):
            slots.restore_mem(0, broken)
    assert slots.cache_tokens(0) == []  # the refusals changed nothing


# ---- the cache's entries: budget, order, choice


def test_the_budget_drops_the_oldest_entries_first() -> None:
    lines: list[str] = []
    cache = PromptCache(1, lines.append)
    chunk = MIB // 3  # three fit, a fourth does not
    for i in range(3):
        cache.put([i, 1, 2, 3], bytes(chunk))
    assert [e.tokens[0] for e in cache.entries] == [0, 1, 2] and cache.size() <= MIB
    cache.put([9, 1, 2, 3], bytes(chunk))  # over the budget: the oldest goes
    assert [e.tokens[0] for e in cache.entries] == [1, 2, 9] and cache.size() <= MIB
    assert any("removing oldest entry" in line for line in lines)
    assert not cache.fits(MIB + 1) and PromptCache(-1, lines.append).fits(MIB * 10)
    cache.put([1, 1, 2, 3, 4], bytes(10))  # contains entry [1, 1, 2, 3]: that one is dropped
    assert [e.tokens[0] for e in cache.entries] == [2, 9, 1]
    assert cache.holds([2, 1]) and not cache.holds([2, 1, 2, 3, 4])


def test_an_entry_is_taken_only_where_it_beats_the_slot() -> None:
    cache = PromptCache(-1, lambda line: None)
    cache.put(list(range(100)), b"a")
    cache.put([7] * 10, b"b")
    prompt = list(range(60)) + [500]
    assert cache.take(prompt, 60, 60) is None  # the slot holds as much already
    assert cache.take([1, 2, 3], 0, 0) is None  # no entry shares a prefix
    assert cache.take(list(range(20)), 0, 0) is None  # it would keep a fifth of the entry: not worth it
    got = cache.take(prompt, 5, 50)
    assert got is not None and got.data == b"a" and len(cache.entries) == 1  # taken out


# ---- the server


def completion(s: Server, prompt: str, **extra: object) -> dict:
    r = call(s.port, "POST", "/completion", {"prompt": prompt, "cache_prompt": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def log_of(s: Server) -> str:
    s.stop()
    return s.proc.stdout.read() if s.proc.stdout else ""


LONG = "the quick brown fox jumps over the lazy dog and runs far away into the green hills " * 2
OTHER = "a completely different story about ships"


@pytest.mark.parametrize("cram", ["100", "0"])
def test_a_prompt_restored_from_the_cache_gives_the_same_tokens(chat_gguf: Path, cram: str) -> None:  # noqa: F811
    s = Server(chat_gguf, "-np", "1", "-c", "256", "--temp", "0", "--mode", "plain", "-n", "6", "--cache-ram", cram,
               "--verbose")
    try:
        first = completion(s, LONG)
        completion(s, OTHER)  # the only slot takes another prompt: its cache is dropped (and kept with --cache-ram)
        again = completion(s, LONG)
    finally:
        log = log_of(s)
    assert again["content"] == first["content"]
    assert first["timings"]["cache_n"] == 0
    if cram == "0":
        assert again["timings"]["cache_n"] == 0 and "updating prompt cache" not in log
    else:
        assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 2  # all but the last tokens restored
        assert again["timings"]["prompt_n"] < first["timings"]["prompt_n"]
        assert "updating prompt cache" in log


def test_idle_slots_are_kept_and_cleared_with_kv_unified(chat_gguf: Path) -> None:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "256", "--temp", "0", "--mode", "plain", "-n", "4", "-kvu", "--verbose")
    try:
        first = completion(s, LONG, id_slot=0)
        completion(s, OTHER, id_slot=1)  # slot 0 is idle: kept, then dropped from the shared cache
        slots = call(s.port, "GET", "/slots").json()
        again = completion(s, LONG)
    finally:
        log = log_of(s)
    assert "__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__" in log and "__TEST_TAG_CACHE_IDLE_SLOT__" in log
    assert len(slots) == 2
    assert again["content"] == first["content"] and again["timings"]["cache_n"] > 0


def test_no_cache_idle_slots_and_bad_values(chat_gguf: Path) -> None:  # noqa: F811
    s = Server(chat_gguf, "-np", "2", "-c", "256", "--temp", "0", "--mode", "plain", "-n", "4", "-kvu", "--verbose",
               "--no-cache-idle-slots")
    try:
        completion(s, LONG, id_slot=0)
        completion(s, OTHER, id_slot=1)
    finally:
        log = log_of(s)
    assert "__TEST_TAG_CACHE_IDLE_SLOT" not in log
    for bad in ("lots", "-2"):
        with pytest.raises(RuntimeError, match="--cache-ram"):
            Server(chat_gguf, "--cache-ram", bad)
