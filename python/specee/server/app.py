"""The app: its routes, the guard in front of them (the API key, refusals as OpenAI-shaped errors), the flags and
main()."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hmac
import importlib.metadata
import json
import logging
import os
import socket
import sys
import warnings
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from specee.context_options import CONTEXT_OPTIONS, add_context_flags, context_options_of
from specee._core import SpecEEError
from specee.generate import MODES, SPEC_TYPES, GenerateOptions
from specee.grammar import set_limit as set_grammar_limit
from specee.model import Model
from specee.pooling import POOLINGS
from specee.server.engine import Engine, ServerState
from specee.server.anthropic import count_tokens
from specee.server.anthropic import messages as anthropic_messages
from specee.server.flags import GENERATION_OPTIONS, add_llama_flags, llama_flags_of
from specee.server.embed import embeddings, rerank
from specee.server.gcp import GcpSettings, gcp_routes, gcp_settings
from specee.server.infill import infill
from specee.server.prompt_cache import DEFAULT_MIB, PromptCache
from specee.server.llama import (detokenize, health, llama_completion, lora_adapters, metrics, props, slot_action,
                                 slots, tokenize)
from specee.server.openai import apply_template, chat_completions, chat_input_tokens, completions, models
from specee.server.reasoning import ReasoningError, reasoning_of
from specee.server.request import ApiError, options_fields
from specee.server.responses import responses, responses_input_tokens
from specee.server.router import CHILD_ENV, ROUTER_ROUTES, RouterState, exit_with_router, make_router, router_lifespan
from specee.server.sleep import READ_ONLY, Sleeper
from specee.server.templates import ChatTemplate, chat_template_of

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)


CORS_METHODS = b"GET, POST, DELETE, OPTIONS"


def is_localhost(origin: str) -> bool:
    """An origin on this machine: http(s)://localhost, 127.0.0.1 or [::1], any port."""
    rest = origin.split("://", 1)[1] if "://" in origin else ""
    host = rest[1:rest.find("]")] if rest.startswith("[") else rest.split(":", 1)[0]
    return host in ("localhost", "127.0.0.1", "::1") and "/" not in rest


def cors_origin(origins: list[str], origin: str) -> str | None:
    """The Access-Control-Allow-Origin a request from `origin` gets (None: none, the browser refuses): '*' reflects
    any origin (credentials are allowed), 'localhost' those on this machine, else the listed ones."""
    if not origin:
        return "*" if origins == ["*"] else None
    if "*" in origins or origin in origins or ("localhost" in origins and is_localhost(origin)):
        return origin
    return None


