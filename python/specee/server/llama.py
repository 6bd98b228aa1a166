"""llama.cpp's server endpoints, in its shapes: /completion (with its `timings` and `completion_probabilities`; /infill
lays out its prompt in server/infill.py and answers here), /tokenize, /detokenize, /health, /props, /lora-adapters,
/slots (and POST /slots/{id}: a slot's cache saved, restored, erased) and /metrics (Prometheus text: llama.cpp's
metrics under `llamacpp:`, this server's own under `specee:`)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import os
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from specee._core import SpecEEError
from specee.generate import GenerateOptions
from specee.server.engine import ServerState
from specee.server.generation import Result, TokenProb, generate_all, respond, text_of, timings
from specee.server.request import (MAX_BODY, ApiError, body_field, json_body, json_object, logit_bias_of, off_loop,
                                   lora_of, options_fields, prompts_of, request_params, shown, tokens_wanted)

# /props' build_info: llama.cpp's reads b<build>-<commit>; here the package's version
BUILD_INFO = f"b{importlib.metadata.version('specee')}-specee"

# a request's fields that /completion's generation_settings echo (llama.cpp's names)
GENERATION_FIELDS = ("n_predict", "seed", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                     "ignore_eos", "mode", "n_probs", "stop")


def llama_probs(probs: list[TokenProb], as_probs: bool = False) -> list[dict]:
    """llama.cpp's `completion_probabilities`: [{id, token, bytes, logprob, top_logprobs: [{id, token, bytes,
    logprob}]}]; as_probs (the request's post_sampling_probs): `prob` and `top_probs` instead, the probabilities
    themselves, which the slot then gives after the sampler's chain (top-k / top-p / min-p, temperature), as
    llama.cpp's."""

    def entry(tok: int, piece: bytes, lp: float) -> dict:
        value = {"prob": math.exp(lp)} if as_probs else {"logprob": lp}
        return {"id": tok, "token": text_of(piece), "bytes": list(piece), **value}

    top = "top_probs" if as_probs else "top_logprobs"
    return [{**entry(p.token, p.piece, p.logprob), top: [entry(*t) for t in p.top]} for p in probs]


def pick_fields(out: dict, fields: list[str]) -> dict:
    """llama.cpp's `response_fields`: only these fields, a path "a/b" read inside objects and kept under its path."""
    picked = {}
    for path in fields:
        value: Any = out
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            picked[path] = value
    return picked


def generation_settings(state: ServerState, body: dict) -> dict:
    """/completion's `generation_settings`: the request's settings over the server's (llama.cpp's names), its logit
    biases as llama.cpp lists them ({token, bias}, null: -inf; the end-of-generation tokens' with ignore_eos)."""
    settings = {**default_params(state), **{k: body[k] for k in GENERATION_FIELDS if body.get(k) is not None}}
    bias = logit_bias_of(state.model, body) or state.sampling.get("logit_bias") or ""
    items = (m.groups() for x in bias.split(",") if (m := re.match(r"(\d+)([+-])(.*)", x)))
    settings["logit_bias"] = [{"token": int(t), "bias": None if b == "inf" and sign == "-" else float(sign + b)}
                              for t, sign, b in items]
    if settings["ignore_eos"]:
        settings["logit_bias"] += [{"token": t, "bias": None} for t in state.model.eog_tokens]
    settings["n_predict"] = tokens_wanted(body, "llama", state.n_predict)  # the request's, else the server's -n
    return settings


def completion_final(state: ServerState, res: Result, tokens: list[int], settings: dict, stream: bool,
                     ids: list[int], probs: dict, index: int = 0) -> dict:
    """/completion's last answer (a stream's last chunk: its content and tokens were in the chunks before): `ids` the
    generated tokens it lists, `probs` its completion_probabilities ({} or the field); its `prompt` is the prompt's
    text with the special tokens' text (as llama-server's)."""
    return {"index": index, "content": "" if stream else res.text, "tokens": ids, "id_slot": res.slot, "stop": True,
            "model": state.alias, **probs, "tokens_predicted": res.n_generated, "tokens_evaluated": len(tokens),
            "generation_settings": settings,
            "prompt": state.model.detokenize(tokens, False, True),
            "has_new_line": "\n" in res.text, "truncated": res.truncated,
            "stop_type": {"stop": "word" if res.finish == "stop" else "eos", "length": "limit"}.get(res.finish or "",
                                                                                                  "none"),
            "stopping_word": "", "tokens_cached": len(tokens) + res.n_generated, "mode": res.mode,
            "timings": timings(res)}


def completion_partial(res: Result, piece: str | None, ids: list[int], probs: dict, index: int = 0) -> dict:
    """/completion's streamed chunk of a piece: `ids` its new tokens, `probs` their completion_probabilities."""
    return {"index": index, "content": piece or "", "tokens": ids, "stop": False, **probs}


def verbose_of(state: ServerState, body: dict, res: Result, tokens: list[int], piece: str | None,
               final: bool) -> dict:
    """llama.cpp's `__verbose` (--verbose, or a request's `verbose: true`) in OpenAI's shapes: what /completion would
    answer for this chunk or the whole, the prompt with its special tokens' text."""
    stream = bool(body.get("stream"))
    if not final:
        return {**completion_partial(res, piece, res.new_tokens(), {}), "id_slot": res.slot,
                "tokens_predicted": res.n_generated, "tokens_evaluated": len(tokens)}
    return completion_final(state, res, tokens, generation_settings(state, body), stream,
                            [] if stream else res.tokens, {})


def verbose(state: ServerState, body: dict) -> bool:
    return body.get("verbose") is True or state.verbose


async def llama_completion(request: Request) -> Response:
    """llama.cpp's /completion: {prompt, n_predict, ...} -> {content, stop, tokens, generation_settings, timings,
    ...}; a list of prompts (not streamed) -> a list of such answers."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    prompts = await off_loop(request, prompts_of, state.model, body)
    return await llama_answer(state, request, body, prompts)


async def llama_answer(state: ServerState, request: Request, body: dict, prompts: list[list[int]]) -> Response:
    """/completion's answer to `body` for these prompts (token ids; /infill's too): whole or streamed, one answer
    per prompt."""
    stream = body_field(body, "stream", bool, False)
    fields = body_field(body, "response_fields", list, [], lambda v: all(isinstance(f, str) for f in v),
                        "a list of field names")
    with_tokens = body_field(body, "return_tokens", bool, False)
    as_probs = body_field(body, "post_sampling_probs", bool, False)
    settings = generation_settings(state, body)

    def shape(res: Result, piece: str | None, first: bool = False, final: bool = False, tokens: list[int] = prompts[0],
              index: int = 0) -> dict:
        new = res.new_probs(final and not stream)
        probs = {} if new is None else {"completion_probabilities": llama_probs(new, as_probs)}
        ids = res.new_tokens() if stream else res.tokens
        if not final:
            return completion_partial(res, piece, ids if with_tokens or stream else [], probs, index)
        out = completion_final(state, res, tokens, settings, stream, ids if with_tokens else [], probs, index)
        return pick_fields(out, fields) if fields else out

    if len(prompts) == 1:
        return await respond(state, request, prompts[0], body, shape, "llama")
    if stream:
        raise ApiError(400, "'prompt': a list of prompts is answered as one JSON list, not streamed", param="prompt")
    params = request_params(body, "llama", state.mode, state.n_predict, state.sampling, state.model,
                            state.engine.n_lora)
    results = await asyncio.gather(*(generate_all(state, request, t, params) for t in prompts))
    return JSONResponse([shape(r, None, final=True, tokens=t, index=i)
                         for i, (r, t) in enumerate(zip(results, prompts))])


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def default_params(state: ServerState) -> dict:
    """The settings a request gets when it names none (the server's sampling flags over the library's defaults)."""
    o = GenerateOptions(**options_fields(state.sampling))
    return {"n_predict": state.n_predict, "seed": -1 if o.seed is None else o.seed, "temperature": o.temp,
            "top_k": o.top_k, "top_p": o.top_p, "min_p": o.min_p, "repeat_penalty": o.repeat_penalty,
            "repeat_last_n": o.repeat_last_n, "ignore_eos": o.ignore_eos, "mode": state.mode}


async def props(request: Request) -> Response:
    """llama.cpp's /props: the settings a request gets when it names none, `n_predict` the server's -n (for requests
    that give none; -1: none, such a request then generates until an end-of-generation token or a full slot of `n_ctx`
    tokens, its prompt included), the slots, the model's file, the largest body, whether the model is unloaded for
    now (--sleep-idle-seconds; answered without loading it)."""
    state: ServerState = request.app.state.server
    return JSONResponse({"default_generation_settings": {"n_ctx": state.engine.n_ctx_slot,
                                                         "n_predict": state.n_predict, "params": default_params(state)},
                         "total_slots": state.engine.n_slots, "model_alias": state.alias,
                         "model_path": state.model.path, "modalities": {"vision": False, "audio": False},
                         "max_body_bytes": MAX_BODY, "build_info": BUILD_INFO,
                         "is_sleeping": state.sleeping})


async def lora_adapters(request: Request) -> Response:
    """llama.cpp's GET /lora-adapters: each adapter's id, file and the scale of requests that give none; POST
    (a list of {id, scale}, the adapters not listed at 0) sets those scales for the requests that follow."""
    state: ServerState = request.app.state.server
    e = state.engine
    if request.method == "POST":
        body = await json_body(request)
        if not isinstance(body, list):
            raise ApiError(400, "the request body must be a list of {\"id\", \"scale\"} objects")
        e.set_lora_scales(lora_of({"lora": body}, e.n_lora) or {})
        return JSONResponse({"success": True})
    with e.cond:
        scales = list(e.lora_scales)
    return JSONResponse([{"id": a["id"], "path": a["path"], "scale": scales[a["id"]], "task_name": "",
                          "prompt_prefix": ""} for a in e.lora_adapters])


async def slots(request: Request) -> Response:
    """llama.cpp's GET /slots (unless --no-slots): each slot's id, context size and whether it holds a request."""
    state: ServerState = request.app.state.server
    if not state.slots:
        raise ApiError(501, "the slots endpoint is off (started with --no-slots)", "not_supported_error")
    e = state.engine
    with e.cond:
        busy = set(e.running)
    return JSONResponse([{"id": i, "n_ctx": e.n_ctx_slot, "is_processing": i in busy}
                         for i in range(e.n_slots)])


SLOT_ACTIONS = ("save", "restore", "erase")


def slot_file_name(name: Any) -> str:
    """A file name a request gives for a slot's cache: one name inside --slot-save-path, never a path out of it."""
    if (not isinstance(name, str) or not name or name in (".", "..") or name != name.strip()
            or len(name.encode("utf-8")) > 255 or any(c in name for c in "/\\:") or not name.isprintable()):
        raise ApiError(400, f"'filename' must be a file name (no path, no separators), not {shown(name)}",
                       param="filename")
    return name


