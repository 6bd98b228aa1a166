"""One generation as text and as a response, whatever the API: its tokens turned into text as they come (stop strings
and split UTF-8 sequences held back), its log-probabilities, and the response, one JSON body or server-sent events.
Each API gives `respond` a `shape` function that writes its own body for a chunk or for the whole."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specee import _core
from specee.generate import StopText
from specee.grammar import GRAMMAR_TYPES, check_spec
from specee.server.engine import Job, ServerState
from specee.server.reasoning import ThoughtBudget
from specee.server.request import ApiError, RequestParams, body_field, request_params

FINISH = {"stop": "stop", "length": "length", "context": "length", None: None, "error": "error"}


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
    slot: int = -1  # the slot it ran on
    n_probs: int = -1  # the request's alternatives per token; < 0: no log-probabilities
    probs: list[TokenProb] = field(default_factory=list)  # with n_probs >= 0, per generated token
    probs_sent: int = 0  # of probs, given out in stream chunks so far
    tokens: list[int] = field(default_factory=list)  # the generated token ids
    tokens_sent: int = 0  # of tokens, given out in stream chunks so far
    truncated: bool = False  # llama.cpp's: the context filled (the request ended there, or was shifted)

    def new_tokens(self) -> list[int]:
        """The generated token ids not yet given out."""
        new, self.tokens_sent = self.tokens[self.tokens_sent:], len(self.tokens)
        return new

    def new_probs(self, whole: bool) -> list[TokenProb] | None:
        """The tokens' log-probabilities not yet given out; None where there are none to give (whole: a whole
        response, which has them, maybe [], when the request asked)."""
        new, self.probs_sent = self.probs[self.probs_sent:], len(self.probs)
        return new if new or (whole and self.n_probs >= 0) else None


@dataclass
class Progress:
    """llama.cpp's `prompt_progress` (return_progress): the prompt's tokens, those its slot's cache held when the
    request came, those in the cache now, and the milliseconds since a slot took it."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def json(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}

    def timings(self) -> dict:
        """`timings` so far: the prompt's, nothing generated yet."""
        n, ms = self.processed - self.cache, self.time_ms
        return {"cache_n": self.cache, "prompt_n": n, "prompt_ms": ms, "prompt_per_token_ms": ms / n if n else 0.0,
                "prompt_per_second": 1e3 * n / ms if ms else 0.0, "predicted_n": 0, "predicted_ms": 0.0,
                "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}


def text_of(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def usage(res: Result) -> dict:
    return {"prompt_tokens": res.n_prompt, "completion_tokens": res.n_generated,
            "total_tokens": res.n_prompt + res.n_generated}


def timings(res: Result) -> dict:
    """llama.cpp's `timings` object: prompt_n the prompt tokens evaluated (cache_n more were reused), predicted_n the
    tokens generated, the rates over the decoding steps (the first token comes from the prompt's pass); draft_n the
    draft tokens verified and draft_n_accepted those accepted, where any were drafted."""
    st = res.stats
    pn, pms = int(st.get("n_prompt", 0)), float(st.get("t_prompt_ms", 0.0))
    dn, dms = int(st.get("n_decoded", 0)), float(st.get("t_decode_ms", 0.0))
    drafts = {"draft_n": int(st["n_drafted"]), "draft_n_accepted": int(st.get("n_accepted", 0))} \
        if st.get("n_drafted", 0) > 0 else {}  # as llama.cpp: only where something was drafted
    return {**drafts, "cache_n": int(st.get("n_reused", 0)), "prompt_n": pn, "prompt_ms": pms,
            "prompt_per_token_ms": pms / pn if pn else 0.0, "prompt_per_second": 1e3 * pn / pms if pms else 0.0,
            "predicted_n": int(st.get("n_tokens", res.n_generated)), "predicted_ms": dms,
            "predicted_per_token_ms": dms / dn if dn and dms else 0.0,
            "predicted_per_second": 1e3 * dn / dms if dn and dms else 0.0}


def sse(obj: Any, named: bool = False) -> str:
    """One server-sent event; named: with an `event:` line, its object's "type" (Anthropic's events)."""
    head = f"event: {obj['type']}\n" if named else ""
    return f"{head}data: {json.dumps(obj)}\n\n"


def chunks(out: dict | list[dict] | None) -> list[dict]:
    """What a `shape` gave for a stream: one chunk, several, or none (a piece held back)."""
    return [] if out is None else out if isinstance(out, list) else [out]


async def generate(state: ServerState, request: Request, tokens: list[int], params: RequestParams,
                   result: Result) -> AsyncGenerator[str | Progress, None]:
    """Text pieces of one generation as they complete (and, with return_progress, the prompt's `Progress` before
    them); `result` holds the rest when it ends. The slot is freed when the client goes away, or a stop string is
    found."""
    engine = state.engine
    if len(tokens) >= engine.n_ctx_slot:
        raise ApiError(400, f"the prompt has {len(tokens)} tokens, more than the context allows: {engine.n_ctx_slot}"
                       f" per slot (-c {engine.model.n_ctx} over -np {engine.n_slots})",
                       "exceed_context_size_error", param="prompt",
                       extra={"n_prompt_tokens": len(tokens), "n_ctx": engine.n_ctx_slot})
    job = Job(tokens, params, asyncio.get_running_loop())
    engine.submit(job)
    out = StopText(params.stop)
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
            if event[0] == "error":  # the request refused (400), or a failed pass (500)
                raise ApiError(event[2], event[1], "invalid_request_error" if event[2] == 400 else "server_error")
            if event[0] == "start":
                result.mode, result.slot = event[1], event[2]
                yield ""  # admitted: a stream's headers can go
            elif event[0] == "progress":
                yield Progress(len(tokens), *event[1:])
            elif event[0] == "tokens":
                if event[3] is not None:  # timings_per_token: the stats so far
                    result.stats = event[3]
                for i, tok in enumerate(event[1]):
                    result.n_generated += 1
                    result.tokens.append(tok)
                    raw = engine.model.token_to_piece(tok, tok in params.preserved)
                    if params.n_probs >= 0:
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
                if finish == "error" and error.split(":", 1)[0] in GRAMMAR_TYPES:  # the request's grammar gave out
                    raise ApiError(400, f"the grammar failed during generation: {error}", param="grammar")
                if finish == "error":
                    raise ApiError(500, f"generation failed: {error}", "server_error")
                rest = out.finish()
                result.text += rest
                result.finish, result.stats = FINISH[finish], stats
                result.truncated = finish == "context" or stats.get("n_shifted", 0) > 0
                if rest:
                    yield rest
                return
    finally:
        if result.finish is None or result.finish == "stop":
            engine.cancel(job)  # gone, or ended by a stop string: free the slot now


async def generate_all(state: ServerState, request: Request, tokens: list[int], params: RequestParams) -> Result:
    """One generation run to its end, not streamed."""
    res = Result(n_probs=params.n_probs)
    async for _ in generate(state, request, tokens, params, res):
        pass
    return res


async def compile_grammar(state: ServerState, spec: tuple[int, str] | None, tools: bool = False) -> None:
    """A request's grammar compiled before it reaches the batching thread: on a worker thread (off the event loop; the
    runtime compiles on a thread of its own within its budget), into the runtime's cache, where the slot's submit
    finds it. 400 with the runtime's short message when it is refused (with `tools`, said of the request's tools:
    the grammar is the one that holds a reply to them)."""
    if spec is None or state.sleeping:
        return
    try:
        await asyncio.to_thread(check_spec, state.model, spec)
    except _core.SpecEEError as e:
        if tools:
            raise ApiError(400, f"tools: the grammar that holds a reply to them is refused: {e}", param="tools") from None
        raise ApiError(400, str(e), param="grammar") from None


async def respond(state: ServerState, request: Request, tokens: list[int], body: dict, shape: Callable[..., Any],
                  api: str, budget: ThoughtBudget | None = None) -> Response:
    """A generation's response (api: chat, completions, llama, anthropic, responses): one JSON body, or server-sent
    events when body["stream"]. In a stream, `shape` may give a list of chunks or None (a piece it holds back: a tool
    call is sent once it is whole); Anthropic's and the Responses API's events are named and end without [DONE].
    With return_progress, each `Progress` goes out as the chunk `shape` makes of an empty piece, with
    `prompt_progress`; with timings_per_token, every chunk has the `timings` so far. `budget`: a chat's thinking
    budget (server/reasoning.py)."""
    params = request_params(body, api, state.mode, state.n_predict, state.sampling, state.model,
                            state.engine.n_lora)
    params.budget = budget
    await compile_grammar(state, params.options.grammar_spec, bool(body.get("tools")))
    stream = body_field(body, "stream", bool, False)
    stream_options = body_field(body, "stream_options", dict, {})
    include_usage = stream and bool(stream_options.get("include_usage"))
    if not stream and params.n_choices > 1:  # n choices: n generations on the slots, one response
        results = await asyncio.gather(*(generate_all(state, request, tokens, params) for _ in range(params.n_choices)))
        bodies = [shape(r, None, final=True) for r in results]
        out = {**bodies[0], "choices": [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]}
        n_generated = sum(r.n_generated for r in results)
        out["usage"] = {"prompt_tokens": len(tokens), "completion_tokens": n_generated,
                        "total_tokens": len(tokens) + n_generated}
        return JSONResponse(out)
    if not stream:
        return JSONResponse(shape(await generate_all(state, request, tokens, params), None, final=True))
    res = Result(n_probs=params.n_probs)
    pieces = generate(state, request, tokens, params, res)
    first = await pieces.__anext__()  # admitted (or an ApiError now, before any header)
    assert first == ""

    async def events() -> AsyncIterator[str]:
        named = api in ("anthropic", "responses")  # their events are named
        try:
            if api != "llama":  # OpenAI's first chunk: the role; llama.cpp's chunks each hold a piece
                for chunk in chunks(shape(res, "", first=True)):
                    yield sse(chunk, named)
            async for piece in pieces:
                if isinstance(piece, Progress):  # return_progress: a chunk with nothing new (chat's: the role, as
                    # llama.cpp's), and the progress
                    for chunk in chunks(shape(res, "")) or chunks(shape(res, "", first=True)):
                        yield sse({**chunk, "prompt_progress": piece.json(),
                                   **({"timings": piece.timings()} if params.timings else {})}, named)
                    continue
                for chunk in chunks(shape(res, piece)):
                    yield sse({**chunk, "timings": timings(res)} if params.timings else chunk, named)
            final = chunks(shape(res, None, final=True))
            for chunk in final:
                yield sse(chunk, named)
            if include_usage:
                yield sse({**final[-1], "choices": [], "usage": usage(res), "timings": timings(res)})
            if api not in ("llama", "anthropic", "responses"):
                yield "data: [DONE]\n\n"
        except ApiError as e:
            yield sse({"type": "error", "error": e.body()["error"]}, True) if named else sse(e.body())
        finally:
            await pieces.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
