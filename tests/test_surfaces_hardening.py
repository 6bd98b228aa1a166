"""Issue 46's other surfaces, tried as an attacker would (docs/hardening.md, "The other surfaces"): LoRA adapter files
(tests/fuzz_lora.py's short run and hand-made cases, through the Python API and the server's --lora), /infill on a
FIM-keyed model with a huge `input_extra`, tools and tool histories at scale, and Jinja chat templates given by file
(--chat-template-file): endless loops, huge output, missing variables. Each case asserts the answer and that the
process serves a new request afterwards. Servers bind 127.0.0.1 and are stopped by their fixtures; loops are
bounded."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import gguf
import pytest

import specee
from fuzz_gguf import Shape, Worker
from fuzz_lora import PROMPT, boundary_inputs, fuzz_lora, random_inputs, write_adapter, write_lora_seeds
from specee.server import infill as infill_module
from specee.server import templates
from test_embed import copy_gguf
from test_server import Server, call
from test_server_infill import FIM_KEYS

Q = gguf.GGMLQuantizationType


# ---- LoRA adapter files ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return write_lora_seeds(tmp_path_factory.mktemp("lora-seeds"))


def test_fuzz_lora_short_run(lora_seeds: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    """Every 16th boundary input and 200 random ones: no crash, no hang, every refusal a clean error; the same
    worker process then loads a good adapter and generates."""
    base, seeds = lora_seeds
    items = [x for i, x in enumerate(boundary_inputs(seeds)) if i % 16 == 0]
    items += list(random_inputs(seeds, 200, seed=46, tmp=tmp_path / "structured.gguf"))
    rep = fuzz_lora(tmp_path / "out", iter(items), base)
    assert rep.total == len(items) > 500 and rep.ok > 0 and rep.errors > 0
    assert not rep.crashes and not rep.hangs and not rep.pyexc, rep.crashes[:3] + rep.hangs[:3] + rep.pyexc[:3]
    w = Worker(tmp_path / "again", 4096, [sys.executable, str(Path(__file__).with_name("fuzz_lora.py")), "--worker",
                                          str(base)])
    (tmp_path / "again").mkdir()
    try:
        assert w.ask(items[1][1], 20.0)[0] in ("ok", "error")
        pid = w.proc.pid
        kind, line = w.ask(seeds["lora-f32"].read_bytes(), 20.0)
        assert kind == "ok" and w.proc.pid == pid, line
    finally:
        w.stop()


@pytest.mark.parametrize("what,args,message", [
    ("another model's shapes", dict(targets=[(0, "attn_q")], rank=4, types=(Q.F32, Q.F32), alpha=1.0,
                                    shape=Shape(n_embd=64, n_ff=128)), "another model"),
    ("a negative alpha", dict(targets=[(0, "attn_q")], rank=4, types=(Q.F32, Q.F32), alpha=-1.0), "alpha"),
    ("a NaN alpha", dict(targets=[(0, "attn_q")], rank=4, types=(Q.F32, Q.F32), alpha=float("nan")), "alpha"),
    ("a rank of 0", dict(targets=[(0, "attn_q")], rank=0, types=(Q.F32, Q.F32), alpha=1.0), "rank"),
])
def test_a_bad_adapter_is_refused_and_the_model_still_serves(lora_seeds: tuple[Path, dict[str, Path]], tmp_path: Path,
                                                             what: str, args: dict, message: str) -> None:
    base, seeds = lora_seeds
    bad = tmp_path / "bad.gguf"
    write_adapter(bad, seed=1, **args)
    with pytest.raises(specee.SpecEEError, match=message):
        specee.Model(base, lora=[bad], n_ctx=64, n_threads=1)
    with specee.Model(base, lora=[seeds["lora-f16"]], n_ctx=64, n_threads=1) as m:
        assert len(m.generate_tokens(m.tokenize(PROMPT)[:6], 3, temp=0.0)) == 3


def test_the_server_refuses_a_bad_adapter_at_start(lora_seeds: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    base, _ = lora_seeds
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(lora_seeds[1]["lora-f32"].read_bytes()[:5000])
    r = subprocess.run([sys.executable, "-m", "specee.server", "-m", str(base), "--lora", str(bad), "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "specee-server: error:" in r.stderr and "truncated" in r.stderr, r.stderr[-500:]
    assert "Traceback" not in r.stderr


# ---- /infill with a huge input_extra -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fim_gguf(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_gguf(smollm2_path, tmp_path_factory.mktemp("infill") / "smollm2-fim.gguf", FIM_KEYS)


def whole_layout(m: specee.Model, prefix: list[int], suffix: list[int], extra: list[tuple[str, str]],
                 prompt: list[int], n_batch: int, n_predict: int, n_ctx: int) -> list[int]:
    """The layout with every text tokenized whole (what infill_prompt did before it cut texts): snippets, no sep."""
    tok = lambda s: m.tokenize(s, add_special=False)  # noqa: E731
    fim = m.fim_tokens
    context = [fim["rep"], *tok("myproject\n")] if fim["rep"] >= 0 else []
    for _name, text in extra:
        context += tok("\n\n--- snippet ---\n\n") + tok(text)
    n_context = min(max(0, n_ctx - n_batch - 2 * n_predict), len(context))
    return [*context[len(context) - n_context:], fim["pre"], *prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)):],
            *prompt, fim["suf"], *suffix[:min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))], fim["mid"]]


@pytest.mark.slow
def test_infill_tokenizes_only_what_fits(fim_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 MB input_extra (and a 4 MB prefix) costs the tokens that fit, not the whole text, and the layout is the
    one of whole texts."""
    m = specee.Model(fim_gguf, n_ctx=64)
    code = "".join(f"int f{i}(int x) {{ return x * {i} + g(x); }}\n" for i in range(200))
    extra = [("a.c", code), ("b.c", code[::-1]), ("c.c", code)]
    prefix = m.tokenize(code, add_special=False)
    for n_ctx in (40, 400, 2048):
        assert infill_module.infill_prompt(m, prefix, [5, 6], extra, [7], 64, 16, n_ctx) == \
            whole_layout(m, prefix, [5, 6], extra, [7], 64, 16, n_ctx)
    seen = []
    tokenize = m.tokenize
    monkeypatch.setattr(m, "tokenize", lambda text, *a, **k: seen.append(len(text)) or tokenize(text, *a, **k))
    huge = [("big.c", code * 500), *[(f"f{i}", "x = 1\n") for i in range(100_000)]]
    ids = infill_module.infill_prompt(m, [1], [2], huge, [3], 512, 64, 4096)
    assert len(ids) <= 4096 - 512 - 128 + 6 and sum(seen) < 4096 * infill_module.MAX_TOKEN_CHARS * 2, sum(seen)


