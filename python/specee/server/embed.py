"""Embeddings and reranking, pooled as the server was started (--pooling, --reranking; specee.pooling's table):
OpenAI's /v1/embeddings, llama.cpp's /embeddings (/embedding), and /rerank (/v1/rerank, /reranking, /v1/reranking) in
Jina's shape, or TEI's when the documents come as `texts`. Each text is evaluated between the slots' passes on a KV
sequence of its own (`Slots.embed`)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specee import _core
from specee.server.engine import ServerState
from specee.server.request import ApiError, body_field, json_object, off_loop, prompts_of

MAX_INPUTS = 256  # texts in one request


async def embed_tokens(state: ServerState, tokens: list[int], pooling: str, key: str, i: int) -> np.ndarray:
    """The tokens pooled (`Slots.embed`, not normalised), counted in the metrics as llama.cpp counts them; 400 when
    they do not fit a slot."""
    n_ctx = state.engine.n_ctx_slot
    if not tokens:
        raise ApiError(400, f"{key} {i} is empty: nothing to embed", param=key)
    if len(tokens) > n_ctx:
        raise ApiError(400, f"{key} {i} has {len(tokens)} tokens, more than the context allows: {n_ctx}",
                       "exceed_context_size_error", param=key, extra={"n_prompt_tokens": len(tokens), "n_ctx": n_ctx})
    try:
        vec = await asyncio.to_thread(state.engine.slots.embed, tokens, pooling)
    except _core.SpecEEError as e:
        raise ApiError(503, f"cannot embed now: {e}", "server_error", headers={"Retry-After": "1"}) from None
    with state.engine.cond:  # llama.cpp's metrics count an embedding's prompt and its pass
        state.engine.metrics["prompt_tokens"] += len(tokens)
        state.engine.metrics["embed_passes"] += 1
    return vec


def normalized(vec: np.ndarray, p: int) -> np.ndarray:
    """A pooled vector scaled as llama.cpp's embd_normalize says: -1 not at all, 0 its largest magnitude to 32760 (the
    int16 range), 1 to unit taxicab length, 2 to unit length (the default), p > 2 to unit p-norm."""
    x = np.abs(vec.astype(np.float64))
    if p < 0:
        return vec
    norm = x.max() / 32760.0 if p == 0 else x.sum() if p == 1 else float((x ** p).sum() ** (1.0 / p))
    return (vec / norm if norm > 0 else vec * 0.0).astype(np.float32)


async def embeddings(request: Request) -> Response:
    """OpenAI's shape at /v1/embeddings (pooling none refused, as llama.cpp does), llama.cpp's at /embeddings or for a
    body with `content`: [{index, embedding: [rows]}] (one row when pooled, every token's row as it is with pooling
    none). A pooled vector is scaled as `embd_normalize` says (the request's, else --embd-normalize; 2: unit length)."""
    state: ServerState = request.app.state.server
    body = await json_object(request)
    oai = request.url.path.startswith("/v1/") and "input" in body
    if state.pooling == "rank":
        raise ApiError(400, "this server scores documents (--reranking): POST /rerank; embeddings need another "
                       "--pooling")
    if oai and state.pooling == "none":
        raise ApiError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type "
                       "(POST /embeddings gives every token's row)")
    inputs = body.get("input", body.get("content"))
    if isinstance(inputs, list) and len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"'input' must be a non-empty string or list of at most {MAX_INPUTS} strings",
                       param="input")
    encoding = body_field(body, "encoding_format", str, "float", lambda v: v in ("float", "base64"),
                          "'float' or 'base64'")
    norm = body_field(body, "embd_normalize", int, state.embd_normalize, lambda v: v >= -1, "an integer >= -1")
    # inputs as completion prompts: a string, token ids, a JSON prompt object, or a list of these
    prompts = await off_loop(request, prompts_of, state.model, {"input": inputs}, "input")
    data: list[dict[str, Any]] = []
    n_tokens = 0
    for i, tokens in enumerate(prompts):
        vec = await embed_tokens(state, tokens, state.pooling, "input", i)
        n_tokens += len(tokens)
        if not oai:
            rows = vec if state.pooling == "none" else normalized(vec, norm)[None, :]
            data.append({"index": i, "embedding": rows.astype(float).tolist()})
        elif encoding == "base64":
            data.append({"object": "embedding", "index": i, "encoding_format": "base64",
                         "embedding": base64.b64encode(normalized(vec, norm).astype("<f4").tobytes()).decode()})
        else:
            data.append({"object": "embedding", "index": i, "embedding": normalized(vec, norm).astype(float).tolist()})
    if not oai:
        return JSONResponse(data)
    return JSONResponse({"object": "list", "data": data, "model": state.alias,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


# ---- reranking ----------------------------------------------------------------------------------------------


def rerank_prompt(state: ServerState, query: str, document: str) -> list[int]:
    """A (query, document) pair as llama.cpp's server lays it out: the file's tokenizer.chat_template.rerank with
    {query} and {document} filled in, else BOS (as the vocabulary asks), the query, EOS (when the vocabulary adds
    one), SEP (likewise), the document, EOS."""
    model, meta = state.model, state.model.metadata
    template = meta.get("tokenizer.chat_template.rerank")
    if template:
        text = template.replace("{query}", query).replace("{document}", document)
        return model.tokenize(text, add_special=False, parse_special=True)
    add_eos = meta.get("tokenizer.ggml.add_eos_token") == "true"
    sep = meta.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling
    tokens = model.tokenize(query, add_special=True)  # BOS, the query, EOS as the vocabulary asks
    if meta.get("tokenizer.ggml.add_sep_token") == "true" and sep is not None:
        tokens.append(int(sep))
    tokens += model.tokenize(document, add_special=False)
    return tokens + [model.eos] if add_eos else tokens


async def rerank(request: Request) -> Response:
    """llama.cpp's /rerank: each document's relevance to the query (rank pooling), best first, `top_n` of them; Jina's
    shape {model, object, usage, results: [{index, relevance_score}]}, or TEI's [{index, score(, text)}] when the
    documents come as `texts` (`return_text`: each with its text)."""
    state: ServerState = request.app.state.server
    if state.pooling != "rank":
        raise ApiError(501, "This server does not support reranking. Start it with `--reranking`",
                       "not_supported_error")
    body = await json_object(request)
    tei = "texts" in body
    if not isinstance(body.get("query"), str):
        raise ApiError(400, "\"query\" must be provided" if body.get("query") is None else "\"query\" must be a string",
                       param="query")
    key = "texts" if tei else "documents"
    documents = body.get(key)
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise ApiError(400, f"\"{key}\" must be a non-empty string array", param=key)
    if len(documents) > MAX_INPUTS:
        raise ApiError(400, f"\"{key}\": at most {MAX_INPUTS} documents", param=key)
    top_n = body_field(body, "top_n", int, len(documents), lambda v: v >= 0, "an integer >= 0")
    return_text = tei and body_field(body, "return_text", bool, False)
    prompts = await off_loop(request, lambda: [rerank_prompt(state, body["query"], d) for d in documents])
    label = "score" if tei else "relevance_score"
    results, n_tokens = [], 0
    for i, tokens in enumerate(prompts):
        score = float((await embed_tokens(state, tokens, "rank", key, i))[0])
        n_tokens += len(tokens)
        results.append({"index": i, label: score, **({"text": documents[i]} if return_text else {})})
    results.sort(key=lambda r: -r[label])  # stable: equal scores keep the documents' order
    results = results[:top_n]
    if tei:
        return JSONResponse(results)
    return JSONResponse({"model": state.alias, "object": "list",
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results})
