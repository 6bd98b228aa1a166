"""Tool calls on chat: a request's `tools`, `tool_choice` and `parallel_tool_calls` checked, its messages (tool-call
history included) made ready for the chat template, the JSON Schema that holds the reply to a call, and the reply
read back as OpenAI's `tool_calls`.

The format is the model family's, chosen from the server's template as llama.cpp chooses it
(server/tool_formats.py; docs/server.md, "Tool calls"):
- **a family's own** (`hermes`, `llama3`, `mistral`, `mistral-args`): a Jinja template that reads `tools` (--jinja) describes them
  itself and the reply is read in its family's format; under `required` or a named function the grammar holds the
  reply to calls in that format (the named function's only), under `auto` it is free.
- **generic** (every other template, the built-in ones included): the tools are described in a system message (and
  by the template too where it reads them) and the reply is held by the grammar engine to one JSON object,
  `{"tool_calls": [{"name", "arguments"}]}` or `{"response": "text"}`; `required` and a named function allow only
  the first, with only the named function.
`tool_choice: "none"` describes no tool and holds nothing; the history still renders.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any

from specee.grammar import StructuredOutputConflict, structured_output_of
from specee.model import CHAT_ROLES, Model
from specee.server.request import ApiError
from specee.server.reasoning import (REASONING_FORMATS, ReasoningError, ReplyThoughts, ThoughtBudget, budget_of,
                                    format_of, thinks_open)
from specee.server.templates import ChatTemplate, TemplateError
from specee.server.tool_formats import PRESERVED, PYTHON_TAG, Call, call_grammar, parse_calls, tool_format_of

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
GENERIC_SYSTEM = (
    "You can call tools. Answer with one JSON object: {\"tool_calls\": [{\"name\": <a tool's name>, \"arguments\": "
    "{<its parameters>}}]} to call tools, or {\"response\": \"<your answer>\"} to answer the user directly.\n"
    "The tools:\n")


@dataclass
class Tools:
    """A request's tools, checked: each function's name, description and parameters' JSON Schema, the choice
    ("auto", "none", "required", or a function's name) and whether several calls may come in one reply."""

    functions: list[dict]
    choice: str
    parallel: bool
    format: str = "generic"  # the family's tool-call format (server/tool_formats.py)
    described: bool = False  # the template describes them itself (it reads `tools`)
    builtin: bool = False  # llama3: the template has Llama 3.1's built-in tools (<|python_tag|>)

    @property
    def native(self) -> bool:
        """The reply is read in a family's own format (not the generic JSON)."""
        return self.format != "generic"

    @property
    def offered(self) -> list[dict]:
        """The functions the model may call under the choice."""
        if self.choice in ("auto", "required"):
            return self.functions
        return [f for f in self.functions if f["name"] == self.choice]

    @property
    def openai(self) -> list[dict]:
        """The tools in OpenAI's shape, as templates that read `tools` expect them."""
        return [{"type": "function", "function": f} for f in self.functions]

    def call_schemas(self) -> list[dict]:
        """The schema of a call of each offered function: {"name", "arguments"}."""
        return [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments_schema(f)},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in self.offered]

    def schema(self) -> dict | None:
        """The generic format's JSON Schema the reply is held to, None where it is free (choice none, or a family's
        own format: `tool_grammar`)."""
        if self.choice == "none" or self.native:
            return None
        calls = self.call_schemas()
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                "additionalProperties": False}
        if self.choice != "auto":
            return call
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return {"anyOf": [call, answer]}

    def system_text(self) -> str:
        described = [{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in self.offered]
        return GENERIC_SYSTEM + "\n".join(json.dumps(d, ensure_ascii=False) for d in described)


def arguments_schema(f: dict) -> dict:
    """The schema a call's arguments are held to: the function's parameters, with no properties beyond those it
    names where it does not say (as OpenAI's strict function calling does: a small model otherwise writes on)."""
    params = f.get("parameters", NO_PARAMETERS)
    return params if "additionalProperties" in params else {**params, "additionalProperties": False}


def tools_of(body: dict, template: ChatTemplate) -> Tools | None:
    """The request's tools (400 on a malformed one), None when it gives none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' names a tool but the request gives no 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    functions: list[dict] = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"description\", \"parameters\"}}", param="tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ApiError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-', not "
                           f"{json.dumps(name)[:40]}", param="tools")
        if any(g["name"] == name for g in functions):
            raise ApiError(400, f"tools[{i}]: a second function named {name!r}", param="tools")
        if not isinstance(f.get("description", ""), str):
            raise ApiError(400, f"tools[{i}].function.description must be a string", param="tools")
        params = f.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema of an object "
                           "({\"type\": \"object\", \"properties\": ...})", param="tools")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    names = [f["name"] for f in functions]
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(400, "'tool_choice' must be auto, none, required or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice")
        if name not in names:
            raise ApiError(400, f"'tool_choice' names the function {name!r}, which is not among 'tools' "
                           f"({', '.join(names)})", param="tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ApiError(400, "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", param="tool_choice")
    fmt = tool_format_of(template.source)
    return Tools(functions, choice, parallel is not False, fmt, template.supports_tools,
                 fmt == "llama3" and PYTHON_TAG in (template.source or ""))


# ---- the messages -----------------------------------------------------------------------------------------


def text_of_content(content: Any, i: int, joiner: str = "\n") -> str:
    """A message's text: its content, or its text parts joined by a line (llama.cpp's rule; a continued final
    message's parts by a blank line)."""
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: the text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
        return joiner.join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}]: 'content' must be a string, a list of text parts, or null (an assistant's "
                       "message with 'tool_calls')", param="messages")
    return content