@pytest.fixture(scope="module")
def infill_server(fim_gguf: Path) -> Iterator[Server]:
    s = Server(fim_gguf, "-np", "1", "-c", "1024", "-b", "512")
    yield s
    s.stop()


def health_during(port: int, fn) -> tuple[object, float]:
    """fn()'s result, and the slowest /health answer while it ran (asked every 0.1 s)."""
    worst, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert call(port, "GET", "/health").status_code == 200
            worst[0] = max(worst[0], time.monotonic() - t)
            done.wait(0.1)

    th = threading.Thread(target=watch)
    th.start()
    try:
        return fn(), worst[0]
    finally:
        done.set()
        th.join()


@pytest.mark.slow
@pytest.mark.parametrize("what,body,status", [
    ("one extra file of 3.6 MB", {"input_extra": [{"filename": "big.c", "text": "int x = 1;\n" * 300_000}]}, 200),
    ("60,000 extra files", {"input_extra": [{"filename": f"f{i}.c", "text": "y"} for i in range(60_000)]}, 200),
    ("a prefix of 3.6 MB", {"input_prefix": "a = b + c\n" * 330_000}, 200),
    ("a prompt of 3.9 MB", {"prompt": "q" * 3_900_000}, 400),
    ("token ids out of the vocabulary", {"input_prefix": [10**9] * 100_000}, 400),
    ("an extra file without text", {"input_extra": [{"filename": "x"}] * 10}, 400),
])
def test_infill_at_scale(infill_server: Server, what: str, body: dict, status: int) -> None:
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 2, "temperature": 0, **body}
    r, worst = health_during(infill_server.port, lambda: call(infill_server.port, "POST", "/infill", body))
    assert r.status_code == status, r.text[:300]
    if status == 400:
        message = r.json()["error"]["message"]
        assert "\n" not in message and len(message) < 300, message
    assert worst < 1.0, worst
    ok = call(infill_server.port, "POST", "/infill", {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 1})
    assert ok.status_code == 200


