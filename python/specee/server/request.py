"""A request read and checked: its body (size, JSON), its prompt, and what it asks to generate.

Every refusal is an `ApiError`: an HTTP status and OpenAI's error shape. A body is refused whole (400) when it is not
UTF-8 JSON, nests deeper than `MAX_DEPTH`, or holds a string that is not Unicode (an escaped lone surrogate, which
Python's JSON decoder lets through), so no endpoint meets such a value. A large body (over `INLINE_BYTES`) is parsed,
tokenized and answered on a worker thread (`off_loop`), never on the event loop. `request_params` reads every generation
field of a body and decides the mode (under mode auto, a request asking for log-probabilities decodes plainly)
before it builds the request's one `GenerateOptions`, which the runtime checks as it is made; that object goes to
the slots as it is (`Slots.submit_options`), never changed or made again.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from specee import _core
from specee.generate import MODES, DraftParams, ExitParams, GenerateOptions, NgramParams
from specee.grammar import StructuredOutputConflict, structured_output_of
from specee.model import Model
from specee.server.reasoning import ThoughtBudget

MAX_BODY = 4 * 1024 * 1024  # bytes of a request body
MAX_DEPTH = 64  # arrays and objects nested in a request body
MAX_CHOICES = 16  # a request's n: generations of one prompt, each on a slot
# a body up to this size is parsed, tokenized and answered on the event loop (a few ms at most: a 16 KiB single word
# tokenizes in about 3 ms on SmolLM2); a larger one on a worker thread, so /health and the streams keep being served
INLINE_BYTES = 16 * 1024


class ApiError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers
        self.extra = extra or {}  # more fields of the error object (llama.cpp's n_prompt_tokens, n_ctx)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status,
                          **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shown(value: Any) -> str:
    """A JSON value for an error message, short whatever its size: containers by their kind, strings cut at 40."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return json.dumps(value[:40] + ("..." if len(value) > 40 else ""))
    return json.dumps(value)[:40]


def body_field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None,
               check: Callable[[Any], bool] | None = None, expect: str = "") -> Any:
    """body[name] checked: its type (bool is not a number here) and `check`; default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {expect or names}, not {shown(value)}", param=name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {expect}, not {shown(value)}", param=name)
    return value


def option_field(body: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    """body[name], a generation option of the same name: its type checked here, its range by the library's table (the
    one place it is written), None when absent or null."""
    value = body_field(body, name, kind)
    if value is not None:
        try:
            GenerateOptions(**{name: value})
        except (ValueError, _core.SpecEEError) as e:
            raise ApiError(400, str(e), param=name) from None
    return value


# ---- the body -------------------------------------------------------------------------------------------


# an escape of a UTF-16 surrogate in JSON text, the only way a lone surrogate gets into a body decoded as UTF-8
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_json(value: Any, strings: bool = True) -> None:
    """A parsed body's values: nesting at most MAX_DEPTH, and with `strings` every string (keys too) valid Unicode.
    Level by level in a loop, not a recursion (no body can exhaust the stack here), holding one level's containers
    (not a record per value: a 4 MiB list of numbers would cost 150 MB)."""

    def text(s: str) -> None:
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"the request body is not valid JSON: a string holds the lone surrogate "
                                    f"\\u{ord(s[e.start]):04x}, which is not Unicode text") from None

    level, depth = [value], 1
    while level:
        below = []
        for v in level:
            if isinstance(v, str):  # the body itself
                if strings:
                    text(v)
                continue
            if not isinstance(v, (dict, list)):
                continue
            if depth > MAX_DEPTH:
                raise ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep")
            if isinstance(v, dict):
                if strings:
                    for k in v:
                        text(k)
                v = v.values()
            for x in v:
                t = type(x)
                if t is str:
                    if strings:
                        text(x)
                elif t is list or t is dict:
                    below.append(x)
        level, depth = below, depth + 1


def parse_json(raw: bytes) -> Any:
    """A request body's JSON (UTF-8, as RFC 8259 wants between systems), checked by `check_json`; ApiError 400 for
    anything else, whatever the decoder's reason (too deep for it included)."""
    def constant(name: str) -> None:  # Python's decoder takes NaN, Infinity, -Infinity; JSON has no such numbers
        raise ApiError(400, f"the request body is not valid JSON: {name} is not a JSON number")

    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    check_json(value, strings=SURROGATE_ESCAPE.search(text) is not None)
    return value


