"""Tool calls in each model family's own format: which one a chat template speaks, a reply read back in it (whole,
or as far as a stream has it), and the grammar that holds a reply to one call or more in it.

The format is chosen from the template's source as llama.cpp's common/chat.cpp chooses it, by the first of these
markers the template holds (a template that does not read `tools` speaks `generic`):
- `hermes`, `<tool_call>` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name", "arguments"}</tool_call>` blocks,
  content before and between them;
- `llama3`, `<|start_header_id|>ipython<|end_header_id|>` (Llama 3.1 to 3.3): the reply is one JSON object
  `{"name", "parameters"}` (or several joined by `;`); where the template also holds `<|python_tag|>` (3.1's
  built-in tools), `<|python_tag|>name.call(key=value, ...)` calls a built-in tool, and other text after the tag is
  code for the `python` tool;
- `mistral`, `[TOOL_CALLS]` (Mistral Nemo, Small 3.1): content, then `[TOOL_CALLS]` and a JSON array of
  `{"name", "arguments"}`; its templates want call ids of 9 letters and digits;
- `mistral-args`, `[TOOL_CALLS]` with `[ARGS]` in the template (Devstral, Ministral 3, Magistral, Small 3.2): content,
  then each call as `[TOOL_CALLS]name[ARGS]{...}` (Small 3.2: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`, ids of 9 letters
  and digits);
- `generic`: every other template, the built-in ones included: one JSON object `{"tool_calls": [...]}` or
  `{"response": "..."}` held by the grammar (server/tools.py).
The markers are special tokens in these families' vocabularies: the reply keeps their text (llama.cpp's
`preserved_tokens`), so that they can be read back.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

FORMAT_MARKERS = (  # llama.cpp's order of detection
    ("hermes", "<tool_call>"),
    ("llama3", "<|start_header_id|>ipython<|end_header_id|>"),
    ("mistral", "[TOOL_CALLS]"),
)
TOOL_FORMATS = ("hermes", "llama3", "mistral", "mistral-args", "generic")
PYTHON_TAG = "<|python_tag|>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# the special tokens whose text a reply keeps, per format
PRESERVED = {"hermes": (HERMES_OPEN, HERMES_CLOSE), "llama3": (PYTHON_TAG,), "mistral": (MISTRAL_MARKER,),
             "mistral-args": (MISTRAL_MARKER, MISTRAL_CALL_ID, MISTRAL_ARGS), "generic": ()}
MISTRAL_ARGS_HEAD = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]")
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
LLAMA3_CALL = re.compile(r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:')
BUILTIN_CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\.call\((.*)\)\s*$", re.DOTALL)


@dataclass
class Call:
    """One call as the model wrote it: the function's name, its arguments (an object, or JSON text) and the id the
    model gave it (Mistral's; "" where none)."""

    name: str
    arguments: Any
    id: str = ""


def tool_format_of(source: str | None) -> str:
    """The tool-call format of a chat template's source (None: a built-in template): llama.cpp's choice."""
    if source is None or "tools" not in source:
        return "generic"
    for name, marker in FORMAT_MARKERS:
        if marker in source:
            return "mistral-args" if name == "mistral" and MISTRAL_ARGS in source else name
    return "generic"


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Where `text` may end with the start of a marker: its length where it cannot."""
    for at in range(max(0, len(text) - max(len(m) for m in markers)), len(text)):
        if any(m.startswith(text[at:]) for m in markers):
            return at
    return len(text)


def as_call(obj: Any, arguments_key: str = "arguments") -> Call | None:
    """A {"name", arguments_key} object as a Call (`arguments` or `parameters` either way), None when it is not."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("parameters" if arguments_key == "arguments" else "arguments", {}))
    if not isinstance(args, (dict, str)):
        return None
    return Call(obj["name"], args, obj["id"] if isinstance(obj.get("id"), str) else "")


def json_values(text: str, at: int, separator: str) -> tuple[list[Any], int]:
    """The JSON values written whole from `at` on, joined by `separator` (and spaces), and where they end."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            return out, at
        out.append(value)
        at = end
        sep = re.match(r"\s*" + re.escape(separator), text[at:])
        if sep is None:
            return out, at
        at += sep.end()


# ---- the families -----------------------------------------------------------------------------------------


def parse_hermes(text: str, partial: bool) -> tuple[str, list[Call]]:
    """Content outside `<tool_call>` blocks and the blocks' calls; a bare `{"name", "arguments"}` reply is a call
    too. Partial: the content before the first block (not a marker's start) and the blocks closed so far."""
    if partial:
        start = text.find(HERMES_OPEN)
        content = text[:held_back(text, (HERMES_OPEN,))] if start < 0 else text[:start]
    else:
        content = HERMES_BLOCK.sub("", text)
    calls = []
    for block in HERMES_BLOCK.findall(text):
        try:
            c = as_call(json.loads(block))
        except ValueError:
            c = None
        if c is not None:
            calls.append(c)
    if not calls and not partial and text.lstrip().startswith("{"):
        try:
            c = as_call(json.loads(text))
        except ValueError:
            c = None
        if c is not None:
            return "", [c]
    return content, calls


def python_call(text: str) -> Call:
    """What follows Llama 3.1's `<|python_tag|>`: `name.call(key=value, ...)` (a built-in tool; values as Python
    literals), a JSON call, or code for the `python` tool."""
    m = BUILTIN_CALL.match(text)
    if m is not None:
        try:
            node = ast.parse(f"f({m.group(2)})", mode="eval").body
            if isinstance(node, ast.Call) and not node.args and all(k.arg for k in node.keywords):
                return Call(m.group(1), {k.arg: ast.literal_eval(k.value) for k in node.keywords})
        except (SyntaxError, ValueError):
            pass
    if LLAMA3_CALL.match(text):
        values, _ = json_values(text, text.index("{"), ";")
        c = as_call(values[0], "parameters") if values else None
        if c is not None:
            return c
    return Call("python", {"code": text.strip()})


def parse_llama3(text: str, partial: bool, builtin: bool) -> tuple[str, list[Call]]:
    """A reply that is one JSON call `{"name", "parameters"}` (or several joined by `;`), a `<|python_tag|>` call
    (`builtin`: the template has built-in tools), or content. Partial: content unless it may become a call; calls
    only once the reply is whole."""
    body = text.lstrip()
    if builtin and body.startswith(PYTHON_TAG):
        return ("", []) if partial else ("", [python_call(body[len(PYTHON_TAG):])])
    maybe_call = body.startswith("{") or builtin and PYTHON_TAG.startswith(body)
    if partial:
        return ("" if maybe_call else text), []
    if LLAMA3_CALL.match(text):
        values, end = json_values(text, text.index("{"), ";")
        calls = [c for c in (as_call(v, "parameters") for v in values) if c is not None]
        if calls:
            return text[end:].strip(), calls
    return text, []


def parse_mistral(text: str, partial: bool) -> tuple[str, list[Call]]:
    """Content before `[TOOL_CALLS]`, then a JSON array of calls (or one call). Partial: the content before the
    marker (not its start); calls only once the reply is whole."""
    at = text.find(MISTRAL_MARKER)
    if at < 0:
        return (text[:held_back(text, (MISTRAL_MARKER,))] if partial else text), []
    if partial:
        return text[:at], []
    values, end = json_values(text, at + len(MISTRAL_MARKER), ",")
    if values and isinstance(values[0], list):
        values = values[0]
    calls = [c for c in (as_call(v) for v in values) if c is not None]
    return (text[:at] + text[end:]).strip() if calls else text, calls


def parse_mistral_args(text: str, partial: bool) -> tuple[str, list[Call]]:
    """Content before the first `[TOOL_CALLS]`, then `[TOOL_CALLS]name([CALL_ID]id)?[ARGS]` and the arguments' JSON
    (an object, or an object as JSON text), call after call. Partial: the content before the marker (not its start)
    and the calls whose arguments are written whole."""
    at = text.find(MISTRAL_MARKER)
    if at < 0:
        return (text[:held_back(text, (MISTRAL_MARKER,))] if partial else text), []
    calls: list[Call] = []
    decoder, pos = json.JSONDecoder(), at
    while True:
        head = MISTRAL_ARGS_HEAD.match(text, pos)
        if head is None:
            break
        start = head.end()
        while start < len(text) and text[start].isspace():
            start += 1
        try:
            args, pos = decoder.raw_decode(text, start)
        except ValueError:
            break
        if isinstance(args, str):  # arguments written as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                break
        if not isinstance(args, dict):
            break
        calls.append(Call(head.group(1), args, head.group(2) or ""))
        while pos < len(text) and text[pos].isspace():
            pos += 1
    if partial:
        return text[:at], calls
    return ((text[:at] + text[pos:]).strip() if calls else text), calls


def parse_calls(fmt: str, text: str, partial: bool = False, builtin: bool = False) -> tuple[str, list[Call]]:
    """A reply in a family's format (not `generic`): its content and calls. `partial`: the text so far of a reply
    still generated: the content that can be sent (never the start of a marker) and the calls written whole."""
    if fmt == "hermes":
        content, calls = parse_hermes(text, partial)
    elif fmt == "llama3":
        content, calls = parse_llama3(text, partial, builtin)
    elif fmt == "mistral":
        content, calls = parse_mistral(text, partial)
    elif fmt == "mistral-args":
        content, calls = parse_mistral_args(text, partial)
    else:
        raise ValueError(f"tool-call format {fmt!r} is read by server/tools.py")
    return content.strip(), calls


# ---- the grammar under tool_choice required or a named function ------------------------------------------


def marker_rule(marker: str, token: int | None) -> str:
    """A marker in a Lark grammar: its special token by id where it is one (llguidance's `<[id]>`), else its text."""
    return f"<[{token}]>" if token is not None else json.dumps(marker)


def call_grammar(fmt: str, calls: list[dict], parallel: bool, tokens: dict[str, int]) -> tuple[str, Any]:
    """The grammar that holds a reply to calls in the family's own format, the call objects' schemas `calls`
    ({"name", "arguments"} each): ("json_schema", schema) or ("lark", text). `tokens`: the markers that are special
    tokens of the vocabulary, by id."""
    if fmt == "llama3":  # one call, its arguments under "parameters"
        objects = [{"type": "object", "properties": {"name": c["properties"]["name"],
                                                     "parameters": c["properties"]["arguments"]},
                    "required": ["name", "parameters"], "additionalProperties": False} for c in calls]
        return "json_schema", objects[0] if len(objects) == 1 else {"anyOf": objects}
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "hermes":
        call = (f"call: {marker_rule(HERMES_OPEN, tokens.get(HERMES_OPEN))} \"\\n\" %json {json.dumps(one)} "
                f"\"\\n\" {marker_rule(HERMES_CLOSE, tokens.get(HERMES_CLOSE))}")
        return "lark", ("start: call (\"\\n\" call)*\n" if parallel else "start: call\n") + call + "\n"
    if fmt == "mistral":
        array: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return "lark", f"start: {marker_rule(MISTRAL_MARKER, tokens.get(MISTRAL_MARKER))} %json {json.dumps(array)}\n"
    if fmt == "mistral-args":  # each call: the marker, its name, an optional 9-character id, [ARGS], its arguments
        marker, args = marker_rule(MISTRAL_MARKER, tokens.get(MISTRAL_MARKER)), marker_rule(MISTRAL_ARGS, tokens.get(
            MISTRAL_ARGS))
        call_id = marker_rule(MISTRAL_CALL_ID, tokens.get(MISTRAL_CALL_ID))
        alternatives = " | ".join(f"{json.dumps(c['properties']['name']['const'])} ({call_id} /[A-Za-z0-9]{{9}}/)? "
                                  f"{args} %json {json.dumps(c['properties']['arguments'])}" for c in calls)
        return "lark", ("start: call+\n" if parallel else "start: call\n") + f"call: {marker} ({alternatives})\n"
    raise ValueError(f"tool-call format {fmt!r} has no grammar of its own")
