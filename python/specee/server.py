"""specee-server: an OpenAI-compatible HTTP server over the runtime's parallel slots.

    python -m specee.server -m model.gguf -np 4 --port 8080

The batching loop is the library's (csrc/specee-slots.cpp): one thread here calls `Slots.step()` (one pass of the
model, the GIL released) while the event loop takes requests; each pass decodes the next token of every plain
request at once, verifies the draft trees of EAGLE requests (eagle, eagle2: per request with the extra field "mode")
and prefills a chunk of a new prompt beside them; early-exit and tree-exit requests (checked with the extra field
"exit_check") run their sequence alone after the shared pass. This module only
parses requests, turns tokens into text (stop strings included) and writes responses. HTTP is Starlette on uvicorn
(docs/server.md says why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import numpy as np

from specee import _core
from specee._optional import missing_package_exits
from specee.generate import MODES, ExitParams, GenerateOptions, StopText
from specee.model import Model

with missing_package_exits("specee-server"):  # the [server] extra
    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

MAX_BODY = 4 * 1024 * 1024  # bytes of a request body
FINISH = {"stop": "stop", "length": "length", "context": "length", None: None, "error": "error"}


# ---- errors ---------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, check: Callable[[Any], bool] |
           None = None, expect: str = "") -> Any:
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


# ---- requests and the batching thread ----------------------------------------------------------------------


@dataclass
class Job:
    """One generation: its prompt and options, and what the batching thread sends back to the event loop."""

    tokens: list[int]
    n_predict: int
    options: GenerateOptions
    n_probs: int  # alternatives per token with log-probabilities; < 0: none
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    cancelled: bool = False
    t_start: float = field(default_factory=time.perf_counter)

    def send(self, *event: Any) -> None:  # from the batching thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """The model, its slots and the thread that steps them; jobs wait in a bounded queue for a free slot."""

    def __init__(self, model: Model, n_parallel: int, max_queue: int, n_chunk: int) -> None:
        self.model = model
        self.slots = model.slots(n_parallel, n_chunk)
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.cond = threading.Condition()
        self.stopping = False
        self.metrics = dict(prompt_tokens=0, prompt_ms=0.0, predicted_tokens=0, predicted_ms=0.0, requests_ok=0,
                            requests_error=0, requests_cancelled=0, requests_refused=0, spec_steps=0,
                            spec_tokens=0, exit_steps=0, exit_exits=0)
        self.thread = threading.Thread(target=self._run, name="specee-slots", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                self.metrics["requests_refused"] += 1
                raise ApiError(503, f"the server is busy: {len(self.waiting)} requests wait for a slot", "server_error",
                               headers={"Retry-After": "1"})
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone (or a stop string ended it): its slot is freed before the next pass."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    # -- the batching thread

    def _admit(self) -> None:
        while self.waiting:
            job = self.waiting[0]
            if job.cancelled:
                self.waiting.popleft()
                continue
            try:
                slot = self.slots.submit(job.tokens, job.n_predict, job.n_probs, **vars(job.options))
            except Exception as e:  # a bad prompt or options: the request's 400, never the thread's end
                self.waiting.popleft()
                self.metrics["requests_error"] += 1
                job.send("error", str(e))
                continue
            if slot is None:
                return
            self.waiting.popleft()
            job.slot = slot
            self.running[slot] = job
            job.send("start", self.slots.mode(slot))

    def _drop_cancelled(self) -> None:
        for slot, job in list(self.running.items()):
            if job.cancelled:
                self.slots.release(slot)
                del self.running[slot]
                self.metrics["requests_cancelled"] += 1

    def _deliver(self) -> None:
        self._drop_cancelled()
        for slot, job in list(self.running.items()):
            out = self.slots.read(slot)
            if out.tokens:
                job.send("tokens", out.tokens, out.logprobs)
            if out.finish is not None:
                stats = self.slots.stats(slot)
                self._count(stats, self.slots.mode(slot))
                self.slots.release(slot)
                del self.running[slot]
                self.metrics["requests_ok" if out.finish != "error" else "requests_error"] += 1
                job.send("done", out.finish, out.error, stats)

    def _count(self, st: dict[str, float], mode: str) -> None:
        m = self.metrics
        m["prompt_tokens"] += int(st["n_prompt"])
        m["prompt_ms"] += st["t_prompt_ms"]
        m["predicted_tokens"] += int(st["n_tokens"])
        m["predicted_ms"] += st["t_decode_ms"]
        if mode in ("eagle", "eagle2", "tree-exit"):
            m["spec_steps"] += int(st["n_steps"])
            m["spec_tokens"] += int(st["n_decoded"])
        if mode in ("early-exit", "tree-exit"):
            m["exit_steps"] += int(st["n_steps"])
            m["exit_exits"] += int(st["n_exits"])

    def _fail_running(self, message: str) -> None:
        with self.cond:
            for slot, job in self.running.items():
                self.slots.release(slot)
                job.send("error", message)
            self.running.clear()

    def _run(self) -> None:
        while not self.stopping:
            try:
                self._pass()
            except Exception as e:  # whatever failed, the requests on the slots get it and the loop goes on
                self._fail_running(f"internal error: {e}")

    def _pass(self) -> None:
        """Admit waiting requests, run one pass, hand out its tokens."""
        with self.cond:
            while not self.stopping and not self.waiting and not self.running:
                self.cond.wait(timeout=1.0)
            if self.stopping:
                return
            self._drop_cancelled()  # before the next pass
            self._admit()
        if self.running:
            try:
                self.slots.step()  # the GIL is released for the pass
            except _core.SpecEEError as e:
                self._fail_running(str(e))
        with self.cond:
            self._deliver()


# ---- generation as text -----------------------------------------------------------------------------------


@dataclass
class TokenProb:
    """A generated token's log-probability and its step's most likely tokens' (token id, bytes, logprob)."""

    token: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]]