async def off_loop(request: Request, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) for a request: on a worker thread when its body is larger than INLINE_BYTES (tokenizing a 4 MiB body
    takes about a second), else here on the event loop."""
    if getattr(request.state, "body_bytes", 0) > INLINE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def body_bytes(request: Request) -> bytes:
    """The request's body, at most MAX_BODY bytes (413 beyond, from its Content-Length or as it comes)."""
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    chunks, n = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        n += len(chunk)
        if n > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    return b"".join(chunks)


async def json_body(request: Request) -> Any:
    raw = await body_bytes(request)
    request.state.body_bytes = len(raw)
    return await off_loop(request, parse_json, raw)


async def json_object(request: Request) -> dict:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ---- the prompt -----------------------------------------------------------------------------------------


def prompts_of(model: Model, body: dict, key: str = "prompt") -> list[list[int]]:
    """A completion's prompts as token ids: one prompt, or a list of them (llama.cpp's /completion answers each).
    A prompt is a string, token ids (strings among ids are tokenized in place, without BOS), or llama.cpp's JSON
    prompt object {"prompt_string": ...} or {"content": [text parts]} (`multimodal_data` refused: text only)."""
    prompt = body.get(key)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list, dict)) for p in prompt):
        return [one_prompt(model, p, key) for p in prompt]
    return [one_prompt(model, prompt, key)]


def one_prompt(model: Model, prompt: Any, key: str) -> list[int]:
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise ApiError(400, f"'{key}': multimodal data is not supported: this server takes text only", param=key)
        parts = prompt.get("content")
        if isinstance(parts, list) and "prompt_string" not in prompt:  # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise ApiError(400, f"'{key}': only text content parts are supported", param=key)
            prompt = "".join(p["text"] for p in parts)
        else:
            prompt = prompt.get("prompt_string")
    try:
        if isinstance(prompt, str) and prompt:
            return model.tokenize(prompt, add_special=True, parse_special=True)
        if isinstance(prompt, list) and any(isinstance(t, int) for t in prompt) and all(
                isinstance(t, (int, str)) and not isinstance(t, bool) for t in prompt):
            tokens: list[int] = []
            for t in prompt:
                tokens += model.tokenize(t, add_special=False, parse_special=True) if isinstance(t, str) else [t]
            if not all(0 <= t < model.n_vocab for t in tokens):
                raise ApiError(400, f"token ids of '{key}' must be in [0, {model.n_vocab})", param=key)
            if tokens:
                return tokens
    except ValueError as e:  # a lone surrogate (check_json refuses them first)
        raise ApiError(400, f"'{key}': {e}", param=key) from None
    raise ApiError(400, f"'{key}' must be a non-empty string, a list of token ids (and strings), a JSON prompt "
                   "object {\"prompt_string\": ...}, or a list of these", param=key)


def prompt_of(model: Model, body: dict, key: str = "prompt") -> list[int]:
    """A completion prompt (`prompts_of`), one per request."""
    prompts = prompts_of(model, body, key)
    if len(prompts) != 1:
        raise ApiError(400, f"'{key}': one prompt per request here, not {len(prompts)} (llama.cpp's /completion "
                       "takes several)", param=key)
    return prompts[0]


# ---- what it asks to generate ---------------------------------------------------------------------------


