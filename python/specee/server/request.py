"""A request read and checked: its body (size, JSON), its prompt, and what it asks to generate.

Every refusal is an `ApiError`: an HTTP status and OpenAI's error shape. `request_params` reads every generation
field of a body and decides the mode (under mode auto, a request asking for log-probabilities decodes plainly)
before it builds the request's one `GenerateOptions`, which the runtime checks as it is made; that object goes to
the slots as it is (`Slots.submit_options`), never changed or made again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from specee import _core
from specee.generate import MODES, ExitParams, GenerateOptions
from specee.model import Model

MAX_BODY = 4 * 1024 * 1024  # bytes of a request body


class ApiError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def body_field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None,
               check: Callable[[Any], bool] | None = None, expect: str = "") -> Any:
    """body[name] checked: its type (bool is not a number here) and `check`; default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {expect or names}, not {json.dumps(value)[:40]}", param=name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {expect}, not {json.dumps(value)[:40]}", param=name)
    return value


# ---- the body -------------------------------------------------------------------------------------------


async def json_body(request: Request) -> Any:
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


async def json_object(request: Request) -> dict:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ---- the prompt -----------------------------------------------------------------------------------------


def prompt_of(model: Model, body: dict, key: str = "prompt") -> list[int]:
    """A completion prompt: a string, or token ids (or a list holding one of them)."""
    prompt = body.get(key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return model.tokenize(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < model.n_vocab for t in prompt):
            raise ApiError(400, f"token ids of '{key}' must be in [0, {model.n_vocab})", param=key)
        return list(prompt)
    raise ApiError(400, f"'{key}' must be a non-empty string or list of token ids (one prompt per request)", param=key)


def messages_of(model: Model, body: dict) -> list[int]:
    """A chat's messages through the model's chat template, as token ids."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    chat = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message must be an object with a 'role' and a 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "a message's 'content' must be a string or a list of text parts", param="messages")
        chat.append({"role": m["role"], "content": content})
    try:
        return model.prompt_tokens(chat)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


# ---- what it asks to generate ---------------------------------------------------------------------------


@dataclass
class RequestParams:
    """A generation request's parameters, checked: the runtime's options (made once), how many tokens, the
    alternatives per token with log-probabilities (< 0: none) and the stop strings (the server's, not the runtime's)."""

    options: GenerateOptions
    n_predict: int
    n_probs: int
    stop: list[str]


def probs_wanted(body: dict, api: str) -> int:
    """The alternatives per token a request asks log-probabilities for, -1 for none (400 on a bad field): chat's
    `logprobs` + `top_logprobs`, /v1/completions' `logprobs: N`, llama.cpp's `n_probs` (api: chat, completions,
    llama)."""
    top = f"an integer in [0, {_core.MAX_PROBS}]"
    if api == "chat":
        n = body_field(body, "top_logprobs", int, None, lambda v: 0 <= v <= _core.MAX_PROBS, top)
        if not body_field(body, "logprobs", bool, False):
            if n is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return -1
        return n or 0
    if api == "completions":
        return body_field(body, "logprobs", int, -1, lambda v: 0 <= v <= _core.MAX_PROBS, top)
    n = body_field(body, "n_probs", int, 0, lambda v: 0 <= v <= _core.MAX_PROBS, top)
    return n if n > 0 else -1


def grammar_of(body: dict) -> dict[str, Any]:
    """The structured output a request asks for, as GenerateOptions' fields (400 on a malformed field; a grammar or
    schema the engine refuses is a 400 with its message when the request is admitted): OpenAI's `response_format`
    ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}), llama.cpp's `grammar` (GBNF) and `json_schema`. At most one of them."""
    found: dict[str, Any] = {}
    fmt = body_field(body, "response_format", dict, None, expect="an object like {\"type\": \"json_object\"}")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found["json_schema"] = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ApiError(400, "response_format json_schema: 'json_schema' must be an object with a 'schema' "
                               "object", param="response_format")
            if "strict" in spec and not isinstance(spec["strict"], bool):
                raise ApiError(400, "response_format json_schema: 'strict' must be true or false",
                               param="response_format")
            # strict or not, the output is held to the schema (the engine has no looser mode)
            found["json_schema"] = spec.get("schema", {})
        elif kind != "text":
            raise ApiError(400, "'response_format' type must be text, json_object or json_schema, not "
                           f"{json.dumps(kind)[:40]}", param="response_format")
    grammar = body_field(body, "grammar", str, None, lambda v: v != "", "a non-empty GBNF grammar")
    schema = body_field(body, "json_schema", (dict, bool), None, expect="a JSON Schema object")
    given = [k for k, v in (("response_format", found.get("json_schema")), ("grammar", grammar),
                            ("json_schema", schema)) if v is not None]
    if len(given) > 1:
        raise ApiError(400, f"one structured-output field at a time, not {' and '.join(given)}", param=given[1])
    if grammar is not None:
        return {"grammar": grammar}
    if schema is not None:
        return {"json_schema": schema}
    return found


def request_params(body: dict, api: str, mode: str) -> RequestParams:
    """What a request body asks to generate (api: chat, completions, llama; mode: the server's, for requests that
    name none), every field checked (400 on a bad one). The mode is settled first, then the options are made: the
    runtime's checks see them as they will run."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    llama = api == "llama"
    n_key = "n_predict" if llama else "max_tokens"
    n_predict = body_field(body, n_key, int, -1 if llama else None, lambda v: v >= (-1 if llama else 1) and v < 2**31,
                           "a positive integer")
    if n_predict is None:
        n_predict = body_field(body, "max_completion_tokens", int, -1, lambda v: 1 <= v < 2**31, "a positive integer")
    # the API's own bounds on the sampling fields; a field not given keeps the library's default (GenerateOptions)
    given = {
        "temp": body_field(body, "temperature", (int, float), None, lambda v: 0 <= v <= 100, "a number >= 0"),
        "top_p": body_field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": body_field(body, "top_k", int, None, lambda v: 0 <= v < 2**31, "an integer >= 0"),
        "min_p": body_field(body, "min_p", (int, float), None, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "seed": body_field(body, "seed", int, None, lambda v: -1 <= v < 2**32, "an integer in [-1, 2**32)"),
        "ignore_eos": body_field(body, "ignore_eos", bool, None),
        "mode": body_field(body, "mode", str, mode, lambda v: v in MODES, "one of " + ", ".join(MODES)),
    }
    if body_field(body, "exit_check", bool, False):  # checked exits: early-exit and tree-exit output equals plain's
        given["exit"] = ExitParams(check=True)
    stop = body_field(body, "stop", (str, list), [], expect="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 non-empty strings", param="stop")
    if body_field(body, "n", int, 1) != 1:
        raise ApiError(400, "'n' must be 1: one choice per request", param="n")
    n_probs = probs_wanted(body, api)
    if n_probs >= 0 and (MODES[given["mode"]].tree or MODES[given["mode"]].exits):
        raise ApiError(400, f"log-probabilities need mode plain, not {given['mode']}: a speculative step's tokens come "
                       "from drafts and verification passes", param="logprobs")
    if n_probs >= 0:
        given["mode"] = "plain"  # mode auto: a request asking for log-probabilities decodes plainly
    given.update(grammar_of(body))
    try:
        options = GenerateOptions(**{k: v for k, v in given.items() if v is not None})
    except (ValueError, _core.SpecEEError) as e:
        raise ApiError(400, str(e)) from None
    return RequestParams(options, n_predict, n_probs, stop)