@dataclass
class Result:
    text: str = ""
    finish: str | None = None
    n_prompt: int = 0
    n_generated: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    mode: str = ""
    n_probs: int = -1  # the request's alternatives per token; < 0: no log-probabilities
    probs: list[TokenProb] = field(default_factory=list)  # with n_probs >= 0, per generated token
    probs_sent: int = 0  # of probs, given out in stream chunks so far

    def new_probs(self, whole: bool) -> list[TokenProb] | None:
        """The tokens' log-probabilities not yet given out; None where there are none to give (whole: a whole
        response, which has them, maybe [], when the request asked)."""
        new, self.probs_sent = self.probs[self.probs_sent:], len(self.probs)
        return new if new or (whole and self.n_probs >= 0) else None


async def generate(state: ServerState, request: Request, tokens: list[int], n_predict: int, options: GenerateOptions,
                   stop: list[str], n_probs: int, result: Result) -> AsyncGenerator[str, None]:
    """Text pieces of one generation as they complete; `result` holds the rest when it ends. The slot is freed when
    the client goes away, or a stop string is found."""
    engine = state.engine
    if len(tokens) >= engine.slots.n_ctx_slot:
        raise ApiError(400, f"the prompt has {len(tokens)} tokens, more than the context allows: {engine.slots.n_ctx_slot}"
                       f" per slot (-c {engine.model.n_ctx} over -np {engine.slots.n_slots})", param="prompt")
    job = Job(tokens, n_predict, options, n_probs, asyncio.get_running_loop())
    engine.submit(job)
    out = StopText(stop)
    result.n_prompt = len(tokens)
    checked = time.perf_counter()
    try:
        while True:
            if not job.events.empty():  # tokens waiting: no timer to set up
                event = job.events.get_nowait()
            else:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    event = None
            if event is None or time.perf_counter() - checked > 0.5:  # a client gone frees its slot
                checked = time.perf_counter()
                if await request.is_disconnected():
                    return
                if event is None:
                    continue
            if event[0] == "error":
                raise ApiError(400, event[1])
            if event[0] == "start":
                result.mode = event[1]
                yield ""  # admitted: a stream's headers can go
            elif event[0] == "tokens":
                for i, tok in enumerate(event[1]):
                    result.n_generated += 1
                    raw = engine.model.token_to_piece(tok)
                    if n_probs >= 0:
                        top = [(t, engine.model.token_to_piece(t), lp) for t, lp in event[2][i][1:]]
                        result.probs.append(TokenProb(tok, raw, event[2][i][0][1], top))
                    piece = out.push(raw)
                    result.text += piece
                    if piece:
                        yield piece
                    if out.stopped:
                        result.finish = "stop"
                        return
            else:
                _, finish, error, stats = event
                if finish == "error":
                    raise ApiError(500, f"generation failed: {error}", "server_error")
                rest = out.finish()
                result.text += rest
                result.finish, result.stats = FINISH[finish], stats
                if rest:
                    yield rest
                return
    finally:
        if result.finish is None or result.finish == "stop":
            engine.cancel(job)  # gone, or ended by a stop string: free the slot now


