"""Tool calls in each family's own format (python/specee/server/tool_formats.py), without a model: the format chosen
from the template as llama.cpp chooses it; calls written by each family's real template (the tool-call parts of
Llama 3.1/3.2's, Mistral Nemo's, Devstral's and Mistral Small 3.2's, as llama.cpp keeps them in models/templates/, MIT) read
back whole and streamed (every prefix of the reply); Mistral's 9-character ids that its templates take back; the
grammar that holds a reply to a family's call format under tool_choice required."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from specee.server.templates import ChatTemplate, jinja_environment
from specee.server.tool_formats import call_grammar, parse_calls, tool_format_of
from specee.server.tools import Tools, chat_messages, reply_of, reply_so_far, tools_of
from test_server import TIMEOUT, Server, call
from test_server_tools import HERMES, SCHEMAS, TOOLS

# Llama 3.2's template (llama.cpp: models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja), tool-call parts as they are
LLAMA32 = """{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- messages[0]['content']|trim + "<|eot_id|>"}}{%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
# Llama 3.1's built-in tools (meta-llama-Llama-3.1-8B-Instruct.jinja): a call of one is written after <|python_tag|>
LLAMA31_BUILTIN = LLAMA32.replace("""        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}""", """        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}""").replace("""        {{- "}" }}
        {{- "<|eot_id|>" }}""", """        {{- "}" }}
        {%- endif %}
        {{- "<|eot_id|>" }}""")
# Mistral Nemo's (mistralai-Mistral-Nemo-Instruct-2407.jinja), tool-call parts as they are: ids of 9 characters
NEMO = """{%- set loop_messages = messages %}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == loop_messages | selectattr("role", "equalto", "user") | list | last) %}
            {{- "[AVAILABLE_TOOLS][" }}{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}{{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST]" + message["content"] + "[/INST]" }}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}{%- set content = message.content.content %}
        {%- else %}{%- set content = message.content %}{%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""
# Devstral Small 2507's (unsloth-mistral-Devstral-Small-2507.jinja) and Mistral Small 3.2's
# (Mistral-Small-3.2-24B-Instruct-2506.jinja) tool-call parts as they are, in a loop of their own over the messages:
# `[TOOL_CALLS]name[ARGS]arguments`, Small 3.2 with `[CALL_ID]id` (9 characters) between
MISTRAL_ARGS_LOOP = """{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools is not none and tools|length > 0 %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
CALLS
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message.content|string + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""
DEVSTRAL = MISTRAL_ARGS_LOOP.replace("CALLS", """        {%- if message['tool_calls'] is defined and message['tool_calls'] is not none %}
            {%- for tool in message['tool_calls'] %}
                {%- set arguments = tool['function']['arguments'] %}
                {%- if arguments is not string %}
                    {%- set arguments = arguments|tojson %}
                {%- endif %}
                {{- "[TOOL_CALLS]" + tool['function']['name'] + "[ARGS]" + arguments }}
            {%- endfor %}
        {%- endif %}""")
SMALL32 = MISTRAL_ARGS_LOOP.replace("CALLS", """        {%- if message.get('tool_calls') %}
            {%- for tool_call in message.tool_calls %}
                {{- '[TOOL_CALLS]' + tool_call.function.name }}
                {%- if not tool_call.id is defined or tool_call.id is not string or tool_call.id|length != 9 %}
                    {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
                {%- endif %}
                {{- '[CALL_ID]' + tool_call.id }}
                {{- '[ARGS]' + tool_call['function']['arguments']|tojson }}
            {%- endfor %}
        {%- else %}{{- message['content'] }}{%- endif %}""")
QWEN_LIKE = HERMES
GENERIC_READER = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
TEMPLATES = {"hermes": QWEN_LIKE, "llama3": LLAMA32, "mistral": NEMO, "mistral-args": DEVSTRAL}


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source=source, eos="</s>", compiled=jinja_environment().from_string(source))


def test_format_chosen_as_llama_cpp_chooses_it() -> None:
    assert tool_format_of(None) == "generic"  # a built-in template
    assert tool_format_of(HERMES) == "hermes" and tool_format_of(LLAMA32) == "llama3"
    assert tool_format_of(NEMO) == "mistral" and tool_format_of(GENERIC_READER) == "generic"
    assert tool_format_of(DEVSTRAL) == "mistral-args" == tool_format_of(SMALL32)  # [TOOL_CALLS] with [ARGS]
    assert tool_format_of("{{ messages }}<tool_call>") == "generic"  # it does not read tools
    # Hermes' marker first, then Llama 3's, then Mistral's
    assert tool_format_of("{{ tools }}[TOOL_CALLS]<tool_call>") == "hermes"
    for fmt, source in TEMPLATES.items():
        t = tools_of({"tools": TOOLS}, template(source))
        assert t.format == fmt and t.native and t.described
    assert tools_of({"tools": TOOLS}, template(LLAMA31_BUILTIN)).builtin


def test_a_template_reading_tools_without_a_family_marker_speaks_generic() -> None:
    # as llama.cpp: the template is given the tools, a system message asks for the generic JSON, the grammar holds it
    t = template(GENERIC_READER)
    body = {"messages": QUESTION, "tools": TOOLS}
    tools = tools_of(body, t)
    assert tools.format == "generic" and tools.described and not tools.native
    messages = chat_messages(body, tools, t)
    assert messages[0]["role"] == "system" and '{"tool_calls"' in messages[0]["content"]
    assert "Tools: [" in t.render(messages, tools.openai)
    assert tools.schema() is not None  # under auto too: the tool_calls or the response object


def assistant_text(t: ChatTemplate, body: dict) -> str:
    """What the template writes for the chat's final assistant message: the text after the generation prompt."""
    tools = tools_of(body, t)
    messages = chat_messages(body, tools, t)
    whole = t.render(messages, tools.openai, add_generation_prompt=False)
    head = t.render(messages[:-1], tools.openai, add_generation_prompt=True)
    assert whole.startswith(head)
    return re.sub(r"(<\|eot_id\|>|</s>|<\|im_end\|>\n?)$", "", whole[len(head):])


def call_message(calls: list[tuple[str, dict, str]], content: str | None = None) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a, i in calls]}


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CASES = {  # a family: the calls its template writes for one assistant message
    "hermes": [("get_weather", {"city": "Paris"}, "call_1"), ("get_time", {"zone": "CET"}, "call_2")],
    "llama3": [("get_weather", {"city": "Paris", "unit": "celsius"}, "call_1")],  # one call a message
    "mistral": [("get_weather", {"city": "Paris"}, "abcDEF123"), ("get_time", {"zone": "CET"}, "XYZ987abc")],
    "mistral-args": [("get_weather", {"city": "Paris"}, "abcDEF123"), ("get_time", {"zone": "CET"}, "XYZ987abc")],
}


