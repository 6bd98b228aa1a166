"""The grammar front door (issue 46; csrc/decode/specee-grammar-limits.cpp, csrc/decode/specee-grammar-compile.cpp,
docs/hardening.md "Grammars"): grammars and schemas that crashed, stalled or bloated the engine are refused with a
short message naming the limit, before the engine sees them; a compile runs on a worker within a budget (forced
small here to show the mechanism); compiled grammars are cached by text; each class is also sent to specee-server,
which answers 400 and serves the next request, /health meanwhile; the Python API's and protocol's edges of the issue;
and the fuzzer's short runs (tests/fuzz_grammar.py). Servers bind 127.0.0.1, are stopped by their fixtures, and
every loop is bounded."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from fuzz_grammar import (anyof_ref_chain, cases, deep_json, fuzz_library, fuzz_server, gbnf_alternatives, gbnf_chain,
                          ref_chain, rss_mb)
from specee import Model, SpecEEError, _core, grammar
from test_server import Server, call

pytestmark = pytest.mark.slow

SELF_REF = json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
MUTUAL_REF = json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
                         "$ref": "#/$defs/a"})
RECURSIVE_OBJECT = json.dumps({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                               "required": ["next"]}}, "$ref": "#/$defs/n"})

# (what, grammar type, text, what the message names): each class of issue 46, refused before the engine
REFUSED = [
    ("$ref chain 5,000 deep", "json_schema", ref_chain(5000), "max_refs"),
    ("anyOf + $ref 2,000 deep", "json_schema", anyof_ref_chain(2000), "max_refs"),
    ("JSON 2,000 levels deep", "json_schema", deep_json(2000), "max_depth"),
    ("GBNF of 100,000 chained rules (3 MB)", "gbnf", gbnf_chain(100_000), "max_bytes"),
    ("GBNF of 5,000 chained rules", "gbnf", gbnf_chain(5000), "max_rules"),
    ("one rule of 60,000 alternatives (600 KB)", "gbnf", gbnf_alternatives(60_000), "max_bytes"),
    ("one rule of 20,000 alternatives", "gbnf", gbnf_alternatives(20_000), "max_alternatives"),
    ("{0,1000000000}", "gbnf", 'root ::= "a"{0,1000000000}\n', "max_repeat"),
    ("minItems 10^9", "json_schema", json.dumps({"type": "array", "minItems": 10**9}), "max_repeat"),
    ("maxLength 10^9", "json_schema", json.dumps({"type": "string", "maxLength": 10**9}), "max_repeat"),
    ("groups 5,000 deep", "gbnf", "root ::= " + "(" * 5000 + '"x"' + ")" * 5000 + "\n", "max_depth"),
    ("a regex bound of 10^9", "regex", "a{0,1000000000}", "max_repeat"),
    ("an enum of 20,000 values", "json_schema", json.dumps({"enum": list(range(20_000))}), "max_alternatives"),
]
# refused by the engine, or served: either way in bounded time, with a short message when refused
ENGINE_JUDGES = [("self-recursive $ref", SELF_REF), ("mutually recursive $refs", MUTUAL_REF),
                 ("a recursive object", RECURSIVE_OBJECT)]


@pytest.fixture(scope="module")
def model() -> Model:
    grammar.use_library()
    return Model(n_ctx=512)


def one_line(message: str) -> None:
    assert "\n" not in message and len(message) < 300, message


def generates(m: Model) -> None:
    """The model still serves a constrained generation (the process and the engine are fine)."""
    out = m.generate("A number:", 8, temp=0, json_schema={"type": "integer"})
    assert out.strip().lstrip("-").isdigit(), out


def test_the_limits_are_one_table() -> None:
    limits = grammar.limits()
    assert {"max_bytes", "max_depth", "max_rules", "max_alternatives", "max_refs", "max_repeat", "compile_ms",
            "compile_mb", "cache_entries", "cache_mb"} <= set(limits)
    with pytest.raises(SpecEEError, match="no limit 'nope'"):
        grammar.set_limit("nope", 3)
    with pytest.raises(SpecEEError, match="must be >= 1"):
        grammar.set_limit("compile_ms", 0)


@pytest.mark.parametrize("what,kind,text,limit", REFUSED, ids=[r[0] for r in REFUSED])
def test_each_hostile_class_is_refused_before_the_engine(model: Model, what: str, kind: str, text: str,
                                                         limit: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(SpecEEError) as e:
        _core.grammar_check(model._model, grammar.GRAMMAR_TYPES[kind], text)
    one_line(str(e.value))
    assert limit in str(e.value) and str(e.value).startswith(kind + ":"), str(e.value)
    assert time.monotonic() - t0 < 5.0  # a linear scan: milliseconds, generous for a loaded machine
    generates(model)


def test_the_python_api_refuses_them_as_well(model: Model) -> None:
    with pytest.raises(SpecEEError, match="max_refs"):
        model.generate("x", 4, json_schema=ref_chain(5000))
    with pytest.raises(SpecEEError, match="max_rules"):
        model.generate("x", 4, grammar=gbnf_chain(5000))
    generates(model)


def test_within_the_limits_the_engine_serves(model: Model) -> None:
    """What the issue saw served is still served: a 300-deep $ref chain, a 1,000-rule chain, 5,000 alternatives."""
    for kind, text in (("json_schema", ref_chain(300)), ("gbnf", gbnf_chain(1000)),
                       ("gbnf", gbnf_alternatives(5000)), ("json_schema", deep_json(60))):
        _core.grammar_check(model._model, grammar.GRAMMAR_TYPES[kind], text)
    generates(model)


@pytest.mark.parametrize("what,text", ENGINE_JUDGES, ids=[r[0] for r in ENGINE_JUDGES])
def test_recursive_schemas_get_a_short_answer(model: Model, what: str, text: str) -> None:
    try:
        _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["json_schema"], text)
    except SpecEEError as e:
        one_line(str(e))
        assert str(e).startswith("json_schema:")
    generates(model)


def test_a_compile_past_its_budget_is_abandoned(model: Model) -> None:
    """The mechanism, with the budget forced to 1 ms: the caller gets the refusal at once, naming the limit, while the
    engine's worker finishes on its own; the refusal is cached (the same text is refused at once again)."""
    text = gbnf_alternatives(4000).replace("w", "budget")  # a text no other test compiled
    grammar.set_limit("compile_ms", 1)
    try:
        with pytest.raises(SpecEEError, match="compile_ms") as e:
            _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["gbnf"], text)
        one_line(str(e.value))
        hits = grammar.cache_info()["hits"]
        with pytest.raises(SpecEEError, match="compile_ms"):
            _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["gbnf"], text)
        assert grammar.cache_info()["hits"] == hits + 1
    finally:
        grammar.set_limit("compile_ms", 3000)
    deadline = time.monotonic() + 60
    while grammar.n_abandoned() > 0 and time.monotonic() < deadline:  # it ends on its own; new compiles are taken again
        time.sleep(0.05)
    assert grammar.n_abandoned() == 0
    generates(model)