# ---- tools and tool histories at scale ----------------------------------------------------------------------------

def tool(i: int, depth: int = 2) -> dict:
    p: dict = {"type": "string"}
    for d in range(depth):
        p = {"type": "object", "properties": {f"k{d}": p, "n": {"type": "integer"}}, "required": [f"k{d}"]}
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"does thing {i}", "parameters": p}}


ASK = [{"role": "user", "content": "What is the weather?"}]
CALLS = [x for i in range(3000) for x in (
    {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
                                                          "function": {"name": "tool_0", "arguments": "{\"k0\": \"x\"}"}}]},
    {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"})]


@pytest.fixture(scope="module")
def chat_server(smollm2_path: Path) -> Iterator[Server]:
    s = Server(smollm2_path, "-np", "1", "-c", "4096", "--jinja")
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("what,body,message", [
    ("500 tools", {"tools": [tool(i) for i in range(500)]}, "more than the context allows"),
    ("3,000 tools held to a grammar", {"tools": [tool(i) for i in range(3000)], "tool_choice": "required"},
     "tools: the grammar that holds a reply to them is refused"),
    ("a tool schema nested past the body's depth", {"tools": [tool(0, 40)]}, "nests arrays and objects more than"),
    ("a history of 20,000 messages", {"messages": [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"}
                                                   for i in range(20_001)]}, "more than the context allows"),
    ("a tool history of 3,000 calls", {"messages": ASK + CALLS, "tools": [tool(0)]}, "more than the context allows"),
    ("a call naming no tool", {"messages": ASK + CALLS[:2], "tools": [tool(1)]}, None),
])
def test_tools_at_scale(chat_server: Server, what: str, body: dict, message: str | None) -> None:
    body = {"messages": ASK, "max_tokens": 2, "temperature": 0, **body}
    r, worst = health_during(chat_server.port, lambda: call(chat_server.port, "POST", "/v1/chat/completions", body))
    if message is None:
        assert r.status_code in (200, 400), r.text[:300]
    else:
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text[:300]
        assert len(r.json()["error"]["message"]) < 400
    assert worst < 1.0, worst
    assert call(chat_server.port, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 1}).status_code == 200


# ---- Jinja templates given by file -------------------------------------------------------------------------------

