"""llama.cpp's server endpoints, in its shapes: /completion (with its `timings` and `completion_probabilities`),
/tokenize, /detokenize, /health, /props and /metrics (Prometheus text, under `specee:`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from specee.generate import GenerateOptions
from specee.server.engine import ServerState
from specee.server.generation import Result, TokenProb, respond, text_of
from specee.server.request import MAX_BODY, ApiError, body_field, json_body, json_object, off_loop, prompt_of


def timings(res: Result) -> dict:
    """llama.cpp's `timings` object."""
    st = res.stats
    pn, pms = int(st.get("n_prompt", 0)), float(st.get("t_prompt_ms", 0.0))
    dn, dms = int(st.get("n_decoded", 0)), float(st.get("t_decode_ms", 0.0))
    return {"prompt_n": pn, "prompt_ms": pms, "prompt_per_token_ms": pms / pn if pn else 0.0,
            "prompt_per_second": 1e3 * pn / pms if pms else 0.0, "predicted_n": dn, "predicted_ms": dms,
            "predicted_per_token_ms": dms / dn if dn else 0.0, "predicted_per_second": 1e3 * dn / dms if dms else 0.0,
            "cache_n": int(st.get("n_reused", 0))}


def llama_probs(probs: list[TokenProb]) -> list[dict]:
    """llama.cpp's `completion_probabilities`: [{id, token, bytes, logprob, top_logprobs: [{id, token, bytes,
    logprob}]}]."""

    def entry(tok: int, piece: bytes, lp: float) -> dict:
        return {"id": tok, "token": text_of(piece), "bytes": list(piece), "logprob": lp}

    return [{**entry(p.token, p.piece, p.logprob), "top_logprobs": [entry(*t) for t in p.top]} for p in probs]


async def llama_completion(request: Request) -> Response:
    """llama.cpp's /completion: {prompt, n_predict, ...} -> {content, stop, timings, ...}"""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    tokens = await off_loop(request, prompt_of, state.model, body)

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


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    """llama.cpp's /props: the settings a request gets when it names none, `n_predict` the server's cap (-n; -1: none,
    a request then generates until an end-of-generation token or a full slot of `n_ctx` tokens, its prompt
    included), the slots, the largest body."""
    state: ServerState = request.app.state.server
    o = GenerateOptions()
    params = {"n_predict": state.n_predict, "temperature": o.temp, "top_k": o.top_k, "top_p": o.top_p,
              "min_p": o.min_p, "mode": state.mode}
    return JSONResponse({"default_generation_settings": {"n_ctx": state.engine.slots.n_ctx_slot,
                                                         "n_predict": state.n_predict, "params": params},
                         "total_slots": state.engine.slots.n_slots, "model_alias": state.alias,
                         "max_body_bytes": MAX_BODY})


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("content"), str):
        raise ApiError(400, "'content' must be a string", param="content")
    special = body_field(body, "add_special", bool, False)

    def answer() -> Response:  # a 4 MiB body: a second of tokenizing and a list of millions to write
        try:
            tokens = state.model.tokenize(body["content"], add_special=special, parse_special=True)
        except ValueError as e:  # a lone surrogate (json_body refuses them first)
            raise ApiError(400, f"'content': {e}", param="content") from None
        # written in pieces: json.dumps of the whole list would hold the GIL, and so the event loop, for 0.5 s
        parts = [",".join(map(str, tokens[i:i + 65536])) for i in range(0, len(tokens), 65536)]
        return Response('{"tokens":[' + ",".join(parts) + "]}", media_type="application/json")

    return await off_loop(request, answer)


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_body(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None

    def answer() -> Response:
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                   0 <= t < state.model.n_vocab for t in tokens):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {state.model.n_vocab})", param="tokens")
        return JSONResponse({"content": state.model.detokenize(tokens)})

    return await off_loop(request, answer)


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
