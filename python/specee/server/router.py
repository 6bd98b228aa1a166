"""Router mode (llama-server's): a server started without -m and with --models-dir, --models-preset, --models-max or
--(no-)models-autoload serves several models, each by a child specee-server of its own.

The router lists the models of its sources (`scan`): each GGUF file of --models-dir (a sub-folder holding one counts
as one, under the folder's name) and each [name] section of the --models-preset INI file (its keys are llama-server's
flags without the dashes, `model = FILE`, `ctx-size = 1024`, `jinja = false`; [*] holds keys for every model; and the
router's keys `load-on-startup`, `stop-timeout`, `alias`). A request names its model in the body's `model` field (GET
requests: `?model=`); the router starts that model's child on a free 127.0.0.1 port when it is not running (unless
--no-models-autoload, or the request's `?autoload=false`), waits for its /health, and passes the request through.
At most --models-max children run; to start another the least recently used child that serves no request is stopped
(a request waits while every child is busy). A child's flags are the router's own (--temp, -c, -np, ...: every model
gets them) after the model's, without the router's flags, --host, --port and the API key (the router checks it).

Routes: /health; /props (the router's, or a child's with ?model=); GET /models and /v1/models (each model's status:
unloaded, loading, loaded; `?reload=1` reads the sources again: a model gone or changed is stopped); POST
/models/load and /models/unload {model}; every other request is passed to the child it names. llama.cpp's router
also downloads models (POST /models) and removes downloaded ones (DELETE /models): nothing is downloaded here, so
there is no cache of downloads to list or remove, and both answer 400 saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import configparser
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specee._tools import free_port
from specee.server.llama import BUILD_INFO
from specee.server.request import ApiError, body_bytes

# the router's flags, and what else its children do not get (--host, --port, the API key: the router checks it)
ROUTER_FLAGS = ("--models-dir", "--models-preset", "--models-max", "--models-autoload", "--no-models-autoload")
ROUTER_ONLY = (*ROUTER_FLAGS, "--host", "--port", "--api-key", "--api-key-file", "-a", "--alias", "-m", "--model")
# set in a child's environment: it ends when the router does (exit_with_router)
CHILD_ENV = "SPECEE_ROUTER_CHILD"
# an INI section's keys that are the router's, not a child's flag (llama.cpp's dedup-cache-models hides a downloaded
# model a preset also names: there are no downloaded models here, so it changes nothing)
PRESET_KEYS = ("load-on-startup", "stop-timeout", "alias", "dedup-cache-models", "version")
TRUE, FALSE = ("1", "true", "on", "yes", "enabled"), ("0", "false", "off", "no", "disabled")
# response headers not passed back from a child (the router's server writes its own)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


@dataclass
class Source:
    """A model as its source describes it: where it comes from, the child's flags for it, its INI text."""

    source: str  # models_dir or preset
    args: list[str]
    preset: str = ""
    aliases: list[str] = field(default_factory=list)
    load_on_startup: bool = False
    stop_timeout: float = 10.0


@dataclass
class Child:
    """A model the router serves, and its child server while one runs."""

    name: str
    spec: Source
    status: str = "unloaded"  # unloaded, loading, loaded
    port: int = 0
    proc: subprocess.Popen | None = None
    exit_code: int = 0  # of the last child, when it ended by itself
    last_used: float = 0.0
    busy: int = 0  # requests being passed to it


# ---- the sources ----------------------------------------------------------------------------------------


def models_dir_sources(folder: str) -> dict[str, Source]:
    """Each .gguf file of `folder` under its name without .gguf; a sub-folder with one model file under the
    folder's name (a split model by its first part; mmproj files are not models)."""
    if not os.path.isdir(folder):
        raise ValueError(f"--models-dir: {folder} is not a directory")
    out = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = None
        if entry.is_dir():
            files = sorted(f for f in os.listdir(entry.path) if f.endswith(".gguf") and "mmproj" not in f)
            firsts = [f for f in files if "-00001-of-" in f]
            path = os.path.join(entry.path, (firsts or files)[0]) if files else None
            name = entry.name
        elif entry.name.endswith(".gguf") and "mmproj" not in entry.name:
            path, name = entry.path, entry.name[:-len(".gguf")]
        if path is not None:
            out[name] = Source("models_dir", ["--model", path])
    return out


def switch_value(key: str, value: str, where: str) -> bool:
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise ValueError(f"{where}: {key} = {value}: expected true or false")


