"""Chat templates, tool calls and Anthropic's API on specee-server (server/templates.py, tools.py, anthropic.py).

Fast tests check the pieces without a model: the JSON Schema a tool call is held to, the reply read back, the
messages of an agent's loop, the refusals, Jinja's Hugging Face conventions. The slow ones run specee-server on
SmolLM2 (127.0.0.1, started and stopped by their fixtures) and drive it with the official `openai` client and plain
HTTP: every call's arguments validate against its tool's schema (jsonschema), a two-turn agent loop with
`content: null`, streamed tool-call deltas reassembled equal the whole answer, /apply-template, a
--chat-template-file, 400s for bad tools, a bad template refused at start, /v1/messages in its shapes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
from openai import OpenAI

from specee import Model, _core
from specee.server.request import ApiError
from specee.server.templates import ChatTemplate, checked, jinja_environment
from specee.server.tools import Tools, chat_messages, reply_of, response_so_far, tools_of
from test_server import TIMEOUT, Server, call

KEY = "test-key"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
BUILTIN = ChatTemplate(builtin="chatml")
# a Hermes-style template that describes tools itself (written for these tests, in the manner of such templates)
HERMES = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def hermes() -> ChatTemplate:
    return ChatTemplate(source=HERMES, compiled=jinja_environment().from_string(HERMES))


# ---- the pieces, without a model ----------------------------------------------------------------------------


def test_schema_allows_only_the_chosen_branch() -> None:
    call_ = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    two = {"tool_calls": [call_["tool_calls"][0], {"name": "get_time", "arguments": {"zone": "UTC"}}]}
    answer = {"response": "Hello"}
    cases = {  # tool_choice, parallel -> (accepted, refused)
        ("auto", True): ([call_, two, answer], [{"tool_calls": []}, {"tool_calls": [{"name": "nope", "arguments": {}}]}]),
        ("required", True): ([call_, two], [answer]),
        ("required", False): ([call_], [two, answer]),
        ("get_time", True): ([{"tool_calls": [two["tool_calls"][1]]}], [call_, answer]),
    }
    for (choice, parallel), (ok, bad) in cases.items():
        body = {"tools": TOOLS, "tool_choice": choice if "_" not in choice else
                {"type": "function", "function": {"name": choice}}, "parallel_tool_calls": parallel}
        schema = tools_of(body, BUILTIN).schema()
        for instance in ok:
            jsonschema.validate(instance, schema)
        for instance in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(instance, schema)
    # arguments beyond the parameters' properties are refused where the tool does not allow them
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {"city": "P", "x": 1}}]},
                            tools_of({"tools": TOOLS, "tool_choice": "required"}, BUILTIN).schema())
    assert tools_of({"tools": TOOLS, "tool_choice": "none"}, BUILTIN).schema() is None
    assert tools_of({"tools": TOOLS}, hermes()).schema() is None  # native under auto: free


def test_reply_read_back() -> None:
    generic = Tools([t["function"] for t in TOOLS], "auto", True, format="generic")
    content, calls = reply_of('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}', generic)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")
    assert reply_of('{"response":"Hi there"}', generic) == ("Hi there", [])
    cut = '{"tool_calls":[{"name":"get_time","arguments":{"zone":"UTC"}},{"name":"get_time","argu'
    assert [json.loads(c["function"]["arguments"]) for c in reply_of(cut, generic)[1]] == [{"zone": "UTC"}]
    assert reply_of("plain words", generic) == ("plain words", [])
    # a generic answer as far as it is written: what a stream sends as it comes, and the whole reply when cut short
    written = '{"response":"Caf\\u00e9 \\"ok\\"\\n\\ud83d\\ude00 done"}'
    assert json.loads(written)["response"] == "Café \"ok\"\n\U0001F600 done"
    prefixes = [response_so_far(written[:n]) for n in range(len(written) + 1)]
    assert all(p is None for p in prefixes[:13]) and prefixes[-1] == json.loads(written)["response"]
    assert all(json.loads(written)["response"].startswith(p) for p in prefixes[13:])  # never a wrong character
    assert [len(p) for p in prefixes[13:]] == sorted(len(p) for p in prefixes[13:])
    assert reply_of(written[:30], generic) == (response_so_far(written[:30]), [])
    native = Tools(generic.functions, "auto", True, format="hermes", described=True)
    content, calls = reply_of('Let me look.\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
                              '</tool_call>', native)
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_time"
    assert reply_of('{"name": "get_weather", "parameters": {"city": "Oslo"}}', native)[1][0]["function"]["name"] == \
        "get_weather"
    assert reply_of('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', native)[1] == []


def agent_history() -> list[dict]:
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def test_agent_history_rendered_both_ways() -> None:
    body = {"messages": agent_history(), "tools": TOOLS}
    generic = chat_messages(body, tools_of(body, BUILTIN), BUILTIN)
    assert generic[0]["role"] == "system" and "get_time" in generic[0]["content"]
    assert json.loads(generic[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert generic[3]["role"] == "user" and json.loads(generic[3]["content"])["tool_response"]["name"] == "get_weather"
    assert BUILTIN.render(generic).endswith("<|im_start|>assistant\n")
    t = hermes()
    native = chat_messages(body, tools_of(body, t), t)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as templates want
    text = t.render(native, tools_of(body, t).openai)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>sunny, 21 C</tool_response>" in text and '"name": "get_time"' in text
    # an assistant's reasoning reaches a Jinja template (Qwen3's <think>), not the built-in ones
    thought = {"messages": [*QUESTION, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}]}
    assert chat_messages(thought, None, t)[1]["reasoning_content"] == "Look it up."
    assert "reasoning_content" not in chat_messages(thought, None, BUILTIN)[1]


@pytest.mark.parametrize("body, message", [
    ({"tools": {"x": 1}}, "'tools' must be a list"),
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "a second function named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "parameters must be a JSON Schema of an object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names the function 'nope', which is not among 'tools' (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be auto, none, required"),
    ({"tool_choice": "required"}, "gives no 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false"),
])
def test_bad_tools_refused(body: dict, message: str) -> None:
    with pytest.raises(ApiError, match=re.escape(message)) as e:
        tools_of(body, BUILTIN)
    assert e.value.status == 400


def test_content_null_only_where_tool_calls_may_stand() -> None:
    ok = chat_messages({"messages": agent_history()}, None, BUILTIN)
    assert len(ok) == 3
    with pytest.raises(ApiError, match="'content' must be"):
        chat_messages({"messages": [{"role": "user", "content": None}]}, None, BUILTIN)
    with pytest.raises(ApiError, match="not JSON"):
        chat_messages({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, None, BUILTIN)


def test_jinja_conventions() -> None:
    """Hugging Face's: raise_exception, tojson without ASCII escapes, strftime_now, bos/eos, sandboxed."""
    source = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
              "{% endif %}{{ m | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}{{ eos_token }}"
              "{{ date_string == strftime_now('%d %b %Y') }}{{ enable_thinking }}")
    t = ChatTemplate(source=source, bos="<s>", eos="</s>", compiled=jinja_environment().from_string(source))
    # enable_thinking: the template's (false for one that does not think, server/reasoning.py), a request's wins
    assert t.render([{"role": "user", "content": "é"}]) == '<s>{"role": "user", "content": "é"}4</s>TrueFalse'
    assert t.render(QUESTION, kwargs={"enable_thinking": True}).endswith("TrueTrue")
    with pytest.raises(ValueError, match="no bad"):
        t.render([{"role": "bad", "content": ""}])
    unsafe = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate(source=unsafe, compiled=jinja_environment().from_string(unsafe)).render(QUESTION)


