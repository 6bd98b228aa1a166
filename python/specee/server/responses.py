"""OpenAI's Responses API on the same engine: POST /v1/responses (and /responses), one JSON response or its stream of
events (response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta, response.output_text.done, response.content_part.done, response.output_item.done,
response.completed). A request is read into the chat request it means (`chat_body`: `input` as a string or a list of
messages and function-call items, `instructions` as the system message, function tools, `text.format` as
response_format, `max_output_tokens`) and goes through chat's template, tools and generation; the reply is written
back as output items: a message with its output_text, and a function_call item per tool call. Nothing is stored:
`previous_response_id` and `store: true` are refused. llama.cpp's extra fields (return_progress, timings_per_token,
n_probs, ...) pass through as in chat."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specee.server.engine import ServerState
from specee.server.generation import Result, respond, timings
from specee.server.request import ApiError, json_object, off_loop, shown
from specee.server.tools import chat_prompt, reply_of

# the Responses API's fields read here, not passed on to chat as they are
OWN_FIELDS = ("input", "instructions", "tools", "tool_choice", "text", "store", "previous_response_id", "model",
              "metadata", "reasoning", "truncation", "user", "include", "parallel_tool_calls")
TEXT_PARTS = ("input_text", "output_text", "text")


def content_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text), as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of input_text parts (text only here)",
                   param="input")


def chat_messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages: function_call items become an assistant's tool_calls,
    function_call_output items tool messages."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "'input' must be a string or a non-empty list of messages", param="input")
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        where = f"input[{i}]"
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": content_text(item.get("content"), where)})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": content_text(item.get("output", ""), where)})
        else:
            raise ApiError(400, f"{where}: an item of type {shown(kind)} is not supported here (messages with "
                           "role system, developer, user or assistant; function_call; function_call_output)",
                           param="input")
    return messages


def response_format_of(text: Any) -> dict | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                   "\"json_schema\", \"schema\": ...}", param="text")


def chat_body(body: dict) -> dict:
    """The chat request a Responses request means (400 on a malformed field)."""
    if body.get("previous_response_id") is not None or body.get("store") is True:
        raise ApiError(400, "responses are not stored here: give the whole conversation in 'input' (no "
                       "'previous_response_id', no 'store': true)", param="previous_response_id")
    chat = {k: v for k, v in body.items() if k not in OWN_FIELDS}
    chat["messages"] = chat_messages(body)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"name\", \"description\", "
                           "\"parameters\"} (function tools only here)", param="tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}}
                               if isinstance(choice, dict) else choice)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    fmt = response_format_of(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


async def responses_input_tokens(request: Request) -> Response:
    """llama.cpp's /v1/responses/input_tokens: how many tokens a Responses request's input is through the template."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    prompt = await off_loop(request, chat_prompt, state.model, state.template, chat_body(body))
    return JSONResponse({"input_tokens": len(prompt.tokens)})


async def responses(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_object(request)
    chat = chat_body(body)
    prompt = await off_loop(request, chat_prompt, state.model, state.template, chat)
    tools = prompt.tools if prompt.tools is not None and prompt.tools.choice != "none" else None
    stream = bool(chat.get("stream"))
    rid, mid, created = "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24], int(time.time())
    seq = [0]  # the stream's sequence_number

    def event(kind: str, **fields: Any) -> dict:
        seq[0] += 1
        return {"type": kind, "sequence_number": seq[0] - 1, **fields}

    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": mid, "status": status, "role": "assistant",
                "content": [part(text)] if status == "completed" else []}

    def output_of(res: Result) -> list[dict]:
        content, calls = (res.text, []) if tools is None else reply_of(res.text, tools)
        out = [message(content or "")] if content or not calls else []
        for c in calls:
            out.append({"type": "function_call", "id": "fc_" + c["id"][5:], "call_id": c["id"], "status": "completed",
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        return out

    def response(res: Result, status: str, output: list[dict]) -> dict:
        out: dict[str, Any] = {"id": rid, "object": "response", "created_at": created, "status": status,
                               "model": state.alias, "output": output}
        if status == "completed":
            out["completed_at"] = int(time.time())
            out["usage"] = {"input_tokens": res.n_prompt, "output_tokens": res.n_generated,
                            "total_tokens": res.n_prompt + res.n_generated,
                            "input_tokens_details": {"cached_tokens": int(res.stats.get("n_reused", 0))}}
            if res.finish == "length":
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return out

    def item_events(i: int, item: dict) -> list[dict]:
        """A whole output item's events (a message's text in one delta)."""
        if item["type"] != "message":
            return [event("response.output_item.added", output_index=i, item=item),
                    event("response.output_item.done", output_index=i, item=item)]
        text = item["content"][0]["text"]
        return [event("response.output_item.added", output_index=i, item=message("", "in_progress")),
                event("response.content_part.added", item_id=mid, output_index=i, content_index=0, part=part("")),
                event("response.output_text.delta", item_id=mid, output_index=i, content_index=0, delta=text),
                *text_done(i, text, item)]

    def text_done(i: int, text: str, item: dict) -> list[dict]:
        return [event("response.output_text.done", item_id=mid, output_index=i, content_index=0, text=text),
                event("response.content_part.done", item_id=mid, output_index=i, content_index=0, part=part(text)),
                event("response.output_item.done", output_index=i, item=item)]

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False) -> dict | list[dict] | None:
        if final and not stream:
            return response(res, "completed", output_of(res))
        if first:
            out = [event("response.created", response=response(res, "in_progress", [])),
                   event("response.in_progress", response=response(res, "in_progress", []))]
            if tools is None:
                out += [event("response.output_item.added", output_index=0, item=message("", "in_progress")),
                        event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                              part=part(""))]
            return out
        if not final:
            if piece == "":  # the prompt's progress (return_progress)
                return event("response.in_progress", response=response(res, "in_progress", []))
            if tools is not None:  # a reply with tools is read once whole
                return None
            return event("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=piece)
        output = output_of(res)
        if tools is None:
            out = text_done(0, res.text, output[0])
        else:
            out = [e for i, item in enumerate(output) for e in item_events(i, item)]
        done = event("response.completed", response=response(res, "completed", output))
        return out + [{**done, "timings": timings(res)}]

    return await respond(state, request, prompt.tokens, {**chat, **prompt.extra}, shape, "responses", prompt.budget)