async def slot_action(request: Request) -> Response:
    """llama.cpp's POST /slots/{id}?action=save|restore|erase: a free slot's cache (its tokens and their K/V cells)
    written to a file in --slot-save-path, read back into a slot (any slot: its next request reuses it as a cached
    prefix), or dropped. A slot holding a request is waited for."""
    state: ServerState = request.app.state.server
    if state.slot_save_path is None:
        raise ApiError(501, "this server does not save slots: start it with --slot-save-path DIR",
                       "not_supported_error")
    e = state.engine
    raw = request.path_params["id_slot"]
    if not raw.isdigit() or int(raw) >= e.slots.n_slots:
        raise ApiError(400, f"no slot {shown(raw)}: the slots are 0 to {e.slots.n_slots - 1}", param="id_slot")
    slot, action = int(raw), request.query_params.get("action", "")
    if action not in SLOT_ACTIONS:
        raise ApiError(400, f"'action' must be one of {', '.join(SLOT_ACTIONS)}, not {shown(action)}", param="action")
    name = path = ""
    if action != "erase":
        body = await json_object(request)
        name = slot_file_name(body.get("filename"))
        path = os.path.join(state.slot_save_path, name)

    def act() -> int | None:  # on a worker thread: None while the slot holds a request
        with e.cond:  # no request is admitted onto the slot meanwhile
            if slot in e.running:
                return None
            return e.slots.erase(slot) if action == "erase" else {"save": e.slots.save, "restore": e.slots.restore}[
                action](slot, path)

    t0 = time.perf_counter()
    while True:
        try:
            n = await asyncio.to_thread(act)
        except SpecEEError as err:
            raise ApiError(400, str(err), param="filename") from None
        if n is not None:
            break
        if await request.is_disconnected():
            return Response(status_code=204)
        await asyncio.sleep(0.05)
    ms = 1e3 * (time.perf_counter() - t0)
    if action == "erase":
        return JSONResponse({"id_slot": slot, "n_erased": n})
    counts = {"save": ("n_saved", "n_written"), "restore": ("n_restored", "n_read")}[action]
    return JSONResponse({"id_slot": slot, "filename": name, counts[0]: n, counts[1]: os.path.getsize(path),
                         "timings": {f"{action}_ms": ms}})


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("content"), str):
        raise ApiError(400, "'content' must be a string", param="content")
    special = body_field(body, "add_special", bool, False)
    pieces = body_field(body, "with_pieces", bool, False)

    def answer() -> Response:  # a 4 MiB body: a second of tokenizing and a list of millions to write
        try:
            tokens = state.model.tokenize(body["content"], add_special=special, parse_special=True)
        except ValueError as e:  # a lone surrogate (json_body refuses them first)
            raise ApiError(400, f"'content': {e}", param="content") from None
        if pieces:  # llama.cpp's with_pieces: [{id, piece}], a piece that is not whole UTF-8 as its bytes
            out = []
            for t in tokens:
                raw = state.model.token_to_piece(t)
                try:
                    out.append({"id": t, "piece": raw.decode("utf-8")})
                except UnicodeDecodeError:
                    out.append({"id": t, "piece": list(raw)})
            return JSONResponse({"tokens": out})
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
        m, b, tot, waiting, running = dict(e.metrics), dict(e.bucket), e.totals(), len(e.waiting), len(e.running)
        # the rate gauges average over the time since the last scrape, as llama.cpp's do
        e.bucket.update(prompt_tokens=0, prompt_ms=0.0, predicted_decoded=0, predicted_ms=0.0)
    # llama.cpp's metrics under its names, then this server's own under specee:
    rows = [
        ("llamacpp", "prompt_tokens_total", "counter", "prompt tokens evaluated", m["prompt_tokens"]),
        ("llamacpp", "prompt_tokens_cached_total", "counter", "prompt tokens reused from a slot's cache",
         m["prompt_cached"]),
        ("llamacpp", "prompt_seconds_total", "counter", "time in prompt evaluation", m["prompt_ms"] / 1e3),
        ("llamacpp", "tokens_predicted_total", "counter", "tokens generated", m["predicted_tokens"]),
        ("llamacpp", "tokens_predicted_seconds_total", "counter", "time in decoding", m["predicted_ms"] / 1e3),
        ("llamacpp", "n_decode_total", "counter", "passes of the model", tot["n_passes"] + m["embed_passes"]),
        ("llamacpp", "n_tokens_max", "counter", "most tokens a request has had (prompt and output)", m["tokens_max"]),
        ("llamacpp", "spec_decode_num_draft_tokens_total", "counter", "draft tokens verified (EAGLE and n-gram)",
         m["spec_drafted"]),
        ("llamacpp", "spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted", m["spec_accepted"]),
        ("llamacpp", "spec_decode_num_drafts_total", "counter", "draft-and-verify steps", m["spec_steps"]),
        ("llamacpp", "prompt_tokens_seconds", "gauge", "prompt tokens per second since the last scrape",
         1e3 * b["prompt_tokens"] / b["prompt_ms"] if b["prompt_ms"] else 0.0),
        ("llamacpp", "predicted_tokens_seconds", "gauge", "generated tokens per second since the last scrape",
         1e3 * b["predicted_decoded"] / b["predicted_ms"] if b["predicted_ms"] else 0.0),
        ("llamacpp", "requests_processing", "gauge", "requests on a slot", running),
        ("llamacpp", "requests_deferred", "gauge", "requests waiting for a slot", waiting),
        ("llamacpp", "n_busy_slots_per_decode", "gauge", "slots holding a request now", running),
        ("specee", "requests_total", "counter", "requests submitted to the slots", tot["n_requests"]),
        ("specee", "requests_cancelled_total", "counter", "requests whose client left (or a stop string ended)",
         m["requests_cancelled"]),
        ("specee", "requests_refused_total", "counter", "requests refused with 503 (queue full)",
         m["requests_refused"]),
        ("specee", "slots_total", "gauge", "parallel slots (-np)", e.n_slots),
        ("specee", "slots_busy_ratio", "gauge", "share of the slots holding a request", running / e.n_slots),
        ("specee", "passes_total", "counter", "passes of the model", tot["n_passes"]),
        ("specee", "pass_tokens_total", "counter", "tokens evaluated in the shared passes", tot["n_pass_tokens"]),
        ("specee", "pass_seconds_total", "counter", "time in the shared passes", tot["t_pass_ms"] / 1e3),
        ("specee", "tokens_per_pass", "gauge", "tokens evaluated per shared pass (batching)",
         tot["n_pass_tokens"] / tot["n_passes"] if tot["n_passes"] else 0.0),
        ("specee", "accepted_tokens_per_step", "gauge", "EAGLE requests: tokens per draft-and-verify step",
         m["spec_tokens"] / m["spec_steps"] if m["spec_steps"] else 0.0),
        ("specee", "exit_ratio", "gauge", "early-exit requests: share of tokens that left before the last layer",
         m["exit_exits"] / m["exit_steps"] if m["exit_steps"] else 0.0),
    ]
    text = "".join(f"# HELP {p}:{n} {h}\n# TYPE {p}:{n} {t}\n{p}:{n} {v}\n" for p, n, t, h, v in rows)
    response = PlainTextResponse(text, media_type="text/plain; version=0.0.4")
    response.raw_headers.append((b"Process-Start-Time-Unix", str(state.created).encode()))  # llama-server's spelling
    return response
