"""Reasoning on specee-server (server/reasoning.py, templates.py, tools.py's chat_prompt): enable_thinking as
--reasoning, a budget of 0, a request's chat_template_kwargs and reasoning_effort decide it; a reply's thoughts split
out of its content, whole and streamed; a thinking budget of N > 0 tokens (the thought cut at exactly N, the closing
tag and the template's text after it forced); Anthropic's thinking blocks; llama.cpp's continuation of a final
assistant message; Jinja's `+` of a string and an undefined value; the reasoning flags' refusals.

Fast tests use no model or only SmolLM2's file for its tokenizer; the slow ones run specee-server on SmolLM2 with a
thinking template written here (127.0.0.1, started and stopped by the fixture).
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any, Iterator

import jinja2
import pytest

from specee import Model
from specee.server.app import parse_args
from specee.server.reasoning import (ReasoningError, Reasoning, ReplySplitter, ThoughtBudget, budget_of, format_of,
                                     split, switch_of, tags_in)
from specee.server.request import ApiError
from specee.server.templates import ChatTemplate, chat_template_of, jinja_environment
from specee.server.tools import chat_prompt
from test_server import Server, call

# a ChatML template that opens a thought in its generation prompt and closes it at once without thinking (as
# DeepSeek-R1's and QwQ's do), written for these tests
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% if not enable_thinking %}</think>\n{% endif %}{% endif %}")
# Qwen3's way: a thought in its own lines, a blank line between it and the content
THINKING_QWEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                 "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
                 "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "<think>\n{% if not enable_thinking %}</think>\n{% endif %}{% endif %}")
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ASK = [{"role": "user", "content": "What is 2+2?"}]
TAGS = ("<think>", "</think>")
REPLIES = [
    "I add them.\n</think>\n\nFour.",  # the prompt opened the thought
    "  <think>\nI add them.</think> Four. ",  # the reply opens it
    "Four, without a thought.",
    "<think>never closed, cut short",
    "<thinking is not the tag> Four.",
    "",
    "a </think",
]


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Model:
    return Model(smollm2_path, n_ctx=64)


def template(model: Model, source: str, reasoning: Reasoning | None = None, **kwargs: Any) -> ChatTemplate:
    return chat_template_of(model, True, source, None, kwargs, reasoning or Reasoning())


# ---- the pieces ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("open_", [True, False])
@pytest.mark.parametrize("reply", REPLIES)
def test_streamed_split_adds_up_to_the_whole(reply: str, open_: bool) -> None:
    """Whatever the cut points, a stream's thoughts and content put together are the whole reply's split, and no
    tag is ever sent."""
    whole = split(reply, TAGS, open_)
    for step in (1, 2, 5):
        s = ReplySplitter(TAGS, open_)
        parts = [s.push(reply[:i]) for i in range(step, len(reply), step)] + [s.push(reply, final=True)]
        assert ("".join(t for t, _ in parts), "".join(c for _, c in parts)) == whole
        assert not any(tag in t or tag in c for t, c in parts for tag in TAGS)


def test_split_rules() -> None:
    assert split(REPLIES[0], TAGS, True) == ("I add them.", "Four.")
    assert split(REPLIES[0], TAGS, False) == ("", REPLIES[0])  # not opened by the prompt nor the reply
    assert split(REPLIES[1], TAGS, False) == ("I add them.", "Four. ")
    assert split(REPLIES[3], TAGS, False) == ("never closed, cut short", "")
    assert split(REPLIES[4], TAGS, False) == ("", REPLIES[4])


def test_settings_refused_with_their_names() -> None:
    assert [switch_of(v) for v in ("on", "OFF", "auto", "1", "disabled")] == [True, False, None, True, False]
    assert format_of("deepseek-legacy") == "deepseek-legacy" and budget_of("0") == 0 and budget_of(-1) == -1
    assert budget_of("12") == 12
    for fn, value, message in [(switch_of, "maybe", "on, off, auto"), (format_of, "qwen", "deepseek"),
                               (budget_of, "twelve", "N > 0 tokens"), (budget_of, -2, "-1 (unlimited)"),
                               (budget_of, True, "-1 (unlimited)")]:
        with pytest.raises(ReasoningError, match=re.escape(message)):
            fn(value)
    assert tags_in(THINKING) == TAGS and tags_in(PLAIN) is None


def test_undefined_and_null_concatenate_as_empty_text() -> None:
    """llama.cpp's engine: `+` of a string and an undefined variable or null is the string (FireFunction-v2 adds
    `functions`); other operations on undefined values still fail. `datetime` is today as FireFunction prints it."""
    env = jinja_environment()
    assert env.from_string("{{ 'a' + functions + 'b' + none }}").render() == "ab"
    with pytest.raises(jinja2.exceptions.UndefinedError):
        env.from_string("{{ 1 + functions }}").render()
    t = ChatTemplate(source="{{ datetime }}", compiled=env.from_string("{{ datetime }}"))
    assert t.render(ASK) == datetime.date.today().strftime("%b %d %Y")


@pytest.mark.parametrize("reasoning, kwargs, thinks", [
    (Reasoning(), {}, True),  # auto: the template thinks
    (Reasoning(switch=False), {}, False),
    (Reasoning(switch=True), {}, True),
    (Reasoning(budget=0), {}, False),
    (Reasoning(), {"enable_thinking": False}, False),  # --chat-template-kwargs
])
def test_enable_thinking_at_start(model: Model, reasoning: Reasoning, kwargs: dict, thinks: bool) -> None:
    t = template(model, THINKING, reasoning, **kwargs)
    text = chat_prompt(model, t, {"messages": ASK}, False).text
    assert text.endswith("<think>\n") == thinks and text.endswith("</think>\n") != thinks
    assert not template(model, PLAIN).enable_thinking  # a template that does not think: false (on: true)
    assert template(model, PLAIN, Reasoning(switch=True)).enable_thinking


@pytest.mark.parametrize("fields, closed", [
    ({}, False),
    ({"chat_template_kwargs": {"enable_thinking": False}}, True),
    ({"reasoning_effort": "none"}, True),
    ({"reasoning_effort": "high"}, False),
    ({"reasoning_budget_tokens": 0}, True),
])
def test_a_request_decides_for_itself(model: Model, fields: dict, closed: bool) -> None:
    t = template(model, THINKING)
    p = chat_prompt(model, t, {"messages": ASK, **fields}, False)
    assert p.text.endswith("</think>\n") == closed
    assert p.thoughts is not None and p.thoughts.open != closed  # the reply begins inside the thought, or not


@pytest.mark.parametrize("fields, message", [
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "true or false"),
    ({"reasoning_effort": 3}, "'reasoning_effort'"),
    ({"reasoning_budget_tokens": -5}, "'reasoning_budget_tokens' must be -1"),
    ({"thinking_budget_tokens": "many"}, "'thinking_budget_tokens' must be -1"),
    ({"reasoning_budget_tokens": 3, "reasoning_budget_message": 7}, "'reasoning_budget_message' must be a string"),
    ({"reasoning_format": "qwen"}, "'reasoning_format' must be one of"),
])
def test_bad_reasoning_fields_get_400(model: Model, fields: dict, message: str) -> None:
    with pytest.raises(ApiError, match=message) as e:
        chat_prompt(model, template(model, THINKING), {"messages": ASK, **fields})
    assert e.value.status == 400


def test_thoughts_split_only_where_they_can_be(model: Model) -> None:
    t = template(model, THINKING)
    assert chat_prompt(model, t, {"messages": ASK, "reasoning_format": "none"}, False).thoughts is None
    held = {"messages": ASK, "response_format": {"type": "json_object"}}  # a reply held to JSON starts with it
    assert chat_prompt(model, t, held, False).thoughts is None
    assert chat_prompt(model, template(model, PLAIN), {"messages": ASK}, False).thoughts is None
    legacy = chat_prompt(model, t, {"messages": ASK, "reasoning_format": "deepseek-legacy"}, False).thoughts
    assert legacy is not None and legacy.split("x</think>y") == ("x", "<think>x</think>y")


def test_continued_final_message_as_llama_cpp_renders_it(model: Model) -> None:
    """The messages before it, the generation prompt, the thought (closed where the message has content), the
    content: text parts joined by a blank line."""
    prefill = {"role": "assistant", "content": [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]}
    t = template(model, THINKING)
    head = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt(model, t, {"messages": [*ASK, prefill]}, False).text == head + "<think></think>Wh\n\nill"
    thought = {"role": "assistant", "content": "", "reasoning_content": "Let me add"}
    assert chat_prompt(model, t, {"messages": [*ASK, thought]}, False).text == head + "<think>Let me add"
    plain = template(model, PLAIN)
    assert chat_prompt(model, plain, {"messages": [*ASK, prefill]}, False).text == head + "Wh\n\nill"
    plain.prefill = False  # --no-prefill-assistant: the message is a whole one, answered after
    assert chat_prompt(model, plain, {"messages": [*ASK, prefill]}, False).text.endswith(
        "Wh\nill<|im_end|>\n<|im_start|>assistant\n")


def test_budget_counts_thought_tokens_only() -> None:
    """Tokens count inside a thought only, after its opening tag (its own tokens not), the prompt's included; a
    thought closed by the model ends the count, a new one starts another; a budget spent by the prompt cuts before
    the first token."""
    b = ThoughtBudget(3, TAGS, [9])
    b.prefill([b"<|im_start|>", b"assistant\n", b"<think>", b"\n"])
    assert b.counting and b.used == 1
    assert b.cut([b"a"]) is None and b.cut([b"c", b"d"]) == 1  # the third token spends it
    assert b.cut([b"x"] * 5) is None  # the thought is over: the answer is free
    b = ThoughtBudget(2, TAGS, [9])
    assert b.cut([b"Hi ", b"<th", b"ink>", b"a"]) is None and b.cut([b"b", b"c"]) == 1
    b = ThoughtBudget(4, TAGS, [9])  # a tag's first tokens count until it is whole (llama.cpp's)
    b.prefill([b"<think>"])
    assert b.cut([b"a", b"</th", b"ink>", b"x", b"y", b"<think>", b"p"]) is None  # closed, then a new thought
    assert b.cut([b"q"] * 5) == 3
    b = ThoughtBudget(2, TAGS, [9])
    b.prefill([b"<think>", b"I", b" think"])
    assert b.cut([b"a", b"b"]) == 0


def test_budget_of_a_chat(model: Model) -> None:
    """A request's budget (else the server's) with the message and the template's text after the closing tag
    forced; none where unlimited, held to a grammar, or without thinking markers."""
    t = template(model, THINKING_QWEN, Reasoning(budget=7, budget_message="Enough."))
    assert t.after_thinking == "\n\n" and template(model, THINKING).after_thinking == ""
    b = chat_prompt(model, t, {"messages": ASK}).budget
    assert b is not None and b.n == 7 and b.counting and b.used == 1  # the generation prompt's "<think>\n"
    assert model.detokenize(b.forced, False, True) == "Enough.</think>\n\n"
    b = chat_prompt(model, t, {"messages": ASK, "thinking_budget_tokens": 3, "reasoning_budget_message": ""}).budget
    assert b is not None and b.n == 3 and model.detokenize(b.forced, False, True) == "</think>\n\n"
    off = chat_prompt(model, t, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).budget
    assert off is not None and not off.counting  # the prompt closed its thought: none counted until one opens
    assert chat_prompt(model, template(model, THINKING_QWEN), {"messages": ASK}).budget is None
    held = {"messages": ASK, "reasoning_budget_tokens": 5, "response_format": {"type": "json_object"}}
    assert chat_prompt(model, t, held).budget is None
    assert chat_prompt(model, template(model, PLAIN), {"messages": ASK, "reasoning_budget_tokens": 5}).budget is None


@pytest.mark.parametrize("flags, message", [
    (["--reasoning", "maybe"], "--reasoning: 'maybe'"),
    (["--reasoning-format", "qwen"], "--reasoning-format must be one of"),
    (["--reasoning-budget", "-3"], "--reasoning-budget must be -1 (unlimited)"),
    (["--skip-chat-parsing"], "--skip-chat-parsing: not supported"),
])
def test_reasoning_flags_refused_with_their_names(flags: list[str], message: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_reasoning_flags_accepted() -> None:
    args = parse_args(["-rea", "off", "--reasoning-format", "none", "--reasoning-budget", "0", "--reasoning-effort",
                       "low", "--no-prefill-assistant", "--reasoning-preserve"])
    assert args.reasoning == Reasoning(switch=False, format="none", budget=0, effort="low")
    args = parse_args(["--reasoning-budget", "256", "--reasoning-budget-message", "Enough."])
    assert args.reasoning == Reasoning(budget=256, budget_message="Enough.")
    assert parse_args(["--reasoning-effort", "default"]).reasoning == Reasoning()


# ---- the server on SmolLM2 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("reasoning") / "thinking.jinja"
    path.write_text(THINKING)
    s = Server(smollm2_path, "-np", "1", "-c", "1024", "--mode", "plain", "--jinja", "--chat-template-file", str(path),
               "--verbose")
    yield s
    s.stop()


def chat(server: Server, **fields: Any) -> dict:
    r = call(server.port, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 12, "temperature": 0,
                                                            **fields})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_thoughts_in_reasoning_content(server: Server) -> None:
    """The prompt opens a thought: the reply up to </think> (here all of it: SmolLM2 does not close it) is
    reasoning_content; with reasoning_format none the same tokens are content; streamed deltas add up to it."""
    raw = chat(server, reasoning_format="none")["choices"][0]["message"]
    assert "reasoning_content" not in raw and raw["content"]
    split_ = chat(server)
    msg = split_["choices"][0]["message"]
    thoughts, content = split(raw["content"], TAGS, True)
    assert (msg.get("reasoning_content"), msg["content"]) == (thoughts or None, content) and thoughts
    assert split_["__verbose"]["prompt"].endswith("<|im_start|>assistant\n<think>\n")  # --verbose
    r = call(server.port, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 12, "temperature": 0,
                                                            "stream": True})
    deltas = [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in r.text.split("\n\n")
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (msg.get("reasoning_content") or "")
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    assert all(d.get("reasoning_content") != "" for d in deltas)  # never an empty delta


@pytest.mark.slow
def test_no_thinking_asked_by_the_request(server: Server) -> None:
    """enable_thinking false closes the thought in the prompt: the reply is content unless it opens one itself."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = chat(server, reasoning_format="none", **off)["choices"][0]["message"]["content"]
    msg = chat(server, **off)["choices"][0]["message"]
    thoughts, content = split(raw, TAGS, False)
    assert (msg.get("reasoning_content"), msg["content"]) == (thoughts or None, content)
    r = call(server.port, "POST", "/apply-template", {"messages": ASK, "reasoning_effort": "none"})
    assert r.json()["prompt"].endswith("<think>\n</think>\n")


