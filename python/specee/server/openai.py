"""OpenAI's endpoints: /v1/chat/completions (tool calls included), /v1/completions, /v1/models, in OpenAI's shapes
(the log-probabilities of chat and of completions included), and llama.cpp's /apply-template (/v1/embeddings: embed.py)."""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specee.server.engine import ServerState
from specee.server.generation import Result, TokenProb, respond, text_of, usage
from specee.server.llama import verbose, verbose_of
from specee.server.request import ApiError, json_object, off_loop, prompt_of
from specee.server.tools import chat_prompt, reply_of, reply_so_far


# llama-server's system_fingerprint is "b" and its build number; here "b" and the package's version
FINGERPRINT = "b" + importlib.metadata.version("specee")


def base(state: ServerState, kind: str, rid: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": state.alias,
            "system_fingerprint": FINGERPRINT}


def chat_logprobs(probs: list[TokenProb]) -> dict:
    """OpenAI chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(piece: bytes, lp: float) -> dict:
        return {"token": text_of(piece), "logprob": lp, "bytes": list(piece)}

    return {"content": [{**entry(p.piece, p.logprob), "top_logprobs": [entry(b, lp) for _, b, lp in p.top]}
                        for p in probs]}


def completion_logprobs(probs: list[TokenProb], offset: int = 0) -> dict:
    """OpenAI completions' `logprobs`: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset (from
    `offset`, characters of the completion's text before these tokens)."""
    offsets, tops = [], []
    for p in probs:
        offsets.append(offset)
        offset += len(text_of(p.piece))
        top: dict[str, float] = {}
        for _, b, lp in p.top:
            top.setdefault(text_of(b), lp)  # tokens of the same text: the likelier one
        tops.append(top)
    return {"tokens": [text_of(p.piece) for p in probs], "token_logprobs": [p.logprob for p in probs],
            "top_logprobs": tops, "text_offset": offsets}


def tool_call_deltas(calls: list[dict], first: int = 0) -> list[dict]:
    """A reply's tool calls as stream deltas (numbered from `first`): per call, one with its id, type and name, one
    with its arguments."""
    out = []
    for i, c in enumerate(calls, first):
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out