def test_generation_tag_and_templates_without_a_system_role() -> None:
    source = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
              "{% endif %}<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    t = checked(ChatTemplate(source=source, compiled=jinja_environment().from_string(source)))
    assert not t.system  # found by the probe at start
    assert t.render([{"role": "system", "content": "Be brief."}, *QUESTION]) == \
        "<user>Be brief.\n\nWhat is the weather in Paris?"


# upstream's own collection of real models' templates (the llama-cpp-python 0.3.36 sdist unpacked in ../up), or
# $SPECEE_UPSTREAM_TEMPLATES
UPSTREAM_TEMPLATES = Path(os.environ.get("SPECEE_UPSTREAM_TEMPLATES", Path(__file__).resolve().parents[2] / "up" /
                                         "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"))
# templates that need what this server does not give: Functionary's string arguments, Mistral's 9-character call ids
# (Firefunction's `functions`, which nothing defines, renders as "" as in llama.cpp; its tools are described by the
# generic system message since the tool formats are chosen by marker, server/tool_formats.py)
NOT_RENDERED = {"meetkai-functionary-medium-v3.2", "Mistral-Small-3.2-24B-Instruct-2506",
                "mistralai-Mistral-Nemo-Instruct-2407"}


@pytest.mark.upstream
def test_real_templates_render_an_agent_loop() -> None:
    """Every real template of upstream's collection (but NOT_RENDERED) passes the start's check and renders an agent's
    loop: the tools described (by the template where it reads them, else by the generic system message) and the tool's
    result in the prompt."""
    files = sorted(UPSTREAM_TEMPLATES.glob("*.jinja"))
    if not files:
        pytest.skip(f"upstream's templates are not here ({UPSTREAM_TEMPLATES}; SPECEE_UPSTREAM_TEMPLATES names them)")
    body = {"messages": agent_history(), "tools": TOOLS}
    failed = []
    for f in files:
        source = f.read_text()
        try:
            t = checked(ChatTemplate(source=source, bos="<s>", eos="</s>",
                                     compiled=jinja_environment().from_string(source)))
            tools = tools_of(body, t)
            text = t.render(chat_messages(body, tools, t), tools.openai if tools.described else None)
            assert "sunny, 21 C" in text and "get_time" in text
        except (ValueError, AssertionError) as e:
            failed.append(f.stem)
            assert f.stem in NOT_RENDERED, f"{f.name}: {e}"
    assert set(failed) == NOT_RENDERED & {f.stem for f in files}