@pytest.mark.parametrize("fmt", CASES)
def test_calls_written_by_the_template_read_back_whole_and_streamed(fmt: str) -> None:
    t = template(TEMPLATES[fmt])
    body = {"messages": [*QUESTION, call_message(CASES[fmt])], "tools": TOOLS}
    text = assistant_text(t, body)
    tools = tools_of(body, t)
    content, calls = reply_of(text, tools)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(n, a) for n, a, _ in CASES[fmt]]
    if fmt == "mistral":  # the ids the model wrote are kept
        assert [c["id"] for c in calls] == [i for _, _, i in CASES[fmt]]
    # streamed: no prefix sends a marker's text as content, and the calls come whole, in order
    for n in range(len(text) + 1):
        so_far, done = reply_so_far(text[:n], tools)
        assert so_far == "", (fmt, text[:n], so_far)
        assert [c["function"]["name"] for c in done] == [c["function"]["name"] for c in calls][:len(done)]


def test_mistral_small_32_calls_with_their_ids_read_back_and_go_back() -> None:
    """Small 3.2 writes `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`: the ids it wrote are kept, and ids made here (9
    letters and digits) pass its template's check on the next turn."""
    t = template(SMALL32)
    body = {"messages": [*QUESTION, call_message(CASES["mistral-args"])], "tools": TOOLS}
    text = assistant_text(t, body)
    assert text.startswith("[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{")
    tools = tools_of(body, t)
    content, calls = reply_of(text, tools)
    assert content is None and [c["id"] for c in calls] == ["abcDEF123", "XYZ987abc"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [a for _, a, _ in CASES["mistral-args"]]
    _, made = reply_of('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', tools)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", made[0]["id"])
    history = {"messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": made},
                            {"role": "tool", "tool_call_id": made[0]["id"], "content": "12:00"}], "tools": TOOLS}
    assert f"[CALL_ID]{made[0]['id']}[ARGS]" in t.render(chat_messages(history, tools, t), tools.openai)
    # arguments written as JSON text, and a reply cut inside a call's arguments: the calls written whole so far
    _, calls = reply_of('[TOOL_CALLS]get_time[ARGS]"{\\"zone\\": \\"UTC\\"}"', tools)
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    so_far, done = reply_so_far('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"ci', tools)
    assert so_far == "" and [c["function"]["name"] for c in done] == ["get_time"]


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "mistral-args"])
def test_content_before_the_calls_streams_as_it_comes(fmt: str) -> None:
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "mistral-args": "[TOOL_CALLS]"}[fmt]
    call = {"hermes": '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
            "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            "mistral-args": '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'}[fmt]
    text = "Let me look that up. " + call
    tools = Tools([t["function"] for t in TOOLS], "auto", True, fmt, True)
    sent = ""
    for n in range(len(text) + 1):
        so_far, _ = reply_so_far(text[:n], tools)
        assert so_far.startswith(sent) and marker[:2] not in so_far  # only ever grows, never a marker's start
        sent = so_far
    assert sent == "Let me look that up."
    content, calls = reply_of(text, tools)
    assert content == sent and calls[0]["function"]["name"] == "get_time"
    assert reply_of("No tool needed.", tools) == ("No tool needed.", [])


def test_llama3_forms() -> None:
    tools = Tools([t["function"] for t in TOOLS], "auto", True, "llama3", True)
    content, calls = reply_of('{"type": "function", "name": "get_time", "parameters": {"zone": "UTC"}}', tools)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    _, calls = reply_of('{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", '
                        '"parameters": {"city": "Rome"}}', tools)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert reply_of("The answer is 4.", tools) == ("The answer is 4.", [])
    assert reply_so_far("The answer", tools) == ("The answer", [])
    assert reply_so_far('{"name": "get_ti', tools) == ("", [])
    # Llama 3.1's built-in tools after <|python_tag|>, and code for the python tool
    builtin = Tools([{"name": "brave_search"}, {"name": "python"}], "auto", True, "llama3", True, builtin=True)
    _, calls = reply_of('<|python_tag|>brave_search.call(query="weather in Paris")', builtin)
    assert calls[0]["function"]["name"] == "brave_search"
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "weather in Paris"}
    _, calls = reply_of("<|python_tag|>print(2 + 2)", builtin)
    assert calls[0]["function"]["name"] == "python"
    assert json.loads(calls[0]["function"]["arguments"]) == {"code": "print(2 + 2)"}
    assert reply_so_far("<|python", builtin) == ("", [])


