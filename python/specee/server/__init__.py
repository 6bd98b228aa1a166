"""specee-server: an OpenAI-compatible HTTP server over the runtime's parallel slots.

    python -m specee.server -m model.gguf -np 4 --port 8080

The batching loop is the library's (csrc/serve/specee-slots.cpp): one thread here calls `Slots.step()` (one pass of the
model, the GIL released) while the event loop takes requests; each pass decodes the next token of every plain
request at once, verifies the draft trees of EAGLE requests (eagle, eagle2: per request with the extra field "mode")
and prefills a chunk of a new prompt beside them; early-exit and tree-exit requests (checked with the extra field
"exit_check") run their sequence alone after the shared pass. This package only parses requests, turns tokens into
text (stop strings included) and writes responses. HTTP is Starlette on uvicorn (docs/server.md says why).

    request.py     a request read and checked: body, prompt, its generation parameters (the options made once)
    engine.py      the batching thread over the slots, and the state the endpoints share
    generation.py  one generation as text (stop strings, log-probabilities) and as a response (JSON or events)
    templates.py   chat messages -> prompt text: the built-in templates or jinja2 (--jinja)
    tools.py       tool calls on chat: tools checked, history rendered, the reply held to a schema and read back
    tool_formats.py  each family's tool-call format (Hermes, Llama 3, Mistral): chosen from the template, read back
                   whole or streamed, its grammar under tool_choice required
    openai.py      OpenAI's endpoints: chat (tool calls included), completions, embeddings, models; /apply-template
    anthropic.py   Anthropic's /v1/messages and /v1/messages/count_tokens over chat's path
    responses.py   OpenAI's Responses API, /v1/responses, over chat's path
    llama.py       llama.cpp's endpoints: /completion, /tokenize, /detokenize, /health, /props, /slots (a slot's cache
                   saved, restored, erased), /metrics
    infill.py      llama.cpp's /infill: the fill-in-the-middle prompt laid out with the model's FIM tokens
    gcp.py         Vertex AI's predict route (AIP_MODE=PREDICTION): each instance to one of the POST endpoints
    sleep.py       --sleep-idle-seconds: the model unloaded when idle, loaded again by the next request needing it
    router.py      router mode (no -m, --models-dir / --models-preset): a child server per model, requests routed
    app.py         the routes, the guard (API key, errors, the sleeper), the flags, the listening sockets, main()
"""

from specee._optional import missing_package_exits

with missing_package_exits("specee-server"):  # the [server] extra: Starlette, uvicorn, jinja2
    from specee.server.app import main, parse_args

__all__ = ["main", "parse_args"]