# ---- request parsing ----------------------------------------------------------------------------------


def probs_wanted(body: dict, api: str) -> int:
    """The alternatives per token a request asks log-probabilities for, -1 for none (400 on a bad field): chat's
    `logprobs` + `top_logprobs`, /v1/completions' `logprobs: N`, llama.cpp's `n_probs` (api: chat, completions,
    llama)."""
    top = f"an integer in [0, {_core.MAX_PROBS}]"
    if api == "chat":
        n = _field(body, "top_logprobs", int, None, lambda v: 0 <= v <= _core.MAX_PROBS, top)
        if not _field(body, "logprobs", bool, False):
            if n is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return -1
        return n or 0
    if api == "completions":
        return _field(body, "logprobs", int, -1, lambda v: 0 <= v <= _core.MAX_PROBS, top)
    n = _field(body, "n_probs", int, 0, lambda v: 0 <= v <= _core.MAX_PROBS, top)
    return n if n > 0 else -1


def sampling_options(state: ServerState, body: dict, llama: bool = False) -> tuple[GenerateOptions, int, list[str]]:
    """The generation options of a request body, its max tokens and stop strings (400 on a bad field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    n_key = "n_predict" if llama else "max_tokens"
    n_predict = _field(body, n_key, int, -1 if llama else None, lambda v: v >= (-1 if llama else 1) and v < 2**31,
                       "a positive integer")
    if n_predict is None:
        n_predict = _field(body, "max_completion_tokens", int, -1, lambda v: 1 <= v < 2**31, "a positive integer")
    # the API's own bounds on the sampling fields; a field not given keeps the library's default (GenerateOptions)
    given = {
        "temp": _field(body, "temperature", (int, float), None, lambda v: 0 <= v <= 100, "a number >= 0"),
        "top_p": _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "top_k": _field(body, "top_k", int, None, lambda v: 0 <= v < 2**31, "an integer >= 0"),
        "min_p": _field(body, "min_p", (int, float), None, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "seed": _field(body, "seed", int, None, lambda v: -1 <= v < 2**32, "an integer in [-1, 2**32)"),
        "ignore_eos": _field(body, "ignore_eos", bool, None),
        "mode": _field(body, "mode", str, state.mode, lambda v: v in MODES, "one of " + ", ".join(MODES)),
    }
    if _field(body, "exit_check", bool, False):  # checked exits: early-exit and tree-exit output equals plain's
        given["exit"] = ExitParams(check=True)
    stop = _field(body, "stop", (str, list), [], expect="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 non-empty strings", param="stop")
    if _field(body, "n", int, 1) != 1:
        raise ApiError(400, "'n' must be 1: one choice per request", param="n")
    try:
        opts = GenerateOptions(**{k: v for k, v in given.items() if v is not None})
    except (ValueError, _core.SpecEEError) as e:
        raise ApiError(400, str(e)) from None
    return opts, n_predict, stop


def prompt_of(state: ServerState, body: dict, key: str = "prompt") -> list[int]:
    """A completion prompt: a string, or token ids (or a list holding one of them)."""
    prompt = body.get(key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return state.model.tokenize(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < state.model.n_vocab for t in prompt):
            raise ApiError(400, f"token ids of '{key}' must be in [0, {state.model.n_vocab})", param=key)
        return list(prompt)
    raise ApiError(400, f"'{key}' must be a non-empty string or list of token ids (one prompt per request)", param=key)


def messages_of(state: ServerState, body: dict) -> list[int]:
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
        return state.model.prompt_tokens(chat)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


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


# ---- responses ------------------------------------------------------------------------------------------


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(res: Result) -> dict:
    return {"prompt_tokens": res.n_prompt, "completion_tokens": res.n_generated,
            "total_tokens": res.n_prompt + res.n_generated}


def timings(res: Result) -> dict:
    """llama.cpp's `timings` object."""
    st = res.stats
    pn, pms = int(st.get("n_prompt", 0)), float(st.get("t_prompt_ms", 0.0))
    dn, dms = int(st.get("n_decoded", 0)), float(st.get("t_decode_ms", 0.0))
    return {"prompt_n": pn, "prompt_ms": pms, "prompt_per_token_ms": pms / pn if pn else 0.0,
            "prompt_per_second": 1e3 * pn / pms if pms else 0.0, "predicted_n": dn, "predicted_ms": dms,
            "predicted_per_token_ms": dms / dn if dn else 0.0, "predicted_per_second": 1e3 * dn / dms if dms else 0.0,
            "cache_n": int(st.get("n_reused", 0))}