def flag_args(key: str, value: str, parser: argparse.ArgumentParser, where: str) -> list[str]:
    """An INI key and value as a child's flags: `ctx-size = 1024` -> --ctx-size 1024; a switch's true -> --key, its
    false -> --no-key (nothing when there is no such spelling)."""
    flag = "--" + key
    action = parser._option_string_actions.get(flag)
    if action is None or flag in ROUTER_FLAGS:
        raise ValueError(f"{where}: {key}: not a flag of specee-server")
    if action.nargs != 0:
        return [flag, value]
    if switch_value(key, value, where):
        return [flag]
    negative = "--no-" + key[3:] if key.startswith("no-") else "--no-" + key
    return [negative] if negative in parser._option_string_actions and not key.startswith("no-") else []


def preset_sources(path: str, parser: argparse.ArgumentParser) -> dict[str, Source]:
    """The [name] sections of the INI file at `path`, [*]'s keys under each."""
    ini = configparser.ConfigParser(interpolation=None, delimiters=("=",), comment_prefixes=("#", ";"),
                                    inline_comment_prefixes=("#", ";"), default_section="\0", strict=True)
    ini.optionxform = str  # type: ignore[assignment,method-assign]  # keys as written
    try:
        with open(path) as f:
            ini.read_file(f)
    except (OSError, configparser.Error) as e:
        raise ValueError(f"--models-preset {path}: {e}") from None
    every = dict(ini["*"]) if ini.has_section("*") else {}
    out = {}
    for name in ini.sections():
        if name == "*":
            continue
        where = f"--models-preset {path} [{name}]"
        section = {**every, **ini[name]}
        args: list[str] = []
        for key, value in section.items():
            if key not in PRESET_KEYS:
                args += flag_args(key, value, parser, where)
        text = f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in section.items())
        try:
            timeout = float(section.get("stop-timeout", "10"))
        except ValueError:
            raise ValueError(f"{where}: stop-timeout: expected seconds") from None
        out[name] = Source("preset", args, text, [a.strip() for a in section.get("alias", "").split(",") if a.strip()],
                           switch_value("load-on-startup", section.get("load-on-startup", "false"), where), timeout)
    return out


def child_base_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The router's command line without its own flags: what every child gets after its model's flags."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        action = parser._option_string_actions.get(name)
        if action is not None and any(s in ROUTER_ONLY for s in action.option_strings):
            skip = action.nargs != 0 and "=" not in token
            continue
        out.append(token)
    return out


def exit_with_router() -> None:
    """In a child (CHILD_ENV set): a thread that ends this server (SIGTERM to itself) once its stdin, a pipe from the
    router, closes; a router killed outright leaves no server behind."""

    def wait() -> None:
        sys.stdin.buffer.read()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="specee-router-pipe", daemon=True).start()


# ---- the router -----------------------------------------------------------------------------------------


