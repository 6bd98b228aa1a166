"""A grammar compile abandoned past its budget outlives its request, and may outlive its model (issue 46;
csrc/decode/specee-grammar-compile.h, docs/hardening.md "Grammars"). The engine cannot be stopped: the worker runs on,
and calls back into the vocabulary's tokenizer while it does. These tests free the model under such a compile (the
Python API's Model.close, a server's sleep and its shutdown) and check that the process goes on serving, another model
loading and generating; that the vocabulary and what was cached for it go once the compile ends; and that threads and
memory stay bounded after many abandoned compiles. Run them under scripts/sanitize.sh as well: there a read of the
freed model is a report. The slow grammar is a real one within the limits (3,000 alternatives, each its own lexeme:
about 2 s to compile here), with the budget forced small."""

from __future__ import annotations

import gc
import signal
import time
from pathlib import Path
from typing import Callable

import pytest

from specee import Model, SpecEEError, _core, grammar
from test_server import Server, call

pytestmark = pytest.mark.slow

INTEGER = {"type": "integer"}


def slow_grammar(tag: str) -> str:
    """A grammar the engine takes seconds over (each alternative its own lexeme); `tag` makes its text new."""
    return "root ::= " + " | ".join(f'"{tag}{i}" [a-z]{{{i % 50},{i % 50 + 20}}}' for i in range(3000)) + "\n"


def status(field: str) -> int:
    """A /proc/self/status figure: Threads, or VmRSS in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def resident_kib() -> int:
    """VmRSS after glibc hands its free heap back (malloc_trim): what the process holds, not what the allocator keeps
    for reuse (after a model with a decode was freed, it kept ~90 MB of it in a long test session)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure as it is
        pass
    return status("VmRSS")


def wait_until(done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def abandon(model: Model, tag: str, budget_ms: int = 50) -> None:
    """Starts compiling a slow grammar for `model` with the budget forced to budget_ms: refused, still running."""
    grammar.set_limit("compile_ms", budget_ms)
    try:
        with pytest.raises(SpecEEError, match="compile_ms"):
            _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["gbnf"], slow_grammar(tag))
    finally:
        grammar.set_limit("compile_ms", 3000)


def generates(m: Model) -> None:
    out = m.generate("A number:", 8, temp=0, json_schema=INTEGER)
    assert out.strip().lstrip("-").isdigit(), out


@pytest.fixture(autouse=True)
def no_compile_left() -> None:
    grammar.use_library()
    assert wait_until(lambda: grammar.n_abandoned() == 0, 120)


def test_a_model_freed_under_an_abandoned_compile() -> None:
    """The model is freed while its abandoned compile runs on (and then tokenizes with its vocabulary); another model
    loads and generates meanwhile and after; the orphaned vocabulary's cached refusal is dropped by the next compile."""
    grammar.cache_clear()
    first = Model(n_ctx=256)
    abandon(first, "freed")
    assert grammar.n_abandoned() == 1  # still compiling when its model goes
    first.close()
    del first
    gc.collect()
    second = Model(n_ctx=256)
    generates(second)
    assert wait_until(lambda: grammar.n_abandoned() == 0, 120)
    generates(second)
    assert grammar.cache_info()["entries"] == 1  # the second model's schema; the first model's refusal went with it
    second.close()


def test_many_abandoned_compiles_keep_threads_and_memory_bounded() -> None:
    """Rounds of: a model loaded, two slow compiles abandoned (a third refused at once while they run), the model
    closed under them. Threads stay within two workers of the start throughout and come back to it; resident memory
    (after the allocator's free heap is handed back) comes back within 40 MB of the first round's end."""
    def one_round(i: int) -> int:
        m = Model(n_ctx=256)
        abandon(m, f"round{i}a")
        abandon(m, f"round{i}b")
        peak = status("Threads")
        t0 = time.monotonic()
        with pytest.raises(SpecEEError, match="still busy"):
            _core.grammar_check(m._model, grammar.GRAMMAR_TYPES["gbnf"], slow_grammar(f"round{i}c"))
        assert time.monotonic() - t0 < 1.0
        m.close()
        del m
        gc.collect()
        assert wait_until(lambda: grammar.n_abandoned() == 0, 120)
        return peak

    gc.collect()
    threads0 = status("Threads")
    one_round(0)
    rss0 = resident_kib()
    rss, peaks = [], []
    for i in range(1, 7):
        peaks.append(one_round(i))
        rss.append(resident_kib())
    last = Model(n_ctx=256)
    generates(last)  # a compile: the closed models' refusals are dropped, and with them their vocabularies
    last.close()
    gc.collect()
    print(f"threads {threads0} at the start, at most {max(peaks)} in a round, {status('Threads')} after; RSS after "
          f"each round (MB): {[round(r / 1024) for r in [rss0, *rss]]}, after the last compile {resident_kib() // 1024}")
    assert max(peaks) <= threads0 + 2, (threads0, peaks)
    assert wait_until(lambda: status("Threads") <= threads0, 10), (threads0, status("Threads"))
    assert resident_kib() - rss0 < 40 * 1024, (rss0, rss, resident_kib())


# ---- the server: its model freed by a sleep, and its shutdown, under an abandoned compile --------------------------

def props(server: Server) -> dict:
    return call(server.port, "GET", "/props").json()


def test_a_server_sleeps_and_stops_under_an_abandoned_compile(smollm2_path: Path) -> None:
    """specee-server with a small compile budget and a short idle time: a slow grammar is a 400, the server then
    unloads its model while that compile still runs, the next request loads it again and generates (a grammar too),
    and the server stops cleanly on SIGTERM while another abandoned compile runs."""
    s = Server(smollm2_path, "-c", "512", "--mode", "plain", "--sleep-idle-seconds", "1", "--grammar-limit",
               "compile_ms=100")
    try:
        r = call(s.port, "POST", "/completion", {"prompt": "Hi", "n_predict": 2, "grammar": slow_grammar("sleep")})
        assert r.status_code == 400 and "compile_ms" in r.json()["error"]["message"], r.text
        assert wait_until(lambda: props(s)["is_sleeping"], 30)
        r = call(s.port, "POST", "/completion", {"prompt": "A number:", "n_predict": 6, "json_schema": INTEGER})
        assert r.status_code == 200 and r.json()["content"].strip().isdigit(), r.text
        time.sleep(5.0)  # the first abandoned compile has ended by now (about 2 s)
        r = call(s.port, "POST", "/completion", {"prompt": "A number:", "n_predict": 6, "json_schema": INTEGER})
        assert r.status_code == 200 and r.json()["content"].strip().isdigit(), r.text
        r = call(s.port, "POST", "/completion", {"prompt": "Hi", "n_predict": 2, "grammar": slow_grammar("stop")})
        assert r.status_code == 400, r.text
    finally:
        s.proc.terminate()
        out, _ = s.proc.communicate(timeout=60)
    # uvicorn ends on the signal it caught once shut down (-15); a crash would be SIGSEGV, a sanitizer's SIGABRT
    assert s.proc.returncode in (0, -signal.SIGTERM), out[-4000:]
    assert "Sanitizer" not in out and "runtime error" not in out, out[-4000:]