async def respond(state: ServerState, request: Request, tokens: list[int], body: dict, shape: Callable[..., dict],
                  api: str) -> Response:
    """A generation's response (api: chat, completions, llama): one JSON body, or server-sent events when
    body["stream"]."""
    llama = api == "llama"
    opts, n_predict, stop = sampling_options(state, body, llama)
    n_probs = probs_wanted(body, api)
    if n_probs >= 0 and opts.mode not in ("plain", "auto"):
        raise ApiError(400, f"log-probabilities need mode plain, not {opts.mode}: a speculative step's tokens come "
                       "from drafts and verification passes", param="logprobs")
    if n_probs >= 0:
        opts.mode = "plain"  # mode auto: a request asking for log-probabilities decodes plainly
    stream = _field(body, "stream", bool, False)
    stream_options = _field(body, "stream_options", dict, {})
    include_usage = stream and bool(stream_options.get("include_usage"))
    res = Result(n_probs=n_probs)
    pieces = generate(state, request, tokens, n_predict, opts, stop, n_probs, res)
    first = await pieces.__anext__()  # admitted (or an ApiError now, before any header)
    assert first == ""
    if not stream:
        async for _ in pieces:
            pass
        return JSONResponse(shape(res, None, final=True))

    async def events() -> AsyncIterator[str]:
        try:
            yield sse(shape(res, "", first=True))
            async for piece in pieces:
                yield sse(shape(res, piece))
            yield sse(shape(res, None, final=True))
            if include_usage:
                yield sse({**shape(res, None, final=True), "choices": [], "usage": usage(res)})
            if not llama:
                yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse({"error": {"message": e.message, "type": e.kind, "code": e.status}})
        finally:
            await pieces.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def base(state: ServerState, kind: str, rid: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": state.alias}


def text_of(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


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


def llama_probs(probs: list[TokenProb]) -> list[dict]:
    """llama.cpp's `completion_probabilities`: [{id, token, bytes, logprob, top_logprobs: [{id, token, bytes,
    logprob}]}]."""

    def entry(tok: int, piece: bytes, lp: float) -> dict:
        return {"id": tok, "token": text_of(piece), "bytes": list(piece), "logprob": lp}

    return [{**entry(p.token, p.piece, p.logprob), "top_logprobs": [entry(*t) for t in p.top]} for p in probs]


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_object(request)
    tokens = messages_of(state, body)
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False) -> dict:
        new = res.new_probs(final and not body.get("stream"))
        logprobs = None if new is None else chat_logprobs(new)
        if piece is None and final and not body.get("stream"):
            msg = {"role": "assistant", "content": res.text}
            return {**base(state, "chat.completion", rid), "choices": [{"index": 0, "message": msg,
                    "finish_reason": res.finish, "logprobs": logprobs}], "usage": usage(res), "mode": res.mode}
        delta = {"role": "assistant", "content": ""} if first else {} if final else {"content": piece}
        return {**base(state, "chat.completion.chunk", rid), "choices": [{"index": 0, "delta": delta,
                "finish_reason": res.finish if final else None, "logprobs": logprobs}]}

    return await respond(state, request, tokens, body, shape, "chat")


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_object(request)
    tokens = prompt_of(state, body)
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
        return out

    return await respond(state, request, tokens, body, shape, "completions")


async def llama_completion(request: Request) -> Response:
    """llama.cpp's /completion: {prompt, n_predict, ...} -> {content, stop, timings, ...}"""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    tokens = prompt_of(state, body)

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False) -> dict:
        new = res.new_probs(final and not body.get("stream"))
        probs = {} if new is None else {"completion_probabilities": llama_probs(new)}
        if not final:
            return {"content": piece or "", "stop": False, **probs}
        out = {"content": "" if body.get("stream") else res.text, "stop": True, "model": state.alias, **probs,
               "tokens_predicted": res.n_generated, "tokens_evaluated": res.n_prompt, "mode": res.mode,
               "stop_type": {"stop": "word" if res.finish == "stop" else "eos", "length": "limit"}.get(
                   res.finish or "", "none"), "timings": timings(res)}
        return out

    return await respond(state, request, tokens, body, shape, "llama")