OK_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
HOSTILE = [  # (what, template, what the error says): each refused at start
    ("endless nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "longer than"),
    ("huge output", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "passed"),
    ("a huge string", "{{ 'x' * 10**9 }}", "would make"),
    ("a number squared past any size",
     "{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
     "bits"),
    ("a filter's width", "{{ 'x' | center(10**9) }}", "center"),
    ("a method's width", "{{ 'x'.ljust(10**9) }}", "ljust"),
    ("a format's width", "{{ '%1000000000s' % 'x' }}", "width"),
    ("str.format's width", "{{ '{:>1000000000}'.format('x') }}", "width"),
    ("endless recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("a missing variable's attribute", "{{ nothing.at.all }}", "undefined"),
    ("a syntax error", "{% for m in messages %}{{ m.role }", "line 1"),
    ("its own exception", "{{ raise_exception('no chats here') }}", "no chats here"),
]


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> specee.Model:
    return specee.Model(smollm2_path, n_ctx=256)


@pytest.mark.slow
@pytest.mark.parametrize("what,source,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_template_file_is_refused_at_start(model: specee.Model, tmp_path: Path, monkeypatch:
                                                     pytest.MonkeyPatch, what: str, source: str, message: str) -> None:
    monkeypatch.setattr(templates, "MAX_RENDER_SECONDS", 0.5)  # the bound, small here: the loops run 10^10 times
    path = tmp_path / "t.jinja"
    path.write_text(source)
    with pytest.raises(ValueError, match="chat template") as e:
        templates.chat_template_of(model, True, None, str(path))
    assert message in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)
    path.write_text(OK_TEMPLATE)  # the same process renders a good one after
    assert "<|im_start|>assistant" in templates.chat_template_of(model, True, None, str(path)).render(ASK)


@pytest.mark.slow
def test_the_server_with_a_hostile_template_file_exits_clearly(smollm2_path: Path, tmp_path: Path) -> None:
    for name, source in (("loop", HOSTILE[1][1]), ("bytes", None)):
        path = tmp_path / f"{name}.jinja"
        path.write_bytes(b"\xff\xfe{{ x }}" if source is None else source.encode())
        r = subprocess.run([sys.executable, "-m", "specee.server", "-m", str(smollm2_path), "--jinja",
                            "--chat-template-file", str(path), "--port", "1"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "specee-server: error:" in r.stderr, (r.returncode, r.stderr[-400:])


@pytest.mark.slow
def test_a_template_hostile_to_one_request_answers_it_400(smollm2_path: Path, tmp_path: Path) -> None:
    """Fine for the start's probe (4 messages), hostile past 6 messages: that request is a 400 within the bound, and
    the next one is served. The output bound trips at once; the time bound after MAX_RENDER_SECONDS (10 s)."""
    path = tmp_path / "t.jinja"
    path.write_text("{% if messages|length > 6 %}{% if messages[0].content == 'loop' %}{% for i in range(100000) %}"
                    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% else %}{% for i in range(100000) %}"
                    "{{ 'x' * 1000 }}{% endfor %}{% endif %}{% endif %}" + OK_TEMPLATE)
    s = Server(smollm2_path, "-np", "1", "-c", "512", "--jinja", "--chat-template-file", str(path))
    try:
        for first, bound in (("big", "passed"), ("loop", "longer than")):
            long_chat = [{"role": ("user", "assistant")[i % 2], "content": first if i == 0 else "x"} for i in range(7)]
            t0 = time.monotonic()
            r = call(s.port, "POST", "/v1/chat/completions", {"messages": long_chat, "max_tokens": 1})
            assert r.status_code == 400 and bound in r.json()["error"]["message"], r.text[:300]
            assert time.monotonic() - t0 < 120  # bounded: 10 s of rendering, then the answer
            assert call(s.port, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 1}).status_code == 200
    finally:
        s.stop()


def test_a_bounded_render_gives_the_same_text(tmp_path: Path) -> None:
    env = templates.jinja_environment()
    t = env.from_string(OK_TEMPLATE + "{{ messages | tojson }}{{ '%5d' % 42 }}{{ '{:>8}'.format('r') }}{{ 'a' * 3 }}")
    values = {"messages": ASK * 3, "add_generation_prompt": True}
    assert templates.bounded_render(t, values) == t.render(**values)
    before = sys.gettrace()  # the thread's trace function (a debugger's, coverage's) is put back after a render
    templates.bounded_render(t, values)
    assert sys.gettrace() is before