def test_compiled_grammars_are_cached_by_text(model: Model) -> None:
    schema = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(200)}})
    hits = grammar.cache_info()["hits"]
    t0 = time.perf_counter()
    _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["json_schema"], schema)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["json_schema"], schema)
    again = time.perf_counter() - t0
    assert grammar.cache_info()["hits"] == hits + 1
    print(f"compile {first * 1000:.1f} ms, from the cache {again * 1000:.2f} ms")
    assert 0 < grammar.cache_info()["entries"] <= grammar.limits()["cache_entries"]


def test_memory_returns_after_a_hostile_run(model: Model) -> None:
    """Grammars at the limits compiled (and the refused ones tried), then the cache dropped: the process is back
    within 50 MB of where it started."""
    import os

    generates(model)
    start = rss_mb(os.getpid())
    for n in (10000, 9000, 8000):
        for text in (json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": n}),
                     json.dumps({"type": "string", "minLength": n})):
            try:
                _core.grammar_check(model._model, grammar.GRAMMAR_TYPES["json_schema"], text)
            except SpecEEError as e:
                one_line(str(e))
    for _what, kind, text, _limit in REFUSED:
        with pytest.raises(SpecEEError):
            _core.grammar_check(model._model, grammar.GRAMMAR_TYPES[kind], text)
    grammar.cache_clear()
    assert rss_mb(os.getpid()) - start < 50, (start, rss_mb(os.getpid()))
    generates(model)


# ---- the Python API's edges (issue 46) ------------------------------------------------------------------------

def test_an_unknown_grammar_type_is_named(model: Model) -> None:
    with pytest.raises(ValueError, match="grammar_type must be one of"):
        model.generate("x", 2, grammar='root ::= "a"', grammar_type="zzz")


def test_a_limit_too_large_says_the_limit() -> None:
    with pytest.raises(ValueError, match="ngram_cache must be at most 2147483647"):  # the options table's error
        Model(n_ctx=64, ngram_cache=2**62)