def calls_of(m: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls, checked: [{id, name, arguments (an object)}]."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls: each must be {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}", param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ApiError(400, f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not JSON",
                               param="messages") from None
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else "", "name": fn["name"], "arguments": args})
    return out


def chat_messages(body: dict, tools: Tools | None, template: ChatTemplate) -> list[dict]:
    """The request's messages checked (400) and made ready for the template: for a template that reads tools, in
    Hugging Face's shape (an assistant's `tool_calls` with arguments as objects, a tool's `tool_call_id` and `name`);
    for any other, the generic form (calls as the JSON the model writes, results as a user message)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    native = template.supports_tools
    # a chat without tool calls renders as the Python API renders it (Model.prompt_tokens): tool results in the
    # generic form only where the chat has calls or tools
    calling = tools is not None or any(isinstance(m, dict) and m.get("tool_calls") for m in messages)
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise ApiError(400, f"each message must be an object with a 'role' ({', '.join(CHAT_ROLES)}) and a "
                           "'content'", param="messages")
        role = m["role"]
        if m.get("content") is None and not (role == "assistant" and "content" in m or m.get("tool_calls")):
            raise ApiError(400, f"messages[{i}]: 'content' must be a string, a list of text parts, or null (an "
                           "assistant's message with 'tool_calls')", param="messages")
        content = text_of_content(m.get("content"), i)
        calls = calls_of(m, i) if role == "assistant" else []
        for c in calls:
            names[c["id"]] = c["name"]
        if role == "tool":
            call_id = m.get("tool_call_id")
            name = m.get("name") if isinstance(m.get("name"), str) else names.get(str(call_id), "")
            if native or not calling:
                out.append({"role": "tool", "content": content, "tool_call_id": call_id, "name": name})
            else:
                result = json.dumps({"tool_response": {"tool_call_id": call_id, "name": name, "content": content}},
                                    ensure_ascii=False)
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": "user", "content": result, "tool_results": True})
            continue
        # an assistant's reasoning, for Jinja templates that render it (Qwen3's <think>)
        reasoning = m.get("reasoning_content") if role == "assistant" and template.kind == "jinja" else None
        extra = {"reasoning_content": reasoning} if isinstance(reasoning, str) else {}
        if calls and native:
            out.append({"role": role, "content": content, **extra, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]})
            continue
        if calls:
            written = json.dumps({"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]},
                                 ensure_ascii=False)
            content = (content + "\n" if content else "") + written
        out.append({"role": role, "content": content, **extra})
    for m in out:
        m.pop("tool_results", None)
    if tools is not None and not tools.native and tools.choice != "none":  # llama.cpp's generic: a system message
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tools.system_text()}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out


# ---- the reply --------------------------------------------------------------------------------------------


def new_call(name: str, arguments: Any, fmt: str = "generic", given: str = "") -> dict:
    """One call in OpenAI's shape (arguments as JSON text), its id the model's own (`given`) where it wrote one, else
    a new one: 9 letters and digits for Mistral (its templates refuse others), else "call_" and 24 hex digits."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if given:
        call_id = given
    elif fmt.startswith("mistral"):
        call_id = "".join(random.choices(string.ascii_letters + string.digits, k=9))
    else:
        call_id = "call_" + uuid.uuid4().hex[:24]
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def whole_calls(text: str) -> list[Any]:
    """The calls written whole at the start of a generic reply cut short: `{"tool_calls":[{...},{...},{..` gives the
    first two."""
    head = re.match(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*', text)
    out: list[Any] = []
    if head is None:
        return out
    decoder, at = json.JSONDecoder(), head.end()
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return out
        out.append(value)
        sep = re.match(r"\s*,\s*", text[at:])
        if sep is None:
            return out
        at += sep.end()


RESPONSE_HEAD = re.compile(r'\s*\{\s*"response"\s*:\s*"')
UNFINISHED_ESCAPE = re.compile(r'(\\u[0-9a-fA-F]{0,3}|\\u[dD][89abAB][0-9a-fA-F]{2}(\\u?[0-9a-fA-F]{0,3})?)$')


def response_so_far(text: str) -> str | None:
    """The text of a generic `{"response": "..."}` reply as far as it is written (escapes decoded, an unfinished
    one held back), None when the reply is not one: what a stream sends while the reply is generated."""
    head = RESPONSE_HEAD.match(text)
    if head is None:
        return None
    body, i = text[head.end():], 0
    while i < len(body) and body[i] != '"':
        i += 2 if body[i] == "\\" else 1
    body = body[:min(i, len(body))]
    if (len(body) - len(body.rstrip("\\"))) % 2 == 1:  # a lone backslash: its escape is not written yet
        body = body[:-1]
    body = UNFINISHED_ESCAPE.sub("", body)
    try:
        return json.loads('"' + body + '"')
    except ValueError:
        return None


def reply_of(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """A reply's text content (None when it only calls tools) and its calls in OpenAI's shape: read in the family's
    format, or the generic JSON (a call of a function not offered is dropped)."""
    if tools.native:
        content, written = parse_calls(tools.format, text, builtin=tools.builtin)
        found = openai_calls(written, tools)
        return (content or None, found) if found else (text, [])
    known = {f["name"] for f in tools.functions}

    def call_in(obj: Any) -> dict | None:
        if isinstance(obj, dict) and obj.get("name") in known:
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, (dict, str)):
                return new_call(obj["name"], args)
        return None

    try:
        whole = json.loads(text)
    except ValueError:  # cut short (max_tokens): the calls written whole, or the answer as far as it goes
        so_far = response_so_far(text)
        if so_far is not None:
            return so_far, []
        whole = {"tool_calls": whole_calls(text)}
    if isinstance(whole, dict) and isinstance(whole.get("tool_calls"), list):
        calls = [c for c in (call_in(x) for x in whole["tool_calls"]) if c is not None]
        if calls:
            return None, calls
    if isinstance(whole, dict) and isinstance(whole.get("response"), str):
        return whole["response"], []
    return text, []


def openai_calls(calls: list[Call], tools: Tools) -> list[dict]:
    """A family's calls in OpenAI's shape, those of functions the request offers."""
    known = {f["name"] for f in tools.functions}
    return [new_call(c.name, c.arguments, tools.format, c.id) for c in calls if c.name in known]


def reply_so_far(text: str, tools: Tools) -> tuple[str, list[dict]]:
    """What a stream can send of a reply still generated: its content so far (never part of a call's marker) and,
    in a family's format, the calls written whole so far (Hermes' closed blocks); a generic answer's text as far as
    it is written."""
    if not tools.native:
        return response_so_far(text) or "", []
    content, calls = parse_calls(tools.format, text, partial=True, builtin=tools.builtin)
    return content, openai_calls(calls, tools)


def tool_grammar(tools: Tools, model: Model) -> dict[str, Any]:
    """The generation's fields that hold the reply to the tools (none where it is free): the generic JSON Schema, or
    under `required` and a named function the family's own call format (a JSON Schema for Llama 3's one object, a
    Lark grammar with the markers for Hermes and Mistral)."""
    if tools.choice == "none" or tools.native and tools.choice == "auto":
        return {}
    if not tools.native:
        return {"json_schema": tools.schema()}
    markers = {}
    for marker in PRESERVED[tools.format]:
        ids = model.tokenize(marker, add_special=False, parse_special=True)
        if len(ids) == 1 and model.token_to_piece(ids[0], False) == b"":  # a control token: by its id
            markers[marker] = ids[0]
    kind, grammar = call_grammar(tools.format, tools.call_schemas(), tools.parallel, markers)
    return {"json_schema": grammar} if kind == "json_schema" else {"grammar": grammar, "grammar_type": "lark"}


# ---- the prompt -------------------------------------------------------------------------------------------


@dataclass
class ChatPrompt:
    """A chat request made ready to generate: the rendered text, its tokens, the tools (None: none) and the fields
    the generation gets beside the request's own (the schema a tool call is held to)."""

    text: str
    tokens: list[int]
    tools: Tools | None
    extra: dict[str, Any]
    thoughts: ReplyThoughts | None = None  # how the reply's thoughts are split out of it (None: they are not)
    budget: ThoughtBudget | None = None  # where its thoughts are cut (reasoning budget N > 0; None: never)


def template_kwargs(body: dict) -> dict[str, Any]:
    """The variables a request gives the template beyond the messages: its `chat_template_kwargs`, with
    `reasoning_effort` ("none": no thinking, else the template's `reasoning_effort`) and a thinking budget of 0
    (`reasoning_budget_tokens`, `thinking_budget_tokens`: no thinking) over them (400 on a bad one)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    kwargs = dict(kwargs or {})
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise ApiError(400, "'chat_template_kwargs': enable_thinking must be true or false",
                       param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise ApiError(400, "'reasoning_effort' must be a string (none, low, medium, high, ...)",
                       param="reasoning_effort")
    if effort == "none":
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif effort:
        kwargs["reasoning_effort"] = effort
    if budget_asked(body) == 0:
        kwargs["enable_thinking"] = False
    return kwargs


def budget_asked(body: dict) -> int:
    """A request's thinking budget, llama.cpp's fields: `reasoning_budget_tokens`, else `thinking_budget_tokens`
    (-1: the server's; 400 on a bad one)."""
    for key in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        if body.get(key) is not None:
            try:
                return budget_of(body[key], f"'{key}'")
            except ReasoningError as e:
                raise ApiError(400, str(e), param=key) from None
    return -1


def budget_for(model: Model, template: ChatTemplate, body: dict, tokens: list[int], held: bool
               ) -> ThoughtBudget | None:
    """The reply's thinking budget of N > 0 tokens (the request's, else --reasoning-budget), None where there is
    none: unlimited, no thinking markers, or a reply held to a grammar; it has counted the prompt's `tokens`. The
    forced text is the request's `reasoning_budget_message` (else --reasoning-budget-message), the closing tag and
    the template's text after it."""
    n = budget_asked(body)
    n = template.reasoning.budget if n == -1 else n
    if n <= 0 or template.thinking is None or held:
        return None
    message = body.get("reasoning_budget_message")
    if message is not None and not isinstance(message, str):
        raise ApiError(400, "'reasoning_budget_message' must be a string", param="reasoning_budget_message")
    message = template.reasoning.budget_message if message is None else message
    forced = model.tokenize(message + template.thinking[1] + template.after_thinking, add_special=False,
                            parse_special=True)
    budget = ThoughtBudget(n, template.thinking, forced)
    budget.prefill([model.token_to_piece(t, True) for t in tokens])
    return budget


def continued(template: ChatTemplate, messages: list[dict], described: list[dict] | None, kwargs: dict[str, Any],
              content: str) -> str:
    """A chat whose final assistant message is continued, as llama.cpp renders it: the messages before it, the
    generation prompt, then (for a template that thinks) its thoughts in their tags, closed where it has content,
    and its content."""
    head = template.render(messages[:-1], described, add_generation_prompt=False, kwargs=kwargs)
    text = template.render(messages[:-1], described, add_generation_prompt=True, kwargs=kwargs)
    same = 0
    while same < min(len(head), len(text)) and head[same] == text[same]:
        same += 1
    prompt, generation = text[:same], text[same:]
    if template.thinking is not None:
        start, end = template.thinking
        thoughts = messages[-1].get("reasoning_content") or ""
        at = generation.find(start)
        closed = bool(content) or not thoughts  # a message of thoughts only continues them
        generation = (generation if at < 0 else generation[:at]) + start + thoughts + (end if closed else "")
    return prompt + generation + content


def chat_prompt(model: Model, template: ChatTemplate, body: dict, tokenize: bool = True) -> ChatPrompt:
    """A chat request's prompt through the server's template (400 on bad messages or tools, or a template that
    refuses them)."""
    tools = tools_of(body, template)
    messages = chat_messages(body, tools, template)
    kwargs = template_kwargs(body)
    described = tools.openai if tools is not None and tools.described and tools.choice != "none" else None
    add = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message")
    if not isinstance(add, bool) or cont is not None and not isinstance(cont, bool):
        raise ApiError(400, "'add_generation_prompt' and 'continue_final_message' must be true or false")
    if add and cont and "add_generation_prompt" in body:
        raise ApiError(400, "'continue_final_message' continues the last message: not with 'add_generation_prompt'",
                       param="continue_final_message")
    last = messages[-1]
    # llama.cpp's prefill: a chat ending with an assistant's message (no tool calls) is continued, not answered
    if cont is None:
        cont = template.prefill and last["role"] == "assistant" and not last.get("tool_calls") and bool(
            last["content"] or last.get("reasoning_content"))
    try:
        if cont and last.get("tool_calls"):
            raise ApiError(400, "'continue_final_message': an assistant's message with tool calls cannot be continued",
                           param="continue_final_message")
        if cont and last["role"] == "assistant":
            content = text_of_content(body["messages"][-1].get("content"), len(messages) - 1, "\n\n")
            text = continued(template, messages, described, kwargs, content)
        elif cont:  # another role's message (transformers'): the chat rendered whole, cut after that message's text
            text = template.render(messages, described, add_generation_prompt=False, kwargs=kwargs)
            end = text.rfind(last["content"])
            if end >= 0:
                text = text[:end + len(last["content"])]
        else:
            text = template.render(messages, described, add_generation_prompt=add, kwargs=kwargs)
    except TemplateError as e:
        raise ApiError(400, str(e), param="messages") from None
    extra: dict[str, Any] = tool_grammar(tools, model) if tools is not None else {}
    if tools is not None and extra:
        fmt = body.get("response_format")
        try:
            structured_output_of({"tools": tools, "response_format": None if isinstance(fmt, dict) and
                                  fmt.get("type") == "text" else fmt, "grammar": body.get("grammar"),
                                  "json_schema": body.get("json_schema")})
        except StructuredOutputConflict as e:
            raise ApiError(400, f"'tools' (under tool_choice {tools.choice}) hold the reply to a tool call's JSON: "
                           f"not with {e.names[1]} too", param=e.names[1]) from None
    if tools is not None and tools.native and tools.choice != "none":  # the markers' text stays in the reply
        extra["preserved_tokens"] = list(PRESERVED[tools.format])
    fmt = body.get("response_format")
    is_held = (bool(extra.get("json_schema") or extra.get("grammar")) or body.get("grammar") is not None
            or body.get("json_schema") is not None or isinstance(fmt, dict) and fmt.get("type") not in (None, "text"))
    tokens = template.tokens(model, text) if tokenize else []
    return ChatPrompt(text, tokens, tools, extra, thoughts_of(template, body, text, is_held),
                      budget_for(model, template, body, tokens, is_held) if tokenize else None)


def thoughts_of(template: ChatTemplate, body: dict, text: str, held: bool) -> ReplyThoughts | None:
    """How a reply's thoughts are split out (server/reasoning.py), None where they are not: a template without
    thinking markers, the format none, or a reply held to a grammar (`held`: it starts with its JSON)."""
    try:
        name = format_of(body["reasoning_format"], "'reasoning_format'") if body.get("reasoning_format") is not None \
            else template.reasoning.format
    except ReasoningError as e:
        raise ApiError(400, str(e), param="reasoning_format") from None
    if template.thinking is None or not REASONING_FORMATS[name].split or held:
        return None
    return ReplyThoughts(template.thinking, thinks_open(text, template.thinking), REASONING_FORMATS[name].in_content)