@dataclass
class RequestParams:
    """A generation request's parameters, checked: the runtime's options (made once), how many tokens, the
    alternatives per token with log-probabilities (< 0: none), the stop strings (the server's, not the runtime's) and
    how many choices."""

    options: GenerateOptions
    n_predict: int
    n_probs: int
    stop: list[str]
    n_choices: int = 1  # OpenAI's n: generations of the same request, answered together (not streamed)
    id_slot: int = -1  # llama.cpp's id_slot: the slot to run on (-1: the one whose cache holds most of the prompt)
    progress: bool = False  # llama.cpp's return_progress: a stream reports the prompt's evaluation as it goes
    timings: bool = False  # llama.cpp's timings_per_token: every streamed chunk has the timings so far
    budget: ThoughtBudget | None = None  # a chat's thinking budget (server/reasoning.py; each job counts on a copy)
    lora: dict[int, float] | None = None  # llama.cpp's per-request `lora`: {adapter id: scale}; None: the server's
    preserved: frozenset[int] = frozenset()  # llama.cpp's preserved_tokens: special tokens whose text the reply keeps
    post_sampling: bool = False  # llama.cpp's post_sampling_probs: the probabilities after the sampler's chain


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


def tokens_wanted(body: dict, api: str, default: int = -1) -> int:
    """The most tokens a request generates (400 on a bad field), llama.cpp's rule: the request's `max_tokens`
    (`max_completion_tokens`; llama.cpp's `n_predict`, OpenAI Responses' `max_output_tokens`) >= 0 as given, larger
    than the server's -n or not; -1, absent or null: the server's -n (`default`). -1 back: until an end-of-generation
    token or the slot's context is full (the Python API's `specee.slots.token_limit`). OpenAI's max_tokens is at least
    1; llama.cpp's n_predict 0 evaluates the prompt only."""
    n, lo = None, 0 if api == "llama" else 1
    keys = {"llama": ("n_predict",), "responses": ("max_output_tokens",)}.get(api, ("max_tokens",
                                                                                   "max_completion_tokens"))
    for key in keys:
        n = body_field(body, key, int, None, lambda v: v == -1 or lo <= v < 2**31, f"-1 (no limit) or an integer in "
                       f"[{lo}, 2**31)")
        if n is not None:
            break
    return default if n is None or n < 0 else n


def grammar_of(body: dict) -> dict[str, Any]:
    """The structured output a request asks for, as GenerateOptions' fields (400 on a malformed field; a grammar or
    schema the engine refuses is a 400 with its message when the request is admitted): OpenAI's `response_format`
    ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}; llama.cpp's {"type": "json_object", "schema": ...}), llama.cpp's `grammar` (GBNF; Lark, llguidance's,
    with `"grammar_type": "lark"`) and `json_schema`. At most one of them."""
    found: dict[str, Any] = {}
    fmt = body_field(body, "response_format", dict, None, expect="an object like {\"type\": \"json_object\"}")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":  # llama.cpp's: with a "schema", held to it
            schema = fmt.get("schema", {"type": "object"})
            if not isinstance(schema, (dict, bool)):
                raise ApiError(400, "response_format json_object: 'schema' must be a JSON Schema object",
                               param="response_format")
            found["json_schema"] = schema
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
    try:
        structured_output_of({"response_format": found.get("json_schema"), "grammar": grammar, "json_schema": schema})
    except StructuredOutputConflict as e:
        raise ApiError(400, f"one structured-output field at a time, not {' and '.join(e.names)}",
                       param=e.names[1]) from None
    kind = body_field(body, "grammar_type", str, "gbnf", lambda v: v in ("gbnf", "lark"), "gbnf or lark")
    if grammar is not None:
        return {"grammar": grammar, "grammar_type": kind}
    if schema is not None:
        return {"json_schema": schema}
    return found