def with_headers(send: Callable, extra: list[tuple[bytes, bytes]]) -> Callable:
    """An ASGI send that adds `extra` to the response's headers."""

    async def send_with(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with


class Guard:
    """ASGI middleware: CORS (a preflight OPTIONS is answered here, before the API key, as browsers send it without
    one; every response gets the allowed origin), the API key (every endpoint but /health; `Authorization: Bearer
    KEY` or Anthropic's `x-api-key: KEY`; compared in constant time), the sleeper (a request that needs the model
    wakes it and holds it awake until it ends, server/sleep.py) and ApiError as an OpenAI-shaped response; any other
    failure before a response began is a 500 in the same shape (its traceback in the log), never a bare one. `state`:
    the one-model server's ServerState, or the router's RouterState (server/router.py)."""

    def __init__(self, app: Any, state: ServerState | RouterState, sleeper: Sleeper | None = None) -> None:
        self.app, self.state, self.sleeper = app, state, sleeper

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        allowed = cors_origin(self.state.cors_origins, headers.get(b"origin", b"").decode("latin-1"))
        # header names as llama-server spells them (HTTP's are case-insensitive; some clients' dicts are not)
        cors = [] if allowed is None else [(b"Access-Control-Allow-Origin", allowed.encode("latin-1"))]
        if scope["method"] == "OPTIONS":
            cors += [(b"Access-Control-Allow-Credentials", b"true"), (b"Access-Control-Allow-Methods", CORS_METHODS),
                     (b"Access-Control-Allow-Headers", b"*"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": cors})
            return await send({"type": "http.response.body", "body": b""})
        if cors:
            send = with_headers(send, cors)
        key = self.state.api_key
        if key and scope["path"] != "/health":
            scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")  # the scheme in any case
            bearer = hmac.compare_digest(scheme.lower() + b" " + token.strip(), b"bearer " + key.encode())
            x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode())  # Anthropic's header
            if not (bearer or x_api_key):
                return await ApiError(401, "invalid API key", "authentication_error").response()(scope, receive, send)
        started = False

        async def send_noting(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        sleeper = self.sleeper
        held = False
        try:
            if sleeper is not None and scope["path"] not in READ_ONLY:
                await asyncio.to_thread(sleeper.hold)  # loads the model if it sleeps
                held = True
            await self.app(scope, receive, send_noting)
        except ApiError as e:
            if started:
                raise
            await e.response()(scope, receive, send)
        except ClientDisconnect:  # gone while its body was read: nobody to answer
            return
        except Exception as e:
            if started:
                raise
            logging.getLogger("specee.server").exception("%s %s", scope.get("method"), scope["path"])
            await ApiError(500, f"internal error: {type(e).__name__}", "server_error").response()(scope, receive, send)
        finally:
            if held:
                assert sleeper is not None
                sleeper.release()


def make_app(state: ServerState, sleeper: Sleeper | None = None, gcp: GcpSettings | None = None) -> Starlette:
    """The app; with `gcp` (AIP_MODE=PREDICTION), Vertex AI's predict and health routes too."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", llama_completion, methods=["POST"]),  # llama.cpp's, as llama-server routes it
        Route("/completion", llama_completion, methods=["POST"]),
        Route("/infill", infill, methods=["POST"]),  # llama.cpp's fill-in-the-middle (server/infill.py)
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/embeddings", embeddings, methods=["POST"]),  # llama.cpp's shape, as /embedding
        Route("/embedding", embeddings, methods=["POST"]),
        *[Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking")],
        Route("/v1/models", models),
        Route("/models", models),
        Route("/health", health),
        Route("/props", props),
        Route("/slots", slots),
        Route("/lora-adapters", lora_adapters, methods=["GET", "POST"]),
        Route("/slots/{id_slot}", slot_action, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/responses", responses, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses_input_tokens, methods=["POST"]),
        Route("/responses/input_tokens", responses_input_tokens, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics),
        *TEMPLATE_ROUTES,
    ]
    if gcp is not None:
        routes += gcp_routes(gcp, routes, health)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}",
                        "not_found_error" if status == 404 else "invalid_request_error").response()

    app = Starlette(routes=routes, middleware=[Middleware(Guard, state=state, sleeper=sleeper)],
                    exception_handlers={404: not_found, 405: not_found})
    app.state.server = state
    return app


# ---- chat templates, tool calls, Anthropic's API: their flags and routes ----------------------------------
# (one block: server/templates.py, server/tools.py, server/anthropic.py; docs/server.md "Chat templates and tools")

TEMPLATE_ROUTES = [
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/v1/messages", anthropic_messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]


def add_template_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jinja", action=argparse.BooleanOptionalAction, default=False,
                   help="render chats with jinja2: the model's tokenizer.chat_template, or --chat-template(-file) "
                   "(--no-jinja, the default: the built-in templates, byte-identical to their Jinja for the "
                   "templates they know; a model's own template they do not know is rendered with jinja2 anyway)")
    p.add_argument("--chat-template", metavar="NAME|TEXT",
                   help="the chat template: a built-in name (chatml, smollm2, qwen2.5, llama2, vicuna, llama3, zephyr, "
                   "phi3, gemma, command-r) or Jinja text (any text with --jinja); default: the model's own")
    p.add_argument("--chat-template-file", metavar="FILE", help="the chat template's text from a file")
    p.add_argument("--chat-template-kwargs", metavar="JSON", type=json_object_arg, default={},
                   help="variables for a Jinja template, a JSON object ('{\"enable_thinking\": false}'); a request's "
                   "chat_template_kwargs add to them")


def json_object_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def template_of(model: Model, args: argparse.Namespace) -> ChatTemplate:
    """The server's chat template from its flags; a clear exit (status 2) when it cannot render a chat."""
    try:
        template = chat_template_of(model, args.jinja, args.chat_template, args.chat_template_file,
                                    args.chat_template_kwargs, args.reasoning)
    except ValueError as e:
        print(f"specee-server: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if template.kind == "jinja" and not args.jinja:
        print("specee-server: the model's chat template is not a built-in one: rendered with jinja2",
              file=sys.stderr, flush=True)
    template.prefill = args.llama.get("prefill_assistant") != "--no-prefill-assistant"
    return template


# the settings (flags.py's server rows) that start the router instead of a model, when no -m is given
ROUTER_SETTINGS = ("models_dir", "models_preset", "models_max", "models_autoload")

# every context option (llama.cpp's -fa is accepted and changes nothing: attention is always ggml's flash attention)
CONTEXT_FLAGS = list(CONTEXT_OPTIONS)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specee-server", allow_abbrev=False, usage="%(prog)s [-m FNAME] [options]",
                                description="OpenAI-compatible server with parallel slots batched in the runtime, "
                                "EAGLE and SpecEE early exit per request")
    p.add_argument("-a", "--alias", help="the model's name in the API, or comma-separated names: "
                   "all are listed as /v1/models' aliases, the first in sorted order is its id (default: the file's "
                   "name)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="parallel slots: requests decoded together (4)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="most prompt tokens prefilled in one pass beside the decoding slots (256)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (64)")
    p.add_argument("--host", default="127.0.0.1", help="addresses to listen on, comma-separated (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--api-key", default=os.environ.get("SPECEE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECEE_API_KEY; none)")
    p.add_argument(*GENERATION_OPTIONS["mode"]["flags"], default="auto", choices=MODES,
                   help="decoding mode of requests that name none (auto)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    p.add_argument("-n", "--n-predict", "--predict", type=int, default=-1,
                   help="most tokens a request generates when it gives no max_tokens / n_predict (or -1); a request's "
                   "own is taken as it is, larger or not (llama-server's rule); /props shows it (default: -1 = until "
                   "an end-of-generation token or the slot's context is full, -c / -np tokens with the prompt)")
    p.add_argument("--grammar-limit", action="append", default=[], metavar="NAME=VALUE",
                   help="change one of the grammar front door's limits (the runtime's table, "
                   "specee.grammar.limits(): max_bytes, max_depth, max_rules, compile_ms, cache_entries, ...); "
                   "repeatable")
    # the model, context and placement flags: the runtime's table (the KV cache is shared by the slots)
    add_context_flags(p, CONTEXT_FLAGS, defaults=dict(n_ctx="4096"))
    add_template_flags(p)
    # llama-server's other flags: the table in flags.py (after every flag of the server's own)
    add_llama_flags(p)
    return p


def int_setting(p: argparse.ArgumentParser, settings: dict[str, Any], dest: str, default: int) -> int:
    """A server row's value as an integer (the parser's error naming the flag otherwise)."""
    value = settings.get(dest, default)
    try:
        return int(value)
    except ValueError:
        p.error(f"--{dest.replace('_', '-')}: expected an integer, not {value!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.n_predict < -1:
        p.error(f"-n/--n-predict must be -1 (no cap) or >= 0, not {args.n_predict}")
    args.sampling, args.llama = llama_flags_of(args, p)
    if "version" in args.llama:
        print(f"specee-server {importlib.metadata.version('specee')}")
        raise SystemExit(0)
    if "api_key_file" in args.llama:
        try:
            with open(args.llama["api_key_file"]) as f:
                args.api_key = f.readline().strip() or None
        except OSError as e:
            p.error(f"--api-key-file: {e.strerror}: {args.llama['api_key_file']}")
    for item in args.grammar_limit:  # the table's names and checks (specee-grammar-limits.cpp)
        name, _, value = item.partition("=")
        try:
            set_grammar_limit(name.strip(), int(value))
        except (ValueError, RuntimeError) as e:
            p.error(f"--grammar-limit {item}: {e if isinstance(e, RuntimeError) else 'expected NAME=INTEGER'}")
    args.hosts = [h.strip() for h in args.host.split(",") if h.strip()]
    if not args.hosts:
        p.error("--host: give at least one address")
    given = [args.llama[k] if k == "models_autoload" else f"--{k.replace('_', '-')}" for k in ROUTER_SETTINGS
             if k in args.llama]  # (models_autoload holds the spelling given)
    if args.model is not None and given:
        p.error(f"{given[0]}: router mode serves the models of --models-dir / --models-preset: give it without -m")
    if given and args.alias:
        p.error("-a/--alias: in router mode a model's name is its file's or its preset section's (a preset's `alias` "
                "key adds names)")
    if int_setting(p, args.llama, "models_max", 4) < 0:
        p.error("--models-max: a number of models, 0 for no limit")
    args.sleep_idle_seconds = int_setting(p, args.llama, "sleep_idle_seconds", -1)
    if args.sleep_idle_seconds == 0 or args.sleep_idle_seconds < -1:
        p.error("--sleep-idle-seconds: seconds > 0, or -1 (never)")
    try:
        args.reasoning = reasoning_of(args.llama)
    except ReasoningError as e:
        p.error(str(e))
    origins = args.llama.get("cors_origins", "*")
    args.cors_origins = [o.strip() for o in origins.split(",") if o.strip()]
    if not args.cors_origins:
        p.error("--cors-origins: give '*', 'localhost' or comma-separated origins")
    try:
        args.keep = int(args.llama.get("keep", 0))
    except ValueError:
        p.error(f"--keep: expected an integer, not {args.llama['keep']!r}")
    spec = args.llama.get("spec_type", "draft-simple" if args.draft_model else None)
    if "spec_default" in args.llama:
        spec = "ngram-mod"
    if spec is not None and args.mode == "auto":  # llama.cpp's speculation types: a mode here
        if spec not in SPEC_TYPES:
            p.error(f"--spec-type {spec}: not supported by specee-server: one of {', '.join(SPEC_TYPES)}")
        if SPEC_TYPES[spec] == "draft" and not args.draft_model:
            p.error(f"--spec-type {spec} needs a draft model (-md FILE)")
        args.mode = SPEC_TYPES[spec]
    args.pooling = "rank" if "reranking" in args.llama else args.llama.get("pooling")  # None: the model's
    if args.pooling is not None and args.pooling not in POOLINGS:
        p.error(f"--pooling {args.pooling}: expected one of {', '.join(POOLINGS)}")
    norm = args.llama.get("embd_normalize", "2")
    if not norm.lstrip("-").isdigit() or int(norm) < -1:
        p.error(f"--embd-normalize {norm}: expected an integer >= -1")
    args.embd_normalize = int(norm)
    try:  # the defaults are checked now, not at the first request
        GenerateOptions(**options_fields(args.sampling))
    except (ValueError, SpecEEError) as e:
        p.error(f"sampling flags: {e}")
    return args


def listen(hosts: list[str], port: int) -> list[socket.socket]:
    """A listening socket on each address (llama-server's `--host a,b`); a clear exit when one cannot be bound."""
    sockets: list[socket.socket] = []
    for host in hosts:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # :: and 0.0.0.0 may both be given
            sock.bind(address)
            sock.listen(2048)
        except OSError as e:
            for s in sockets:
                s.close()
            print(f"specee-server: error: cannot listen on {host} port {port}: {e.strerror or e}", file=sys.stderr,
                  flush=True)
            raise SystemExit(1) from None
        sockets.append(sock)
    return sockets


def serve(app: Starlette, args: argparse.Namespace) -> None:
    """Serve `app` on every address of --host (comma-separated) at --port until stopped."""
    for host in args.hosts:
        if host not in ("127.0.0.1", "localhost", "::1"):
            warnings.warn(f"specee-server listens on {host}: reachable from other machines"
                          f"{'' if args.api_key else ' without an API key (--api-key)'}", stacklevel=1)
    sockets = listen(args.hosts, args.port)
    config = uvicorn.Config(app, log_level="info" if "verbose" in args.llama else "warning")
    uvicorn.Server(config).run(sockets=sockets)


def log_of(args: argparse.Namespace) -> Callable[[str], None]:
    """The server's log lines (llama-server's words where its tests read them): on stderr with --verbose."""
    if "verbose" not in args.llama:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def prompt_cache_of(args: argparse.Namespace, log: Callable[[str], None]) -> PromptCache | None:
    """--cache-ram N (MiB; llama-server's default 8192, -1: no limit, 0: off) as the engine's prompt cache."""
    given = args.llama.get("cache_ram", str(DEFAULT_MIB))
    try:
        mib = int(given)
    except ValueError:
        raise ValueError(f"--cache-ram: expected a number of MiB, not {given!r}") from None
    if mib < -1:
        raise ValueError(f"--cache-ram {mib}: expected -1 (no limit), 0 (off) or a number of MiB")
    if mib == 0:
        if args.llama.get("cache_idle_slots") == "--cache-idle-slots":
            print("specee-server: warning: --cache-idle-slots requires --cache-ram, disabling", file=sys.stderr,
                  flush=True)
        return None
    log(f"prompt cache is enabled, size limit: {'no limit' if mib < 0 else f'{mib} MiB'}")
    return PromptCache(mib, log)


def tune_malloc() -> None:
    """glibc's malloc set for a long-lived server (issue 46: after 2,384 hostile grammars the server kept +56 MB):
    two arenas, not one per thread that ever allocated (grammar compiles run on threads of their own, each leaving a
    partly used arena behind), and blocks of 256 KiB or more mapped on their own, so they go back to the system when
    freed (glibc's adaptive threshold otherwise moves large blocks into the arenas after the first is freed). The
    same run then keeps +25 MB, with a 35 MB lower peak (docs/hardening.md). Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    if hasattr(libc, "gnu_get_libc_version"):
        libc.mallopt(M_ARENA_MAX, 2)
        libc.mallopt(M_MMAP_THRESHOLD, 256 * 1024)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tune_malloc()
    if args.model is None and any(k in args.llama for k in ROUTER_SETTINGS):  # no model here, a child per model
        router = make_router(args, argv if argv is not None else sys.argv[1:], make_parser())
        app = Starlette(routes=ROUTER_ROUTES, middleware=[Middleware(Guard, state=router)], lifespan=router_lifespan)
        app.state.router = router
        return serve(app, args)
    if os.environ.get(CHILD_ENV):  # started by a router (server/router.py): it ends with the router
        exit_with_router()
    try:
        gcp = gcp_settings()
        save_path = args.llama.get("slot_save_path")
        if save_path is not None:
            os.makedirs(save_path, exist_ok=True)
        log = log_of(args)
        cache = prompt_cache_of(args, log)
    except (ValueError, OSError) as e:
        print(f"specee-server: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if gcp is not None and gcp.port is not None:
        args.port = gcp.port  # as llama-server: Vertex AI's port wins
    options = context_options_of(args, [name for name in CONTEXT_FLAGS if name != "flash_attn"])  # -fa: accepted
    try:
        model = Model(options.pop("model", None), **options)
    except (SpecEEError, ValueError, OSError) as e:  # a bad model or adapter file: its reason, not a traceback
        print(f"specee-server: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    template = template_of(model, args)
    engine = Engine(model, args.parallel, args.max_queue, args.prefill_chunk,
                    unified=args.llama.get("kv_unified") in ("-kvu", "--kv-unified"),
                    context_shift=args.keep if "context_shift" in args.llama else None, cache=cache,
                    cache_idle_slots=args.llama.get("cache_idle_slots") != "--no-cache-idle-slots", log=log)
    if engine.cache_idle_slots:
        engine.log("idle slots will be saved to prompt cache" + (" and cleared" if engine.unified else "") +
                   " upon starting a new task")
        engine.log("__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__")
    # llama-server's order: its id is the first of the names sorted
    aliases = sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()}) or [os.path.basename(model.path)]
    state = ServerState(model, engine, aliases[0], args.mode, args.api_key, args.metrics, args.n_predict,
                        sampling=args.sampling, slots=args.llama.get("slots") != "--no-slots", aliases=aliases,
                        tags=[t.strip() for t in args.llama.get("tags", "").split(",") if t.strip()],
                        cors_origins=args.cors_origins, template=template, verbose="verbose" in args.llama,
                        model_meta={"n_ctx": model.n_ctx, "n_vocab": model.n_vocab, "desc": model.desc},
                        slot_save_path=save_path, pooling=args.pooling or model.pooling,
                        embd_normalize=args.embd_normalize,
                        n_batch=args.n_batch or ServerState.n_batch,
                        spm_infill="spm_infill" in args.llama)
    sleeper = None
    if args.sleep_idle_seconds > 0:
        sleeper = Sleeper(state, args.sleep_idle_seconds, lambda: Model(model.path, **options))
    try:
        app = make_app(state, sleeper, gcp)
    except ValueError as e:
        print(f"specee-server: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    sys.setswitchinterval(0.001)  # the batching thread takes the GIL back soon after each pass
    engine.start()
    if sleeper is not None:
        sleeper.start()
    cap = "" if args.n_predict < 0 else f", at most {args.n_predict} generated"
    print(f"specee-server: {state.alias} on {', '.join(f'http://{h}:{args.port}' for h in args.hosts)} "
          f"({args.parallel} slots of {engine.n_ctx_slot} tokens{cap})", file=sys.stderr, flush=True)
    try:
        serve(app, args)
    finally:
        if sleeper is not None:
            sleeper.stop()
        engine.stop()