@dataclass
class RouterState:
    """What the router's endpoints share (the Guard reads `api_key` and `cors_origins`)."""

    args: argparse.Namespace
    parser: argparse.ArgumentParser
    base_args: list[str]
    api_key: str | None
    cors_origins: list[str]
    models_max: int
    autoload: bool
    children: dict[str, Child] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while children start or stop
    created: int = field(default_factory=lambda: int(time.time()))

    def scan(self) -> dict[str, Source]:
        found: dict[str, Source] = {}
        if "models_dir" in self.args.llama:
            found.update(models_dir_sources(self.args.llama["models_dir"]))
        if "models_preset" in self.args.llama:
            found.update(preset_sources(self.args.llama["models_preset"], self.parser))
        return found

    async def reload(self) -> None:
        """Read the sources again: new models are added, a model gone (or changed) is stopped and removed
        (updated)."""
        try:
            found = self.scan()
        except ValueError as e:
            raise ApiError(500, f"cannot read the models: {e}", "server_error") from None
        async with self.lock:
            for name, child in list(self.children.items()):
                if found.get(name) != child.spec:
                    await self.stop(child)
                    del self.children[name]
            for name, spec in found.items():
                self.children.setdefault(name, Child(name, spec))

    def find(self, name: str) -> Child | None:
        if name in self.children:
            return self.children[name]
        return next((c for c in self.children.values() if name in c.spec.aliases), None)

    def running(self) -> list[Child]:
        return [c for c in self.children.values() if c.status != "unloaded"]

    async def start(self, child: Child) -> None:
        """Start `child`'s server (stopping the least recently used idle child at --models-max) and wait until it
        answers /health, or ends (ApiError with its exit code)."""
        while True:
            async with self.lock:
                if child.status != "unloaded":
                    break
                running = self.running()
                if self.models_max <= 0 or len(running) < self.models_max:
                    child.port, child.status, child.last_used = free_port(), "loading", time.monotonic()
                    argv = [sys.executable, "-m", "specee.server", *child.spec.args, *self.base_args,
                            "--host", "127.0.0.1", "--port", str(child.port), "-a", child.name]
                    # the child's stdin is a pipe from the router: its end (the router gone, however) ends the child
                    child.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env={**os.environ, CHILD_ENV: "1"})
                    asyncio.get_running_loop().create_task(self.watch(child, child.proc))
                    break
                idle = [c for c in running if c.busy == 0 and c.status == "loaded"]
                if idle:
                    await self.stop(min(idle, key=lambda c: c.last_used))
                    continue
            await asyncio.sleep(0.1)  # every child serves a request: wait for one to finish
        while child.status == "loading":
            await asyncio.sleep(0.05)
        if child.status != "loaded":
            raise ApiError(500, f"model '{child.name}' did not start: its server exited with status {child.exit_code}"
                           " (its log is the router's)", "server_error")

    async def watch(self, child: Child, proc: subprocess.Popen) -> None:
        """Mark `child` loaded once its /health answers, unloaded when its process ends."""
        while proc.poll() is None:
            if child.status == "loading" and child.proc is proc:
                if await asyncio.to_thread(answers_health, child.port):
                    child.status = "loaded"
            await asyncio.sleep(0.1)
        if child.proc is proc:  # it ended by itself (a stop clears proc first)
            child.status, child.exit_code, child.proc = "unloaded", proc.returncode, None

    async def stop(self, child: Child) -> None:
        """Stop `child`'s server: SIGTERM, then SIGKILL after its stop-timeout."""
        proc, child.proc, child.status, child.exit_code = child.proc, None, "unloaded", 0
        if proc is None:
            return
        proc.terminate()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.to_thread(proc.wait, child.spec.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def stop_all(self) -> None:
        for child in self.children.values():
            await self.stop(child)


def answers_health(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def request_child(port: int, method: str, path: str, body: bytes, headers: dict[str, str], timeout: float
                  ) -> tuple[int, list[tuple[str, str]], http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=body or None, headers=headers)
    r = conn.getresponse()
    return r.status, r.getheaders(), r


# ---- the routes ----------------------------------------------------------------------------------------


def router_of(request: Request) -> RouterState:
    return request.app.state.router


async def body_of(request: Request) -> tuple[bytes, dict]:
    raw = await body_bytes(request)
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return raw, body


def model_named(router: RouterState, name: Any, autoload: bool) -> Child:
    """The model a request names (llama.cpp's router's checks and messages)."""
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model name is missing from the request", param="model")
    child = router.find(name)
    if child is None:
        raise ApiError(400, f"model '{name}' not found", param="model")
    if not autoload and child.status == "unloaded":
        raise ApiError(400, "model is not loaded", param="model")
    return child


def autoload_of(router: RouterState, request: Request) -> bool:
    value = request.query_params.get("autoload")
    return router.autoload if value is None else value in ("1", "true")


async def pass_through(request: Request, child: Child, raw: bytes) -> Response:
    """The request to `child`'s server, its answer streamed back; the child counts as busy until the end."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length", "authorization",
                                                                             "x-api-key", "connection")}
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    child.busy += 1
    child.last_used = time.monotonic()
    try:
        status, answer_headers, answer = await asyncio.to_thread(request_child, child.port, request.method, path, raw,
                                                                 headers, 600.0)
    except OSError as e:
        child.busy -= 1
        raise ApiError(502, f"model '{child.name}': its server did not answer: {e}", "server_error") from None

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while data := await asyncio.to_thread(answer.read1, 65536):
                yield data
        finally:
            answer.close()
            child.busy -= 1
            child.last_used = time.monotonic()

    kept = {k: v for k, v in answer_headers if k.lower() not in HOP_HEADERS}
    return StreamingResponse(chunks(), status_code=status, headers=kept)


async def proxy_post(request: Request) -> Response:
    router = router_of(request)
    raw, body = await body_of(request)
    child = model_named(router, body.get("model"), autoload_of(router, request))
    await router.start(child)
    return await pass_through(request, child, raw)


async def proxy_get(request: Request) -> Response:
    router = router_of(request)
    child = model_named(router, request.query_params.get("model"), autoload_of(router, request))
    await router.start(child)
    return await pass_through(request, child, b"")


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    """The router's /props (llama.cpp's shape), or the named model's with ?model=."""
    if request.query_params.get("model"):
        return await proxy_get(request)
    router = router_of(request)
    return JSONResponse({"role": "router", "max_instances": router.models_max, "models_autoload": router.autoload,
                         "model_alias": "specee-server", "model_path": "none",
                         "default_generation_settings": {"params": {}, "n_ctx": 0}, "build_info": BUILD_INFO})


async def list_models(request: Request) -> Response:
    router = router_of(request)
    if request.query_params.get("reload"):
        await router.reload()
    data = []
    for child in router.children.values():
        status: dict[str, Any] = {"value": child.status, "args": child.spec.args + router.base_args}
        if child.spec.preset:
            status["preset"] = child.spec.preset
        if child.status == "unloaded" and child.exit_code != 0:
            status.update(exit_code=child.exit_code, failed=True)
        data.append({"id": child.name, "aliases": child.spec.aliases, "tags": [], "object": "model",
                     "owned_by": "specee", "created": router.created, "status": status,
                     "source": child.spec.source, "can_remove": False})
    return JSONResponse({"data": data, "object": "list"})


async def load(request: Request) -> Response:
    router = router_of(request)
    _, body = await body_of(request)
    child = router.find(body.get("model") or "")
    if child is None:
        raise ApiError(404, "model is not found", "not_found_error", param="model")
    if child.status != "unloaded":
        raise ApiError(400, "model is already running", param="model")
    await router.start(child)
    return JSONResponse({"success": True})


async def unload(request: Request) -> Response:
    router = router_of(request)
    _, body = await body_of(request)
    child = router.find(body.get("model") or "")
    if child is None:
        raise ApiError(400, "model is not found", param="model")
    if child.status == "unloaded":
        raise ApiError(400, "model is not running", param="model")
    async with router.lock:
        await router.stop(child)
    return JSONResponse({"success": True})


async def download(request: Request) -> Response:
    raise ApiError(400, "specee-server downloads nothing: put the GGUF file in --models-dir or name it in "
                   "--models-preset")


async def remove(request: Request) -> Response:
    router = router_of(request)
    name = request.query_params.get("model", "")
    if router.find(name) is None:
        raise ApiError(404, f"model '{name}' is not found", "not_found_error", param="model")
    raise ApiError(400, f"model '{name}' is not removable: only downloaded models are, and specee-server downloads "
                   "nothing (its models are files of --models-dir or --models-preset)", param="model")


ROUTER_ROUTES = [
    Route("/health", health), Route("/v1/health", health),
    Route("/props", props),
    Route("/models", list_models), Route("/v1/models", list_models),
    Route("/models", download, methods=["POST"]),
    Route("/models", remove, methods=["DELETE"]),
    Route("/models/load", load, methods=["POST"]),
    Route("/models/unload", unload, methods=["POST"]),
    Route("/{path:path}", proxy_post, methods=["POST"]),  # every other request goes to the model it names
    Route("/{path:path}", proxy_get, methods=["GET"]),
]


@contextlib.asynccontextmanager
async def router_lifespan(app: Starlette) -> AsyncIterator[None]:
    """The models marked load-on-startup are started; every child is stopped when the router stops."""
    router: RouterState = app.state.router
    loop = asyncio.get_running_loop()
    for child in router.children.values():
        if child.spec.load_on_startup:
            loop.create_task(router.start(child))
    yield
    async with router.lock:
        await router.stop_all()


def make_router(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser) -> RouterState:
    """The router of parsed `args` (`argv` as given: the children get its flags; `parser`: the server's, which
    reads a preset's keys); a source that cannot be read ends the start (status 1) naming it."""
    router = RouterState(args, parser, child_base_args(argv, parser), args.api_key, args.cors_origins,
                         int(args.llama.get("models_max", "4")),  # checked by parse_args
                         args.llama.get("models_autoload") != "--no-models-autoload")
    try:
        router.children = {name: Child(name, spec) for name, spec in router.scan().items()}
    except ValueError as e:
        print(f"specee-server: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    names = ", ".join(f"{c.name} ({c.spec.source})" for c in router.children.values()) or "none"
    print(f"specee-server: router on {', '.join(f'http://{h}:{args.port}' for h in args.hosts)}, models: {names}",
          file=sys.stderr, flush=True)
    return router