def logit_bias_of(model: Model | None, body: dict) -> str | None:
    """A request's `logit_bias` as the runtime's text ("15043+1,2-inf"), None when absent: OpenAI's {"TOKEN": bias}
    or llama.cpp's [[TOKEN, bias], ...], where a key may also be text (each of its tokens gets the bias) and a bias
    false bans the token."""
    given = body.get("logit_bias")
    if given is None:
        return None
    pairs = list(given.items()) if isinstance(given, dict) else given
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ApiError(400, "'logit_bias' must be an object {token: bias} or a list of [token, bias]",
                       param="logit_bias")
    items = []
    for key, bias in pairs:
        if bias is False:
            bias = float("-inf")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ApiError(400, f"'logit_bias': the bias of {shown(key)} must be a number or false, not {shown(bias)}",
                           param="logit_bias")
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            tokens = [key]
        elif isinstance(key, str) and key and model is not None:
            tokens = model.tokenize(key, add_special=False, parse_special=False)
        else:
            raise ApiError(400, f"'logit_bias': {shown(key)} is not a token id or text", param="logit_bias")
        if not all(0 <= t < (model.n_vocab if model is not None else 2**31) for t in tokens):
            raise ApiError(400, f"'logit_bias': token {shown(key)} is not in the vocabulary", param="logit_bias")
        items += [f"{t}{'+' if bias >= 0 else '-'}{abs(float(bias))}" for t in tokens]
    return ",".join(items)


def options_fields(values: dict[str, Any]) -> dict[str, Any]:
    """GenerateOptions' keywords from the server's defaults, whose draft model and n-gram settings are named
    "draft.n_max", "ngram.draft_max", ...: those as one DraftParams / NgramParams."""
    groups = {"draft": DraftParams, "ngram": NgramParams}
    out = {k: v for k, v in values.items() if k.split(".", 1)[0] not in groups}
    for name, cls in groups.items():
        given = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")}
        if given:
            out[name] = cls(**given)
    return out


# llama.cpp's per-request settings of its draft model: DraftParams' fields
SPECULATIVE_FIELDS: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "speculative.n_max": ("n_max", int), "speculative.n_min": ("n_min", int), "speculative.p_min": ("p_min", (int, float))}


def lora_of(body: dict, n_lora: int) -> dict[int, float] | None:
    """llama.cpp's per-request `lora`: [{"id": i, "scale": s}, ...], the adapters not listed at scale 0 (llama.cpp's
    rule); absent, null or []: None, the server's scales (POST /lora-adapters). 400 on an id the server does not
    have or a scale that is not a finite number."""
    entries = body_field(body, "lora", list, None, expect="a list of {\"id\", \"scale\"} objects")
    if not entries:
        return None
    out = {}
    for e in entries:
        i = e.get("id") if isinstance(e, dict) else None
        s = e.get("scale", 0.0) if isinstance(e, dict) else None
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_lora:
            raise ApiError(400, f"'lora': no adapter with id {shown(i)} (this server has {n_lora}, ids from 0)",
                           param="lora")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ApiError(400, f"'lora': the scale of adapter {i} must be a finite number, not {shown(s)}",
                           param="lora")
        out[i] = float(s)
    return out