def check_last_messages(body: dict) -> None:
    """llama.cpp's rule: a chat ending with an assistant's message is continued (prefill); two of them at the end
    are refused (which one would go on?)."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) >= 2 and all(
            isinstance(m, dict) and m.get("role") == "assistant" for m in messages[-2:]):
        raise ApiError(400, "'messages' may end with one assistant message (continued), not two or more",
                       param="messages")


async def chat_completions(request: Request) -> Response:
    """Chat through the server's template; with `tools`, the reply read as OpenAI's `tool_calls` (server/tools.py):
    in a stream, the reply's text as it is generated (a generic answer's text; in a family's format the content before
    a call's marker), each call once whole. A reply's thoughts go to `reasoning_content` (server/reasoning.py), in a
    stream as they come."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    check_last_messages(body)
    prompt = await off_loop(request, chat_prompt, state.model, state.template, body)
    tools = prompt.tools if prompt.tools is not None and prompt.tools.choice != "none" else None
    stream = bool(body.get("stream"))
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    sent = [0]  # characters of the reply's content streamed so far (with tools)
    calls_sent: list[dict] = []  # the calls streamed so far (their ids stay)
    # a stream's thoughts as they come (deepseek-legacy streams them as content, as llama.cpp does)
    thinking = prompt.thoughts.stream() if stream and prompt.thoughts and not prompt.thoughts.in_content else None

    def reply(res: Result) -> tuple[str | None, str | None, list[dict], str | None]:
        """(thoughts, content, tool calls, finish) of a whole reply."""
        thoughts, text = prompt.thoughts.split(res.text) if prompt.thoughts else (None, res.text)
        if tools is None:
            return thoughts, text, [], res.finish
        content, calls = reply_of(text, tools)
        return thoughts, content, calls, "tool_calls" if calls and res.finish == "stop" else res.finish

    def chunk(res: Result, delta: dict, finish: str | None, logprobs: dict | None) -> dict:
        return {**base(state, "chat.completion.chunk", rid), "choices": [{"index": 0, "delta": delta,
                "finish_reason": finish, "logprobs": logprobs}]}

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False) -> dict | list[dict] | None:
        if final and not stream:
            new = res.new_probs(True)
            thoughts, content, calls, finish = reply(res)
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thoughts is not None:
                msg["reasoning_content"] = thoughts
            if calls:
                msg["tool_calls"] = calls
            out = {**base(state, "chat.completion", rid), "choices": [{"index": 0, "message": msg,
                   "finish_reason": finish, "logprobs": None if new is None else chat_logprobs(new)}],
                   "usage": usage(res), "mode": res.mode}
            if verbose(state, body):  # llama.cpp's: what /completion answers (the prompt as evaluated, the reply, ...)
                out["__verbose"] = verbose_of(state, body, res, prompt.tokens, None, True)
            return out
        if first:  # llama.cpp's first chunk: the role, no content
            return chunk(res, {"role": "assistant", "content": None}, None, None)
        # what the reply adds: its thoughts and (without tools) its content as they come; a generic answer's text
        # as far as it is written; at the end, the rest, the calls and the finish
        thoughts, text = thinking.push(res.text, final) if thinking is not None else ("", piece or "")
        delta = [{"reasoning_content": thoughts}] if thoughts else []
        finish = res.finish
        if tools is None:
            delta += [{"content": text}] if text else []
        elif not final:
            _, so_far = prompt.thoughts.split(res.text) if prompt.thoughts else (None, res.text)
            content, calls = reply_so_far(so_far, tools)
            if len(content) > sent[0]:
                delta.append({"content": content[sent[0]:]})
                sent[0] = len(content)
            delta += tool_call_deltas(calls[len(calls_sent):], len(calls_sent))
            calls_sent.extend(calls[len(calls_sent):])
        else:
            _, content, calls, finish = reply(res)
            rest = (content or "")[sent[0]:]
            delta += ([{"content": rest}] if rest else []) + tool_call_deltas(calls[len(calls_sent):], len(calls_sent))
        if not final and not delta:
            return None  # held back: part of a tag, or a call not yet whole
        new = res.new_probs(False)
        logprobs = None if new is None else chat_logprobs(new)
        if not final:  # the log-probabilities with the last delta
            return [chunk(res, d, None, None) for d in delta[:-1]] + [chunk(res, delta[-1], None, logprobs)]
        chunks = [chunk(res, d, None, None) for d in delta] + [chunk(res, {}, finish, logprobs)]
        if verbose(state, body):  # llama.cpp's: on the first of the last chunks
            chunks[0]["__verbose"] = verbose_of(state, body, res, prompt.tokens, None, True)
        return chunks

    return await respond(state, request, prompt.tokens, {**body, **prompt.extra}, shape, "chat", prompt.budget)


async def apply_template(request: Request) -> Response:
    """llama.cpp's /apply-template: {"messages", "tools"?, ...} -> {"prompt": the rendered text}."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    prompt = await off_loop(request, chat_prompt, state.model, state.template, body, False)
    return JSONResponse({"prompt": prompt.text})


async def chat_input_tokens(request: Request) -> Response:
    """llama.cpp's /chat/completions/input_tokens: how many tokens a chat's messages are through the template."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    prompt = await off_loop(request, chat_prompt, state.model, state.template, body)
    return JSONResponse({"input_tokens": len(prompt.tokens)})


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_object(request)
    tokens = await off_loop(request, prompt_of, state.model, body)
    rid = "cmpl-" + uuid.uuid4().hex[:24]

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False) -> dict:
        text = res.text if final and not body.get("stream") else "" if piece is None else piece
        offset = sum(len(text_of(p.piece)) for p in res.probs[:res.probs_sent])
        new = res.new_probs(final and not body.get("stream"))
        logprobs = None if new is None else completion_logprobs(new, offset)
        out = {**base(state, "text_completion", rid), "choices": [{"index": 0, "text": text, "logprobs": logprobs,
               "finish_reason": res.finish if final else None}]}
        if final and not body.get("stream"):
            out["usage"], out["mode"] = usage(res), res.mode
        if verbose(state, body):  # llama.cpp's: what /completion answers for this chunk, or the whole
            out["__verbose"] = verbose_of(state, body, res, tokens, piece, final)
        return out

    return await respond(state, request, tokens, body, shape, "completions")


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [{"id": state.alias, "object": "model", "created": state.created,
                                                     "owned_by": "specee", "aliases": state.aliases,
                                                     "tags": state.tags, "meta": state.model_meta}]})