def test_llama31_builtin_call_written_by_its_template_reads_back() -> None:
    t = template(LLAMA31_BUILTIN)
    search = {"type": "function", "function": {"name": "brave_search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}}
    body = {"messages": [*QUESTION, call_message([("brave_search", {"query": "Paris weather"}, "call_1")])],
            "tools": [search]}
    t.kwargs["builtin_tools"] = ["brave_search"]
    text = assistant_text(t, body)
    assert text.startswith("<|python_tag|>brave_search.call(")
    _, calls = reply_of(text, tools_of(body, t))
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "Paris weather"}


def test_mistral_ids_round_trip_through_its_template() -> None:
    t = template(NEMO)
    tools = tools_of({"tools": TOOLS}, t)
    _, calls = reply_of('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', tools)
    (call,) = calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    body = {"messages": history, "tools": TOOLS}
    text = t.render(chat_messages(body, tools, t), tools.openai)
    assert f'"id": "{call["id"]}"' in text and f'"call_id": "{call["id"]}"' in text
    # ids of other families (call_ and 24 hex digits) are not for it: its template refuses them
    generic = Tools(tools.functions, "auto", True, "hermes", True)
    other = reply_of('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', generic)[1]
    assert other[0]["id"].startswith("call_") and len(other[0]["id"]) == 29


def test_required_holds_the_reply_to_the_family_format() -> None:
    one = Tools([t["function"] for t in TOOLS], "get_time", False, "llama3", True)
    kind, schema = call_grammar("llama3", one.call_schemas(), one.parallel, {})
    assert kind == "json_schema" and schema["properties"]["name"] == {"const": "get_time"}
    assert set(schema["required"]) == {"name", "parameters"}
    kind, lark = call_grammar("hermes", one.call_schemas(), False, {})
    assert kind == "lark" and lark.startswith("start: call\n") and '"<tool_call>"' in lark and "%json" in lark
    kind, lark = call_grammar("hermes", one.call_schemas(), True, {"<tool_call>": 151657, "</tool_call>": 151658})
    assert "<[151657]>" in lark and "<[151658]>" in lark and "call (" in lark
    kind, lark = call_grammar("mistral", one.call_schemas(), False, {"[TOOL_CALLS]": 5})
    assert kind == "lark" and lark.startswith("start: <[5]> %json ")
    array = json.loads(lark[len("start: <[5]> %json "):])
    assert array["maxItems"] == 1 and array["items"]["properties"]["name"] == {"const": "get_time"}
    kind, lark = call_grammar("mistral-args", one.call_schemas(), False, {"[TOOL_CALLS]": 9, "[ARGS]": 32})
    assert kind == "lark" and lark.startswith("start: call\n") and lark.count("<[9]>") == 1
    assert '"get_time" ("[CALL_ID]" /[A-Za-z0-9]{9}/)? <[32]> %json ' in lark
    both = Tools([t["function"] for t in TOOLS], "required", True, "mistral-args", True)
    kind, lark = call_grammar("mistral-args", both.call_schemas(), True, {})
    assert lark.startswith("start: call+\n") and '"get_weather"' in lark and '"get_time"' in lark
    with pytest.raises(ValueError):
        call_grammar("generic", one.call_schemas(), False, {})


def test_partial_parse_is_a_prefix_of_the_whole() -> None:
    text = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    for n in range(len(text) + 1):
        content, calls = parse_calls("hermes", text[:n], partial=True)
        assert "Checking.".startswith(content) and len(calls) <= 1
    assert parse_calls("hermes", text)[0] == "Checking."


# ---- on the server: SmolLM2 with each family's template (--jinja --chat-template-file) -------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "mistral-args"])
def test_required_call_in_the_family_format_whole_streamed_and_back(smollm2_path: Path, tmp_path: Path,
                                                                      fmt: str) -> None:
    """Under tool_choice required the grammar holds the reply to the family's own call format (the raw text in
    `__verbose` shows it), read back whole and streamed alike; the call and its result go back through the template
    on the next turn (Mistral's with its 9-character id)."""
    (tmp_path / f"{fmt}.jinja").write_text(TEMPLATES[fmt])
    s = Server(smollm2_path, "-np", "1", "-c", "2048", "--mode", "plain", "--jinja", "--chat-template-file",
               str(tmp_path / f"{fmt}.jinja"))
    try:
        body = {"model": "m", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
                "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0}
        whole = call(s.port, "POST", "/v1/chat/completions", {**body, "verbose": True}).json()
        raw = whole["__verbose"]["content"]
        assert raw.lstrip().startswith({"hermes": "<tool_call>", "llama3": '{"name"', "mistral": "[TOOL_CALLS]",
                                        "mistral-args": "[TOOL_CALLS]"}[fmt])
        message = whole["choices"][0]["message"]
        (c,) = message["tool_calls"]
        assert whole["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
        assert c["function"]["name"] in {"get_weather", "get_time"}
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
        if fmt.startswith("mistral"):
            assert re.fullmatch(r"[A-Za-z0-9]{9}", c["id"])
        client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        streamed: dict[int, dict] = {}
        for chunk in client.chat.completions.create(**{**body, "stream": True}):
            assert not chunk.choices[0].delta.content  # no marker's text as content
            for tc in chunk.choices[0].delta.tool_calls or []:
                got = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                got["name"] += tc.function.name or "" if tc.function else ""
                got["arguments"] += tc.function.arguments or "" if tc.function else ""
        assert list(streamed.values()) == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}]
        history = [*QUESTION, message, {"role": "tool", "tool_call_id": c["id"], "content": "sunny, 21 C"}]
        again = call(s.port, "POST", "/v1/chat/completions", {"model": "m", "messages": history, "tools": TOOLS,
                                                               "max_tokens": 8, "temperature": 0, "verbose": True})
        assert again.status_code == 200, again.text
        assert "sunny, 21 C" in again.json()["__verbose"]["prompt"]
    finally:
        s.stop()