def request_params(body: dict, api: str, mode: str, n_predict: int = -1,
                   defaults: dict[str, Any] | None = None, model: Model | None = None, n_lora: int = 0
                   ) -> RequestParams:
    """What a request body asks to generate (api: chat, completions, llama, anthropic, responses; mode: the server's,
    for requests that name none; n_predict: the server's -n, for requests that give no max_tokens / n_predict;
    defaults: the server's sampling defaults, GenerateOptions' fields, for fields a request does not give; model: for
    logit_bias given as text; n_lora: the server's LoRA adapters), every field checked (400 on a bad one). The mode
    is settled first, then the options are made: the runtime's checks see them as they will run."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    n_predict = tokens_wanted(body, api, n_predict)
    # the sampling fields: the API's own bounds where they are narrower than the library's (temperature, top_k,
    # repeat_penalty), else the library's; a field not given keeps the library's default (GenerateOptions)
    given = {
        "temp": body_field(body, "temperature", (int, float), None, lambda v: 0 <= v <= 100, "a number >= 0"),
        "top_p": option_field(body, "top_p", (int, float)),
        "top_k": body_field(body, "top_k", int, None, lambda v: 0 <= v < 2**31, "an integer >= 0"),
        "min_p": option_field(body, "min_p", (int, float)),
        "repeat_penalty": body_field(body, "repeat_penalty", (int, float), None, lambda v: 0 < v <= 100,
                                     "a number in (0, 100]"),
        "repeat_last_n": option_field(body, "repeat_last_n", int),
        "seed": option_field(body, "seed", int),
        "ignore_eos": body_field(body, "ignore_eos", bool, None),
        "logit_bias": logit_bias_of(model, body),
        "mode": body_field(body, "mode", str, mode, lambda v: v in MODES, "one of " + ", ".join(MODES)),
    }
    draft, ngram = {}, {}
    for name, value in (defaults or {}).items():
        if name.startswith("draft."):
            draft[name.split(".", 1)[1]] = value
        elif name.startswith("ngram."):  # --spec-ngram-mod-n-max
            ngram[name.split(".", 1)[1]] = value
        elif given.get(name) is None:
            given[name] = value
    for name, (attr, kind) in SPECULATIVE_FIELDS.items():
        value = body_field(body, name, kind, None, lambda v: v >= 0, "a number >= 0")
        if value is not None:
            draft[attr] = value
    if body_field(body, "exit_check", bool, False):  # checked exits: early-exit and tree-exit output equals plain's
        given["exit"] = ExitParams(check=True)
    stop = body_field(body, "stop", (str, list), [], expect="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 non-empty strings", param="stop")
    n_choices = body_field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
    if n_choices > 1 and body_field(body, "stream", bool, False):
        raise ApiError(400, "'n' > 1 is answered as one response, not streamed", param="n")
    n_probs = probs_wanted(body, api)
    if n_probs >= 0 and (MODES[given["mode"]].tree or MODES[given["mode"]].exits):
        raise ApiError(400, f"log-probabilities need mode plain, not {given['mode']}: a speculative step's tokens come "
                       "from drafts and verification passes", param="logprobs")
    if n_probs >= 0:
        given["mode"] = "plain"  # mode auto: a request asking for log-probabilities decodes plainly
    given.update(grammar_of(body))
    if draft and model is not None and model.draft_model and "draft" in MODES[given["mode"]].reads:
        try:  # a draft model's settings, where it drafts (as llama.cpp, which reads them only with a draft model)
            given["draft"] = DraftParams(**draft)
        except (ValueError, _core.SpecEEError) as e:
            raise ApiError(400, str(e)) from None
    if ngram:
        given["ngram"] = NgramParams(**ngram)
    try:
        options = GenerateOptions(**{k: v for k, v in given.items() if v is not None})
    except (ValueError, _core.SpecEEError) as e:
        raise ApiError(400, str(e)) from None
    id_slot = body_field(body, "id_slot", int, -1, lambda v: v >= -1, "-1 (any slot) or a slot's id")
    progress = body_field(body, "return_progress", bool, False)
    timings = body_field(body, "timings_per_token", bool, False)
    post_sampling = api == "llama" and body_field(body, "post_sampling_probs", bool, False)
    return RequestParams(options, n_predict, n_probs, stop, n_choices, id_slot, progress, timings,
                         lora=lora_of(body, n_lora), preserved=preserved_of(model, body), post_sampling=post_sampling)


def preserved_of(model: Model | None, body: dict) -> frozenset[int]:
    """llama.cpp's `preserved_tokens`: texts of special tokens the reply keeps (a tool call's markers); a text that is
    not one token of the vocabulary is left out, as llama.cpp leaves it."""
    texts = body_field(body, "preserved_tokens", list, [], expect="a list of strings")
    if not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "'preserved_tokens' must be a list of strings", param="preserved_tokens")
    if model is None:
        return frozenset()
    found = (model.tokenize(t, add_special=False, parse_special=True) for t in texts)
    return frozenset(ids[0] for ids in found if len(ids) == 1)