async def embeddings(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_object(request)
    inputs = body.get("input", body.get("content"))
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or len(inputs) > 256:
        raise ApiError(400, "'input' must be a non-empty string or list of at most 256 strings", param="input")
    data, n_tokens = [], 0
    for i, text in enumerate(inputs):
        tokens = prompt_of(state, {"input": text}, "input")
        if len(tokens) > state.engine.slots.n_ctx_slot:
            raise ApiError(400, f"input {i} has {len(tokens)} tokens, more than the context allows: "
                                f"{state.engine.slots.n_ctx_slot}", param="input")
        try:
            vec = await asyncio.to_thread(state.engine.slots.embed, tokens)
        except _core.SpecEEError as e:
            raise ApiError(503, f"cannot embed now: {e}", "server_error", headers={"Retry-After": "1"}) from None
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        data.append({"object": "embedding", "index": i, "embedding": vec.astype(float).tolist()})
        n_tokens += len(tokens)
    return JSONResponse({"object": "list", "data": data, "model": state.alias,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [{"id": state.alias, "object": "model", "created": state.created,
                                                     "owned_by": "specee", "meta": {"n_ctx": state.model.n_ctx,
                                                     "n_vocab": state.model.n_vocab, "desc": state.model.desc}}]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("content"), str):
        raise ApiError(400, "'content' must be a string", param="content")
    special = _field(body, "add_special", bool, False)
    return JSONResponse({"tokens": state.model.tokenize(body["content"], add_special=special, parse_special=True)})


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_body(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                               0 <= t < state.model.n_vocab for t in tokens):
        raise ApiError(400, f"'tokens' must be a list of token ids in [0, {state.model.n_vocab})", param="tokens")
    return JSONResponse({"content": state.model.detokenize(tokens)})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if not state.metrics:
        raise ApiError(501, "the metrics endpoint is off (start the server with --metrics)", "not_supported_error")
    e = state.engine
    with e.cond:
        m, tot, waiting, running = dict(e.metrics), e.slots.totals(), len(e.waiting), len(e.running)
    rows = [
        ("prompt_tokens_total", "counter", "prompt tokens evaluated", m["prompt_tokens"]),
        ("prompt_seconds_total", "counter", "time in prompt evaluation", m["prompt_ms"] / 1e3),
        ("tokens_predicted_total", "counter", "tokens generated", tot["n_tokens"]),
        ("requests_total", "counter", "requests submitted to the slots", tot["n_requests"]),
        ("requests_cancelled_total", "counter", "requests whose client left (or a stop string ended)",
         m["requests_cancelled"]),
        ("requests_refused_total", "counter", "requests refused with 503 (queue full)", m["requests_refused"]),
        ("requests_processing", "gauge", "requests on a slot", running),
        ("requests_deferred", "gauge", "requests waiting for a slot", waiting),
        ("slots_total", "gauge", "parallel slots (-np)", e.slots.n_slots),
        ("slots_busy_ratio", "gauge", "share of the slots holding a request", running / e.slots.n_slots),
        ("passes_total", "counter", "passes of the model", tot["n_passes"]),
        ("pass_tokens_total", "counter", "tokens evaluated in the shared passes", tot["n_pass_tokens"]),
        ("pass_seconds_total", "counter", "time in the shared passes", tot["t_pass_ms"] / 1e3),
        ("tokens_per_pass", "gauge", "tokens evaluated per shared pass (batching)",
         tot["n_pass_tokens"] / tot["n_passes"] if tot["n_passes"] else 0.0),
        ("accepted_tokens_per_step", "gauge", "EAGLE requests: tokens per draft-and-verify step",
         m["spec_tokens"] / m["spec_steps"] if m["spec_steps"] else 0.0),
        ("exit_ratio", "gauge", "early-exit requests: share of tokens that left before the last layer",
         m["exit_exits"] / m["exit_steps"] if m["exit_steps"] else 0.0),
    ]
    text = "".join(f"# HELP specee:{n} {h}\n# TYPE specee:{n} {t}\nspecee:{n} {v}\n" for n, t, h, v in rows)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# ---- the app --------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    model: Model
    engine: Engine
    alias: str
    mode: str
    api_key: str | None
    metrics: bool
    created: int = field(default_factory=lambda: int(time.time()))


class Guard:
    """ASGI middleware: the API key (every endpoint but /health) and ApiError as an OpenAI-shaped response."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = self.state.api_key
        if key and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {key}":
                return await ApiError(401, "invalid API key", "authentication_error").response()(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except ApiError as e:
            await e.response()(scope, receive, send)


def make_app(state: ServerState) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/completion", llama_completion, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models),
        Route("/models", models),
        Route("/health", health),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}",
                        "not_found_error" if status == 404 else "invalid_request_error").response()

    app = Starlette(routes=routes, middleware=[Middleware(Guard, state=state)],
                    exception_handlers={404: not_found, 405: not_found})
    app.state.server = state
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specee-server", description="OpenAI-compatible server with parallel slots "
                                "batched in the runtime, EAGLE and SpecEE early exit per request")
    p.add_argument("-m", "--model", help="GGUF model file (default: the embedded SmolLM2-135M)")
    p.add_argument("-a", "--alias", help="the model's name in the API (default: the file's name)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="KV cache cells, shared by the slots (4096)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="parallel slots: requests decoded together (4)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="most tokens in one pass (512)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="most prompt tokens prefilled in one pass beside the decoding slots (256)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (64)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the CPUs this process may use)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--api-key", default=os.environ.get("SPECEE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECEE_API_KEY; none)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1, help="layers on the GPUs / RPC servers (-1: all)")
    p.add_argument("--rpc", help="comma-separated HOST:PORT of ggml RPC servers")
    p.add_argument("--draft-head", help="draft head file (EAGLE head, exit predictors); 'default': the shipped one")
    p.add_argument("--mode", default="auto", choices=MODES, help="decoding mode of requests that name none (auto)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        warnings.warn(f"specee-server listens on {args.host}: reachable from other machines"
                      f"{'' if args.api_key else ' without an API key (--api-key)'}", stacklevel=1)
    model = Model(args.model, n_ctx=args.ctx_size, n_batch=args.batch_size, n_threads=args.threads,
                  draft_head=args.draft_head, n_gpu_layers=args.n_gpu_layers,
                  rpc_servers=args.rpc.split(",") if args.rpc else None)
    engine = Engine(model, args.parallel, args.max_queue, args.prefill_chunk)
    alias = args.alias or os.path.basename(model.path)
    state = ServerState(model, engine, alias, args.mode, args.api_key, args.metrics)
    app = make_app(state)
    sys.setswitchinterval(0.001)  # the batching thread takes the GIL back soon after each pass
    engine.start()
    print(f"specee-server: {alias} on http://{args.host}:{args.port} ({args.parallel} slots of "
          f"{engine.slots.n_ctx_slot} tokens)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