# ---- the server on SmolLM2 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[Server]:
    s = Server(smollm2_path, "-np", "2", "-c", "4096", "--mode", "plain", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def post(server: Server, path: str, body: Any, key: str = KEY) -> Any:
    return call(server.port, "POST", path, body, headers={"Authorization": f"Bearer {key}"})


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.function.name in names and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_required_and_named_give_valid_calls(client: OpenAI, choice: Any, temperature: float) -> None:
    for seed in (1, 2):
        r = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=80, temperature=temperature,
                                           seed=seed)
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
        assert len(choice0.message.tool_calls) == 1
        check_calls(choice0.message.tool_calls, {"get_time"} if isinstance(choice, dict) else set(SCHEMAS))


@pytest.mark.slow
def test_auto_and_none(client: OpenAI) -> None:
    for question in (QUESTION, HAIKU):
        r = client.chat.completions.create(model="m", messages=question, tools=TOOLS, max_tokens=80, temperature=0)
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            check_calls(m.tool_calls, set(SCHEMAS))
        else:
            assert isinstance(m.content, str) and m.content and not m.content.startswith('{"response"')
    r = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    plain = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content  # none: as if no tools were given


@pytest.mark.slow
def test_agent_loop_with_content_null(client: OpenAI) -> None:
    messages: list[Any] = list(QUESTION)
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    call_ = r.choices[0].message.tool_calls[0]
    messages.append({"role": "assistant", "content": None, "tool_calls": [call_.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call_.id, "content": "sunny, 21 C"})
    r2 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("choice, messages, max_tokens", [
    ("required", QUESTION, 80), ("auto", QUESTION, 80), ("auto", HAIKU, 60), ("auto", HAIKU, 12),
    ("auto", [{"role": "user", "content": "Say hello to Ann."}], 40)])
def test_streamed_calls_equal_whole_answer(client: OpenAI, choice: str, messages: list, max_tokens: int) -> None:
    args = dict(model="m", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=0,
                seed=3)
    whole_reply = client.chat.completions.create(**args)
    whole = whole_reply.choices[0]
    calls: dict[int, dict] = {}
    content, finish, content_chunks = "", None, 0
    for chunk in client.chat.completions.create(**args, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        content_chunks += bool(d.content)
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.id or ""
            c["name"] += tc.function.name or "" if tc.function else ""
            c["arguments"] += tc.function.arguments or "" if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    if whole.message.content and not whole.message.content.startswith('{"tool_calls"') and \
            whole_reply.usage.completion_tokens > 8:  # (a call cut short before it was whole comes back as text)
        assert content_chunks > 1  # a generic answer's text streams as it is generated


@pytest.mark.slow
def test_apply_template(server: Server, smollm2_path: Path) -> None:
    r = post(server, "/apply-template", {"messages": QUESTION})
    assert r.status_code == 200  # the built-in template's text, the default
    assert r.json()["prompt"] == _core.chat_apply_template(Model(smollm2_path, n_ctx=64).chat_template(), QUESTION,
                                                           True)
    with_tools = post(server, "/apply-template", {"messages": agent_history(), "tools": TOOLS}).json()["prompt"]
    assert '"name": "get_time"' in with_tools and "sunny, 21 C" in with_tools
    assert with_tools.endswith("<|im_start|>assistant\n")
    prefill = post(server, "/apply-template", {"messages": [*QUESTION, {"role": "assistant", "content": "It is"}]})
    assert prefill.json()["prompt"].endswith("<|im_start|>assistant\nIt is")


@pytest.mark.slow
@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "banana"}}}}}], "tool_choice": "required"}, "banana"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among 'tools'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "not with"),
    ({"tools": "get_weather"}, "'tools' must be a list"),
])
def test_bad_tools_get_400_and_the_server_keeps_serving(server: Server, body: dict, message: str) -> None:
    r = post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4}).status_code == 200