# ---- a thinking budget, Anthropic's thinking blocks, __verbose (SmolLM2) -----------------------------------------


@pytest.fixture(scope="module")
def qwen_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("reasoning") / "qwen.jinja"
    path.write_text(THINKING_QWEN)
    s = Server(smollm2_path, "-np", "2", "-c", "1024", "--mode", "plain", "--jinja", "--chat-template-file", str(path))
    yield s
    s.stop()


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for block in text.split("\n\n") for line in block.split("\n")
            if line.startswith("data: {")]


def reply_tokens(server: Server, **fields: Any) -> tuple[list[bytes], dict]:
    """The raw reply's tokens (their bytes, from logprobs) and the response."""
    out = chat(server, reasoning_format="none", logprobs=True, max_tokens=24, **fields)
    return [bytes(e["bytes"]) for e in out["choices"][0]["logprobs"]["content"]], out


def in_prompt(model: Model) -> int:
    """The thought's tokens the qwen_server's generation prompt holds (its "<think>\n": they count)."""
    b = chat_prompt(model, template(model, THINKING_QWEN), {"messages": ASK, "reasoning_budget_tokens": 99}).budget
    assert b is not None and b.counting
    return b.used


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3, 6])
def test_budget_cuts_the_thought_at_n_tokens(qwen_server: Server, model: Model, n: int) -> None:
    """The reply is the unbudgeted reply's first tokens, as many as make n with the prompt's, the closing tag and
    the template's blank line (forced), then an answer; its thoughts are those tokens."""
    free, _ = reply_tokens(qwen_server)
    k = n - in_prompt(model)  # the reply's tokens of thought
    assert k >= 0 and b"</think>" not in b"".join(free[:k + 2])  # SmolLM2 thinks longer than the budget
    forced = [model.token_to_piece(t, True) for t in model.tokenize("</think>\n\n", False, True)]
    cut, out = reply_tokens(qwen_server, reasoning_budget_tokens=n)
    assert cut[:k] == free[:k] and cut[k:k + len(forced)] == forced and len(cut) > k + len(forced)
    assert out["usage"]["completion_tokens"] == len(cut)
    msg = chat(qwen_server, reasoning_budget_tokens=n, max_tokens=24)["choices"][0]["message"]
    assert msg.get("reasoning_content") == (b"".join(free[:k]).decode().strip() or None)
    assert msg["content"] == b"".join(cut[k + len(forced):]).decode().strip()


