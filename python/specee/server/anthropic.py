"""Anthropic's Messages API on the same engine: POST /v1/messages (one JSON message, or its stream of named events:
message_start, content_block_start, content_block_delta, content_block_stop, message_delta, message_stop) and POST
/v1/messages/count_tokens. A request is read into the chat request it means (`chat_body`: system as a string or
text blocks, text / tool_use / tool_result blocks, an assistant's thinking blocks as its `reasoning_content`, tools
with input_schema, tool_choice auto / any / tool / none, stop_sequences, `thinking`'s budget_tokens as the chat's
thinking budget) and goes through chat's template, tools and generation; the reply is written back in Anthropic's
shape: its thoughts (server/reasoning.py) a `thinking` block first (streamed as thinking deltas, closed by an empty
signature_delta), then text and tool_use blocks. Errors keep the server's one error shape (request.py's
ApiError)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specee.server.engine import ServerState
from specee.server.generation import Result, respond
from specee.server.request import ApiError, json_object, off_loop
from specee.server.templates import TemplateError
from specee.server.tools import ChatPrompt, chat_prompt, reply_of

STOP_REASON = {"stop": "end_turn", "length": "max_tokens"}


def no_image(block: dict, where: str) -> ApiError:
    """An image block: well formed ({"source": {"type": "base64", "data"} or {"type": "url", "url"}}), llama-server's
    answer for a model without a multimodal projector (a 500 there, kept so that its clients see the same); else a
    400."""
    source = block.get("source")
    good = isinstance(source, dict) and (source.get("type") == "base64" and isinstance(source.get("data"), str) or
                                         source.get("type") == "url" and isinstance(source.get("url"), str))
    return ApiError(500 if good else 400, f"{where}: image input is not supported: this server runs text-only models "
                    "(no multimodal projector)", "server_error" if good else "invalid_request_error", param="messages")


def text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as text (400 on any other block; an image block: `no_image`)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks", param=where)
    out = []
    for b in value:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "image":
                raise no_image(b, where)
            raise ApiError(400, f"{where}: {kind or 'a'} block where a text block was expected", param=where)
        out.append(b["text"])
    return "\n".join(out)


def chat_messages(messages: Any) -> list[dict]:
    """Anthropic's messages as chat's: an assistant's tool_use blocks become its tool_calls, a user's tool_result
    blocks become tool messages."""
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list of {role, content}", param="messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' (user or assistant) and a 'content'",
                           param="messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of content blocks",
                           param="messages")
        texts, calls, thinking = [], [], []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "thinking" and m["role"] == "assistant" and isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])  # the template's reasoning_content
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str):
                calls.append({"id": str(b.get("id", "")), "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content", "")
                text = text_blocks(result, f"messages[{i}].content tool_result")
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": ("Error: " if b.get("is_error") else "") + text})
            elif kind == "image":
                raise no_image(b, f"messages[{i}]")
            else:
                raise ApiError(400, f"messages[{i}]: a content block of type {json.dumps(kind)[:40]} is not "
                               "supported here (text, tool_use in assistant messages, tool_result in user ones)",
                               param="messages")
        if texts or calls or thinking:
            msg: dict[str, Any] = {"role": m["role"], "content": "\n".join(texts) if texts else None}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
    return out


def chat_body(body: dict) -> dict:
    """The chat request an Anthropic request means (400 on a malformed field)."""
    messages = chat_messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": text_blocks(system, "system")})
    chat: dict[str, Any] = {"messages": messages}
    for key in ("temperature", "top_p", "top_k", "stream", "max_tokens", "seed", "mode"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    thinking = body.get("thinking")
    if thinking is not None:  # extended thinking: its budget is the chat's (llama.cpp's default 10000 tokens)
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise ApiError(400, "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                           "{\"type\": \"disabled\"}", param="thinking")
        if thinking["type"] == "enabled":
            chat["thinking_budget_tokens"] = thinking.get("budget_tokens", 10000)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError(400, "'tools' must be a list of {name, description, input_schema}", param="tools")
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.get("name")), ("description", t.get("description")), ("parameters", t.get("input_schema")))
            if v is not None}} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            chat["tool_choice"] = "required" if kind == "any" else kind
        else:
            raise ApiError(400, "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                           "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}", param="tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat


def usage_of(res: Result) -> dict:
    return {"input_tokens": res.n_prompt, "output_tokens": res.n_generated, "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0}


def prompt_of(state: ServerState, chat: dict) -> ChatPrompt:
    """The chat's prompt; no messages at all (llama-server takes them): the template's generation prompt alone."""
    assert state.template is not None  # made at the start
    if chat["messages"]:
        return chat_prompt(state.model, state.template, chat)
    try:
        text = state.template.render([], None, add_generation_prompt=True)
    except TemplateError as e:
        raise ApiError(400, f"'messages': the chat template needs a message: {e}", param="messages") from None
    return ChatPrompt(text, state.template.tokens(state.model, text), None, {})


async def messages(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_object(request)
    if body.get("max_tokens") is None:  # Anthropic's API requires it (count_tokens does not)
        raise ApiError(400, "max_tokens: Field required", param="max_tokens")
    chat = chat_body(body)
    prompt = await off_loop(request, prompt_of, state, chat)
    tools = prompt.tools if prompt.tools is not None and prompt.tools.choice != "none" else None
    stream = bool(chat.get("stream"))
    mid = "msg_" + uuid.uuid4().hex[:24]

    # a stream's thoughts as they come (deepseek-legacy leaves them in the text, as llama.cpp does)
    thinking = prompt.thoughts.stream() if stream and prompt.thoughts and not prompt.thoughts.in_content else None
    opened: list[Any] = [-1, ""]  # a stream's open block: its index and type

    def blocks_of(res: Result) -> tuple[list[dict], str]:
        thoughts, text = prompt.thoughts.split(res.text) if prompt.thoughts else (None, res.text)
        content, calls = (text, []) if tools is None else reply_of(text, tools)
        blocks: list[dict] = [{"type": "thinking", "thinking": thoughts, "signature": ""}] if thoughts else []
        if content or not calls:
            blocks.append({"type": "text", "text": content})
        for c in calls:
            blocks.append({"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["function"]["name"],
                           "input": json.loads(c["function"]["arguments"])})
        reason = "tool_use" if calls and res.finish == "stop" else STOP_REASON.get(res.finish or "", "end_turn")
        return blocks, reason

    def message(res: Result, blocks: list[dict], reason: str | None) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": state.alias, "content": blocks,
                "stop_reason": reason, "stop_sequence": None, "usage": usage_of(res)}

    def close() -> list[dict]:
        """The stream's open block closed (a thinking block with its signature, empty here: no cryptographic
        signature for a local model, as llama.cpp does)."""
        if opened[0] < 0 or not opened[1]:
            return []
        out = [{"type": "content_block_delta", "index": opened[0],
                "delta": {"type": "signature_delta", "signature": ""}}] if opened[1] == "thinking" else []
        opened[1] = ""
        return out + [{"type": "content_block_stop", "index": opened[0]}]

    def block(kind: str, text: str) -> list[dict]:
        """A stream's text for a block of `kind` (thinking, text): the open one, or a new one after it."""
        out = []
        if opened[1] != kind:
            out = close()
            opened[0], opened[1] = opened[0] + 1, kind
            out.append({"type": "content_block_start", "index": opened[0], "content_block": {"type": kind, kind: ""}})
        if text:
            out.append({"type": "content_block_delta", "index": opened[0],
                        "delta": {"type": f"{kind}_delta", kind: text}})
        return out

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False) -> dict | list[dict] | None:
        if final and not stream:
            return message(res, *blocks_of(res))
        if first:  # the text block at once, unless the reply may open with thoughts
            return [{"type": "message_start", "message": message(res, [], None)},
                    *(block("text", "") if tools is None and thinking is None else [])]
        if tools is None:  # thoughts, then text, as they come
            thoughts, text = thinking.push(res.text, final) if thinking is not None else ("", piece or "")
            out = (block("thinking", thoughts) if thoughts else []) + (block("text", text) if text else [])
            if not final:
                return out or None
        elif not final:  # tool calls: the blocks once the reply is whole
            return None

        def end(reason: str) -> dict:
            return {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
                    "usage": {"output_tokens": res.n_generated}}

        if tools is None:
            if opened[0] < 0:  # nothing at all: one empty text block
                out += block("text", "")
            return out + close() + [end(STOP_REASON.get(res.finish or "", "end_turn")), {"type": "message_stop"}]
        blocks, reason = blocks_of(res)
        out = []
        for i, b in enumerate(blocks):
            if b["type"] == "thinking":
                out.append({"type": "content_block_start", "index": i,
                            "content_block": {"type": "thinking", "thinking": ""}})
                out.append({"type": "content_block_delta", "index": i,
                            "delta": {"type": "thinking_delta", "thinking": b["thinking"]}})
                out.append({"type": "content_block_delta", "index": i,
                            "delta": {"type": "signature_delta", "signature": ""}})
            elif b["type"] == "text":
                out.append({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})
                out.append({"type": "content_block_delta", "index": i,
                            "delta": {"type": "text_delta", "text": b["text"]}})
            else:
                out.append({"type": "content_block_start", "index": i, "content_block": {**b, "input": {}}})
                out.append({"type": "content_block_delta", "index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
            out.append({"type": "content_block_stop", "index": i})
        return out + [end(reason), {"type": "message_stop"}]

    return await respond(state, request, prompt.tokens, {**chat, **prompt.extra}, shape, "anthropic", prompt.budget)


async def count_tokens(request: Request) -> Response:
    """{model, messages, system?, tools?} -> {"input_tokens": N}: the prompt /v1/messages would evaluate."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    prompt = await off_loop(request, prompt_of, state, chat_body(body))
    return JSONResponse({"input_tokens": len(prompt.tokens)})