@pytest.mark.slow
def test_anthropic_messages(server: Server) -> None:
    body = {"model": "m", "max_tokens": 12, "temperature": 0, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]}
    r = call(server.port, "POST", "/v1/messages", body, headers={"x-api-key": KEY})
    assert r.status_code == 200
    m = r.json()
    assert m["type"] == "message" and m["role"] == "assistant" and m["content"][0]["type"] == "text"
    assert m["stop_reason"] in ("end_turn", "max_tokens") and 0 < m["usage"]["output_tokens"] <= 12
    assert call(server.port, "POST", "/v1/messages", body, headers={"x-api-key": "wrong"}).status_code == 401
    count = call(server.port, "POST", "/v1/messages/count_tokens", body, headers={"x-api-key": KEY}).json()
    assert count == {"input_tokens": m["usage"]["input_tokens"]}
    # streamed: named events in Anthropic's order, their text the whole message's
    r = call(server.port, "POST", "/v1/messages", {**body, "stream": True}, headers={"x-api-key": KEY})
    events = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):]))
              for e in r.text.strip().split("\n\n")]
    assert all(name == data["type"] for name, data in events)
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == m["content"][0]["text"]
    assert events[-2][1]["delta"]["stop_reason"] == m["stop_reason"]
    # tools: input_schema, tool_choice any, tool_use back, then a tool_result turn
    tools = [{"name": "get_weather", "description": "The weather now in a city",
              "input_schema": SCHEMAS["get_weather"]}]
    ask = {"model": "m", "max_tokens": 80, "temperature": 0, "tools": tools,
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    m = call(server.port, "POST", "/v1/messages", ask, headers={"x-api-key": KEY}).json()
    assert m["stop_reason"] == "tool_use" and [b["type"] for b in m["content"]] == ["tool_use"]
    jsonschema.validate(m["content"][0]["input"], SCHEMAS["get_weather"])
    # streamed: the same call as one tool_use block, once whole (no block per piece generated)
    r = call(server.port, "POST", "/v1/messages", {**ask, "stream": True}, headers={"x-api-key": KEY})
    events = [json.loads(e.split("\n")[1][len("data: "):]) for e in r.text.strip().split("\n\n")]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "tool_use")] and [e["index"] for e in events if e["type"] == "content_block_stop"] == [0]
    assert json.loads("".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")) == \
        m["content"][0]["input"]
    follow = {**ask, "tool_choice": {"type": "none"}, "max_tokens": 16, "messages": [
        *ask["messages"], {"role": "assistant", "content": m["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["content"][0]["id"],
                                      "content": "sunny, 21 C"}]}]}
    r = call(server.port, "POST", "/v1/messages", follow, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"
    bad = {**body, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    r = call(server.port, "POST", "/v1/messages", bad, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "image input is not supported" in r.json()["error"]["message"]


@pytest.mark.slow
def test_chat_template_file_with_tools(smollm2_path: Path, tmp_path: Path) -> None:
    """--jinja --chat-template-file: a template that reads tools renders them itself; required still gives a
    valid call (held to the generic form)."""
    (tmp_path / "hermes.jinja").write_text(HERMES)
    s = Server(smollm2_path, "-np", "1", "-c", "2048", "--mode", "plain", "--jinja", "--chat-template-file",
               str(tmp_path / "hermes.jinja"))
    try:
        body = {"messages": agent_history(), "tools": TOOLS}
        prompt = call(s.port, "POST", "/apply-template", body).json()["prompt"]
        assert prompt == hermes().render(chat_messages(body, tools_of(body, hermes()), hermes()), tools_of(
            body, hermes()).openai)
        client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        r = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
        check_calls(r.choices[0].message.tool_calls, set(SCHEMAS))
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--jinja", "--chat-template", "{% for m in messages %}{{ m.content }"], "chat template: line 1"),
    (["--jinja", "--chat-template", "{{ raise_exception('no chats here') }}"], "no chats here"),
    (["--chat-template", "no-such-template"], "unknown chat template"),
    (["--chat-template-file", "/no/such/file.jinja"], "--chat-template-file /no/such/file.jinja"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
])
def test_bad_template_refused_at_start(smollm2_path: Path, flags: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "specee.server", "-m", str(smollm2_path), "--port", "1", *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