@pytest.mark.slow
def test_budget_in_speculative_steps_streams_and_message(qwen_server: Server, model: Model) -> None:
    """n-gram lookup returns several tokens a step: the thought is still cut at n; a stream's thoughts and content are
    the whole reply's; the budget's message goes before the closing tag; a token limit inside the forced text ends
    the reply there."""
    free, _ = reply_tokens(qwen_server)
    n = 5
    k = n - in_prompt(model)
    text = b"".join(free[:k]).decode()
    raw = chat(qwen_server, reasoning_format="none", reasoning_budget_tokens=n, mode="ngram", max_tokens=24)
    assert raw["choices"][0]["message"]["content"].startswith(text + "</think>\n\n")
    whole = chat(qwen_server, reasoning_budget_tokens=n, max_tokens=24)
    r = call(qwen_server.port, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 24, "temperature": 0,
                                                                "reasoning_budget_tokens": n, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text) if e.get("choices")]
    msg = whole["choices"][0]["message"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    said = chat(qwen_server, reasoning_format="none", reasoning_budget_tokens=n, max_tokens=24,
                reasoning_budget_message=" Enough.")["choices"][0]["message"]["content"]
    assert said.startswith(text + " Enough.</think>\n\n")
    short = chat(qwen_server, reasoning_format="none", reasoning_budget_tokens=n, max_tokens=k + 2)
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == k + 2
    forced = model.tokenize("</think>\n\n", False, True)
    assert short["choices"][0]["message"]["content"] == text + model.detokenize(forced[:2])  # the forced text, cut


@pytest.mark.slow
def test_anthropic_thinking_blocks(qwen_server: Server) -> None:
    """/v1/messages: the thoughts a thinking block (with an empty signature) before the text; streamed as thinking
    deltas closed by a signature_delta, then a text block at index 1; `thinking.budget_tokens` is the budget."""
    ask = {"messages": ASK, "max_tokens": 24, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 4}}
    r = call(qwen_server.port, "POST", "/v1/messages", ask)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"] and blocks[0]["signature"] == ""
    msg = chat(qwen_server, reasoning_budget_tokens=4, max_tokens=24)["choices"][0]["message"]
    assert (blocks[0]["thinking"], blocks[1]["text"]) == (msg["reasoning_content"], msg["content"])
    events = sse_events(call(qwen_server.port, "POST", "/v1/messages", {**ask, "stream": True}).text)
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert "".join(e["delta"].get("thinking", "") for e in deltas if e["index"] == 0) == blocks[0]["thinking"]
    assert "".join(e["delta"].get("text", "") for e in deltas if e["index"] == 1) == blocks[1]["text"]
    kinds = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events]
    at = kinds.index(("content_block_stop", 0, None))  # the thinking block closed, with its signature, before the text
    assert kinds[at - 1] == ("content_block_delta", 0, "signature_delta")
    assert at < kinds.index(("content_block_start", 1, None))
    bad = call(qwen_server.port, "POST", "/v1/messages", {**ask, "thinking": "on"})
    assert bad.status_code == 400 and "'thinking'" in bad.text