def test_the_cli_sets_a_limit_for_its_run(smollm2_path: Path) -> None:
    """`--grammar-limit NAME=VALUE` on the CLI: the same table; a grammar past the lowered limit is refused with the
    limit's name before the engine sees it, and one within it generates."""
    import subprocess

    from specee._tools import tool_path

    base = [str(tool_path("llama-cli")), "-m", str(smollm2_path), "-p", "Answer:", "-n", "4", "--temp", "0",
            "-no-cnv", "--grammar-limit", "max_bytes=24"]
    long = subprocess.run([*base, "--grammar", 'root ::= "yes" | "no" | "maybe" | "perhaps"'], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert long.returncode == 1 and "(the grammar limit max_bytes is 24)" in long.stderr, long.stderr
    short = subprocess.run([*base, "--grammar", 'root ::= "yes" | "no"'], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
    assert short.returncode == 0 and short.stdout.startswith(("Answer:yes", "Answer:no")), (short.stdout, short.stderr)


def test_embed_refuses_a_list_past_its_limit(model: Model) -> None:
    from specee.model import EMBED_MAX_TEXTS

    t0 = time.monotonic()
    with pytest.raises(SpecEEError, match=f"more than the {EMBED_MAX_TEXTS}"):
        model.embed(["hello world"] * (EMBED_MAX_TEXTS + 1))
    assert time.monotonic() - t0 < 5.0  # refused before any text is evaluated
    assert model.embed(["hello world"] * 40).shape[0] == 40  # two chunks, one array


# ---- the server -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[Server]:
    s = Server(smollm2_path, "-np", "2", "-c", "1024", "--mode", "plain", "--api-key", "sekrit")
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer sekrit"}


def serves(server: Server) -> None:
    r = call(server.port, "POST", "/completion", {"prompt": "Hello", "n_predict": 2}, headers=AUTH)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("what,kind,text,limit", REFUSED, ids=[r[0] for r in REFUSED])
def test_the_server_answers_each_class_with_a_400(server: Server, what: str, kind: str, text: str,
                                                  limit: str) -> None:
    if kind == "regex" or len(text) > 3_000_000:
        pytest.skip("the server takes GBNF and JSON schemas; bodies up to 4 MiB")
    field = text if kind == "json_schema" else json.dumps(text)  # the schema's JSON as it is (2,000 levels too)
    raw = f'{{"prompt": "Hi", "n_predict": 4, "{"json_schema" if kind == "json_schema" else "grammar"}": {field}}}'
    r = call(server.port, "POST", "/completion", raw=raw.encode(), headers=AUTH)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    one_line(message)
    assert limit in message or (limit == "max_depth" and "nest" in message), message  # the body's own depth check
    serves(server)


@pytest.mark.parametrize("what,text", ENGINE_JUDGES, ids=[r[0] for r in ENGINE_JUDGES])
def test_the_server_answers_recursive_schemas_200_or_400(server: Server, what: str, text: str) -> None:
    r = call(server.port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": json.loads(text)}}},
             headers=AUTH)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        one_line(r.json()["error"]["message"])
    serves(server)


def test_health_answers_while_a_large_grammar_compiles(server: Server) -> None:
    """A grammar near the limits (8,000 alternatives: about a second to compile here) compiles off the batching thread
    and off the event loop: /health answers within 1 s throughout, and a generation on the other slot goes on."""
    text = gbnf_alternatives(8000).replace("w", "health")
    done: dict = {}

    def constrained() -> None:
        done["r"] = call(server.port, "POST", "/completion", {"prompt": "Hi", "n_predict": 2, "grammar": text},
                         headers=AUTH)

    t = threading.Thread(target=constrained)
    t.start()
    worst = 0.0
    for _ in range(100):
        if not t.is_alive():
            break
        t0 = time.monotonic()
        assert call(server.port, "GET", "/health").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join(60)
    assert done["r"].status_code in (200, 400), done["r"].text
    assert worst < 1.0, worst
    serves(server)


def test_messages_needs_max_tokens_and_bearer_is_case_insensitive(server: Server) -> None:
    ask = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    r = call(server.port, "POST", "/v1/messages", ask, headers=AUTH)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
    assert call(server.port, "POST", "/v1/messages", {**ask, "max_tokens": 2}, headers=AUTH).status_code == 200
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = call(server.port, "POST", "/completion", {"prompt": "Hi", "n_predict": 1},
                 headers={"Authorization": f"{scheme} sekrit"})
        assert r.status_code == 200, (scheme, r.text)
    assert call(server.port, "POST", "/completion", {"prompt": "Hi", "n_predict": 1},
                headers={"Authorization": "bearer wrong"}).status_code == 401


# ---- the fuzzer's short runs --------------------------------------------------------------------------------------

def test_fuzz_grammars_through_the_library(tmp_path: Path) -> None:
    rep = fuzz_library(cases(120, seed=46), tmp_path / "lib", timeout=30.0)
    assert rep.cases == 120 and rep.ok > 0 and rep.errors > 0
    assert not rep.crashes and not rep.hangs and not rep.findings, rep.summary() | {"findings": rep.findings[:5]}


def test_fuzz_grammars_through_the_server(tmp_path: Path, smollm2_path: Path) -> None:
    rep = fuzz_server(cases(60, seed=47), tmp_path / "srv", timeout=30.0, model=str(smollm2_path))
    assert rep.cases > 20 and set(rep.statuses) <= {200, 400}, rep.statuses
    assert not rep.crashes and not rep.hangs and not rep.findings, rep.findings[:5]
    assert rep.health_max_s < 1.0, rep.health_max_s