@pytest.mark.slow
def test_verbose_where_llama_cpp_puts_it(server: Server) -> None:
    """--verbose: /v1/completions carries what /completion answers (each streamed chunk its piece), a chat stream
    on the first of its last chunks (the prompt with its special tokens' text); llama.cpp's /completion does not."""
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    out = call(server.port, "POST", "/v1/completions", body).json()
    v = out["__verbose"]
    assert v["content"] == out["choices"][0]["text"] and v["tokens_predicted"] == out["usage"]["completion_tokens"]
    assert v["stop"] is True and v["prompt"] == "The capital of France is" and "generation_settings" in v
    chunks = sse_events(call(server.port, "POST", "/v1/completions", {**body, "stream": True}).text)
    assert all("__verbose" in c for c in chunks)
    assert "".join(c["__verbose"]["content"] for c in chunks) == v["content"]
    assert [c["__verbose"]["stop"] for c in chunks][-1] is True
    chunks = sse_events(call(server.port, "POST", "/v1/chat/completions",
                             {"messages": ASK, "max_tokens": 6, "temperature": 0, "stream": True}).text)
    marked = [c for c in chunks if "__verbose" in c]
    assert len(marked) == 1 and marked[0]["__verbose"]["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    assert "__verbose" not in call(server.port, "POST", "/completion", {"prompt": "Hi", "n_predict": 2}).json()
